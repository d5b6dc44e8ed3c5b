"""Prototype: grouped attention for groups of up to 24 rows, on one program per group or on a balanced
(stream-K) schedule.

The library's grouped kernel runs one program per 8-row group. At 6/1 and prefill-64k that is 1024
programs on 264 slots (two per SM), 3.88 waves: the kernel lasts four program lengths. Groups of 10 rows
fill 60 of the 64-row tile instead of 48 and their unions grow less than their rows (17% fewer tiles at
overlap 0.98, 7% at 0.8), but 820 programs still take four lengths (3.1 waves), each longer: slower
(docs/performance.md, "Grouped route (prefill)"). Groups of 16 or 21 rows fill 96 or 126 rows of a 128-row tile on 8
warps, the tile the library's 12/1 kernel runs at one program per SM.

On the balanced schedule a persistent grid of ``programs`` programs first attends whole groups in
rounds (program p: groups p, p + P, ..., so that programs running together attend neighbouring groups,
whose K/V the L2 shares), then cuts the sequence of the remaining groups' tiles into P equal runs; a
group cut by a run's end is attended in pieces whose partials ``balanced_fixup_kernel`` merges in
program order. The cut positions depend on the plan's counts only, so the output is as deterministic as
the library's. With ``programs`` equal to the number of groups every program attends one whole group:
the library's schedule.

A plan here is built with torch (``host_plan``): the mask of a group of ``rows`` rows takes ``4 * rows``
bits, in ``ceil(rows / 8)`` int32 words per entry (word w: bit 4(q - 8w) + t % 4 for rows
8w <= q < 8w + 8); word 0 is the library's mask. Scope: fp16 caches of one layout
(``k.stride() == v.stride()``), no gate, no LSE; not a route. K/V tiles hold 8 microblocks (32 tokens, as
the library's) or, with ``mb=16``, 64 tokens, the dense 128-row tile's fastest setting
(``benchmarks/dense_floor.py``).

``python -m benchmarks.lab.balanced_grouped prefill-64k-o98 ... [--only LABEL]... [--out DIR]`` checks
every kernel (or those named, with the library's) against the fp32 reference and times them (attention
only; the planner is not part of it).
"""

from __future__ import annotations
import qsa.attention.grouped.launch

import math
import sys
from dataclasses import dataclass

import triton
import triton.language as tl

from qsa.attention.kernels import attend_tile, enter_launch, load_kv_microblocks, store_output

MAX_GROUP_ROWS = 24


@dataclass
class HostPlan:
    mb_ids: object  # [groups, cap] int32 physical microblock ids, ascending logical order
    masks: object  # [words, groups, cap] int32: word w holds bit 4(q - 8w) + t % 4 for rows 8w <= q < 8w + 8
    counts: object  # [groups] int32
    group_rows: int
    num_rows: int


