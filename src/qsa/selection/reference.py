"""Pure-PyTorch references for the selection stage (docs/spec.md section 2). Slow, loop-based, exact.

Every function here is independent of the Triton kernels: orders come from stable sorts, scores from
plain gathers through the block table and fp32 (or fp64) matmuls. They run on the CPU or the GPU. See ``docs/selection.md`` for the definitions.
"""

from __future__ import annotations

import torch

from ..utils import INT32_MAX

GROUP = 4
"""Tokens per compressed block."""


def visible_blocks_reference(token_to_req, positions, seq_lens):
    """``[rows]`` int64: ``min((pos + 1) // 4, seq_len // 4)``; 0 for padding rows."""
    if seq_lens.shape[0] == 0:  # no request: every row is a padding row
        return torch.zeros(token_to_req.shape[0], dtype=torch.int64, device=token_to_req.device)
    req = token_to_req.long()
    pos = positions.long().clamp(max=INT32_MAX)  # past it, the same tokens; no overflow of pos + 1
    ok = (req >= 0) & (req < seq_lens.shape[0]) & (pos >= 0)
    seq = seq_lens.long()[torch.where(ok, req, 0)]
    vis = torch.minimum(torch.div(pos + 1, GROUP, rounding_mode="floor"),
                        torch.div(seq, GROUP, rounding_mode="floor"))
    return torch.where(ok, vis.clamp(min=0), 0)


def compressed_keys_reference(raw_k, transform=None):
    """Compressed keys of one request from its whole raw key sequence.

    Args:
        raw_k: ``[L, D]`` raw index keys at positions ``0 .. L-1``.
        transform: optional ``f(kc [G, D] fp32, block_idx [G] int64) -> [G, D]``.
    Returns:
        ``[L // 4, D]`` fp32, ``kc[b] = (((k[4b] + k[4b+1]) + k[4b+2]) + k[4b+3]) * 0.25`` in fp32.
    """
    L, D = raw_k.shape
    g = L // GROUP
    x = raw_k[: g * GROUP].float().reshape(g, GROUP, D)
    kc = (((x[:, 0] + x[:, 1]) + x[:, 2]) + x[:, 3]) * 0.25
    if transform is not None:
        kc = transform(kc, torch.arange(g, dtype=torch.int64, device=raw_k.device)).float()
    return kc


def norm_rope_keys(kc, weight, eps: float, cos=None, sin=None):
    """The compressed keys' transform in PyTorch: RMSNorm ``kc / rms(kc) * (1 + weight)`` then partial NeoX
    RoPE with ``cos, sin`` (``[G, half]`` fp32 of each row's group start ``4b``; None: no rotation), all in
    fp32 with no rounding in between. The mean of squares is summed in fp64 from the exact fp64 squares
    and rounded once to fp32, and the scale is ``1 / sqrt`` in fp64 rounded once to fp32 (IEEE on every
    device, unlike an fp32 ``rsqrt``), so the fused store kernel (which sums in its own order) gives the
    same bits unless that sum lies within its rounding error of an fp32 rounding boundary.

    Args:
        kc: ``[G, D]`` fp32 group means. weight: ``[D]`` any float dtype, or None (``1 + 0``).
    Returns:
        ``[G, D]`` fp32.
    """
    x = kc.float()
    mean_sq = (x.double() * x.double()).sum(-1, keepdim=True).div(x.shape[-1]).float()
    y = x * torch.reciprocal(torch.sqrt((mean_sq + eps).double())).float()
    if weight is not None:
        y = y * (1.0 + weight.float())
    if cos is None or cos.shape[-1] == 0:
        return y
    half = cos.shape[-1]
    c, s = cos.float(), sin.float()
    y1, y2 = y[:, :half], y[:, half:2 * half]
    return torch.cat([y1 * c - y2 * s, y2 * c + y1 * s, y[:, 2 * half:]], dim=-1)


