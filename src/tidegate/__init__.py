"""tidegate: priority-aware scheduling of model inference on scarce GPUs."""

from tidegate import native as _native

__version__ = "0.1.0"

_native.activate()  # refuses a stale compiled build; honours TIDEGATE_PURE_PYTHON (native.py)
