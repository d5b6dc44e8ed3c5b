"""The public ops as ``torch.library`` custom ops, so code calling them runs under ``torch.compile``
and inside CUDA graphs.

Registered ops (namespace ``qsa``), each with a fake (meta) implementation that only computes shapes:

* ``qsa::sparse_paged_attention`` -- functional: returns ``(out, lse)`` (``lse`` is ``[0]`` unless
  ``return_lse``); plans internally (logical order), so it needs no buffers from the caller.
* ``qsa::select_tokens`` -- functional: ``[rows, 4k + 3]`` int32 token selection.
* ``qsa::write_kv`` -- mutates an interleaved ``[num_blocks, 2, block_size, Hkv, D]`` cache.
* ``qsa::update_compressed_keys`` -- mutates the compressed-key cache and the partial groups; the
  RMSNorm (weight + 1) and RoPE at position ``4b`` of the QSA layer are applied inside.

Each op that has a Triton kernel takes a ``backend``: ``"triton"`` runs the kernel, ``"torch"`` runs a
vectorised PyTorch implementation of the same contract (used where Triton cannot run -- a CPU without
the interpreter -- and with the ``"reference"`` route). :func:`kernel_backend` picks it.

The Python wrappers below mirror the library functions' signatures.
"""

from __future__ import annotations

import torch

from . import routes

GROUP = 4
"""Tokens per compressed block."""

BACKENDS = ("triton", "torch")


def kernel_backend(route: str, device) -> str:
    """``"torch"`` for the reference route or where Triton cannot run on ``device``, else ``"triton"``."""
    if route == "reference" or routes.triton_available(torch.device(device)) is not None:
        return "torch"
    return "triton"


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# ----------------------------------------------------------------------------------------------
# PyTorch implementations of the selection and cache-write contracts


