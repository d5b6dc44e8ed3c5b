"""Page4 planning: each row's selection turned into microblock work lists (:mod:`.plan`), by the planner
kernels (:mod:`.kernels`), with the pure-PyTorch planners they are checked against (:mod:`.reference`)."""

from .plan import GroupedPlan, PlanWorkspace, SingleRowPlan, plan_groups, plan_single_rows, token_lists

__all__ = ["GroupedPlan", "PlanWorkspace", "SingleRowPlan", "plan_groups", "plan_single_rows", "token_lists"]
