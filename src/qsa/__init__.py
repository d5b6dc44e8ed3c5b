"""qsa: Triton kernels for QSA sparse paged attention."""

from . import ops  # noqa: F401  (registers torch.ops.qsa.*)
from .api import AttentionPlan, plan_attention, run_attention, sparse_paged_attention
from .cache import (BlockAllocator, PagedKVCache, allocate_kv_cache, dequantize_e4m3, quantize_e4m3,
                    random_mapping, relocate, write_kv)
from .indexer import (CompressedKeyCache, block_scores, select_tokens, tokens_from_scores, topk_blocks,
                      update_compressed_keys)
from .layer import LayerCache, QSAAttention, QSAConfig, StepMetadata
from .model import TinyConfig, TinyQSAModel
from .plan import GroupedPlan, PlanWorkspace, SingleRowPlan, plan_groups, plan_single_rows
from .reference import reference_attention, sdpa_attention
from .serving import Engine, GenerationResult, ServingConfig, run_layer
from .tp import TPInfo, shard_heads

# The one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]), as a literal.
__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "BlockAllocator",
    "CompressedKeyCache",
    "Engine",
    "GenerationResult",
    "GroupedPlan",
    "LayerCache",
    "PagedKVCache",
    "PlanWorkspace",
    "QSAAttention",
    "QSAConfig",
    "ServingConfig",
    "SingleRowPlan",
    "StepMetadata",
    "TPInfo",
    "TinyConfig",
    "TinyQSAModel",
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
    "run_layer",
    "sdpa_attention",
    "select_tokens",
    "shard_heads",
    "sparse_paged_attention",
    "tokens_from_scores",
    "topk_blocks",
    "update_compressed_keys",
    "write_kv",
    "__version__",
]