def host_plan(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
              group_rows: int) -> HostPlan:
    """The grouped plan of groups of ``group_rows`` (at most ``MAX_GROUP_ROWS``) adjacent rows, built with
    torch: each group's union by (request, logical microblock) in ascending order, the rows' token bits as
    masks. Keeps what ``plan_groups`` keeps for the benchmark's inputs (every table entry a valid block)."""
    import torch

    if not 1 <= group_rows <= MAX_GROUP_ROWS:
        raise ValueError(f"group_rows must be in [1, {MAX_GROUP_ROWS}], got {group_rows}")
    dev = indices.device
    idx = indices.long()
    rows, width = idx.shape
    req = token_to_req.long()
    pos = positions.long()
    seq = seq_lens.long()[req]
    keep = (idx >= 0) & (idx <= pos[:, None]) & (idx < seq[:, None]) & (pos[:, None] >= 0)
    r = torch.arange(rows, device=dev)[:, None].expand(rows, width)
    t = torch.where(keep, idx, 0)
    lm = t // 4
    nmb = int(lm.max()) + 1 if rows and width else 1
    nreq = block_table.shape[0]
    key = ((r // group_rows) * nreq + req[:, None]) * nmb + lm
    key, q, t = key[keep], (r % group_rows)[keep], t[keep]
    # Each (key, row, token slot) once, so that summing the bits ORs them (a row may repeat an index).
    nbits = 4 * MAX_GROUP_ROWS
    kb = torch.unique(key * nbits + 4 * q + t % 4)
    uk, inv = torch.unique(kb // nbits, return_inverse=True)
    bit = kb % nbits
    words = -(-group_rows // 8)
    masks = []
    for w in range(words):
        sel = (bit >= 32 * w) & (bit < 32 * w + 32)
        m = torch.zeros_like(uk).index_add_(0, inv[sel], torch.ones_like(bit[sel]) << (bit[sel] - 32 * w))
        masks.append(torch.where(m >= 2 ** 31, m - 2 ** 32, m).to(torch.int32))
    ug = uk // (nreq * nmb)
    ureq = (uk // nmb) % nreq
    ulm = uk % nmb
    phys = block_table.long()[ureq, (ulm * 4) // block_size]
    ids = (phys * (block_size // 4) + ulm % (block_size // 4)).to(torch.int32)
    groups = -(-rows // group_rows)
    counts = torch.bincount(ug, minlength=groups)
    starts = torch.cumsum(counts, 0) - counts
    at = torch.arange(uk.numel(), device=dev) - starts[ug]
    cap = max(-(-int(counts.max()) // 64) * 64, 64) if groups else 64
    mb_ids = torch.zeros((groups, cap), dtype=torch.int32, device=dev)
    out_masks = torch.zeros((words, groups, cap), dtype=torch.int32, device=dev)
    mb_ids[ug, at] = ids
    for w in range(words):
        out_masks[w, ug, at] = masks[w]
    return HostPlan(mb_ids, out_masks, counts.to(torch.int32), group_rows, rows)


@triton.jit
def _tile_prefix(counts_ptr, num_groups, g_first, MB: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """Tiles of groups ``[g_first, num_groups)`` (at least one each: an empty group is attended as one
    empty tile; 0 for the other groups) and their inclusive prefix sum."""
    o_g = tl.arange(0, BLOCK_GROUPS)
    m_g = (o_g >= g_first) & (o_g < num_groups)
    b_n = tl.load(counts_ptr + o_g, mask=m_g, other=0)
    b_n = tl.where(m_g, tl.maximum(tl.cdiv(b_n, MB), 1), 0).to(tl.int64)
    return o_g, b_n, tl.cumsum(b_n, 0)


@triton.jit
def _tile_masks(p_masks, o_e, m_e, o_qc, o_slot, stride_word, WORDS: tl.constexpr, MB: tl.constexpr):
    """Plan entries ``o_e``'s masks: the tokens any row keeps ([MB, 4], what is loaded) and which (matrix
    row, token) pairs attend ([BLOCK_M, 4 * MB]); ``o_qc`` is each matrix row's group row, clamped."""
    BLOCK_N: tl.constexpr = 4 * MB
    o_shift = 4 * (o_qc % 8)[:, None] + o_slot[None, :]
    m_used = tl.zeros([MB, 4], tl.int32) != 0
    b_bit = tl.zeros([o_qc.shape[0], BLOCK_N], tl.int32)
    for w in tl.static_range(WORDS):
        b_w = tl.load(p_masks + w * stride_word + o_e, mask=m_e, other=0)
        m_used = m_used | (((b_w[:, None] >> tl.arange(0, 4)[None, :]) & 0x11111111) != 0)
        b_wt = tl.reshape(tl.broadcast_to(b_w[:, None], [MB, 4]), [BLOCK_N])
        b_bit = tl.where((o_qc // 8 == w)[:, None], b_wt[None, :] >> o_shift, b_bit)
    return m_used, (b_bit & 1) != 0


@triton.jit
def _attend_segment(q_ptr, k_ptr, v_ptr, ids_ptr, masks_ptr, g, t0, t1, count, num_rows, qk_scale,
                    stride_q_row, stride_q_head, stride_k_block, stride_k_tok, stride_plan, stride_word,
                    G: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, MB: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, WORDS: tl.constexpr,
                    PREFETCH: tl.constexpr, LAZY_RESCALE: tl.constexpr, PTX: tl.constexpr):
    """Tiles ``[t0, t1)`` of group ``g`` (at least one trip, as the library's kernel): (max, sum, acc) and
    the matrix rows' output rows and heads."""
    MB_PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    o_m = tl.arange(0, BLOCK_M)
    o_q = o_m // G
    o_qc = tl.minimum(o_q, GROUP_ROWS - 1)
    o_d = tl.arange(0, HEAD_DIM)
    o_j = tl.arange(0, MB)
    o_slot = tl.arange(0, 4 * MB) % 4
    o_row = g * GROUP_ROWS + o_q
    m_row = (o_m < GROUP_ROWS * G) & (o_row < num_rows)
    p_q = q_ptr + o_row[:, None] * stride_q_row + (o_m % G)[:, None] * stride_q_head + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None], other=0)
    p_ids = ids_ptr + g * stride_plan
    p_masks = masks_ptr + g * stride_plan
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    t0 = t0.to(tl.int32)
    if PREFETCH:
        o_e = t0 * MB + o_j
        b_id_next = tl.load(p_ids + o_e, mask=o_e < count, other=0)
        m_used_next, m_attend_next = _tile_masks(p_masks, o_e, o_e < count, o_qc, o_slot, stride_word,
                                                 WORDS, MB)
    for j in range(0, tl.maximum(t1.to(tl.int32) - t0, 1)):
        o_e = (t0 + j) * MB + o_j
        if PREFETCH:
            b_id = b_id_next
            m_used = m_used_next
            m_attend = m_attend_next
            b_id_next = tl.load(p_ids + o_e + MB, mask=o_e + MB < count, other=0)
            m_used_next, m_attend_next = _tile_masks(p_masks, o_e + MB, o_e + MB < count, o_qc, o_slot,
                                                     stride_word, WORDS, MB)
        else:
            b_id = tl.load(p_ids + o_e, mask=o_e < count, other=0)
            m_used, m_attend = _tile_masks(p_masks, o_e, o_e < count, o_qc, o_slot, stride_word, WORDS,
                                           MB)
        o_mb = (b_id // MB_PER_BLOCK).to(tl.int64) * stride_k_block + (b_id % MB_PER_BLOCK) * 4 * stride_k_tok
        b_k = load_kv_microblocks(k_ptr, o_mb, stride_k_tok, o_d, m_used, False, tl.float16)
        b_v = load_kv_microblocks(v_ptr, o_mb, stride_k_tok, o_d, m_used, False, tl.float16)
        b_m, b_l, b_acc = attend_tile(b_q, b_k, b_v, m_attend, b_m, b_l, b_acc, qk_scale, tl.float16,
                                      LAZY_RESCALE, PTX)
    return b_m, b_l, b_acc, o_row, o_m % G, m_row


@triton.jit
def balanced_grouped_kernel(
    q_ptr,  # [rows, Hq, D] fp16
    k_ptr,  # [num_blocks, block_size, 1, D] fp16
    v_ptr,  # [num_blocks, block_size, 1, D] fp16, K's strides
    ids_ptr,  # [groups, cap] int32
    masks_ptr,  # [WORDS, groups, cap] int32
    counts_ptr,  # [groups] int32
    out_ptr,  # [rows, Hq, D]
    part_acc_ptr,  # [programs, 2, BLOCK_M, HEAD_DIM] fp32: a program's first and last piece of a cut group
    part_ml_ptr,  # [programs, 2, BLOCK_M, 2] fp32
    num_rows, num_groups, num_programs, qk_scale,
    stride_q_row, stride_q_head, stride_k_block, stride_k_tok, stride_plan, stride_word, stride_o_row,
    stride_o_head,
    G: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, MB: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
    WORDS: tl.constexpr,  # mask words per plan entry: ceil(GROUP_ROWS / 8)
    BALANCED: tl.constexpr,  # persistent programs on the balanced schedule; else one program per group
    PREFETCH: tl.constexpr,  # each tile's plan entries loaded one iteration ahead
    LAZY_RESCALE: tl.constexpr,
    PTX: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    """Balanced: whole groups first, a round of ``num_programs`` at a time (program p: groups p, p + P,
    ...); then the groups left over (fewer than P) as one sequence of tiles cut into P equal runs. Both
    are items of one loop (one copy of the tile loop in the kernel: two copies spilled registers in it)."""
    enter_launch(PDL)
    pid = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, HEAD_DIM)
    if not BALANCED:
        count = tl.load(counts_ptr + pid)
        n = tl.maximum(tl.cdiv(count, MB), 1)
        b_m, b_l, b_acc, o_row, o_head, m_row = _attend_segment(
            q_ptr, k_ptr, v_ptr, ids_ptr, masks_ptr, pid, n * 0, n, count, num_rows, qk_scale, stride_q_row,
            stride_q_head, stride_k_block, stride_k_tok, stride_plan, stride_word, G, GROUP_ROWS, BLOCK_M, MB,
            HEAD_DIM, BLOCK_SIZE, WORDS, PREFETCH, LAZY_RESCALE, PTX)
        store_output(b_acc, b_m, b_l, o_row, o_head, m_row, o_d, out_ptr, out_ptr, out_ptr, 1.0,
                     stride_o_row, stride_o_head, 0, 0, 0, False, False)
    else:
        o_m = tl.arange(0, BLOCK_M)
        g_rest = num_groups // num_programs * num_programs
        n_whole = tl.where(pid < g_rest, (g_rest - 1 - pid) // num_programs + 1, 0)
        o_g, b_n, b_incl = _tile_prefix(counts_ptr, num_groups, g_rest, MB, BLOCK_GROUPS)
        total = tl.sum(b_n, 0)
        start = pid * total // num_programs
        end = (pid + 1) * total // num_programs
        g_cut = g_rest + tl.sum(((b_incl <= start) & (o_g >= g_rest)).to(tl.int64), 0)
        off = tl.sum(tl.where(o_g == g_cut, b_incl - b_n, 0), 0)
        cur = start
        it = pid * 0
        while (it < n_whole) | (cur < end):
            whole = it < n_whole
            g = tl.where(whole, pid + it * num_programs, g_cut)
            count = tl.load(counts_ptr + g)
            n = tl.maximum(tl.cdiv(count, MB), 1).to(tl.int64)
            seg_end = tl.minimum(end, off + n)
            t0 = tl.where(whole, 0, cur - off)
            t1 = tl.where(whole, n, seg_end - off)
            b_m, b_l, b_acc, o_row, o_head, m_row = _attend_segment(
                q_ptr, k_ptr, v_ptr, ids_ptr, masks_ptr, g, t0, t1, count, num_rows, qk_scale, stride_q_row,
                stride_q_head, stride_k_block, stride_k_tok, stride_plan, stride_word, G, GROUP_ROWS, BLOCK_M,
                MB, HEAD_DIM, BLOCK_SIZE, WORDS, PREFETCH, LAZY_RESCALE, PTX)
            if (t0 == 0) & (t1 == n):
                store_output(b_acc, b_m, b_l, o_row, o_head, m_row, o_d, out_ptr, out_ptr, out_ptr, 1.0,
                             stride_o_row, stride_o_head, 0, 0, 0, False, False)
            else:
                i_part = (pid * 2 + (cur != start).to(tl.int64)) * BLOCK_M + o_m
                tl.store(part_acc_ptr + i_part[:, None] * HEAD_DIM + o_d[None, :], b_acc)
                tl.store(part_ml_ptr + i_part * 2, b_m)
                tl.store(part_ml_ptr + i_part * 2 + 1, b_l)
            it += 1
            cur = tl.where(whole, cur, seg_end)
            off = tl.where(whole, off, off + n)
            g_cut = tl.where(whole, g_cut, g_cut + 1)


@triton.jit
def balanced_fixup_kernel(
    counts_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_rows, num_groups, num_programs,
    stride_o_row, stride_o_head,
    G: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, MB: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_GROUPS: tl.constexpr, PDL: tl.constexpr = 0,
):
    """The output of every group that ``balanced_grouped_kernel`` attended in pieces: the pieces merged
    in program order (columns ``BLOCK_D`` per program). One program per left-over group."""
    enter_launch(PDL)
    g_rest = num_groups // num_programs * num_programs
    g = g_rest + tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    o_g, b_n, b_incl = _tile_prefix(counts_ptr, num_groups, g_rest, MB, BLOCK_GROUPS)
    total = tl.sum(b_n, 0)
    first = tl.sum(tl.where(o_g == g, b_incl - b_n, 0), 0)
    last = tl.sum(tl.where(o_g == g, b_incl, 0), 0) - 1
    # The program whose run [p * total // P, (p + 1) * total // P) holds tile x: ((x + 1) * P - 1) // total.
    p0 = ((first + 1) * num_programs - 1) // total
    p1 = ((last + 1) * num_programs - 1) // total
    if (g < num_groups) & (p0 != p1):
        o_m = tl.arange(0, BLOCK_M)
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for p in range(p0, p1 + 1):
            # A piece is its program's first (slot 0) unless the program's run began before the group.
            # (With fewer tiles than programs, a program between two pieces may have an empty run.)
            run = p * total // num_programs
            m_run = tl.zeros([BLOCK_M], tl.int32) + (run < (p + 1) * total // num_programs).to(tl.int32) != 0
            slot = (run < first).to(tl.int64)
            i_part = (p * 2 + slot) * BLOCK_M + o_m
            b_pm = tl.load(part_ml_ptr + i_part * 2, mask=m_run, other=float("-inf"))
            b_pl = tl.load(part_ml_ptr + i_part * 2 + 1, mask=m_run, other=0.0)
            b_pa = tl.load(part_acc_ptr + i_part[:, None] * HEAD_DIM + o_d[None, :], mask=m_run[:, None], other=0.0)
            b_new = tl.maximum(b_m, b_pm)
            b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_a = tl.exp2(b_m - b_ref)
            b_b = tl.exp2(b_pm - b_ref)
            b_acc = b_acc * b_a[:, None] + b_pa * b_b[:, None]
            b_l = b_l * b_a + b_pl * b_b
            b_m = b_new
        o_q = o_m // G
        o_row = g * GROUP_ROWS + o_q
        m_row = (o_m < GROUP_ROWS * G) & (o_row < num_rows)
        store_output(b_acc, b_m, b_l, o_row, o_m % G, m_row, o_d, out_ptr, out_ptr, out_ptr, 1.0,
                     stride_o_row, stride_o_head, 0, 0, 0, False, False)


def balanced_grouped(q, k, v, plan: HostPlan, out, softmax_scale: float, *, programs: int | None = None,
                     balanced: bool = True, num_stages: int = 3, prefetch: bool | None = None,
                     lazy_rescale: bool | None = None, mb: int = 8) -> None:
    """Rows ``[0, plan.num_rows)`` of ``out`` from ``plan``: on ``programs`` persistent programs (default:
    the tiles' programs per SM, two of 64 rows or one of 128) or, without ``balanced``, one program per
    group. ``prefetch`` and ``lazy_rescale`` default to the library's settings for the tile (both on
    128-row tiles); ``mb``: microblocks per K/V tile (8: 32 tokens, as the library's)."""
    import torch

    from qsa.utils import device_facts, launch_options, next_pow2

    d = q.shape[2]
    G = q.shape[1] // k.shape[2]
    if k.shape[2] != 1 or q.dtype != torch.float16 or k.dtype != torch.float16:
        raise ValueError("the prototype covers fp16 caches of one KV head")
    if k.stride() != v.stride():
        raise ValueError(f"K and V caches must share their strides, got {k.stride()} and {v.stride()}")
    block_m = max(16, next_pow2(plan.group_rows * G))
    if block_m > 128:
        raise ValueError(f"{plan.group_rows} rows x {G} heads do not fit a 128-row tile")
    wide = block_m > 64
    prefetch = wide if prefetch is None else prefetch
    lazy_rescale = wide if lazy_rescale is None else lazy_rescale
    groups = plan.counts.shape[0]
    if not balanced:
        programs = groups
    elif programs is None:
        programs = (1 if wide else 2) * device_facts(str(q.device))["sm_count"] if q.is_cuda else 4
    rest = groups % programs
    parts = programs if rest else 1  # partials only where groups are cut
    part_acc = torch.empty((parts, 2, block_m, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((parts, 2, block_m, 2), dtype=torch.float32, device=q.device)
    scale = softmax_scale * math.log2(math.e)
    opts = launch_options(q.device)
    block_groups = next_pow2(max(groups, 2))
    balanced_grouped_kernel[(programs,)](
        q, k, v, plan.mb_ids, plan.masks, plan.counts, out, part_acc, part_ml,
        plan.num_rows, groups, programs, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), plan.mb_ids.stride(0), plan.masks.stride(0),
        out.stride(0), out.stride(1),
        G=G, GROUP_ROWS=plan.group_rows, BLOCK_M=block_m, MB=mb, HEAD_DIM=d, BLOCK_SIZE=k.shape[1],
        BLOCK_GROUPS=block_groups, WORDS=plan.masks.shape[0], BALANCED=balanced, PREFETCH=prefetch, LAZY_RESCALE=lazy_rescale,
        PTX=q.is_cuda, num_warps=8 if wide else 4, num_stages=num_stages, **opts)
    if rest == 0:
        return
    block_d = min(64, d)
    balanced_fixup_kernel[(rest, d // block_d)](
        plan.counts, out, part_acc, part_ml, plan.num_rows, groups, programs, out.stride(0), out.stride(1),
        G=G, GROUP_ROWS=plan.group_rows, BLOCK_M=block_m, MB=mb, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_GROUPS=block_groups, num_warps=4, **opts)


VARIANTS = {
    # label: (rows per group, balanced, microblocks per tile, stages, prefetch: None for the tile's default)
    "grouped-8": (8, False, 8, 3, None),
    "balanced-8": (8, True, 8, 3, None),
    "grouped-10": (10, False, 8, 3, None),
    "balanced-10": (10, True, 8, 3, None),
    "grouped-16": (16, False, 8, 3, None),
    "balanced-16": (16, True, 8, 3, None),
    "grouped-21": (21, False, 8, 3, None),
    "balanced-21": (21, True, 8, 3, None),
    # 128-row tiles over 64-token K/V tiles (the dense floor's fastest 128-row setting: 16 / 8 / 2; three
    # stages of 64 KB do not fit beside the tile's Q)
    "grouped-16-t64": (16, False, 16, 2, None),
    "grouped-21-t64": (21, False, 16, 2, None),
    "grouped-21-t64-np": (21, False, 16, 2, False),
    "balanced-21-t64": (21, True, 16, 2, None),
}


def compare(names, timer, rounds: int = 2, only=None) -> list[dict]:
    """Each scenario: the library's grouped kernel on its plan, and this kernel on host plans of 8, 10,
    16 and 21 rows per group, one program per group and balanced (8-row host plans equal the library's;
    ``grouped-8`` is the library's schedule on this kernel), each checked against the fp32 reference, then
    timed in interleaved rounds. The records also give each plan's tiles."""
    import qsa

    from .harness import compare_kernels

    extra = []

    def make_runs(pb):
        q, c, w = pb.q, pb.cache, pb.workload
        plans = {}
        for rows in sorted({v[0] for v in VARIANTS.values()}):
            plan = host_plan(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                             block_size=c.block_size, group_rows=rows)
            plans[rows] = plan
            tiles = int(((plan.counts + 7) // 8).clamp(min=1).sum())
            extra.append(dict(scenario=pb.name, group_rows=rows, groups=int(plan.counts.numel()), tiles=tiles,
                              mean_union=float(plan.counts.float().mean())))
            print(f"{pb.name}: {rows}-row groups: {plan.counts.numel()} groups, {tiles} tiles, "
                  f"mean union {float(plan.counts.float().mean()):.1f}", flush=True)

        def library(out):
            qsa.attention.grouped.launch.grouped_attention(q, c.k, c.v, pb.plan, out=out, **pb.attention_kwargs)

        def variant(rows, balanced, mb, stages, prefetch):
            return lambda out: balanced_grouped(q, c.k, c.v, plans[rows], out, pb.scale, balanced=balanced,
                                                mb=mb, num_stages=stages, prefetch=prefetch)

        runs = {"library": library}
        runs.update({label: variant(*v) for label, v in VARIANTS.items()})
        return runs

    return extra + compare_kernels(names, timer, make_runs, {"grouped-8": "library"}, rounds, only)


def main(argv=None) -> int:
    from .harness import main as run

    return run("python -m benchmarks.lab.balanced_grouped", __doc__, "balanced-grouped", compare, argv)


if __name__ == "__main__":
    sys.exit(main())
