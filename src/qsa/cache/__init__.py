"""The paged KV cache: its layout and FP8 encoding, K/V writes (:mod:`.paged`, kernel in :mod:`.kernels`),
the block allocator, and page relocation for the invariance checks."""

from .paged import (BlockAllocator, OutOfBlocksError, PagedKVCache, allocate_kv_cache, collision_prone_num_blocks,
                    dequantize_e4m3, quantize_e4m3, random_mapping, relocate, write_kv)

__all__ = ["BlockAllocator", "OutOfBlocksError", "PagedKVCache", "allocate_kv_cache", "collision_prone_num_blocks",
           "dequantize_e4m3", "quantize_e4m3", "random_mapping", "relocate", "write_kv"]
