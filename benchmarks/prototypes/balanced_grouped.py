"""Prototype: grouped attention on a balanced (stream-K) schedule, for groups of 8 or 10 rows.

The library's grouped kernel runs one program per group. At 6/1 and prefill-64k that is 1024 programs
on 264 slots (two per SM), 3.88 waves: the kernel lasts four program lengths. Groups of 10 rows fill 60
of the 64-row tile instead of 48 and their unions grow less than their rows (17% fewer tiles at overlap
0.98, 7% at 0.8), but 820 programs still take four lengths (3.1 waves), each longer: slower
(perf-notes, "groups of 10 rows"). Here a persistent grid of ``programs`` programs cuts the sequence of
all groups' tiles into equal runs, one per program; a group cut by a run's end is attended in pieces
whose partials ``balanced_fixup_kernel`` merges in program order. The cut positions depend on the plan's
counts only, so the output is as deterministic as the library's.

A plan here is built with torch (``host_plan``): a 10-row group's mask takes 40 bits, rows 0-7 in the
int32 ``masks_lo`` as the library's, rows 8-9 in ``masks_hi``. Scope: 6/1/256 fp16 caches of one
layout (``harness.kernel_args``'s checks), no gate, no LSE; not a route.

``python -m benchmarks.prototypes.balanced_grouped prefill-64k-o98 ... [--out DIR]`` checks every kernel
against the fp32 reference and times them (attention only; the planner is not part of it).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import triton
import triton.language as tl

from qsa.kernels.common import attend_tile, enter_launch, load_kv_microblocks, store_output


@dataclass
class HostPlan:
    mb_ids: object  # [groups, cap] int32 physical microblock ids, ascending logical order
    masks_lo: object  # [groups, cap] int32 bit 4q + t % 4 for rows q < 8
    masks_hi: object  # [groups, cap] int32 bit 4(q - 8) + t % 4 for rows 8 <= q < 16
    counts: object  # [groups] int32
    group_rows: int
    num_rows: int


def host_plan(indices, block_table, token_to_req, positions, seq_lens, *, block_size: int,
              group_rows: int) -> HostPlan:
    """The grouped plan of groups of ``group_rows`` (at most 16) adjacent rows, built with torch: each
    group's union by (request, logical microblock) in ascending order, the rows' token bits as masks.
    Keeps what ``plan_groups`` keeps for the benchmark's inputs (every table entry a valid block)."""
    import torch

    if not 1 <= group_rows <= 16:
        raise ValueError(f"group_rows must be in [1, 16], got {group_rows}")
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
    kb = torch.unique(key * 64 + 4 * q + t % 4)
    uk, inv = torch.unique(kb // 64, return_inverse=True)
    m64 = torch.zeros_like(uk).index_add_(0, inv, torch.ones_like(kb) << (kb % 64))
    lo = m64 & 0xFFFFFFFF
    lo = torch.where(lo >= 2 ** 31, lo - 2 ** 32, lo).to(torch.int32)
    hi = (m64 >> 32).to(torch.int32)
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
    masks_lo = torch.zeros((groups, cap), dtype=torch.int32, device=dev)
    masks_hi = torch.zeros((groups, cap), dtype=torch.int32, device=dev)
    mb_ids[ug, at] = ids
    masks_lo[ug, at] = lo
    masks_hi[ug, at] = hi
    return HostPlan(mb_ids, masks_lo, masks_hi, counts.to(torch.int32), group_rows, rows)


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
def _attend_segment(q_ptr, k_ptr, v_ptr, ids_ptr, lo_ptr, hi_ptr, g, t0, t1, count, num_rows, qk_scale,
                    stride_q_row, stride_q_head, stride_k_block, stride_k_tok, stride_plan,
                    G: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, MB: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HI: tl.constexpr, LO_ROWS: tl.constexpr,
                    HI_ROWS: tl.constexpr):
    """Tiles ``[t0, t1)`` of group ``g`` (at least one trip, as the library's kernel): (max, sum, acc) and
    the matrix rows' output rows and heads."""
    BLOCK_N: tl.constexpr = 4 * MB
    MB_PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    o_m = tl.arange(0, BLOCK_M)
    o_q = o_m // G
    o_d = tl.arange(0, HEAD_DIM)
    o_j = tl.arange(0, MB)
    o_n = tl.arange(0, BLOCK_N)
    o_slot = o_n % 4
    m_hi = (o_q >= 8)[:, None]
    o_shift_lo = 4 * tl.minimum(o_q, 7)[:, None] + o_slot[None, :]
    o_shift_hi = 4 * tl.maximum(o_q - 8, 0)[:, None] + o_slot[None, :]
    o_row = g * GROUP_ROWS + o_q
    m_row = (o_m < GROUP_ROWS * G) & (o_row < num_rows)
    p_q = q_ptr + o_row[:, None] * stride_q_row + (o_m % G)[:, None] * stride_q_head + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None], other=0)
    p_ids = ids_ptr + g * stride_plan
    p_lo = lo_ptr + g * stride_plan
    p_hi = hi_ptr + g * stride_plan
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    t0 = t0.to(tl.int32)
    for j in range(0, tl.maximum(t1.to(tl.int32) - t0, 1)):
        o_e = (t0 + j) * MB + o_j
        m_e = o_e < count
        b_id = tl.load(p_ids + o_e, mask=m_e, other=0)
        b_lo = tl.load(p_lo + o_e, mask=m_e, other=0)
        o_mb = (b_id // MB_PER_BLOCK).to(tl.int64) * stride_k_block + (b_id % MB_PER_BLOCK) * 4 * stride_k_tok
        b_any = (b_lo[:, None] >> tl.arange(0, 4)[None, :]) & LO_ROWS
        if HI:
            b_hi = tl.load(p_hi + o_e, mask=m_e, other=0)
            b_any = b_any | ((b_hi[:, None] >> tl.arange(0, 4)[None, :]) & HI_ROWS)
        m_used = b_any != 0
        b_k = load_kv_microblocks(k_ptr, o_mb, stride_k_tok, o_d, m_used, False, tl.float16)
        b_v = load_kv_microblocks(v_ptr, o_mb, stride_k_tok, o_d, m_used, False, tl.float16)
        b_lo_t = tl.reshape(tl.broadcast_to(b_lo[:, None], [MB, 4]), [BLOCK_N])
        if HI:
            b_hi_t = tl.reshape(tl.broadcast_to(b_hi[:, None], [MB, 4]), [BLOCK_N])
            b_bit = tl.where(m_hi, b_hi_t[None, :] >> o_shift_hi, b_lo_t[None, :] >> o_shift_lo)
        else:
            b_bit = b_lo_t[None, :] >> o_shift_lo
        m_attend = (b_bit & 1) != 0
        b_m, b_l, b_acc = attend_tile(b_q, b_k, b_v, m_attend, b_m, b_l, b_acc, qk_scale, tl.float16)
    return b_m, b_l, b_acc, o_row, o_m % G, m_row


@triton.jit
def balanced_grouped_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, lo_ptr, hi_ptr, counts_ptr, out_ptr,
    part_acc_ptr,  # [programs, 2, BLOCK_M, HEAD_DIM] fp32: a program's first and last piece of a cut group
    part_ml_ptr,  # [programs, 2, BLOCK_M, 2] fp32
    num_rows, num_groups, num_programs, qk_scale,
    stride_q_row, stride_q_head, stride_k_block, stride_k_tok, stride_plan, stride_o_row, stride_o_head,
    G: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, MB: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
    HI: tl.constexpr,  # rows past 8: their bits in masks_hi
    LO_ROWS: tl.constexpr,  # bit 4q set for each row q < 8 of a group
    HI_ROWS: tl.constexpr,  # bit 4(q - 8) set for each row q >= 8
    PDL: tl.constexpr = 0,
):
    """Whole groups first, a round of ``num_programs`` at a time (program p: groups p, p + P, ...), so
    that programs running together attend neighbouring groups (whose K/V the L2 shares) as the library's
    grid does; then the groups left over (fewer than P) as one sequence of tiles cut into P equal runs."""
    enter_launch(PDL)
    pid = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, HEAD_DIM)
    o_m = tl.arange(0, BLOCK_M)
    g_rest = num_groups // num_programs * num_programs
    for g in range(pid, g_rest, num_programs):
        count = tl.load(counts_ptr + g)
        n = tl.maximum(tl.cdiv(count, MB), 1)
        b_m, b_l, b_acc, o_row, o_head, m_row = _attend_segment(
            q_ptr, k_ptr, v_ptr, ids_ptr, lo_ptr, hi_ptr, g, n * 0, n, count, num_rows, qk_scale, stride_q_row,
            stride_q_head, stride_k_block, stride_k_tok, stride_plan, G, GROUP_ROWS, BLOCK_M, MB, HEAD_DIM,
            BLOCK_SIZE, HI, LO_ROWS, HI_ROWS)
        store_output(b_acc, b_m, b_l, o_row, o_head, m_row, o_d, out_ptr, out_ptr, out_ptr, 1.0,
                     stride_o_row, stride_o_head, 0, 0, 0, False, False)

    o_g, b_n, b_incl = _tile_prefix(counts_ptr, num_groups, g_rest, MB, BLOCK_GROUPS)
    total = tl.sum(b_n, 0)
    start = pid * total // num_programs
    end = (pid + 1) * total // num_programs
    g = g_rest + tl.sum(((b_incl <= start) & (o_g >= g_rest)).to(tl.int64), 0)
    off = tl.sum(tl.where(o_g == g, b_incl - b_n, 0), 0)
    cur = start
    while cur < end:
        count = tl.load(counts_ptr + g)
        n = tl.maximum(tl.cdiv(count, MB), 1).to(tl.int64)
        seg_end = tl.minimum(end, off + n)
        t0 = cur - off
        t1 = seg_end - off
        b_m, b_l, b_acc, o_row, o_head, m_row = _attend_segment(
            q_ptr, k_ptr, v_ptr, ids_ptr, lo_ptr, hi_ptr, g, t0, t1, count, num_rows, qk_scale, stride_q_row,
            stride_q_head, stride_k_block, stride_k_tok, stride_plan, G, GROUP_ROWS, BLOCK_M, MB, HEAD_DIM,
            BLOCK_SIZE, HI, LO_ROWS, HI_ROWS)
        if (t0 == 0) & (t1 == n):
            store_output(b_acc, b_m, b_l, o_row, o_head, m_row, o_d, out_ptr, out_ptr, out_ptr, 1.0,
                         stride_o_row, stride_o_head, 0, 0, 0, False, False)
        else:
            i_part = (pid * 2 + (cur != start).to(tl.int64)) * BLOCK_M + o_m
            tl.store(part_acc_ptr + i_part[:, None] * HEAD_DIM + o_d[None, :], b_acc)
            tl.store(part_ml_ptr + i_part * 2, b_m)
            tl.store(part_ml_ptr + i_part * 2 + 1, b_l)
        cur = seg_end
        off += n
        g += 1


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
                     num_stages: int = 3) -> None:
    """Rows ``[0, plan.num_rows)`` of ``out`` from ``plan`` on ``programs`` persistent programs (default:
    two per SM)."""
    import torch

    from qsa.utils import device_facts, launch_options, next_pow2

    hq, d = q.shape[1], q.shape[2]
    G = hq // k.shape[2]
    if (G, d, k.shape[2]) != (6, 256, 1) and not (q.device.type == "cpu" and k.shape[2] == 1):
        raise ValueError("the prototype covers one KV head of 6 heads of 256 (any shape under the interpreter)")
    if k.stride() != v.stride():
        raise ValueError(f"K and V caches must share their strides, got {k.stride()} and {v.stride()}")
    block_m = max(16, next_pow2(plan.group_rows * G))
    if block_m > 64 and q.is_cuda:
        raise ValueError(f"{plan.group_rows} rows x {G} heads do not fit a 64-row tile")
    groups = plan.counts.shape[0]
    if programs is None:
        programs = 2 * device_facts(str(q.device))["sm_count"] if q.is_cuda else 4
    part_acc = torch.empty((programs, 2, block_m, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((programs, 2, block_m, 2), dtype=torch.float32, device=q.device)
    scale = softmax_scale * math.log2(math.e)
    opts = launch_options(q.device)
    block_groups = next_pow2(max(groups, 2))
    balanced_grouped_kernel[(programs,)](
        q, k, v, plan.mb_ids, plan.masks_lo, plan.masks_hi, plan.counts, out, part_acc, part_ml,
        plan.num_rows, groups, programs, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), plan.mb_ids.stride(0), out.stride(0), out.stride(1),
        G=G, GROUP_ROWS=plan.group_rows, BLOCK_M=block_m, MB=8, HEAD_DIM=d, BLOCK_SIZE=k.shape[1],
        BLOCK_GROUPS=block_groups, HI=plan.group_rows > 8,
        LO_ROWS=sum(1 << (4 * r) for r in range(min(plan.group_rows, 8))),
        HI_ROWS=sum(1 << (4 * r) for r in range(max(plan.group_rows - 8, 0))), num_warps=4, num_stages=num_stages, **opts)
    block_d = min(64, d)
    rest = groups % programs
    if rest == 0:
        return
    balanced_fixup_kernel[(rest, d // block_d)](
        plan.counts, out, part_acc, part_ml, plan.num_rows, groups, programs, out.stride(0), out.stride(1),
        G=G, GROUP_ROWS=plan.group_rows, BLOCK_M=block_m, MB=8, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_GROUPS=block_groups, num_warps=4, **opts)


def compare(names, timer, rounds: int = 2) -> list[dict]:
    """Each scenario: the library's grouped kernel on its plan, and this kernel on host plans of 8 and 10
    rows per group (8-row host plans equal the library's), each checked against the fp32 reference,
    then timed in interleaved rounds. The records also give each plan's tiles."""
    from qsa import attention

    from .harness import compare_kernels

    extra = []

    def make_runs(pb):
        q, c, w = pb.q, pb.cache, pb.workload
        plans = {rows: host_plan(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                                 block_size=c.block_size, group_rows=rows) for rows in (8, 10)}
        for rows, plan in plans.items():
            tiles = int(((plan.counts + 7) // 8).clamp(min=1).sum())
            extra.append(dict(scenario=pb.name, group_rows=rows, groups=int(plan.counts.numel()), tiles=tiles,
                              mean_union=float(plan.counts.float().mean())))
            print(f"{pb.name}: {rows}-row groups: {plan.counts.numel()} groups, {tiles} tiles", flush=True)

        def library(out):
            attention.grouped_attention(q, c.k, c.v, pb.plan, out=out, **pb.attention_kwargs)

        def balanced(rows):
            return lambda out: balanced_grouped(q, c.k, c.v, plans[rows], out, pb.scale)

        return {"library": library, "balanced-8": balanced(8), "balanced-10": balanced(10)}

    return extra + compare_kernels(names, timer, make_runs, {}, rounds)


def main(argv=None) -> int:
    from .harness import main as run

    return run("python -m benchmarks.prototypes.balanced_grouped", __doc__, "balanced-grouped", compare, argv)


if __name__ == "__main__":
    sys.exit(main())
