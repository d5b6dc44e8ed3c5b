"""Pure-PyTorch references: sparse paged attention (two independent paths), the page4 planners,
and the checkers the tests use.

Everything here favours clarity over speed (Python loops over rows and tokens) and works on any
device. Two attention paths cross-check each other:

* :func:`reference_attention` -- per row, the kept token SET in Python, gathered through the block
  table, softmax in ``compute_dtype`` (fp64 = ground truth; fp16/bf16 = what plain PyTorch at that
  precision would get, the yardstick for kernel tolerances).
* :func:`sdpa_attention` -- vectorised: a dense boolean mask ``[rows, tokens]`` per request into
  ``torch.nn.functional.scaled_dot_product_attention``.

The reference planners rebuild :class:`~qsa.plan.SingleRowPlan` / :class:`~qsa.plan.GroupedPlan`
from the raw inputs with loops, exactly as documented in :mod:`qsa.plan`; :func:`compare_plans`
compares two plans entry by entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .cache import BlockAllocator, PagedKVCache, allocate_kv_cache, dequantize_e4m3, quantize_e4m3
from .plan import (MAX_GROUP_ROWS, PAD, GroupedPlan, SingleRowPlan, grouped_capacity,
                   single_row_capacity)
from .utils import INT32_MAX, check_tensor, round_up

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


def _kept_tokens(row_indices, req, pos, seq_lens, table, block_size, num_blocks) -> list[int]:
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
                        compute_dtype=torch.float64):
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

    Returns:
        ``(out, lse)``: ``out [rows, Hq, D]`` in ``compute_dtype``; ``lse [rows, Hq]`` natural-log
        log-sum-exp of the scaled scores (fp64 for fp64 compute, else fp32).
    """
    _check_inputs(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, gate,
                  kv_cache_dtype)
    rows, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    fp8 = kv_cache_dtype == "fp8_e4m3"

    out = torch.zeros(rows, num_q_heads, head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((rows, num_q_heads), -math.inf, dtype=_lse_dtype(compute_dtype), device=q.device)
    idx, t2r = indices.tolist(), token_to_req.tolist()
    pos, lens, table = positions.tolist(), seq_lens.tolist(), block_table.tolist()
    for r in range(rows):
        tokens = _kept_tokens(idx[r], t2r[r], pos[r], lens, table, block_size, num_blocks)
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


def _plan_inputs(indices, block_table, token_to_req, positions, seq_lens, block_size, num_blocks):
    check_tensor("indices", indices, ndim=2, dtypes=INDEX_DTYPES, what="[rows, W]")
    rows = indices.shape[0]
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, what="[num_reqs, max_blocks]")
    check_tensor("token_to_req", token_to_req, dtypes=INDEX_DTYPES, shape=(rows,), what="[rows]")
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(rows,), what="[rows]")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(block_table.shape[0],), what="[num_reqs]")
    if block_size <= 0 or block_size % 4 != 0:
        raise ValueError(f"block_size must be a positive multiple of 4, got {block_size}")
    if num_blocks * (block_size // 4) - 1 > INT32_MAX:
        raise ValueError(f"num_blocks * block_size // 4 = {num_blocks * (block_size // 4)} microblock ids "
                         f"do not fit int32")
    return (indices.tolist(), block_table.tolist(), token_to_req.tolist(), positions.tolist(),
            seq_lens.tolist())


def _pad(ids: list, masks: list) -> None:
    """Append ``(ids[0], 0)`` entries up to a multiple of PAD (nothing for an empty list)."""
    if ids:
        extra = round_up(len(ids), PAD) - len(ids)
        ids.extend([ids[0]] * extra)
        masks.extend([0] * extra)


def reference_single_row_plan(indices, block_table, token_to_req, positions, seq_lens, *,
                              block_size: int, num_blocks: int) -> SingleRowPlan:
    """The single-row page4 plan built with Python loops (see :class:`qsa.plan.SingleRowPlan`).

    Per row: kept tokens (docs/spec.md section 4) grouped by logical microblock ``t // 4``, ascending; id
    ``block_table[req, t // block_size] * (block_size // 4) + (t % block_size) // 4``; mask bit
    ``t % 4``. Padded with ``(first id, mask 0)`` to a multiple of PAD; entries past that are 0.
    """
    idx, table, t2r, pos, lens = _plan_inputs(indices, block_table, token_to_req, positions, seq_lens,
                                              block_size, num_blocks)
    rows = len(idx)
    cap = single_row_capacity(indices.shape[1])
    mb_ids = torch.zeros(rows, cap, dtype=torch.int32)
    masks = torch.zeros(rows, cap, dtype=torch.uint8)
    counts = torch.zeros(rows, dtype=torch.int32)
    per_block = block_size // 4
    for r in range(rows):
        by_lm: dict[int, int] = {}
        for t in _kept_tokens(idx[r], t2r[r], pos[r], lens, table, block_size, num_blocks):
            by_lm[t // 4] = by_lm.get(t // 4, 0) | (1 << (t % 4))
        row_ids, row_masks = [], []
        for lm in sorted(by_lm):
            t0 = 4 * lm
            row_ids.append(table[t2r[r]][t0 // block_size] * per_block + (t0 % block_size) // 4)
            row_masks.append(by_lm[lm])
        counts[r] = len(row_ids)
        _pad(row_ids, row_masks)
        mb_ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.int32)
        masks[r, :len(row_masks)] = torch.tensor(row_masks, dtype=torch.uint8)
    dev = indices.device
    return SingleRowPlan(mb_ids.to(dev), masks.to(dev), counts.to(dev), block_size, num_blocks)


def reference_grouped_plan(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
                           num_blocks: int, group_rows: int = 8, num_rows: int | None = None) -> GroupedPlan:
    """The grouped page4 plan built with Python loops (see :class:`qsa.plan.GroupedPlan`).

    Rows ``[0, num_rows)`` (default all) in groups of ``group_rows``; kept tokens re-derived here
    (not via :func:`reference_single_row_plan`). Within a group, the requests in the order of their
    first valid row; for each, the union of its rows' logical microblocks, ascending, mask = OR of
    ``row_mask << 4q`` (stored as int32, bit 31 included), id = the microblock's physical id. Padded
    like the single-row plan.
    """
    idx, table, t2r, pos, lens = _plan_inputs(indices, block_table, token_to_req, positions, seq_lens,
                                              block_size, num_blocks)
    if not 1 <= group_rows <= MAX_GROUP_ROWS:
        raise ValueError(f"group_rows must be in [1, {MAX_GROUP_ROWS}], got {group_rows}")
    num_rows = len(idx) if num_rows is None else int(num_rows)
    if not 0 <= num_rows <= len(idx):
        raise ValueError(f"num_rows must be in [0, {len(idx)}], got {num_rows}")
    num_groups = -(-num_rows // group_rows)
    cap = grouped_capacity(indices.shape[1], group_rows)
    mb_ids = torch.zeros(num_groups, cap, dtype=torch.int32)
    masks = torch.zeros(num_groups, cap, dtype=torch.int32)
    counts = torch.zeros(num_groups, dtype=torch.int32)
    num_reqs = len(lens)

    for g in range(num_groups):
        by_req: dict[int, dict[int, int]] = {}  # request (first-row order) -> logical microblock -> mask
        for q, r in enumerate(range(g * group_rows, min((g + 1) * group_rows, num_rows))):
            req, p = t2r[r], pos[r]
            if req < 0 or req >= num_reqs or p < 0:
                continue
            row = table[req]
            union = by_req.setdefault(req, {})
            for t in set(idx[r]):
                lb = t // block_size
                if 0 <= t < lens[req] and t <= p and lb < len(row) and 0 <= row[lb] < num_blocks:
                    union[t // 4] = union.get(t // 4, 0) | (1 << (t % 4 + 4 * q))
        group_ids, group_masks = [], []
        for req, union in by_req.items():
            for lm in sorted(union):
                group_ids.append(table[req][lm * 4 // block_size] * (block_size // 4) + lm % (block_size // 4))
                group_masks.append(union[lm] - (1 << 32) if union[lm] >= 1 << 31 else union[lm])
        counts[g] = len(group_ids)
        _pad(group_ids, group_masks)
        mb_ids[g, :len(group_ids)] = torch.tensor(group_ids, dtype=torch.int32)
        masks[g, :len(group_masks)] = torch.tensor(group_masks, dtype=torch.int32)
    dev = indices.device
    return GroupedPlan(mb_ids.to(dev), masks.to(dev), counts.to(dev), group_rows, num_rows, block_size,
                       num_blocks)


def compare_plans(a, b, *, ignore_ids: bool = False, mapping: torch.Tensor | None = None,
                  max_messages: int = 20) -> list[str]:
    """Differences between two plans of the same kind; an empty list when they agree.

    Counts must be equal, and ids and masks equal over each list's padded length
    ``round_up(count, PAD)``; entries past it are not compared.

    Args:
        ignore_ids: compare counts and masks only.
        mapping: int64 ``[num_blocks_a]`` relocation (``mapping[old] = new``, see
            :func:`qsa.cache.relocate`): ``b`` must be ``a`` with each id's physical block mapped
            (offset inside the block kept), masks, counts and order unchanged.
        max_messages: stop after this many differences.
    """
    if type(a) is not type(b):
        return [f"plan types differ: {type(a).__name__} vs {type(b).__name__}"]
    msgs = []
    if a.block_size != b.block_size:
        msgs.append(f"block_size differs: {a.block_size} vs {b.block_size}")
    if isinstance(a, GroupedPlan) and (a.group_rows, a.num_rows) != (b.group_rows, b.num_rows):
        msgs.append(f"(group_rows, num_rows) differ: {(a.group_rows, a.num_rows)} vs "
                    f"{(b.group_rows, b.num_rows)}")
    if a.counts.shape != b.counts.shape:
        msgs.append(f"number of lists differs: {a.counts.shape[0]} vs {b.counts.shape[0]}")
    if msgs:
        return msgs
    kind = "group" if isinstance(a, GroupedPlan) else "row"
    per_block = a.block_size // 4
    map_list = mapping.tolist() if mapping is not None else None
    ca, cb = a.counts.tolist(), b.counts.tolist()
    ids_a, ids_b = a.mb_ids.cpu(), b.mb_ids.cpu()
    masks_a, masks_b = a.masks.cpu(), b.masks.cpu()
    for i, (na, nb) in enumerate(zip(ca, cb)):
        if len(msgs) >= max_messages:
            break
        if na != nb:
            msgs.append(f"{kind} {i}: count {na} vs {nb}")
            continue
        n = round_up(na, PAD)
        if n > min(a.capacity, b.capacity):
            msgs.append(f"{kind} {i}: padded count {n} exceeds capacity {min(a.capacity, b.capacity)}")
            continue
        ma, mb = masks_a[i, :n].tolist(), masks_b[i, :n].tolist()
        if ma != mb:
            j = next(j for j in range(n) if ma[j] != mb[j])
            msgs.append(f"{kind} {i}: masks differ first at entry {j}: {ma[j]} vs {mb[j]}")
        if ignore_ids:
            continue
        ia, ib = ids_a[i, :n].tolist(), ids_b[i, :n].tolist()
        if map_list is not None:
            ia = [map_list[x // per_block] * per_block + x % per_block
                  if 0 <= x // per_block < len(map_list) else -1 for x in ia]
        if ia != ib:
            j = next(j for j in range(n) if ia[j] != ib[j])
            what = "mapped ids" if map_list is not None else "ids"
            msgs.append(f"{kind} {i}: {what} differ first at entry {j}: {ia[j]} vs {ib[j]}")
    return msgs[:max_messages]


@dataclass
class AttentionCase:
    """A random sparse paged attention problem (see :func:`make_attention_case`).

    Attributes:
        q: ``[rows, Hq, D]``; gate: ``[rows, Hq, D]`` or None.
        cache: the :class:`~qsa.cache.PagedKVCache` (NaN / 0x7F in every slot no kept token uses).
        indices: ``[rows, W]`` int32; block_table: ``[num_reqs, max_blocks]`` int32;
        token_to_req: ``[rows]`` int32; positions: ``[rows]`` int64; seq_lens: ``[num_reqs]`` int32.
    """

    q: torch.Tensor
    gate: torch.Tensor | None
    cache: PagedKVCache
    indices: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor

    def run(self, fn, **kwargs):
        """``fn(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, ...)``."""
        c = self.cache
        kw = dict(gate=self.gate, kv_cache_dtype=c.kv_cache_dtype, k_scale=c.k_scale, v_scale=c.v_scale)
        kw.update(kwargs)
        return fn(self.q, c.k, c.v, self.indices, self.block_table, self.token_to_req, self.positions,
                  self.seq_lens, **kw)

    def plan_inputs(self) -> dict:
        """Keyword arguments of the planners (``indices`` .. ``num_blocks``)."""
        return dict(indices=self.indices, block_table=self.block_table, token_to_req=self.token_to_req,
                    positions=self.positions, seq_lens=self.seq_lens, block_size=self.cache.block_size,
                    num_blocks=self.cache.num_blocks)

    def relocated(self, mapping: torch.Tensor, *, num_blocks_out: int | None = None) -> "AttentionCase":
        """The same problem with the cache's pages moved by ``mapping`` (unused blocks NaN)."""
        cache, table = self.cache.relocated(self.block_table, mapping, num_blocks_out=num_blocks_out,
                                            fill="nan")
        return replace(self, cache=cache, block_table=table)

    def take_rows(self, rows) -> "AttentionCase":
        """The problem of rows ``rows`` (a list or tensor of row numbers, in that order, repeats allowed) of
        this one: the same cache, table and lengths."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.q.device)
        return replace(self, q=self.q[rows], gate=None if self.gate is None else self.gate[rows],
                       indices=self.indices[rows], token_to_req=self.token_to_req[rows],
                       positions=self.positions[rows])

    def with_permuted_indices(self, generator: torch.Generator) -> "AttentionCase":
        """The same problem with the entries of each ``indices`` row shuffled."""
        perm = torch.argsort(torch.rand(self.indices.shape, generator=generator), dim=1)
        return replace(self, indices=torch.gather(self.indices, 1, perm.to(self.indices.device)))


def make_attention_case(*, rows: int = 13, num_reqs: int = 3, num_q_heads: int = 2, num_kv_heads: int = 1,
                        head_dim: int = 16, block_size: int = 16, width: int = 24, max_seq_len: int = 70,
                        dtype=torch.float16, kv_cache_dtype: str = "auto", layout: str = "interleaved",
                        with_gate: bool = False, messy: bool = True, share_prefix: bool = True,
                        padding_rows: int = 2, spare_blocks: int = 3, seed: int = 0,
                        device="cpu") -> AttentionCase:
    """Build a random problem with the awkward cases of docs/spec.md section 4.

    Requests get random lengths and pages from a shuffled :class:`~qsa.cache.BlockAllocator` (block 0
    reserved); with ``share_prefix`` request 1 aliases request 0's first page. Only slots of tokens
    ``< seq_len`` are written (directly, not through the Triton kernel); the rest of the cache is NaN.
    ``messy`` adds duplicates, -1, tokens past the position, past ``seq_len`` and past the table, an
    entry -1 and an entry ``>= num_blocks`` in the block table. ``padding_rows`` rows get an invalid
    request or position -1.
    """
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    lens = [randint(1, max_seq_len) for _ in range(num_reqs)]
    if share_prefix and num_reqs >= 2:
        lens[0] = max(lens[0], block_size)
        lens[1] = max(lens[1], block_size + 1)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    needed = sum(-(-n // block_size) for n in lens)
    num_blocks = needed + spare_blocks + 1
    alloc = BlockAllocator(num_blocks, block_size, generator=g)
    for r, n in enumerate(lens):
        if r == 1 and share_prefix:
            alloc.share_prefix(0, 1, 1)
        alloc.allocate(r, n)
    table = alloc.block_table(range(num_reqs), max_blocks=max_blocks)

    cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                              kv_cache_dtype=kv_cache_dtype, layout=layout, device=device, fill="nan",
                              k_scale=0.5 if kv_cache_dtype == "fp8_e4m3" else 1.0,
                              v_scale=0.25 if kv_cache_dtype == "fp8_e4m3" else 1.0)
    for r, n in enumerate(lens):
        slots = alloc.slot_mapping(r, 0, n)
        for name, scale in (("k", cache.k_scale), ("v", cache.v_scale)):
            x = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
            if kv_cache_dtype == "fp8_e4m3":
                x = quantize_e4m3(x * scale * 4, scale)
            getattr(cache, name)[slots // block_size, slots % block_size] = x.to(device)

    if messy:
        # Invalidate one page of the last request: -1, and (if it has two) one out of range.
        last = num_reqs - 1
        nb_last = len(alloc.blocks(last))
        table[last, nb_last - 1] = -1
        if nb_last >= 2:
            table[last, 0] = num_blocks + 5

    token_to_req, positions, idx_rows = [], [], []
    for r in range(rows):
        req = randint(0, num_reqs - 1)
        pos = randint(0, lens[req] - 1)
        k = min(width, pos + 1)
        toks = torch.randperm(pos + 1, generator=g)[:k].tolist()
        if messy and width >= 8:
            extra = [-1, pos + randint(1, 5), lens[req] + randint(0, 3),
                     max_blocks * block_size + randint(0, 40), toks[0], toks[-1]]
            toks = toks[:width - len(extra)] + extra
        toks += [-1] * (width - len(toks))
        perm = torch.randperm(width, generator=g).tolist()
        idx_rows.append([toks[i] for i in perm])
        token_to_req.append(req)
        positions.append(pos)
    for r in range(min(padding_rows, rows)):
        if r % 2 == 0:
            token_to_req[r] = -1 if r % 4 == 0 else num_reqs + 2
        else:
            positions[r] = -1

    q = torch.randn(rows, num_q_heads, head_dim, generator=g).to(dtype)
    gate = torch.randn(rows, num_q_heads, head_dim, generator=g).to(dtype) if with_gate else None
    as_dev = dict(device=device)
    return AttentionCase(
        q=q.to(device), gate=gate.to(device) if gate is not None else None, cache=cache,
        indices=torch.tensor(idx_rows, dtype=torch.int32, **as_dev).reshape(rows, width),
        block_table=table.to(device),
        token_to_req=torch.tensor(token_to_req, dtype=torch.int32, **as_dev),
        positions=torch.tensor(positions, dtype=torch.int64, **as_dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, **as_dev))
