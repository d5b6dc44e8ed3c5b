"""Floors under the decode, MTP and prefill targets, measured: how fast the bytes of a step can be read
and how much a step of one or two launches costs, timed as ``qsa bench`` times a step (medians of CUDA-graph
replays with the L2 flushed before each one).

For each named scenario, in one process:

* ``launch-1``, ``launch-2``: a graph of one or two empty kernels. The direct xqa step is two launches
  (the attention kernel and the split merge).
* ``gather`` probes: a kernel that reads exactly the K/V head rows the xqa route reads (each row's kept
  tokens, 4-token runs scattered over the shuffled pages), with the direct kernel's shape of work: one
  program per (row, KV head, split), ``BLOCK_N`` tokens per tile, the split's entries read before the
  loop, the K/V loads pipelined as asynchronous copies; splits from ``qsa.attention.xqa.launch.direct_split_count`` or
  given. It feeds the tiles to two products with all-ones operands and sums the results, so it is the
  time of the loads alone. Variants: ``flat`` (each entry's head row precomputed: one load before the
  loop), ``table`` (the tokens, then their block-table entries, as the direct kernel resolves them;
  it reads every valid entry, as the scenarios' rows keep them all) and ``contiguous`` (the same byte
  count and program shape, each list's rows laid out one after another in a separate buffer: no gather).
  Every probe is checked per program against an fp64 sum before it is timed.
* the ``xqa`` and ``splitk`` routes, plan + run as the benchmark times them (each first checked against
  the fp32 reference under the benchmark's fixed gate), and the target's time:
  80% of the copy bandwidth on the route's bytes (decode), splitk / 1.5 (MTP).

Prefill scenarios (more than 16 rows per request) measure the grouped step instead: the step, the
planner alone and the attention kernel alone (the plan made once), splitk and the target (splitk / 5 at
overlap 0.98, / 3 otherwise), and ``grouped`` probes that walk the grouped plan as the attention kernel
does (one program per group and KV head, tiles of ``MB`` microblocks, loads masked to the tokens some
row of the group keeps): ``products`` feeds the tiles to the kernel's two products (64 rows, wgmma) with
all-ones operands, which is the kernel without its softmax; ``small`` does the same with 16-row products
(mma.sync). Each setting is first checked per program, exactly, on a cache of small integers with NaN in
every slot the plan does not load (:class:`GroupedProbe`).

The tables go to stdout; with ``--out DIR`` also to ``DIR/floors-<device>.json`` and ``.md`` (a later run
into the same directory replaces them).

    python -m benchmarks.floors decode-64 mtp-8 mtp-16 --out /tmp/floors
    python -m benchmarks.floors prefill-64k-o80 prefill-64k-o98 --out /tmp/floors
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import qsa
import qsa.attention.grouped.launch
import qsa.attention.xqa.launch
from qsa.attention.kernels import load_kv_microblocks, split_range

from .baselines import reference_attention_fp32
from .breakdown import check_output, checked_step_fn, plan_args
from .generators import attention_workload, kept_entries
from .registry import SCENARIOS
from .report import slug
from .run import step_bytes
from .timing import Timer, TimingConfig, measure_ceilings


@triton.jit
def _nothing_kernel(x_ptr):
    """An empty kernel: what a launch costs inside a graph replay."""
    if tl.program_id(0) < 0:
        tl.store(x_ptr, 0)


@triton.jit
def gather_sum_kernel(
    off_ptr,  # [lists, W] int64: each entry's head row (element offset / HEAD_DIM; -1: not read); FLAT
    idx_ptr,  # [rows, W] int32 tokens; not FLAT
    bt_ptr,  # [num_reqs, max_blocks] int32; not FLAT
    req_ptr,  # [rows] int32; not FLAT
    k_ptr,
    v_ptr,
    out_ptr,  # [lists, NUM_SPLITS] fp32: each program's sum of what it read
    W,
    num_kv_heads,
    stride_bt,
    stride_block,
    stride_tok,
    stride_head,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FLAT: tl.constexpr,
    SPLIT_N: tl.constexpr,  # power of two >= a split's entries
):
    """One program per (row, KV head, split) sums the K and V head rows of its split's entries, through
    the two products of an attention step with all-ones operands (so the compiler pipelines the K/V loads
    into shared memory as it does the attention kernels'): ``1 @ K^T`` and ``1 @ V``."""
    i_list = tl.program_id(0).to(tl.int64)
    i_split = tl.program_id(1)
    i_r = i_list // num_kv_heads
    i_kvh = i_list % num_kv_heads
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    b_one_q = tl.full([16, HEAD_DIM], 1.0, tl.float16)
    b_one_p = tl.full([16, BLOCK_N], 1.0, tl.float16)
    # The split's entries are resolved before the loop, as the direct kernel resolves them, and each
    # tile takes its own from registers: no K/V load waits on a load of its own tile.
    tile_start, tile_end = split_range(tl.cdiv(W, BLOCK_N), i_split, NUM_SPLITS)
    o_s = tile_start * BLOCK_N + tl.arange(0, SPLIT_N)
    m_s = o_s < tl.minimum(W, tile_end * BLOCK_N)
    # The offsets are formed after the gather (a head row times HEAD_DIM, a block times its stride), so
    # the compiler sees them as multiples of 16 elements and makes the K/V loads 16-byte asynchronous
    # copies, pipelined as in the attention kernels.
    if FLAT:
        b_rows = tl.load(off_ptr + i_list * W + o_s, mask=m_s, other=-1)
    else:
        p_bt = bt_ptr + tl.load(req_ptr + i_r).to(tl.int64) * stride_bt
        b_ts = tl.load(idx_ptr + i_r * W + o_s, mask=m_s, other=-1)
        b_ps = tl.load(p_bt + b_ts // BLOCK_SIZE, mask=b_ts >= 0, other=-1)
    b_sk = tl.zeros([16, BLOCK_N], tl.float32)
    b_sv = tl.zeros([16, HEAD_DIM], tl.float32)
    for i_t in range(tile_start, tile_end):
        o_l = tl.minimum((i_t - tile_start) * BLOCK_N, SPLIT_N - BLOCK_N) + o_n
        if FLAT:
            b_row = tl.gather(b_rows, o_l, 0)
            m_n = b_row >= 0
            b_off = b_row * HEAD_DIM
        else:
            b_t = tl.gather(b_ts, o_l, 0)
            b_p = tl.gather(b_ps, o_l, 0).to(tl.int64)
            m_n = (b_t >= 0) & (b_p >= 0)
            b_off = b_p * stride_block + (b_t % BLOCK_SIZE) * stride_tok + i_kvh * stride_head
        b_k = tl.load(k_ptr + b_off[:, None] + o_d[None, :], mask=m_n[:, None], other=0).to(tl.float16)
        b_v = tl.load(v_ptr + b_off[:, None] + o_d[None, :], mask=m_n[:, None], other=0).to(tl.float16)
        b_sk = tl.dot(b_one_q, tl.trans(b_k), b_sk)
        b_sv = tl.dot(b_one_p, b_v, b_sv)
    b_total = tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, b_sk, 0.0), 1)
    b_total += tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, b_sv, 0.0), 1)
    tl.store(out_ptr + i_list * NUM_SPLITS + i_split + tl.arange(0, 16), b_total, mask=tl.arange(0, 16) == 0)