def gather_compressed_keys(kc_cache, block_table, req: int):
    """All logical compressed keys of request ``req``: ``[n_cols, D]`` fp32 and a ``[n_cols]`` bool
    validity mask (False where the table entry is outside ``[0, num_blocks)``),
    ``n_cols = max_blocks * (block_size // 4)``."""
    num_blocks, rpb, _ = kc_cache.shape
    pages = block_table[req].long().repeat_interleave(rpb)                     # [n_cols]
    rows_in_page = torch.arange(pages.shape[0], device=pages.device) % rpb
    valid = (pages >= 0) & (pages < num_blocks)
    keys = kc_cache[pages.clamp(0, max(num_blocks - 1, 0)), rows_in_page].float()
    return torch.where(valid[:, None], keys, 0.0), valid


def candidate_mask_reference(kc_cache, block_table, token_to_req, positions, seq_lens):
    """``[rows, n_cols]`` bool: block ``b`` is a candidate of row ``r`` (``b < visible(r)`` and a valid
    block-table entry); all False when there is no request."""
    n_cols = block_table.shape[1] * kc_cache.shape[1]
    if block_table.shape[0] == 0:  # every row is a padding row
        return torch.zeros(token_to_req.shape[0], n_cols, dtype=torch.bool, device=token_to_req.device)
    vis = visible_blocks_reference(token_to_req, positions, seq_lens)
    req = token_to_req.long().clamp(0, max(block_table.shape[0] - 1, 0))
    pages = block_table.long()[req].repeat_interleave(kc_cache.shape[1], dim=1)  # [rows, n_cols]
    valid = (pages >= 0) & (pages < kc_cache.shape[0])
    return valid & (torch.arange(n_cols, device=vis.device)[None, :] < vis[:, None])


def block_scores_reference(index_q, kc_cache, block_table, token_to_req, positions, seq_lens,
                           *, dtype=torch.float32):
    """``[rows, n_cols]`` scores, ``n_cols = max_blocks * (block_size // 4)``.

    ``score[r, b] = (relu(q[r,0].kc[b]) + relu(q[r,1].kc[b]) + ...) * D**-0.5`` (heads summed in
    order) for candidates (``b < visible(r)`` and a valid table entry); ``-inf`` elsewhere.
    ``dtype`` is the arithmetic precision (float32, or float64 to measure the kernel's rounding);
    the scale is the fp32 value of ``D**-0.5`` in both.
    """
    rows, H, D = index_q.shape
    n_cols = block_table.shape[1] * kc_cache.shape[1]
    scale = torch.tensor(D ** -0.5, dtype=torch.float32).to(dtype).item()
    cand = candidate_mask_reference(kc_cache, block_table, token_to_req, positions, seq_lens)
    out = torch.full((rows, n_cols), float("-inf"), dtype=dtype, device=index_q.device)
    req = token_to_req.long()
    for r_req in torch.unique(req[cand.any(1)]).tolist():
        sel = (req == r_req).nonzero().squeeze(1)
        keys = gather_compressed_keys(kc_cache, block_table, r_req)[0].to(dtype)  # [n_cols, D]
        dots = torch.matmul(index_q[sel].to(dtype), keys.T)                      # [len, H, n_cols]
        acc = torch.zeros(sel.shape[0], n_cols, dtype=dtype, device=index_q.device)
        for h in range(H):
            acc = acc + torch.relu(dots[:, h])
        out[sel] = acc * scale
    return torch.where(cand, out, float("-inf"))


