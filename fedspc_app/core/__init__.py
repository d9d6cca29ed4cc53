"""The core: run-config, data, partition, models, methods, the training loop and
FedSPC's arithmetic. Nothing here imports Flower's apps, the strategies, the
clients or the experiment tooling."""
