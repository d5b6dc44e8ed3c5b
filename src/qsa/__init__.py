"""qsa: Triton kernels for QSA sparse paged attention."""

from .api import AttentionPlan, plan_attention, run_attention, sparse_paged_attention
from .cache import (BlockAllocator, PagedKVCache, allocate_kv_cache, dequantize_e4m3, quantize_e4m3,
                    random_mapping, relocate, write_kv)
from .indexer import (CompressedKeyCache, block_scores, select_tokens, tokens_from_scores, topk_blocks,
                      update_compressed_keys)
from .plan import GroupedPlan, PlanWorkspace, SingleRowPlan, plan_groups, plan_single_rows
from .reference import reference_attention, sdpa_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "BlockAllocator",
    "CompressedKeyCache",
    "GroupedPlan",
    "PagedKVCache",
    "PlanWorkspace",
    "SingleRowPlan",
    "allocate_kv_cache",
    "block_scores",
    "dequantize_e4m3",
    "plan_attention",
    "plan_groups",
    "plan_single_rows",
    "quantize_e4m3",
    "random_mapping",
    "reference_attention",
    "relocate",
    "run_attention",
    "sdpa_attention",
    "select_tokens",
    "sparse_paged_attention",
    "tokens_from_scores",
    "topk_blocks",
    "update_compressed_keys",
    "write_kv",
    "__version__",
]
