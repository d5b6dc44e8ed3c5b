"""Baselines and the device-side references of the benchmark.

* :func:`naive_attention` -- plain PyTorch in the activation dtype: per row, gather its tokens' K/V
  through the block table, matmul, softmax, matmul; rows in chunks so the gathered K/V stays bounded.
* :func:`reference_attention_fp32` -- the same computation in fp32 (TF32 off): the correctness gate
  for sizes where the loop references of ``qsa.attention.reference`` would take minutes.
* :func:`torch_select_baseline` -- the selection stage in plain PyTorch (dense gather, matmul, ``torch.topk``),
  the pipeline ``select_tokens`` is measured against.
* :func:`exact_selection` -- the exact top-k of the selection stage from fp64 scores (exact for the
  dyadic synthetic keys of :func:`benchmarks.generators.synthetic_index_keys`), ties by lower block.
"""

from __future__ import annotations

import contextlib

import torch

from qsa.selection.reference import GROUP
from qsa.utils import INT32_MAX, check_int

from .generators import INDEX_HEADS, expand_blocks, kept_tokens

GATHER_BYTES = 1 << 30
"""Gathered K/V bytes per chunk of rows (both baselines)."""


@contextlib.contextmanager
def full_fp32_matmul():
    """fp32 matmuls in full precision (no TF32) inside the block."""
    prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev[:2]
        torch.set_float32_matmul_precision(prev[2])


def _chunk_rows(width: int, num_kv_heads: int, head_dim: int, elem: int, budget: int = GATHER_BYTES) -> int:
    per_row = 2 * width * num_kv_heads * head_dim * elem
    return max(1, budget // max(per_row, 1))


def chunked_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, *,
                      compute_dtype: torch.dtype, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                      v_scale: float = 1.0, softmax_scale: float | None = None, out=None,
                      chunk_rows: int | None = None):
    """Sparse paged attention (docs/spec.md section 4) in plain PyTorch, ``chunk_rows`` rows at a time.

    Each row's set ``T_r`` is found with tensor ops (sort, duplicates dropped, validity masked); its
    K/V rows are gathered through the block table into ``[chunk, W, Hkv, D]`` in ``compute_dtype``
    (FP8 bytes dequantised as ``e4m3 * scale``), then ``softmax(q K^T * scale) V`` with masked
    entries at -inf. Empty sets and padding rows give 0. No host synchronisation (graph-capturable).
    Entries are sorted per row, so a row's first entry is kept whenever any is.

    Returns:
        ``[rows, Hq, D]`` in ``compute_dtype`` (``out`` when given).
    """
    rows, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    g = hq // hkv
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    fp8 = kv_cache_dtype == "fp8_e4m3"
    if out is None:
        out = torch.empty(rows, hq, d, dtype=compute_dtype, device=q.device)
    width = indices.shape[1]
    if chunk_rows is None:
        chunk_rows = _chunk_rows(width, hkv, d, torch.finfo(compute_dtype).bits // 8)
    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        tokens, phys, keep = kept_tokens(indices[r0:r1], block_table, token_to_req[r0:r1], positions[r0:r1],
                                         seq_lens, block_size=block_size, num_blocks=num_blocks)
        # Dropped entries read the row's first kept token (finite data; its weight is 0): reading
        # anything else, e.g. block 0, could bring NaN, and 0 * NaN = NaN in P @ V.
        blk = torch.where(keep, phys, phys[:, :1])
        off = torch.where(keep, tokens, tokens[:, :1]) % block_size
        any_kept = keep[:, 0]
        blk, off = torch.where(any_kept[:, None], blk, 0), torch.where(any_kept[:, None], off, 0)
        k = _gather(k_cache, blk, off, fp8, k_scale, compute_dtype)        # [n, W, Hkv, D]
        v = _gather(v_cache, blk, off, fp8, v_scale, compute_dtype)
        qc = q[r0:r1].to(compute_dtype).view(r1 - r0, hkv, g, d)           # [n, Hkv, G, D]
        s = torch.matmul(qc, k.permute(0, 2, 3, 1)) * scale                  # [n, Hkv, G, W]
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, v.permute(0, 2, 1, 3))                           # [n, Hkv, G, D]
        o = torch.where(any_kept[:, None, None, None], o, 0)               # empty sets, padding rows -> 0
        out[r0:r1] = o.reshape(r1 - r0, hq, d).to(out.dtype)
    return out


def _gather(cache, blk, off, fp8: bool, scale: float, dtype):
    """``cache[blk, off]`` -> ``[n, W, Hkv, D]`` in ``dtype``: whole token rows with ``index_select``
    when the cache's strides allow a flat ``[slots, Hkv * D]`` view (the usual layouts, interleaved
    too), which is several times faster than element-wise advanced indexing."""
    nb, bs, hkv, d = cache.shape
    s_blk, s_tok, s_head, s_d = cache.stride()
    if s_d == 1 and s_head == d and s_tok == hkv * d and s_blk % s_tok == 0 and nb > 0:
        per_block = s_blk // s_tok
        flat = cache.as_strided(((nb - 1) * per_block + bs, hkv * d), (s_tok, 1))
        x = flat.index_select(0, (blk * per_block + off).reshape(-1)).view(*blk.shape, hkv, d)
    else:
        x = cache[blk, off]
    if fp8:
        return x.view(torch.float8_e4m3fn).to(dtype) * scale
    return x.to(dtype)


