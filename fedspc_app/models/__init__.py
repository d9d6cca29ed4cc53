"""The models (a small CNN, timm's ResNets, VGG-11 and ViT), the run's model built
from its seed, and its split into shared and personalized parameters. Imports the
core and the data (for a dataset's shape)."""
