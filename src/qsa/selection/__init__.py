"""Token selection: the indexer's block scores, the top-k blocks, and the compressed-key cache they read
(:mod:`.api`), the Triton kernels (:mod:`.kernels`, :mod:`.topk`) and the pure-PyTorch reference
(:mod:`.reference`)."""

from .api import (MAX_K, CompressedKeyCache, block_scores, select_tokens, tokens_from_scores, topk_blocks,
                  update_compressed_keys)

__all__ = ["MAX_K", "CompressedKeyCache", "block_scores", "select_tokens", "tokens_from_scores", "topk_blocks",
           "update_compressed_keys"]
