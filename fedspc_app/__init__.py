"""FedSPC: shared-parameter correction for personalized federated learning, as a Flower app."""