def naive_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, *,
                    kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, out=None):
    """The naive PyTorch baseline, in q's dtype."""
    return chunked_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens,
                             compute_dtype=q.dtype, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                             v_scale=v_scale, out=out)


def reference_attention_fp32(q, k_cache, v_cache, indices, block_table, token_to_req, positions, seq_lens, *,
                             kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """The fp32 reference (full-precision fp32 matmuls), ``[rows, Hq, D]`` fp32."""
    with full_fp32_matmul():
        return chunked_attention(q, k_cache, v_cache, indices, block_table, token_to_req, positions,
                                 seq_lens, compute_dtype=torch.float32, kv_cache_dtype=kv_cache_dtype,
                                 k_scale=k_scale, v_scale=v_scale)


# ------------------------------------------------------------------------------------------------
# selection


def exact_block_scores(index_q, kc_dense, rows_sel):
    """fp64 ``sum_h relu(q[r, h] . kc[b])`` for rows ``rows_sel`` (unscaled; exact for dyadic data)."""
    q = index_q[rows_sel].double()                                           # [n, H, D]
    s = torch.matmul(q.reshape(-1, q.shape[-1]), kc_dense.double().T)        # [n * H, blocks]
    return s.reshape(q.shape[0], INDEX_HEADS, -1).clamp_min(0).sum(1)


def _dense_keys(kc_cache, block_table, req: int):
    rpb = kc_cache.shape[1]
    pages = block_table[req].long()
    ok = (pages >= 0) & (pages < kc_cache.shape[0])
    dense = kc_cache[pages.clamp(0, kc_cache.shape[0] - 1)].reshape(-1, kc_cache.shape[2])
    return dense, ok.repeat_interleave(rpb)


def exact_selection(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *, k: int = 512,
                    chunk_rows: int = 256):
    """The selection stage's exact answer (docs/spec.md section 2), for inputs whose fp32 scores are exact.

    Scores in fp64, order by score descending with ties by lower block index (a stable sort), the
    ``k`` best visible candidate blocks ascending, expanded to ``[rows, 4k + 3]`` int32 tokens.

    Returns:
        ``(tokens, scores_of)``: the tokens, and a function ``rows_sel -> fp64 scores`` that checks
        a baseline's choice up to ties.
    """
    rows = index_q.shape[0]
    num_reqs = block_table.shape[0]
    dev = index_q.device
    req = token_to_req.long()
    pos = positions.long()
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c = torch.where(row_ok, req, 0)
    seq_row = seq_lens.long()[req_c]
    vis = torch.where(row_ok, torch.minimum((pos + 1) // 4, seq_row // 4), 0)
    blocks = torch.full((rows, k), -1, dtype=torch.int64, device=dev)
    dense = {}

    def scores_of(sel):
        r = int(req_c[sel[0]])
        if r not in dense:
            dense[r] = _dense_keys(kc_cache, block_table, r)
        kc_d, ok = dense[r]
        s = exact_block_scores(index_q, kc_d, sel)
        cand = (torch.arange(s.shape[1], device=dev)[None, :] < vis[sel][:, None]) & ok[None, :]
        return s.masked_fill(~cand, float("-inf"))

    for r in torch.unique(req_c).tolist():
        sel_all = torch.nonzero(req_c == r).flatten()
        for c0 in range(0, sel_all.numel(), chunk_rows):
            sel = sel_all[c0:c0 + chunk_rows]
            s = scores_of(sel)
            order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
            top_s = torch.gather(s, 1, order)
            chosen = torch.where(top_s > float("-inf"), order, torch.iinfo(torch.int64).max)
            chosen = torch.sort(chosen, dim=1).values
            blocks[sel, :chosen.shape[1]] = torch.where(chosen == torch.iinfo(torch.int64).max, -1, chosen)
    tokens = expand_blocks(blocks, pos, seq_row, row_ok)
    return tokens, scores_of


def selection_check(out: torch.Tensor, exact: torch.Tensor, scores_of, token_to_req, *, k: int,
                    chunk_rows: int = 256) -> dict:
    """Compare a selection with the exact one.

    Returns:
        dict: ``exact`` (bitwise equal), ``rows_differ`` (rows not bitwise equal), ``tie_equivalent``
        (every differing row chose blocks with the same multiset of scores, i.e. differs only in how
        it broke ties; the tails must match exactly).
    """
    differ = (out != exact).any(1)
    n_diff = int(differ.sum())
    res = dict(exact=n_diff == 0, rows_differ=n_diff, tie_equivalent=n_diff == 0)
    if n_diff == 0:
        return res
    bad = torch.nonzero(differ).flatten()
    ok = True
    req = token_to_req.long()
    for r in torch.unique(req[bad]).tolist():  # scores_of scores rows of one request
        bad_r = bad[req[bad] == r]
        for c0 in range(0, bad_r.numel(), chunk_rows):
            sel = bad_r[c0:c0 + chunk_rows]
            s = scores_of(sel)
            picks = []
            for toks in (out[sel], exact[sel]):
                quads = toks[:, :4 * k].long().view(-1, k, 4)
                b = quads[:, :, 0] // 4
                valid = quads[:, :, 0] >= 0
                # every entry of the block section is a whole 4-token block or four -1s
                whole = torch.where(valid[:, :, None], quads == 4 * b[:, :, None] + torch.arange(4, device=toks.device),
                                    quads == -1).all()
                key = torch.where(valid, b, -1 - torch.arange(k, device=toks.device))  # no duplicate blocks
                distinct = bool((torch.sort(key, dim=1).values.diff(dim=1) != 0).all())
                vals = torch.gather(s, 1, b.clamp(min=0, max=s.shape[1] - 1))
                vals = torch.where(valid & (b < s.shape[1]), vals, float("-inf"))
                picks.append(torch.sort(vals, dim=1).values)
                ok = ok and bool(whole) and distinct
            ok = ok and torch.equal(picks[0], picks[1]) and torch.equal(out[sel, 4 * k:], exact[sel, 4 * k:])
    res["tie_equivalent"] = ok
    return res


def torch_select_baseline(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *,
                          k: int = 512):
    """The plain PyTorch pipeline the kernels are measured against: gather the compressed keys
    densely, one fp32 matmul per request, relu, head sum, ``torch.topk``, ``sort``, expansion.

    Same output layout as :func:`select_tokens`; equal to it except where ``torch.topk`` breaks ties
    differently (its tie order is unspecified) or NaN scores occur. Synchronises with the host (one
    matmul per request present). Needs ``1 <= k <= n_cols = max_blocks * (block_size // 4)``.
    """
    rows, H, D = index_q.shape
    num_reqs, max_blocks = block_table.shape
    num_blocks, rpb = kc_cache.shape[:2]
    n = max_blocks * rpb
    dev = index_q.device
    k = check_int("k", k, 1)
    if k > n:
        raise ValueError(f"k must be <= n_cols = max_blocks * (block_size // 4) = {n} (torch.topk), got {k}")
    if num_reqs == 0:  # every row is a padding row
        return torch.full((rows, 4 * k + 3), -1, dtype=torch.int32, device=dev)
    pages = block_table.long()
    page_ok = (pages >= 0) & (pages < num_blocks)
    if num_blocks == 0:  # no valid page, no candidate: only the causal tails remain
        kc_dense = torch.zeros(num_reqs, n, D, dtype=kc_cache.dtype, device=dev)
    else:
        kc_dense = kc_cache[pages.clamp(0, num_blocks - 1)].reshape(num_reqs, n, D)
    block_ok = page_ok.repeat_interleave(rpb, dim=1)                              # [num_reqs, n]
    req = token_to_req.long()
    pos = positions.long().clamp(max=INT32_MAX)  # past it, the same tokens; no overflow of pos + 1
    row_ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c = torch.where(row_ok, req, 0)
    vis = torch.minimum((pos + 1) // GROUP, seq_lens.long()[req_c] // GROUP)
    vis = torch.where(row_ok, vis.clamp(0, n), 0)
    scores = torch.empty(rows, n, dtype=torch.float32, device=dev)
    for r_req in torch.unique(req_c).tolist():
        sel = (req_c == r_req).nonzero().squeeze(1)
        s = torch.matmul(index_q[sel].float().reshape(-1, D), kc_dense[r_req].float().T)
        scores[sel] = s.reshape(-1, H, n).relu().sum(1) * (D ** -0.5)
    cand = (torch.arange(n, device=dev)[None, :] < vis[:, None]) & block_ok[req_c]
    scores = scores.masked_fill(~cand, float("-inf"))
    top = torch.topk(scores, k, dim=1)
    blocks = torch.where(top.values > float("-inf"), top.indices, n + 1)
    blocks = torch.sort(blocks, dim=1).values
    kept = blocks <= n
    n_kept = kept.sum(1)
    toks = (4 * blocks[:, :, None] + torch.arange(4, device=dev)).reshape(rows, 4 * k)
    j = torch.arange(4 * k + 3, device=dev)[None, :]
    tail_start = ((pos + 1) // GROUP) * GROUP
    tail = tail_start[:, None] + (j - 4 * n_kept[:, None])
    out = torch.where(j < 4 * n_kept[:, None],
                      torch.nn.functional.pad(toks, (0, 3)), torch.where(tail <= pos[:, None], tail, -1))
    seq_row = torch.where(row_ok, seq_lens.long()[req_c], 0)
    out = torch.where((out >= 0) & (out < seq_row[:, None]) & row_ok[:, None], out, -1)
    return out.to(torch.int32)