@triton.jit
def grouped_sum_kernel(
    ids_ptr,  # [groups, cap] int32 physical microblock ids (the grouped plan)
    masks_ptr,  # [groups, cap] int32 bit 4q + t % 4
    counts_ptr,  # [groups] int32
    k_ptr,
    v_ptr,
    out_ptr,  # [groups, Hkv] fp32: each program's sum of what it read
    num_kv_heads,
    stride_plan,
    stride_block,
    stride_tok,
    stride_head,
    BLOCK_M: tl.constexpr,  # rows of the all-ones operands: 64 = the grouped kernel's products
    MB: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache read as its uint8 codes, converted as the attention kernels do
):
    """One program per (plan group, KV head) walks the group's plan exactly as the grouped attention
    kernel does (its tiles of ``MB`` microblocks, offsets and load masks per microblock, every token that
    any row of the group keeps) and sums the K and V tiles through the kernel's two products with
    all-ones operands, ``1 @ K^T`` and ``1 @ V``: the kernel without its softmax (masks, max, exponentials,
    rescale). ``BLOCK_M`` 16 keeps the loads and shrinks the products."""
    i_g = tl.program_id(0)
    i_kvh = tl.program_id(1).to(tl.int64)
    BLOCK_N: tl.constexpr = 4 * MB
    MB_PER_BLOCK: tl.constexpr = BLOCK_SIZE // 4
    o_d = tl.arange(0, HEAD_DIM)
    o_j = tl.arange(0, MB)
    b_one_q = tl.full([BLOCK_M, HEAD_DIM], 1.0, tl.float16)
    b_one_p = tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float16)
    count = tl.load(counts_ptr + i_g)
    p_ids = ids_ptr + i_g.to(tl.int64) * stride_plan
    p_masks = masks_ptr + i_g.to(tl.int64) * stride_plan
    b_sk = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    b_sv = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for i_t in range(0, tl.maximum(tl.cdiv(count, MB), 1)):
        o_e = i_t * MB + o_j
        b_id = tl.load(p_ids + o_e, mask=o_e < count, other=0)
        b_gm = tl.load(p_masks + o_e, mask=o_e < count, other=0)
        o_mb = (b_id // MB_PER_BLOCK).to(tl.int64) * stride_block + (b_id % MB_PER_BLOCK) * 4 * stride_tok \
            + i_kvh * stride_head
        m_used = ((b_gm[:, None] >> tl.arange(0, 4)[None, :]) & 0x11111111) != 0
        b_k = load_kv_microblocks(k_ptr, o_mb, stride_tok, o_d, m_used, KV_FP8, tl.float16)
        b_v = load_kv_microblocks(v_ptr, o_mb, stride_tok, o_d, m_used, KV_FP8, tl.float16)
        b_sk = tl.dot(b_one_q, tl.trans(b_k), b_sk)
        b_sv = tl.dot(b_one_p, b_v, b_sv)
    b_total = tl.sum(tl.where(tl.arange(0, BLOCK_M)[:, None] == 0, b_sk, 0.0), 1)
    b_total += tl.sum(tl.where(tl.arange(0, BLOCK_M)[:, None] == 0, b_sv, 0.0), 1)
    o_out = i_g * num_kv_heads + i_kvh + tl.arange(0, BLOCK_M)
    tl.store(out_ptr + o_out, b_total, mask=tl.arange(0, BLOCK_M) == 0)


def flat_offsets(w, kept: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
    """``[rows * Hkv, W]`` int64: each kept entry's K (= V) head row (its element offset / head_dim),
    -1 elsewhere (``kept`` and ``phys`` from ``generators.kept_entries``)."""
    c = w.cache
    t = w.indices.long().clamp(min=0)
    s_block, s_tok, s_head = c.k.stride(0), c.k.stride(1), c.k.stride(2)
    base = phys * s_block + (t % c.block_size) * s_tok
    heads = torch.arange(c.k.shape[2], device=t.device) * s_head
    off = base[:, None, :] + heads[None, :, None]
    d = c.k.shape[3]
    if any(st % d for st in (s_block, s_tok, s_head)):
        raise ValueError(f"cache strides {c.k.stride()} are not multiples of head_dim {d}")
    return torch.where(kept[:, None, :], off // d, -1).reshape(-1, t.shape[1])


def contiguous_offsets(kept: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Offsets into a dense buffer holding each list's kept entries one after another, in list order."""
    lists = kept.repeat_interleave(num_kv_heads, 0)
    slot = torch.cumsum(lists.flatten().long(), 0).reshape(lists.shape) - 1
    return torch.where(lists, slot, -1)


class Probe:
    """The gather probe of one workload, with its inputs prepared once."""

    def __init__(self, w, scn):
        self.w, self.scn = w, scn
        c = w.cache
        # The entries xqa reads, at their positions in the rows (the scenarios' rows hold each token once).
        self.kept, self.phys = kept_entries(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                                            block_size=c.block_size, num_blocks=c.num_blocks)
        self.flat = flat_offsets(w, self.kept, self.phys).contiguous()
        self.k, self.v = c.k, c.v
        if c.kv_cache_dtype == "fp8_e4m3":  # read the bytes; the sum is of their integer codes
            self.k, self.v = c.k.view(torch.uint8), c.v.view(torch.uint8)
        n = int(self.kept.sum()) * scn.num_kv_heads
        self.dense_k = torch.ones(max(n, 1) * scn.head_dim, dtype=self.k.dtype, device=self.k.device)
        self.dense_v = torch.ones_like(self.dense_k)
        self.contiguous = contiguous_offsets(self.kept, scn.num_kv_heads, scn.head_dim).contiguous()
        self.lists = w.indices.shape[0] * scn.num_kv_heads
        self._expected = {}

    def default_splits(self, block_n: int) -> int:
        """The direct kernel's split count for this workload (its programs per SM), at ``block_n``."""
        scn = self.scn
        cfg = qsa.attention.xqa.launch.xqa_direct_config(scn.num_q_heads // scn.num_kv_heads, scn.head_dim, self.lists,
                                       kv_fp8=scn.kv_cache_dtype == "fp8_e4m3")
        tiles = triton.cdiv(self.w.indices.shape[1], block_n)
        return qsa.attention.xqa.launch.direct_split_count(self.lists, tiles, cfg.programs_per_sm, self.k.device)

    def fn(self, variant: str, splits: int, block_n: int, num_warps: int, stages: int):
        w, scn = self.w, self.scn
        out = torch.empty(self.lists, splits, dtype=torch.float32, device=self.k.device)
        k, v, off = self.k, self.v, self.flat
        if variant == "contiguous":
            k, v, off = self.dense_k, self.dense_v, self.contiguous
        c = w.cache
        args = (off, w.indices, w.block_table, w.token_to_req, k, v, out, w.indices.shape[1], scn.num_kv_heads,
                w.block_table.stride(0), c.k.stride(0), c.k.stride(1), c.k.stride(2))
        kw = dict(NUM_SPLITS=splits, BLOCK_N=block_n, HEAD_DIM=scn.head_dim, BLOCK_SIZE=c.block_size,
                  FLAT=variant != "table", num_warps=num_warps, num_stages=stages,
                  SPLIT_N=triton.next_power_of_2(triton.cdiv(triton.cdiv(w.indices.shape[1], block_n), splits) * block_n))

        def fn():
            gather_sum_kernel[(self.lists, splits)](*args, **kw)

        return fn, out

    def checked(self, variant: str, splits: int, block_n: int, num_warps: int, stages: int):
        """(the probe's launch, whether one launch summed exactly what it must: its output is first
        poisoned with NaN, then compared per program with :meth:`expected`)."""
        fn, out = self.fn(variant, splits, block_n, num_warps, stages)
        out.fill_(float("nan"))
        fn()
        want = self.expected(variant, splits, block_n)
        return fn, bool(torch.allclose(out.double(), want, rtol=1e-4, atol=1e-2))

    def expected(self, variant: str, splits: int, block_n: int) -> torch.Tensor:
        """``[lists, splits]`` fp64: what each program must sum, from the cache indexed by (block, slot,
        head), not from the probe's offsets. The ``table`` variant reads every valid entry, so it
        agrees only where every valid entry is kept (the scenarios' rows)."""
        key = (variant == "contiguous", splits, block_n)
        if key not in self._expected:
            self._expected[key] = self._expected_sums(variant == "contiguous", splits, block_n)
        return self._expected[key]

    def _expected_sums(self, contiguous: bool, splits: int, block_n: int) -> torch.Tensor:
        w = self.w
        width = w.indices.shape[1]
        hkv = self.scn.num_kv_heads
        per_entry = torch.zeros(self.lists, width, dtype=torch.float64, device=self.kept.device)
        t = w.indices.long().clamp(min=0)
        bs = w.cache.block_size
        phys = self.phys
        for i in range(self.lists):
            r, h = divmod(i, hkv)
            m = self.kept[r]
            if contiguous:
                per_entry[i, m] = 2.0 * self.scn.head_dim
            elif bool(m.any()):
                tok = t[r, m]
                kv = self.k[phys[r, m], tok % bs, h].double() + self.v[phys[r, m], tok % bs, h].double()
                per_entry[i, m] = kv.sum(1)
        tiles = triton.cdiv(width, block_n)
        per = triton.cdiv(tiles, splits)
        split_of = torch.arange(width, device=per_entry.device) // block_n // per
        out = torch.zeros(self.lists, splits, dtype=torch.float64, device=per_entry.device)
        return out.index_add_(1, split_of, per_entry)


class GroupedProbe:
    """The grouped probe of one prefill workload: its grouped plan, made once by the planner the route
    uses, walked by :func:`grouped_sum_kernel`.

    Sums of a whole group's K/V in fp32 are not exact (the tensor cores' accumulation loses low bits of
    a large running sum), so each setting is checked on a cache of the same geometry that holds small
    integers in the slots the plan loads and NaN in every other slot: there every partial sum is exact,
    and a read of any other slot makes the sum NaN. The timed launch reads the workload's own cache."""

    CHECK_VALUES = 3  # the check cache's slots hold integers in [-3, 3]

    def __init__(self, w, scn):
        from qsa import plan_attention

        self.w, self.scn = w, scn
        c = w.cache
        self.plan_in, self.plan_kw = plan_args(scn, w, "grouped")
        self.plan = plan_attention(*self.plan_in, **self.plan_kw)
        self.grouped = self.plan.grouped
        if self.grouped is None:
            raise ValueError(f"{scn.name}: the grouped route plans no row of this workload")
        self.k, self.v = c.k, c.v
        self.kv_fp8 = c.kv_cache_dtype == "fp8_e4m3"
        if self.kv_fp8:
            self.k, self.v = c.k.view(torch.uint8), c.v.view(torch.uint8)
        self._check = None

    def _slots(self):
        """``(block, slot, used)``: each plan entry's 4 token slots ``[groups, cap, 4]`` and whether some row
        of its group keeps the token (entries past a group's count: never)."""
        g, bs = self.grouped, self.w.cache.block_size
        ids = g.mb_ids.long()
        live = torch.arange(ids.shape[1], device=ids.device)[None, :] < g.counts[:, None].long()
        ids = torch.where(live, ids, 0)
        four = torch.arange(4, device=ids.device)
        slot = (ids % (bs // 4) * 4)[:, :, None] + four
        block = (ids // (bs // 4))[:, :, None].expand_as(slot)
        used = (((g.masks[:, :, None] >> four) & 0x11111111) != 0) & live[:, :, None]
        return block, slot, used

    def union_tokens(self) -> int:
        """Tokens the groups' plans load (each once per group): the probe's bytes / (KV bytes per token)."""
        return int(self._slots()[2].sum())

    def fn(self, block_m: int, mb: int, num_warps: int, stages: int, k=None, v=None):
        g = self.grouped
        hkv = self.scn.num_kv_heads
        k = self.k if k is None else k
        v = self.v if v is None else v
        if k.stride() != v.stride():
            raise ValueError(f"K and V caches must share their strides, got {k.stride()} and {v.stride()}")
        out = torch.empty(g.num_groups, hkv, dtype=torch.float32, device=k.device)

        def fn():
            grouped_sum_kernel[(g.num_groups, hkv)](
                g.mb_ids, g.masks, g.counts, k, v, out, hkv, g.mb_ids.stride(0), k.stride(0),
                k.stride(1), k.stride(2), BLOCK_M=block_m, MB=mb, HEAD_DIM=self.scn.head_dim,
                BLOCK_SIZE=self.w.cache.block_size, KV_FP8=self.kv_fp8, num_warps=num_warps, num_stages=stages)

        return fn, out

    def check_cache(self):
        """``(k, v, expected)``: the check cache (the workload cache's shape and dtype; integers in the
        slots the plan loads, NaN elsewhere) and ``[groups, Hkv]`` fp64, the sum over each group's plan
        of K and V, computed from that cache by (block, slot, head)."""
        if self._check is None:
            block, slot, used = self._slots()
            kv = []
            gen = torch.Generator(device=self.k.device).manual_seed(7)
            for x in (self.k, self.v):
                vals = torch.full(x.shape, float("nan"), dtype=torch.float32, device=x.device)
                fill = torch.randint(-self.CHECK_VALUES, self.CHECK_VALUES + 1, x.shape, generator=gen,
                                     device=x.device).float()
                vals[block[used], slot[used]] = fill[block[used], slot[used]]
                kv.append(vals.to(torch.float8_e4m3fn).view(torch.uint8) if self.kv_fp8 else vals.to(x.dtype))
            sums = [torch.nan_to_num((x.view(torch.float8_e4m3fn) if self.kv_fp8 else x).double()).sum(-1)
                    for x in kv]  # [blocks, block_size, Hkv]; the NaN slots are never used
            per_tok = sums[0] + sums[1]
            want = torch.where(used[..., None], per_tok[block, slot], 0.0).sum((1, 2))
            self._check = (kv[0], kv[1], want)
        return self._check

    def checked(self, block_m: int, mb: int, num_warps: int, stages: int):
        """(the probe's launch on the workload's cache, whether the same setting summed exactly what it
        must on the check cache: its output is first poisoned with NaN, then compared per program with
        the expected sums)."""
        k, v, want = self.check_cache()
        fn, out = self.fn(block_m, mb, num_warps, stages, k, v)
        out.fill_(float("nan"))
        fn()
        ok = bool(torch.equal(out.double(), want))
        return self.fn(block_m, mb, num_warps, stages)[0], ok


def launch_fns(device):
    x = torch.zeros(1, dtype=torch.int32, device=device)

    def one():
        _nothing_kernel[(1,)](x)

    def two():
        _nothing_kernel[(1,)](x)
        _nothing_kernel[(1,)](x)

    return one, two


def probe_grid(quick: bool):
    """(variant, block_n, num_warps, stages) tried per split count."""
    if quick:
        return [("flat", 32, 4, 3), ("table", 32, 4, 3), ("contiguous", 32, 4, 3)]
    grid = [("flat", 32, 4, 2), ("flat", 32, 4, 3), ("flat", 32, 4, 4), ("flat", 64, 4, 3), ("flat", 64, 8, 2),
            ("flat", 64, 8, 3), ("table", 32, 4, 3), ("contiguous", 32, 4, 3)]
    return grid


def run_scenario(scn, timer: Timer, ceilings: dict, *, quick: bool, split_factors=(0.5, 1, 2)) -> dict:
    dev = timer.device
    w = attention_workload(scn, dev)
    probe = Probe(w, scn)
    kv_per_token, qo_bytes = step_bytes(scn)
    kv_bytes = int(probe.kept.sum()) * kv_per_token
    rec = dict(scenario=scn.name, rows=scn.rows, kv_bytes=kv_bytes, route_bytes=kv_bytes + qo_bytes, probes=[])

    # The routes, plan + run, each checked first.
    ref = reference_attention_fp32(w.q, *w.args, **w.cache_kwargs)
    for route in ("xqa", "splitk"):
        fn, _, _ = checked_step_fn(scn, w, route, ref)
        rec[f"{route}_ms"] = timer.time(fn).median_ms
    if scn.name.startswith("mtp"):
        rec["target_ms"] = rec["splitk_ms"] / 1.5
        rec["target"] = "splitk / 1.5"
    else:
        rec["target_ms"] = rec["route_bytes"] / (0.8 * ceilings["copy_gbps"] * 1e9) * 1e3
        rec["target"] = "route bytes at 0.8 x copy bandwidth"

    one, two = launch_fns(dev)
    one()
    two()
    rec["launch_1_ms"] = timer.time(one).median_ms
    rec["launch_2_ms"] = timer.time(two).median_ms

    for variant, block_n, nw, st in probe_grid(quick):
        base = probe.default_splits(block_n)
        tiles = triton.cdiv(w.indices.shape[1], block_n)
        splits = sorted({max(1, min(tiles, round(base * f))) for f in (split_factors if not quick else (1,))})
        for s in splits:
            fn, ok = probe.checked(variant, s, block_n, nw, st)
            t = timer.time(fn).median_ms if ok else None
            rec["probes"].append(dict(variant=variant, splits=s, block_n=block_n, num_warps=nw, stages=st,
                                      programs=probe.lists * s, ok=ok, median_ms=t,
                                      kv_gbps=None if t is None else kv_bytes / (t * 1e-3) / 1e9))
    done = [p for p in rec["probes"] if p["ok"]]
    for variant in ("flat", "table", "contiguous"):
        best = min((p for p in done if p["variant"] == variant), key=lambda p: p["median_ms"], default=None)
        rec[f"best_{variant}"] = best
    del w, probe
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


GROUPED_TARGETS = {0.98: 5.0}
"""splitk / grouped that each prefill overlap's target asks for (3 at the other overlaps)."""


def grouped_probe_grid(quick: bool):
    """(block_m, mb, num_warps, stages) of the grouped probe: the attention kernel's products and tiles
    first (``qsa.attention.grouped.launch.grouped_config`` for 6/1: 64 rows, 8 microblocks, 4 warps, 3 stages)."""
    if quick:
        return [(64, 8, 4, 3), (16, 8, 4, 3)]
    return [(64, 8, 4, 3), (64, 8, 4, 2), (64, 4, 4, 3), (64, 16, 4, 2), (16, 8, 4, 3), (16, 8, 4, 4)]


def time_grouped_parts(scn, w, probe, ref, timer: Timer) -> dict:
    """The grouped step's planner alone and its attention kernel alone (plan made once), after one plan +
    run checked against ``ref`` on a NaN-filled output: ``{"planner_ms", "attention_ms"}``."""
    from qsa import plan_attention, run_attention
    from qsa.attention.planning.plan import PlanWorkspace

    plan = probe.plan
    ws = PlanWorkspace.for_plan(w.block_table, block_size=w.cache.block_size, num_groups=plan.grouped.num_groups)
    out = torch.empty_like(w.q)

    def planner():
        plan_attention(*probe.plan_in, **probe.plan_kw, out=plan, workspace=ws)

    def attention():
        run_attention(plan, w.q, w.cache.k, w.cache.v, out=out, **w.cache_kwargs)

    out.fill_(float("nan"))
    planner()
    attention()
    check_output(out, ref, w.q.dtype, f"{scn.name}: the grouped attention after its planner")
    times = {}
    for name, f in (("planner", planner), ("attention", attention)):
        f()
        times[f"{name}_ms"] = timer.time(f).median_ms
    return times


def run_grouped_scenario(scn, timer: Timer, ceilings: dict, *, quick: bool) -> dict:
    """Floors of a prefill scenario's grouped step: the planner alone, the attention kernel alone (plan
    made once), the step, and the grouped probes (the kernel's loads and products without its softmax)."""
    dev = timer.device
    w = attention_workload(scn, dev)
    probe = GroupedProbe(w, scn)
    kv_per_token, _ = step_bytes(scn)
    union_bytes = probe.union_tokens() * kv_per_token
    rec = dict(scenario=scn.name, rows=scn.rows, grouped_rows=probe.plan.routes.grouped_rows,
               union_bytes=union_bytes, probes=[])
    ref = reference_attention_fp32(w.q, *w.args, **w.cache_kwargs)
    for route in ("grouped", "splitk"):
        fn, _, _ = checked_step_fn(scn, w, route, ref)
        rec[f"{route}_ms"] = timer.time(fn).median_ms
    ratio = GROUPED_TARGETS.get(scn.overlap, 3.0)
    rec["target_ms"] = rec["splitk_ms"] / ratio
    rec["target"] = f"splitk / {ratio:g}"

    rec.update(time_grouped_parts(scn, w, probe, ref, timer))

    for block_m, mb, nw, st in grouped_probe_grid(quick):
        fn, ok = probe.checked(block_m, mb, nw, st)
        t = timer.time(fn).median_ms if ok else None
        rec["probes"].append(dict(variant="products" if block_m >= 64 else "small", block_m=block_m, mb=mb,
                                  num_warps=nw, stages=st, ok=ok, median_ms=t,
                                  gbps=None if t is None else union_bytes / (t * 1e-3) / 1e9))
    done = [p for p in rec["probes"] if p["ok"]]
    for variant in ("products", "small"):
        rec[f"best_{variant}"] = min((p for p in done if p["variant"] == variant), key=lambda p: p["median_ms"],
                                     default=None)
    return rec  # the workload's memory goes with this frame (main empties the cache)


def is_prefill(scn) -> bool:
    """More rows per request than an MTP step has: the grouped route's workloads."""
    return scn.rows // scn.num_reqs > 16


def markdown(report: dict) -> str:
    lines = [f"Floors on {report['device']}, {report['date']} (copy {report['ceilings']['copy_gbps']:.0f} GB/s); "
             f"us, medians of graph replays with the L2 flushed ({report.get('flush', 'write')}).", ""]

    def us(x):
        return "-" if x is None else f"{x * 1e3:.1f}"

    single = [r for r in report["scenarios"] if "xqa_ms" in r]
    grouped = [r for r in report["scenarios"] if "grouped_ms" in r]
    if single:
        lines += ["| scenario | target | xqa | splitk | 1 launch | 2 launches | best gather (flat) | best gather "
                  "(table) | contiguous | flat GB/s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    def cell(p):  # a probe's time and setting (gather probes: splits and tile; grouped: rows and tile)
        if p is None:
            return "-"
        shape = f"{p['splits']} splits, {p['block_n']}" if "splits" in p else f"{p['block_m']} rows, {p['mb']} mb"
        return f"{us(p['median_ms'])} ({shape}/{p['num_warps']}w/{p['stages']}st)"

    for r in single:
        bf, bt, bc = (r.get(f"best_{v}") for v in ("flat", "table", "contiguous"))
        gbps = "-" if bf is None else f"{bf['kv_gbps']:.0f}"
        lines.append(f"| {r['scenario']} | {us(r['target_ms'])} | {us(r['xqa_ms'])} | {us(r['splitk_ms'])} | "
                     f"{us(r['launch_1_ms'])} | {us(r['launch_2_ms'])} | {cell(bf)} | {cell(bt)} | {cell(bc)} | "
                     f"{gbps} |")
    if single and grouped:
        lines.append("")
    if grouped:
        lines += ["Grouped step (prefill): `products` walks the plan with the attention kernel's loads and its two "
                  "products on all-ones operands (no softmax); `small` the same with 16-row products.", "",
                  "| scenario | target | grouped step | planner | attention | splitk | best products | best small "
                  "| union GB/s (products) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in grouped:
        bp, bl = r.get("best_products"), r.get("best_small")
        gbps = "-" if bp is None else f"{bp['gbps']:.0f}"
        lines.append(f"| {r['scenario']} | {us(r['target_ms'])} ({r['target']}) | {us(r['grouped_ms'])} | "
                     f"{us(r['planner_ms'])} | {us(r['attention_ms'])} | {us(r['splitk_ms'])} | {cell(bp)} | "
                     f"{cell(bl)} | {gbps} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.floors", description=__doc__.split("\n")[0])
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for floors-<device>.json and .md (-<flush>-flush added for --flush read); "
                        "a later run with the same --out replaces them")
    p.add_argument("--quick", action="store_true", help="one probe setting per variant, default splits")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--flush", choices=Timer.FLUSHES, default="write",
                   help="L2 flush before each replay: write (the benchmark's) or read (leaves the L2 clean)")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in SCENARIOS}
    bad = [n for n in args.scenarios if n not in by_name or by_name[n].kind != "attention"]
    if bad:
        p.error(f"not attention scenarios: {bad}")
    dev = torch.device(args.device)
    cfg = TimingConfig(budget_s=0.2, min_reps=20, max_reps=300) if dev.type == "cuda" else TimingConfig()
    timer = Timer(dev, dataclasses.replace(cfg, flush=args.flush))
    ceilings = measure_ceilings(timer)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = dict(device=name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), ceilings=ceilings,
                  flush=args.flush, scenarios=[])
    for n in args.scenarios:
        run = run_grouped_scenario if is_prefill(by_name[n]) else run_scenario
        report["scenarios"].append(run(by_name[n], timer, ceilings, quick=args.quick))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{n}: done", file=sys.stderr, flush=True)
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"floors-{slug(name)}"
        if args.flush != "write":
            stem += f"-{args.flush}-flush"
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
