"""The records of a run: the results folder and its files, the checkpoint, pausing,
TensorBoard, and which code and machine made the run. Imports the core."""
