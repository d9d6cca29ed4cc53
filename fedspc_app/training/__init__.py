"""The one local training loop with its hooks (proximal term, drift correction,
freezing), the device and precision, and a client's data on its device. Imports the
core, the data and the models."""
