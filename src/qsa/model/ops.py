"""The public ops as ``torch.library`` custom ops, so code calling them runs under ``torch.compile``
and inside CUDA graphs.

Registered ops (namespace ``qsa``), each with a fake (meta) implementation that only computes shapes:

* ``qsa::sparse_paged_attention`` -- functional: returns ``(out, lse)`` (``lse`` is ``[0]`` unless
  ``return_lse``); plans internally (logical order), so it needs no buffers from the caller. Takes the
  optional ``index_counts`` (``Tensor?``, last in the schema, default None) as the library does.
* ``qsa::select_tokens`` -- functional: ``[rows, 4k + 3]`` int32 token selection.
* ``qsa::write_kv`` -- mutates an interleaved ``[num_blocks, 2, block_size, Hkv, D]`` cache.
* ``qsa::update_compressed_keys`` -- mutates the compressed-key cache, the partial groups and (when given)
  the requests' next expected positions and the refusal record; the RMSNorm (weight + 1) and RoPE at
  position ``4b`` of the QSA layer are applied inside.

The selection ops take ``block_size``, the main KV cache's tokens per block, and check the compressed-key
cache against it (``block_size // 4`` rows per block).

Each op that has a Triton kernel takes a ``backend``: ``"triton"`` runs the kernel, ``"torch"`` the
library function's PyTorch implementation of the same contract (used where Triton cannot run -- a CPU
without the interpreter -- and with the ``"reference"`` route); :func:`qsa.backend.kernel_backend`
picks it.

The Python wrappers below mirror the library functions' signatures. Each op's implementation
(``write_kv_impl``, ``update_compressed_keys_impl``, ``select_tokens_impl``, with the op's arguments) is also
callable as it is, without the dispatcher: the QSA layer's eager step calls them so.
"""

from __future__ import annotations

import torch

from .. import backend as backends
from ..utils import as_finite_float, check_bool, check_int, check_tensor

# ----------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("qsa::sparse_paged_attention", mutates_args=())
def _sparse_paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               indices: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                               positions: torch.Tensor, seq_lens: torch.Tensor, gate: torch.Tensor | None,
                               kv_cache_dtype: str, k_scale: float, v_scale: float,
                               softmax_scale: float | None, return_lse: bool, route: str,
                               max_query_len: int | None = None, rows_sorted: bool = False,
                               index_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from ..attention.api import sparse_paged_attention as spa

    res = spa(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate=gate,
              kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale,
              return_lse=return_lse, route=route, max_query_len=max_query_len, rows_sorted=rows_sorted,
              index_counts=index_counts)
    if return_lse:
        return res
    return res, torch.empty((0,), dtype=torch.float32, device=q.device)


@_sparse_paged_attention_op.register_fake
def _(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate, kv_cache_dtype,
      k_scale, v_scale, softmax_scale, return_lse, route, max_query_len=None, rows_sorted=False,
      index_counts=None):
    lse_shape = (q.shape[0], q.shape[1]) if return_lse else (0,)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=torch.float32, device=q.device))


def select_tokens_impl(index_q: torch.Tensor, kc_cache: torch.Tensor, block_table: torch.Tensor,
                       token_to_req: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, k: int,
                       backend: str, block_size: int) -> torch.Tensor:
    """``qsa::select_tokens``'s implementation, callable without the dispatcher (the layer's eager step)."""
    from ..selection.api import select_tokens as st

    return st(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, block_size=block_size, k=k,
              backend=backends.resolve_backend(backend, index_q.device))


_select_tokens_op = torch.library.custom_op("qsa::select_tokens", mutates_args=())(select_tokens_impl)


@_select_tokens_op.register_fake
def _(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, k, backend, block_size):
    return torch.empty((index_q.shape[0], 4 * k + 3), dtype=torch.int32, device=index_q.device)


def write_kv_impl(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                  kv_cache_dtype: str, k_scale: float, v_scale: float, backend: str) -> None:
    """``qsa::write_kv``'s implementation, callable without the dispatcher (the layer's eager step)."""
    from ..cache.paged import write_kv as wkv
    from ..utils import check_tensor

    check_tensor("kv_cache", kv_cache, ndim=5, shape=(None, 2, None, None, None),
                 what="[num_blocks, 2, block_size, Hkv, D]")
    wkv(kv_cache[:, 0], kv_cache[:, 1], k, v, slot_mapping, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
        v_scale=v_scale, backend=backends.resolve_backend(backend, kv_cache.device))


_write_kv_op = torch.library.custom_op("qsa::write_kv", mutates_args=("kv_cache",))(write_kv_impl)


@_write_kv_op.register_fake
def _(kv_cache, k, v, slot_mapping, kv_cache_dtype, k_scale, v_scale, backend):
    return None


