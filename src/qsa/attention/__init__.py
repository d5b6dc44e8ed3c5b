"""Sparse paged attention: the public API, route admission, page4 planning, one folder per route and the
references.

* :mod:`.api` -- ``plan_attention`` / ``run_attention`` / ``sparse_paged_attention``.
* :mod:`.routing` -- which kernel takes which rows.
* :mod:`.planning` -- the page4 planners (single-row and grouped work lists), their kernels and reference.
* :mod:`.grouped`, :mod:`.xqa`, :mod:`.splitk`, :mod:`.invariant` -- each route's kernel
  (``kernel.py``) and its launcher with the settings it picks (``launch.py``).
* :mod:`.launch`, :mod:`.kernels` -- what the launchers and the kernels share.
* :mod:`.reference` -- the pure-PyTorch attention every route is checked against.
"""

from .api import AttentionPlan, PlanInputs, plan_attention, run_attention, sparse_paged_attention
from .merge import merge_attention_states
from .reference import reference_attention, sdpa_attention

__all__ = ["AttentionPlan", "PlanInputs", "merge_attention_states", "plan_attention", "reference_attention",
           "run_attention", "sdpa_attention", "sparse_paged_attention"]
