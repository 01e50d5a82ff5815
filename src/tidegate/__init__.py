"""tidegate: priority-aware scheduling of model inference on scarce GPUs."""

__version__ = "0.1.0"
