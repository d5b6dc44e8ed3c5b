"""qsa: Triton kernels for QSA sparse paged attention.

Subsystems: :mod:`qsa.attention` (API, routing, planning, one folder per route, reference),
:mod:`qsa.selection`, :mod:`qsa.cache`, :mod:`qsa.model` (layer, tiny model, serving, tensor parallelism,
torch ops), :mod:`qsa.cli`; every tuning knob in :mod:`qsa.settings`; where kernels can run in
:mod:`qsa.backend`."""

from .attention import (AttentionPlan, PlanInputs, merge_attention_states, plan_attention, reference_attention,
                        run_attention, sdpa_attention, sparse_paged_attention)
from .attention.planning import GroupedPlan, PlanWorkspace, SingleRowPlan, plan_groups, plan_single_rows
from .cache import (BlockAllocator, PagedKVCache, allocate_kv_cache, dequantize_e4m3, quantize_e4m3,
                    random_mapping, relocate, write_kv)
from .model import (Engine, GenerationResult, LayerCache, QSAAttention, QSAConfig, ServingConfig, StepMetadata,
                    TinyConfig, TinyQSAModel, TPInfo, run_layer, shard_heads)
from .selection import (CompressedKeyCache, block_scores, select_tokens, tokens_from_scores, topk_blocks,
                        update_compressed_keys)

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
    "PlanInputs",
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
    "merge_attention_states",
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
