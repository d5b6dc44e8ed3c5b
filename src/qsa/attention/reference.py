"""Pure-PyTorch references of sparse paged attention (two independent paths) and the tolerance rule
every route is held to.

Everything here favours clarity over speed (Python loops over rows and tokens) and works on any
device. Two attention paths cross-check each other:

* :func:`reference_attention` -- per row, the kept token SET in Python, gathered through the block
  table, softmax in ``compute_dtype`` (fp64 = ground truth; fp16/bf16 = what plain PyTorch at that
  precision would get, the yardstick for kernel tolerances).
* :func:`sdpa_attention` -- vectorised: a dense boolean mask ``[rows, tokens]`` per request into
  ``torch.nn.functional.scaled_dot_product_attention``.

The page4 planners' references are in :mod:`qsa.attention.planning.reference`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..cache.paged import dequantize_e4m3
from ..utils import check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)
LOWP_DTYPES = (torch.float16, torch.bfloat16)


def _check_inputs(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens,
                  gate, kv_cache_dtype):
    check_tensor("q", q, ndim=3, what="[rows, Hq, D]")
    rows, num_q_heads, head_dim = q.shape
    if kv_cache_dtype not in ("auto", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")
    cache_dtypes = torch.uint8 if kv_cache_dtype == "fp8_e4m3" else (torch.float16, torch.bfloat16,
                                                                      torch.float32, torch.float64)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, shape=(None, None, None, head_dim),
                 what="[num_blocks, block_size, Hkv, D]")
    check_tensor("v_cache", v_cache, ndim=4, dtypes=k_cache.dtype, shape=tuple(k_cache.shape),
                 what="[num_blocks, block_size, Hkv, D]")
    if num_q_heads % k_cache.shape[2] != 0:
        raise ValueError(f"Hq ({num_q_heads}) must be a multiple of Hkv ({k_cache.shape[2]})")
    check_tensor("indices", indices, ndim=2, dtypes=INDEX_DTYPES, shape=(rows, None), what="[rows, W]")
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, what="[num_reqs, max_blocks]")
    check_tensor("token_to_req", token_to_req, dtypes=INDEX_DTYPES, shape=(rows,), what="[rows]")
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(rows,), what="[rows]")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(block_table.shape[0],),
                 what="[num_reqs]")
    if gate is not None:
        check_tensor("gate", gate, shape=tuple(q.shape), what="[rows, Hq, D]")


def kept_tokens(row_indices, req, pos, seq_lens, table, block_size, num_blocks) -> list[int]:
    """Sorted distinct tokens row attends (docs/spec.md section 4); [] for padding rows."""
    if not 0 <= req < len(seq_lens) or pos < 0:
        return []
    kept = set()
    for t in row_indices:
        if t < 0 or t >= seq_lens[req] or t > pos or t // block_size >= len(table[req]):
            continue
        if 0 <= table[req][t // block_size] < num_blocks:
            kept.add(t)
    return sorted(kept)


def _load_kv(cache, blocks, offsets, fp8: bool, scale: float, dtype) -> torch.Tensor:
    """Rows ``cache[blocks, offsets]`` ``[n, Hkv, D]`` as ``dtype`` (FP8 bytes dequantised)."""
    raw = cache[blocks, offsets]
    if not fp8:
        return raw.to(dtype)
    if dtype == torch.float64:
        return raw.view(torch.float8_e4m3fn).to(torch.float64) * scale
    return dequantize_e4m3(raw, scale).to(dtype)


def _apply_gate(attn, gate, compute_dtype):
    """docs/spec.md section 1: ``round_to_act(attn).float() * sigmoid(gate.float())``, cast back."""
    if gate is None:
        return attn
    if compute_dtype == torch.float64:
        return attn * torch.sigmoid(gate.to(torch.float64))
    return (attn.to(compute_dtype).float() * torch.sigmoid(gate.float())).to(compute_dtype)


def _lse_dtype(compute_dtype):
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def reference_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, *,
                        gate=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, softmax_scale=None,
                        compute_dtype=torch.float64, index_counts=None):
    """Sparse paged attention over token sets, one row at a time (docs/spec.md section 4).

    Row ``r`` attends the set ``T_r`` of distinct tokens ``t`` of ``indices[r]`` with ``t >= 0``,
    ``t < seq_lens[req]``, ``t <= positions[r]`` and a valid ``block_table[req, t // block_size]``
    (``req = token_to_req[r]``). Padding rows (``req`` outside ``[0, num_reqs)`` or ``positions[r] < 0``)
    and empty sets give ``out = 0``, ``lse = -inf``. Tokens outside ``T_r`` are never read.

    Args:
        q: ``[rows, Hq, D]``; KV head ``j`` serves query heads ``[j*G, (j+1)*G)``, ``G = Hq // Hkv``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (uint8 E4M3 for ``"fp8_e4m3"``).
        indices: ``[rows, W]`` int32/int64 logical tokens (any order, duplicates, -1 allowed).
        block_table: ``[num_reqs, max_blocks]``; token_to_req, positions: ``[rows]``;
            seq_lens: ``[num_reqs]``.
        gate: optional ``[rows, Hq, D]``, applied as ``out * sigmoid(gate)``.
        kv_cache_dtype, k_scale, v_scale: FP8 caches read as ``e4m3 * scale``.
        softmax_scale: default ``D ** -0.5``.
        compute_dtype: float64 (ground truth, fp64 out) or the activation dtype (fp16/bf16: scores,
            softmax and P@V in that dtype, then the gate rule of docs/spec.md section 1), or float32.
        index_counts: optional ``[rows]`` int32/int64 (any stride): row ``r`` is only its first
            ``min(max(index_counts[r], 0), W)`` entries of ``indices``; the others are ignored.

    Returns:
        ``(out, lse)``: ``out [rows, Hq, D]`` in ``compute_dtype``; ``lse [rows, Hq]`` natural-log
        log-sum-exp of the scaled scores (fp64 for fp64 compute, else fp32).
    """
    _check_inputs(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate,
                  kv_cache_dtype)
    rows, num_q_heads, head_dim = q.shape
    if index_counts is not None:
        check_tensor("index_counts", index_counts, ndim=1, dtypes=INDEX_DTYPES, shape=(rows,), what="[rows]")
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    fp8 = kv_cache_dtype == "fp8_e4m3"

    out = torch.zeros(rows, num_q_heads, head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((rows, num_q_heads), -math.inf, dtype=_lse_dtype(compute_dtype), device=q.device)
    idx, t2r = indices.tolist(), token_to_req.tolist()
    if index_counts is not None:  # docs/spec.md section 4: a row is its first count entries, clamped to [0, W]
        idx = [row[:min(max(n, 0), len(row))] for row, n in zip(idx, index_counts.tolist())]
    pos, lens, table = positions.tolist(), seq_lens.tolist(), block_table.tolist()
    for r in range(rows):
        tokens = kept_tokens(idx[r], t2r[r], pos[r], lens, table, block_size, num_blocks)
        if not tokens:
            continue
        req = t2r[r]
        blocks = torch.tensor([table[req][t // block_size] for t in tokens], device=k_cache.device)
        offsets = torch.tensor([t % block_size for t in tokens], device=k_cache.device)
        k = _load_kv(k_cache, blocks, offsets, fp8, k_scale, compute_dtype).to(q.device)  # [n, Hkv, D]
        v = _load_kv(v_cache, blocks, offsets, fp8, v_scale, compute_dtype).to(q.device)
        qr = q[r].to(compute_dtype).view(num_kv_heads, group, head_dim)  # [Hkv, G, D]
        s = torch.matmul(qr, k.permute(1, 2, 0)) * scale  # [Hkv, G, n]
        lse[r] = torch.logsumexp(s.to(lse.dtype), dim=-1).reshape(num_q_heads)
        p = torch.softmax(s, dim=-1)
        out[r] = torch.matmul(p, v.permute(1, 0, 2)).reshape(num_q_heads, head_dim)
    return _apply_gate(out, gate, compute_dtype), lse


def sdpa_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, *,
                   gate=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, softmax_scale=None,
                   compute_dtype=torch.float64):
    """Same contract as :func:`reference_attention`, computed independently with dense masks.

    The token sets become a boolean mask ``[rows, max_blocks * block_size]`` built with tensor ops;
    each request's logical K/V is gathered densely through its block table (only tokens some row of
    the request keeps; the rest zero) and fed to ``scaled_dot_product_attention``. Use fp64 or fp32.
    """
    _check_inputs(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate,
                  kv_cache_dtype)
    rows, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs, max_blocks = block_table.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    fp8 = kv_cache_dtype == "fp8_e4m3"
    dev = q.device
    span = max_blocks * block_size

    req = token_to_req.to(dev, torch.int64)
    pos = positions.to(dev, torch.int64)
    table = block_table.to(dev, torch.int64)
    idx = indices.to(dev, torch.int64)
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c = req.clamp(0, max(num_reqs - 1, 0))
    if num_reqs == 0:
        row_ok = torch.zeros_like(row_ok)
        table = torch.full((1, max(max_blocks, 1)), -1, dtype=torch.int64, device=dev)
        seq = torch.zeros(rows, dtype=torch.int64, device=dev)
    else:
        seq = seq_lens.to(dev, torch.int64)[req_c]
    logical_block = torch.div(idx, block_size, rounding_mode="floor")
    phys = table[req_c[:, None], logical_block.clamp(0, max(max_blocks - 1, 0))]
    keep = (row_ok[:, None] & (idx >= 0) & (logical_block < max_blocks) & (idx < seq[:, None])
            & (idx <= pos[:, None]) & (phys >= 0) & (phys < num_blocks))
    # Dropped entries scatter into a spare last column, so every write is a True.
    mask = torch.zeros(rows, span + 1, dtype=torch.bool, device=dev)
    mask.scatter_(1, torch.where(keep, idx, span), True)
    mask = mask[:, :span]

    out = torch.zeros(rows, num_q_heads, head_dim, dtype=compute_dtype, device=dev)
    lse = torch.full((rows, num_q_heads), -math.inf, dtype=_lse_dtype(compute_dtype), device=dev)
    tokens = torch.arange(span, device=dev)
    for rq in torch.unique(req[row_ok]).tolist():
        sel = torch.nonzero(row_ok & (req == rq)).flatten()
        m = mask[sel]  # [n_r, span]
        used = m.any(dim=0)
        blocks = table[rq, tokens[used] // block_size].to(k_cache.device)
        offsets = (tokens[used] % block_size).to(k_cache.device)
        k = torch.zeros(span, num_kv_heads, head_dim, dtype=compute_dtype, device=dev)
        v = torch.zeros_like(k)
        k[used] = _load_kv(k_cache, blocks, offsets, fp8, k_scale, compute_dtype).to(dev)
        v[used] = _load_kv(v_cache, blocks, offsets, fp8, v_scale, compute_dtype).to(dev)
        qh = q[sel].to(compute_dtype).transpose(0, 1)  # [Hq, n_r, D]
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, span, D]
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
        empty = ~m.any(dim=1)
        attend = m.clone()
        attend[empty] = True  # keeps SDPA finite; those rows are zeroed below
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attend, scale=scale)
        o[:, empty] = 0
        out[sel] = o.transpose(0, 1)
        s = torch.matmul(qh, kh.transpose(1, 2)) * scale
        lse[sel] = torch.logsumexp(s.masked_fill(~m, -math.inf), dim=-1).transpose(0, 1).to(lse.dtype)
    return _apply_gate(out, gate, compute_dtype), lse


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Error allowance for rounding once into ``dtype``: one ulp at the largest ``|ref|``."""
    finite = ref[torch.isfinite(ref)]
    if finite.numel() == 0:
        return 0.0
    return torch.finfo(dtype).eps * float(finite.abs().max())


