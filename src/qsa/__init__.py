"""qsa: Triton kernels for QSA sparse paged attention."""

from .plan import GroupedPlan, SingleRowPlan

__version__ = "0.1.0"

__all__ = ["GroupedPlan", "SingleRowPlan", "__version__"]
