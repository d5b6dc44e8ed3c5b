"""qsa: Triton kernels for QSA sparse paged attention."""

from .api import AttentionPlan, plan_attention, run_attention, sparse_paged_attention
from .plan import GroupedPlan, PlanWorkspace, SingleRowPlan, plan_groups, plan_single_rows

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "GroupedPlan",
    "PlanWorkspace",
    "SingleRowPlan",
    "plan_attention",
    "plan_groups",
    "plan_single_rows",
    "run_attention",
    "sparse_paged_attention",
    "__version__",
]