def update_compressed_keys_impl(raw_k: torch.Tensor, token_to_req: torch.Tensor, positions: torch.Tensor,
                                kc_cache: torch.Tensor, block_table: torch.Tensor, partial: torch.Tensor,
                                norm_weight: torch.Tensor | None, eps: float, rotary_dim: int,
                                rope_theta: float, backend: str, block_size: int, next_pos: torch.Tensor | None,
                                refusals: torch.Tensor | None, rows_ordered: bool, key_cos: torch.Tensor | None,
                                key_sin: torch.Tensor | None) -> None:
    """``qsa::update_compressed_keys``'s implementation, callable without the dispatcher (the layer's eager
    step). ``key_cos, key_sin``: the RoPE tables of each row's group start ``4 * (positions // 4)``
    (:meth:`qsa.model.layer.StepMetadata.rope` with ``group_start``), or None to compute them here.
    ``rows_ordered`` is dropped during CUDA-graph capture (the rows are sorted then): a compiled step that an
    engine captures carries the flag of the step it was traced on, and the graph may be replayed with rows
    in another order."""
    # next_pos, refusals, rows_ordered and the tables have no schema default: torch 2.11 drops trailing
    # defaulted arguments before it bumps the version of the mutated ones (an IndexError).
    from ..selection.api import update_compressed_keys as uck
    from .functional import group_start_rope

    if rows_ordered and raw_k.is_cuda and torch.cuda.is_current_stream_capturing():
        rows_ordered = False
    if rotary_dim and key_cos is None:
        key_cos, key_sin = group_start_rope(positions, rotary_dim, rope_theta)
    elif not rotary_dim:
        key_cos = key_sin = None
    uck(raw_k, token_to_req, positions, kc_cache, block_table, partial, block_size=block_size,
        next_pos=next_pos, refusals=refusals, norm_rope=(norm_weight, eps, key_cos, key_sin),
        backend=backends.resolve_backend(backend, raw_k.device), rows_ordered=rows_ordered)


_update_compressed_keys_op = torch.library.custom_op(
    "qsa::update_compressed_keys", mutates_args=("kc_cache", "partial", "next_pos", "refusals"))(update_compressed_keys_impl)


@_update_compressed_keys_op.register_fake
def _(raw_k, token_to_req, positions, kc_cache, block_table, partial, norm_weight, eps, rotary_dim,
      rope_theta, backend, block_size, next_pos, refusals, rows_ordered, key_cos, key_sin):
    return None


# ----------------------------------------------------------------------------------------------
# Python wrappers (library signatures)


def sparse_paged_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, *,
                           gate=None, kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0,
                           softmax_scale: float | None = None, return_lse: bool = False, route: str = "auto",
                           max_query_len: int | None = None, rows_sorted: bool = False, index_counts=None):
    """:func:`qsa.sparse_paged_attention` through the ``qsa::sparse_paged_attention`` custom op
    (no ``out=``: the op is functional). Returns ``out`` or ``(out, lse)``. Forward-only: with grad mode on,
    inputs that require grad raise a ValueError (use ``torch.no_grad()`` or detached tensors).
    ``index_counts`` (optional ``[rows]`` int32, any stride) as in the library: row ``r`` is only its first
    ``clamp(index_counts[r], 0, W)`` entries of ``indices``, and no entry past them is read."""
    from ..attention.api import check_forward_only

    if index_counts is not None:  # the library's TypeError, not the dispatcher's, for a non-tensor
        check_tensor("index_counts", index_counts)

    if isinstance(q, torch.Tensor):
        check_forward_only(q, gate if isinstance(gate, torch.Tensor) else None,
                           k_cache if isinstance(k_cache, torch.Tensor) else None,
                           v_cache if isinstance(v_cache, torch.Tensor) else None)
    out, lse = torch.ops.qsa.sparse_paged_attention(
        q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate, kv_cache_dtype,
        as_finite_float("k_scale", k_scale), as_finite_float("v_scale", v_scale),
        None if softmax_scale is None else as_finite_float("softmax_scale", softmax_scale),
        check_bool("return_lse", return_lse),
        route, None if max_query_len is None else check_int("max_query_len", max_query_len),
        check_bool("rows_sorted", rows_sorted), index_counts)
    return (out, lse) if return_lse else out


def select_tokens(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                  k: int = 512, backend: str = "triton") -> torch.Tensor:
    """:func:`qsa.selection.api.select_tokens` through the ``qsa::select_tokens`` custom op (``block_size``: the
    main KV cache's tokens per block; ``kc_cache`` must have ``block_size // 4`` rows per block)."""
    return torch.ops.qsa.select_tokens(index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
                                       check_int("k", k), backend, check_int("block_size", block_size))


def write_kv(kv_cache, k, v, slot_mapping, *, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
             v_scale: float = 1.0, backend: str = "triton") -> None:
    """Write ``k``, ``v`` ``[T, Hkv, D]`` into an interleaved ``kv_cache``
    ``[num_blocks, 2, block_size, Hkv, D]`` at ``slot_mapping`` (the ``qsa::write_kv`` custom op)."""
    torch.ops.qsa.write_kv(kv_cache, k, v, slot_mapping, kv_cache_dtype, as_finite_float("k_scale", k_scale),
                           as_finite_float("v_scale", v_scale), backend)


def update_compressed_keys(raw_k, token_to_req, positions, kc_cache, block_table, partial, *, block_size: int,
                           next_pos=None, refusals=None, norm_weight=None, eps: float = 1e-6, rotary_dim: int = 0,
                           rope_theta: float = 10000.0, backend: str = "triton", rows_ordered: bool = False) -> None:
    """Feed one step's raw index keys into the compressed-key cache (``qsa::update_compressed_keys``),
    transforming each compressed key by RMSNorm (``norm_weight + 1``) and RoPE at position ``4b``.
    ``block_size``, ``next_pos``, ``refusals`` and ``rows_ordered`` as in
    :func:`qsa.selection.api.update_compressed_keys` (rows in any order unless ``rows_ordered``; with
    ``next_pos``, rows whose group's earlier members were never fed are refused)."""
    torch.ops.qsa.update_compressed_keys(raw_k, token_to_req, positions, kc_cache, block_table, partial,
                                         norm_weight, as_finite_float("eps", eps), check_int("rotary_dim", rotary_dim),
                                         as_finite_float("rope_theta", rope_theta), backend,
                                         check_int("block_size", block_size), next_pos, refusals,
                                         check_bool("rows_ordered", rows_ordered), None, None)
