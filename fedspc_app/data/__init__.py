"""Datasets (CIFAR-10/100, Tiny-ImageNet, the embedded digits), batching and
augmentation, and the partition of a dataset over the clients. Imports the core."""