def topk_blocks_reference(scores, visible, k: int, candidates=None):
    """``[rows, k]`` int32: the best ``k`` blocks among ``b < min(visible[r], n)`` (and
    ``candidates[r, b]`` when given), in ascending block order, padded with -1.

    Best first means value descending, ties by lower index, -0.0 equal to +0.0, NaN (all equal) after
    every number: three stable sorts (value descending with NaN as -inf; NaN last; non-candidates last).
    """
    rows, n = scores.shape
    dev = scores.device
    s = scores.float() + 0.0                                 # -0.0 + 0.0 == +0.0
    cand = torch.arange(n, device=dev)[None, :] < visible.long().clamp(0, n)[:, None]
    if candidates is not None:
        cand = cand & candidates
    nan = torch.isnan(s)
    order = torch.sort(torch.where(nan, float("-inf"), s), dim=1, descending=True, stable=True).indices
    for last in (nan, ~cand):
        order = order.gather(1, torch.sort(last.gather(1, order).to(torch.int8), dim=1, stable=True).indices)
    count = cand.sum(1, keepdim=True).clamp(max=k)
    top = torch.full((rows, k), n, dtype=torch.int64, device=dev)
    m = min(k, n)
    top[:, :m] = torch.where(torch.arange(m, device=dev)[None, :] < count, order[:, :m], n)
    top = torch.sort(top, dim=1).values
    return torch.where(top < n, top, -1).to(torch.int32)


def expand_tokens_reference(blocks, token_to_req, positions, seq_lens):
    """``[rows, 4k + 3]`` int32 token selection from ``[rows, k]`` blocks (ascending, then -1).

    Tokens ``4 * blocks[j // 4] + j % 4`` of the kept blocks, then the causal tail
    ``((pos + 1) // 4) * 4 .. pos``, then -1; tokens ``>= seq_len`` become -1; padding rows are all -1.
    """
    rows, k = blocks.shape
    dev = blocks.device
    if seq_lens.shape[0] == 0:  # no request: every row is a padding row
        return torch.full((rows, GROUP * k + GROUP - 1), -1, dtype=torch.int32, device=dev)
    req = token_to_req.long()
    pos = positions.long().clamp(max=INT32_MAX)
    ok = (req >= 0) & (req < seq_lens.shape[0]) & (pos >= 0)
    seq = torch.where(ok, seq_lens.long()[torch.where(ok, req, 0)], 0)
    n_kept = (blocks >= 0).sum(1, keepdim=True)
    toks = (GROUP * blocks.long()[:, :, None] + torch.arange(GROUP, device=dev)).reshape(rows, GROUP * k)
    toks = torch.nn.functional.pad(toks, (0, GROUP - 1), value=-1)
    j = torch.arange(GROUP * k + GROUP - 1, device=dev)[None, :]
    tail = torch.div(pos + 1, GROUP, rounding_mode="floor")[:, None] * GROUP + (j - GROUP * n_kept)
    out = torch.where(j < GROUP * n_kept, toks, torch.where(tail <= pos[:, None], tail, -1))
    out = torch.where(ok[:, None] & (out >= 0) & (out < seq[:, None]), out, -1)
    return out.to(torch.int32)


def select_tokens_reference(index_q, kc_cache, block_table, token_to_req, positions, seq_lens, *,
                            k: int = 512, scores=None):
    """The whole selection stage: scores, top-k over candidates, expansion. ``[rows, 4k + 3]`` int32.

    ``scores`` (``[rows, n_cols]``) may be given to skip the score step. With no request
    (``num_reqs == 0``) every row is a padding row: all -1.
    """
    if block_table.shape[0] == 0:
        return torch.full((token_to_req.shape[0], 4 * k + 3), -1, dtype=torch.int32,
                          device=token_to_req.device)
    if scores is None:
        scores = block_scores_reference(index_q, kc_cache, block_table, token_to_req, positions,
                                        seq_lens)
    cand = candidate_mask_reference(kc_cache, block_table, token_to_req, positions, seq_lens)
    vis = visible_blocks_reference(token_to_req, positions, seq_lens)
    blocks = topk_blocks_reference(scores, vis, k, candidates=cand)
    return expand_tokens_reference(blocks, token_to_req, positions, seq_lens)