def write_kv_torch(k_cache, v_cache, k, v, slot_mapping, *, kv_cache_dtype: str = "auto",
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """:func:`qsa.cache.write_kv` in PyTorch (slots < 0 or past the cache are skipped)."""
    from .cache import quantize_e4m3

    num_blocks, block_size = k_cache.shape[:2]
    slots = slot_mapping.to(torch.int64)
    ok = (slots >= 0) & (slots < num_blocks * block_size)
    s = slots[ok]
    blk, off = s // block_size, s % block_size
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        x = x[ok]
        cache[blk, off] = quantize_e4m3(x, scale) if kv_cache_dtype == "fp8_e4m3" else x.to(cache.dtype)


def update_compressed_keys_torch(raw_k, token_to_req, positions, kc_cache, block_table, partial, *,
                                 transform=None) -> None:
    """:func:`qsa.indexer.update_compressed_keys` in PyTorch: same contract, same fp32 sums.

    Token ``t`` at position ``p`` closes group ``p // 4`` when ``p % 4 == 3``: its compressed key
    ``(((k0 + k1) + k2) + k3) * 0.25`` (members from this step when present, else from ``partial``)
    goes to the cache; the last token of a request's run whose group stays open stores the group's
    raw keys so far in ``partial``.
    """
    T, D = raw_k.shape
    num_reqs, max_blocks = block_table.shape
    if T == 0:
        return
    dev = raw_k.device
    req = token_to_req.to(torch.int64)
    pos = positions.to(torch.int64)
    ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c = torch.where(ok, req, 0)
    pos_c = torch.where(ok, pos, 0)
    j = pos_c % GROUP
    t_idx = torch.arange(T, device=dev)
    x = raw_k.float()
    members = []
    for m in range(GROUP):
        back = j - m  # rows back to the member at position 4 * (p // 4) + m
        src = (t_idx - back).clamp(0, T - 1)
        here = (back >= 0) & (t_idx - back >= 0) & (req[src] == req) & (pos[src] == pos_c - back)
        before = partial[req_c, min(m, GROUP - 2)]
        members.append(torch.where(here[:, None], x[src],
                                   torch.where(((back >= 0) & (m < GROUP - 1))[:, None], before, 0.0)))
    kc = (((members[0] + members[1]) + members[2]) + members[3]) * 0.25
    if transform is not None:
        kc = transform(kc, pos_c // GROUP).float()

    rows_per_page = kc_cache.shape[1]
    b = pos_c // GROUP
    i_page = b // rows_per_page
    page = block_table.to(torch.int64)[req_c, i_page.clamp(max=max_blocks - 1)]
    close = ok & (j == GROUP - 1) & (i_page < max_blocks) & (page >= 0) & (page < kc_cache.shape[0])
    kc_cache[page[close], (b % rows_per_page)[close]] = kc[close].to(kc_cache.dtype)

    nxt = (t_idx + 1).clamp(max=T - 1)
    last = (t_idx + 1 >= T) | (req[nxt] != req) | (pos[nxt] != pos + 1)
    keep_open = ok & (j != GROUP - 1) & last
    grp = torch.stack(members, 1)  # [T, 4, D]
    for m in range(GROUP - 1):
        sel = keep_open & (j >= m)
        partial[req_c[sel], m] = grp[sel, m]


def select_tokens_torch(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *,
                        k: int = 512) -> torch.Tensor:
    """:func:`qsa.indexer.select_tokens` in PyTorch (fp32 scores, exact top-k, expansion).

    Candidates of row ``r``: blocks ``b < min((pos + 1) // 4, seq_len // 4)`` whose table entry is
    valid. Order: score descending, ties by lower block index, -0.0 == +0.0, NaN below every number
    (a stable sort). Output as :func:`qsa.indexer.select_tokens`. Synchronises with the host.
    """
    rows, H, D = index_q.shape
    num_reqs, max_blocks = block_table.shape
    num_blocks, rows_per_page = kc_cache.shape[:2]
    n = max_blocks * rows_per_page
    dev = index_q.device
    req = token_to_req.to(torch.int64)
    pos = positions.to(torch.int64)
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c = torch.where(row_ok, req, 0)
    seq = seq_lens.to(torch.int64)[req_c]
    vis = torch.where(row_ok, torch.minimum((pos + 1) // GROUP, seq // GROUP), 0).clamp(0, n)

    pages = block_table.to(torch.int64)
    page_ok = (pages >= 0) & (pages < num_blocks)
    keys = kc_cache[pages.clamp(0, max(num_blocks - 1, 0))].reshape(num_reqs, n, D).float()
    cand = (torch.arange(n, device=dev)[None, :] < vis[:, None]) & \
        page_ok.repeat_interleave(rows_per_page, 1)[req_c]
    scores = torch.zeros(rows, n, dtype=torch.float32, device=dev)
    for r in torch.unique(req_c[row_ok]).tolist():
        sel = (req_c == r) & row_ok
        dots = torch.matmul(index_q[sel].float(), keys[r].T)  # [rows_r, H, n]
        scores[sel] = torch.relu(dots).sum(1) * (D ** -0.5)
    key = torch.where(torch.isnan(scores), -1.0, scores + 0.0)  # real scores are >= 0 or +inf
    key = torch.where(cand, key, float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    taken = torch.minimum(cand.sum(1), torch.tensor(k, device=dev))
    o_k = torch.arange(order.shape[1], device=dev)
    blocks = torch.where(o_k[None, :] < taken[:, None], order, n + 1)
    blocks = torch.sort(blocks, dim=1).values
    blocks = torch.nn.functional.pad(blocks, (0, k - blocks.shape[1]), value=n + 1)

    j = torch.arange(4 * k + 3, device=dev)[None, :]
    toks = (GROUP * blocks[:, :, None] + torch.arange(GROUP, device=dev)).reshape(rows, 4 * k)
    toks = torch.nn.functional.pad(toks, (0, 3))
    tail = ((pos + 1) // GROUP * GROUP)[:, None] + (j - GROUP * taken[:, None])
    out = torch.where(j < GROUP * taken[:, None], toks, torch.where(tail <= pos[:, None], tail, -1))
    out = torch.where((out >= 0) & (out < seq[:, None]) & row_ok[:, None], out, -1)
    return out.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("qsa::sparse_paged_attention", mutates_args=())
def _sparse_paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               indices: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
                               positions: torch.Tensor, seq_lens: torch.Tensor, gate: torch.Tensor | None,
                               kv_cache_dtype: str, k_scale: float, v_scale: float,
                               softmax_scale: float | None, return_lse: bool,
                               route: str) -> tuple[torch.Tensor, torch.Tensor]:
    from .api import sparse_paged_attention as spa

    res = spa(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate=gate,
              kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale,
              return_lse=return_lse, route=route)
    if return_lse:
        return res
    return res, torch.empty((0,), dtype=torch.float32, device=q.device)


@_sparse_paged_attention_op.register_fake
def _(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate, kv_cache_dtype,
      k_scale, v_scale, softmax_scale, return_lse, route):
    lse_shape = (q.shape[0], q.shape[1]) if return_lse else (0,)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(lse_shape, dtype=torch.float32, device=q.device))


@torch.library.custom_op("qsa::select_tokens", mutates_args=())
def _select_tokens_op(index_q: torch.Tensor, kc_cache: torch.Tensor, block_table: torch.Tensor,
                      token_to_req: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, k: int,
                      backend: str) -> torch.Tensor:
    _check_backend(backend)
    if backend == "torch":
        return select_tokens_torch(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, k=k)
    from .indexer import select_tokens as st

    return st(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, k=k)


@_select_tokens_op.register_fake
def _(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, k, backend):
    return torch.empty((index_q.shape[0], 4 * k + 3), dtype=torch.int32, device=index_q.device)


@torch.library.custom_op("qsa::write_kv", mutates_args=("kv_cache",))
def _write_kv_op(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_cache_dtype: str, k_scale: float, v_scale: float, backend: str) -> None:
    _check_backend(backend)
    kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if backend == "torch":
        write_kv_torch(kv_cache[:, 0], kv_cache[:, 1], k, v, slot_mapping, **kw)
    else:
        from .cache import write_kv as wkv

        wkv(kv_cache[:, 0], kv_cache[:, 1], k, v, slot_mapping, **kw)


@_write_kv_op.register_fake
def _(kv_cache, k, v, slot_mapping, kv_cache_dtype, k_scale, v_scale, backend):
    return None


@torch.library.custom_op("qsa::update_compressed_keys", mutates_args=("kc_cache", "partial"))
def _update_compressed_keys_op(raw_k: torch.Tensor, token_to_req: torch.Tensor, positions: torch.Tensor,
                               kc_cache: torch.Tensor, block_table: torch.Tensor, partial: torch.Tensor,
                               norm_weight: torch.Tensor | None, eps: float, rotary_dim: int,
                               rope_theta: float, backend: str) -> None:
    _check_backend(backend)
    from .layer import index_key_transform

    transform = index_key_transform(norm_weight, eps, rotary_dim, rope_theta)
    if backend == "torch":
        update_compressed_keys_torch(raw_k, token_to_req, positions, kc_cache, block_table, partial,
                                     transform=transform)
    else:
        from .indexer import update_compressed_keys as uck

        uck(raw_k, token_to_req, positions, kc_cache, block_table, partial, transform=transform)


@_update_compressed_keys_op.register_fake
def _(raw_k, token_to_req, positions, kc_cache, block_table, partial, norm_weight, eps, rotary_dim,
      rope_theta, backend):
    return None


# ----------------------------------------------------------------------------------------------
# Python wrappers (library signatures)


def sparse_paged_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, *,
                           gate=None, kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0,
                           softmax_scale: float | None = None, return_lse: bool = False, route: str = "auto"):
    """:func:`qsa.sparse_paged_attention` through the ``qsa::sparse_paged_attention`` custom op
    (no ``out=``: the op is functional). Returns ``out`` or ``(out, lse)``."""
    out, lse = torch.ops.qsa.sparse_paged_attention(
        q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate, kv_cache_dtype,
        float(k_scale), float(v_scale), None if softmax_scale is None else float(softmax_scale),
        bool(return_lse), route)
    return (out, lse) if return_lse else out


def select_tokens(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, k: int = 512,
                  backend: str = "triton") -> torch.Tensor:
    """:func:`qsa.indexer.select_tokens` through the ``qsa::select_tokens`` custom op."""
    return torch.ops.qsa.select_tokens(index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
                                       int(k), backend)


def write_kv(kv_cache, k, v, slot_mapping, *, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
             v_scale: float = 1.0, backend: str = "triton") -> None:
    """Write ``k``, ``v`` ``[T, Hkv, D]`` into an interleaved ``kv_cache``
    ``[num_blocks, 2, block_size, Hkv, D]`` at ``slot_mapping`` (the ``qsa::write_kv`` custom op)."""
    torch.ops.qsa.write_kv(kv_cache, k, v, slot_mapping, kv_cache_dtype, float(k_scale), float(v_scale),
                           backend)


def update_compressed_keys(raw_k, token_to_req, positions, kc_cache, block_table, partial, *,
                           norm_weight=None, eps: float = 1e-6, rotary_dim: int = 0,
                           rope_theta: float = 10000.0, backend: str = "triton") -> None:
    """Feed one step's raw index keys into the compressed-key cache (``qsa::update_compressed_keys``),
    transforming each compressed key by RMSNorm (``norm_weight + 1``) and RoPE at position ``4b``."""
    torch.ops.qsa.update_compressed_keys(raw_k, token_to_req, positions, kc_cache, block_table, partial,
                                         norm_weight, float(eps), int(rotary_dim), float(rope_theta), backend)