def assert_close_like_torch(out, ref, torch_out, *, lse=None, ref_lse=None, torch_lse=None,
                            factor: float = 2.0, floor: float | None = None, name: str = "out") -> dict:
    """Flash-attention style check: ``|out - ref| <= factor * |torch_out - ref| + floor`` (max norms).

    Args:
        out: the result under test (e.g. a kernel's fp16 output).
        ref: the fp64 ground truth (``reference_attention(..., compute_dtype=torch.float64)``).
        torch_out: the same computation done by PyTorch at ``out``'s precision
            (``reference_attention(..., compute_dtype=out.dtype)``).
        lse, ref_lse, torch_lse: optional log-sum-exps ``[rows, Hq]``, checked the same way where
            ``ref_lse`` is finite; ``-inf`` positions must match exactly and their ``out`` be 0.
        factor: allowed multiple of PyTorch's own error.
        floor: absolute allowance; default :func:`rounding_floor` of ``ref`` in ``out.dtype``.

    Returns:
        dict of the measured errors and bounds (``err``, ``torch_err``, ``bound``, ``lse_err``, ...).

    Raises:
        AssertionError: with the measured numbers.
    """
    ref = ref.double()
    stats = {}
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        bad = torch.nonzero(~torch.isfinite(out))[:4].tolist()
        raise AssertionError(f"{name}: non-finite values, e.g. at {bad}")
    err = float((out.double() - ref).abs().max()) if out.numel() else 0.0
    torch_err = float((torch_out.double() - ref).abs().max()) if out.numel() else 0.0
    floor = rounding_floor(ref, out.dtype) if floor is None else float(floor)
    bound = factor * torch_err + floor
    stats.update(err=err, torch_err=torch_err, floor=floor, bound=bound)
    if not err <= bound:  # a NaN in the reference or in PyTorch's result fails too
        raise AssertionError(f"{name}: max abs error {err:.3e} > {factor} x torch {torch_err:.3e} "
                             f"+ floor {floor:.3e} = {bound:.3e}")
    if ref_lse is None:
        return stats

    empty = torch.isneginf(ref_lse)
    if bool((out[empty] != 0).any()):
        raise AssertionError(f"{name}: rows/heads with an empty token set must be exactly 0")
    if lse is None:
        return stats
    if lse.shape != ref_lse.shape:
        raise AssertionError(f"{name} lse: shape {tuple(lse.shape)} != reference {tuple(ref_lse.shape)}")
    if not torch.equal(torch.isneginf(lse), empty):
        bad = torch.nonzero(torch.isneginf(lse) != empty)[:4].tolist()
        raise AssertionError(f"{name} lse: -inf positions differ from the reference, e.g. at {bad}")
    fin = ~empty
    if not torch.isfinite(lse[fin]).all():
        raise AssertionError(f"{name} lse: non-finite values where the reference is finite")
    ref_l = ref_lse[fin].double()
    lse_err = float((lse[fin].double() - ref_l).abs().max()) if ref_l.numel() else 0.0
    torch_lse_err = (float((torch_lse[fin].double() - ref_l).abs().max())
                     if torch_lse is not None and ref_l.numel() else 0.0)
    lse_floor = torch.finfo(out.dtype).eps * max(1.0, float(ref_l.abs().max()) if ref_l.numel() else 1.0)
    lse_bound = factor * torch_lse_err + lse_floor
    stats.update(lse_err=lse_err, torch_lse_err=torch_lse_err, lse_bound=lse_bound)
    if not lse_err <= lse_bound:
        raise AssertionError(f"{name} lse: max abs error {lse_err:.3e} > {factor} x torch "
                             f"{torch_lse_err:.3e} "
                             f"+ floor {lse_floor:.3e} = {lse_bound:.3e}")
    return stats
