"""``index_counts``: row ``r`` of ``indices`` is only its first ``clamp(index_counts[r], 0, W)`` entries.

vLLM hands its selection over as one ``[rows, W + 1]`` int32 buffer: each row's valid tokens first, then
padding (anything, valid-looking tokens included), and the row's count in the last column. qsa serves it
with no copy: ``indices = buf[:, :W]``, ``index_counts = buf[:, W]``. Here the padding is poison: tokens
each row could keep, whose K/V slots hold NaN (byte 0x7F in an FP8 cache), and junk values. On every route
(and cache dtype) a counted call must give the bits of the same route on a compact copy (-1 past each
count), agree with the fp64 reference and come back finite; under the interpreter every index load is
also watched, and none may touch an entry past its row's count (a masked load, not a load then a mask).
The known-wrong variant, the same buffer without its counts, reads the poison: NaN, and loads caught.
"""

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

import qsa
import qsa.attention.planning.plan
import qsa.settings
from helpers import ascending_rows, assert_bitwise, check_against_reference, make_attention_case, poisoned, slow
from qsa.attention import api, replay
from qsa.attention.planning.plan import plan_groups, plan_single_rows, token_lists
from qsa.attention.planning.reference import compare_plans
from qsa.attention.reference import kept_tokens, reference_attention
from qsa.backend import interpreter_enabled

W = 24
RAW_COUNTS = [7, 13, 0, W, -3, W + 5, 5, 17, 1, 11]
"""A count per row of the 10-row cases: rows 0-1 are padding rows; rows 2-5 hold 0, W, a negative count and
one past W (clamped to 0, W, 0, W)."""
JUNK = [2**31 - 1, -7, 10**6]


@dataclasses.dataclass
class Counted:
    """A case served as vLLM serves it, and its compact twin.

    Attributes:
        case: the rows with ``indices = buf[:, :W]`` (a view of row stride ``W + 1``).
        counts: ``buf[:, W]``, the raw counts (a ``[rows]`` view of stride ``W + 1``).
        compact: the same rows with -1 past each count (no counts needed).
        buf: the ``[rows, W + 1]`` buffer; eff: the clamped counts (numpy).
    """

    case: object
    counts: torch.Tensor
    compact: object
    buf: torch.Tensor
    eff: np.ndarray


def counted_case(device, kv="auto", seed=1, sort=False, raw_counts=RAW_COUNTS, **kw) -> Counted:
    """10 rows of ``W`` messy entries (``make_attention_case``), each cut at its count of ``raw_counts``;
    ``sort``: each row's first entries ascending and distinct, -1 after them (as ``select_tokens`` emits).
    Past the count: tokens the row could keep whose slots no row keeps (poisoned in K and V), and junk."""
    case = make_attention_case(rows=10, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=W,
                               kv_cache_dtype=kv, seed=seed, device=device, **kw)
    rows = case.q.shape[0]
    eff = np.clip(np.array(raw_counts[:rows]), 0, W)
    compact = case.indices.clone().cpu()
    for r in range(rows):
        if sort:
            compact[r, :eff[r]] = ascending_rows(compact[r:r + 1, :eff[r]])[0]
        compact[r, eff[r]:] = -1
    bs, nb = case.cache.block_size, case.cache.num_blocks
    table, lens = case.block_table.tolist(), case.seq_lens.tolist()
    reqs, pos = case.token_to_req.tolist(), case.positions.tolist()

    def slot(req, t):
        return table[req][t // bs], t % bs

    used = {slot(reqs[r], t) for r in range(rows)
            for t in kept_tokens(compact[r].tolist(), reqs[r], pos[r], lens, table, bs, nb)}
    buf = torch.full((rows, W + 1), -1, dtype=torch.int32)
    buf[:, :W] = compact
    poison = set()
    for r in range(rows):
        cands = []
        if 0 <= reqs[r] < len(lens) and pos[r] >= 0:
            cands = [t for t in kept_tokens(range(pos[r] + 1), reqs[r], pos[r], lens, table, bs, nb)
                     if slot(reqs[r], t) not in used]
        fill = [cands[i % len(cands)] if cands and i % 4 != 3 else JUNK[i % 3] for i in range(W - eff[r])]
        buf[r, eff[r]:W] = torch.tensor(fill, dtype=torch.int32)
        poison |= {slot(reqs[r], t) for t in cands}
    buf[:, W] = torch.tensor(raw_counts[:rows], dtype=torch.int32)
    bad = float("nan") if kv == "auto" else 0x7F  # an E4M3 NaN
    for page, off in poison:
        case.cache.k[page, off] = bad
        case.cache.v[page, off] = bad
    buf = buf.to(device)
    return Counted(dataclasses.replace(case, indices=buf[:, :W]), buf[:, W],
                   dataclasses.replace(case, indices=compact.to(device)), buf, eff)


@contextlib.contextmanager
def watched_loads(c: Counted):
    """Yield a list that collects every load (under the interpreter) of an entry of ``c.buf`` past its row's
    count, as ``(row, column)`` pairs; off the interpreter it stays empty."""
    seen = []
    if not interpreter_enabled():
        yield seen
        return
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    load = builder.create_masked_load
    base = c.buf.data_ptr()
    end = base + c.buf.numel() * c.buf.element_size()
    eff = c.eff

    def spy(ptrs, mask, other, *args):
        addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)].astype(np.uint64)
        addr = addr[(addr >= base) & (addr < end)]
        if addr.size:
            off = (addr - np.uint64(base)) // np.uint64(4)
            row, col = (off // np.uint64(W + 1)).astype(np.int64), (off % np.uint64(W + 1)).astype(np.int64)
            past = (col < W) & (col >= eff[row])
            seen.extend(zip(row[past].tolist(), col[past].tolist()))
        return load(ptrs, mask, other, *args)

    builder.create_masked_load = spy
    try:
        yield seen
    finally:
        del builder.create_masked_load


ROUTES = {  # name: (route, rows_sorted)
    "auto": ("auto", False),
    "grouped": ("grouped", False),
    "xqa": ("xqa", False),
    "xqa-direct": ("xqa", True),  # 10 sorted rows: planned in the kernel, straight from indices
    "splitk": ("splitk", False),
    "invariant": ("invariant", False),
    "reference": ("reference", False),
}


def call(case, name, **kw):
    route, rows_sorted = ROUTES[name]
    return case.run(qsa.sparse_paged_attention, route=route, rows_sorted=rows_sorted, return_lse=True,
                    out=poisoned(case.q.shape, case.q.dtype, case.q.device), **kw)


@pytest.mark.parametrize("name,kv", [(name, "auto") for name in ROUTES]
                         + [(name, "fp8_e4m3") if name == "auto" else slow(name, "fp8_e4m3") for name in ROUTES])
def test_every_route_reads_only_each_rows_count(device, name, kv):
    """Counted: the compact copy's bits, finite, within the reference's tolerance, no load past a count.
    Without the counts (fp16 cache): NaN, and loads past the counts seen."""
    c = counted_case(device, kv, sort=name == "xqa-direct", with_gate=name == "auto")
    with watched_loads(c) as seen:
        got = call(c.case, name, index_counts=c.counts)
    assert seen == [], f"{name}: entries past the count were loaded, e.g. (row, column) {seen[:4]}"
    assert torch.isfinite(got[0]).all(), f"{name}: poison reached the output"
    assert_bitwise(got, call(c.compact, name), f"{name} with counts vs the compact copy")
    check_against_reference(c.compact, got, name=f"{name} with counts")
    if kv == "auto":
        # The known-wrong variant: the same buffer without its counts reads the poison.
        with watched_loads(c) as seen:
            wrong = call(c.case, name)
        assert not torch.isfinite(wrong[0]).all(), f"{name}: the poison past the counts was never attended"
        assert seen or name == "reference" or not interpreter_enabled(), "the load watch saw nothing"


def _direct(case, counts, config, splits):
    out, lse = torch.full_like(case.q, float("nan")), torch.full(case.q.shape[:2], float("nan"))
    c = case.cache
    fp8 = c.kv_cache_dtype == "fp8_e4m3"
    k, v = (c.k.view(torch.uint8), c.v.view(torch.uint8)) if fp8 else (c.k, c.v)
    qsa.attention.xqa.launch.xqa_direct_attention(
        case.q, k, v, case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
        row_start=0, out=out, lse=lse, gate=None, softmax_scale=0.25, k_scale=c.k_scale, v_scale=c.v_scale,
        kv_fp8=fp8, config=config, num_splits=splits, index_counts=counts)
    return out, lse


def _invariant(case, counts, fold):
    out, lse = torch.full_like(case.q, float("nan")), torch.full(case.q.shape[:2], float("nan"))
    c = case.cache
    cfg = qsa.settings.InvariantConfig(tile_tokens=16, split_tiles=1, num_warps=4, num_stages=2)
    qsa.attention.invariant.launch.invariant_attention(
        case.q, c.k, c.v, case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
        out=out, lse=lse, gate=None, softmax_scale=0.25, k_scale=1.0, v_scale=1.0, kv_fp8=False, config=cfg,
        fold=fold, index_counts=counts)
    return out, lse


@pytest.mark.parametrize("sort", [True, False])
def test_direct_and_invariant_kernel_variants(device, sort):
    """The kernels that read ``indices`` themselves, in their other forms over 16-token tiles (W = 24: two
    tiles): direct xqa reading tile by tile with the prefetch, its splits resolved before the loop, the
    deferred row check over two splits (whose merge re-sorts a row out of order); the invariant route
    folding in one program and per split with a merge. Rows ascending, or as drawn (sorted in the kernel).
    Each: the compact copy's bits, no load past a count."""
    c = counted_case(device, sort=sort, seed=3)
    cfg = qsa.settings.SplitConfig
    variants = [("prefetch", cfg(tile_tokens=16, num_warps=4, num_stages=2, prefetch=True), 1),
                ("resolved", cfg(tile_tokens=16, num_warps=4, num_stages=2, resolve_split=True), 2),
                ("deferred", cfg(tile_tokens=16, num_warps=4, num_stages=2, resolve_split=True, defer_check=True), 2)]
    for what, config, splits in variants:
        with watched_loads(c) as seen:
            got = _direct(c.case, c.counts, config, splits)
        assert seen == [], (what, seen[:4])
        assert torch.isfinite(got[0]).all(), what
        assert_bitwise(got, _direct(c.compact, None, config, splits), f"direct, {what}")
    for fold in (True, False):
        with watched_loads(c) as seen:
            got = _invariant(c.case, c.counts, fold)
        assert seen == [], (fold, seen[:4])
        assert_bitwise(got, _invariant(c.compact, None, fold), f"invariant, fold={fold}")


@pytest.mark.parametrize("sort", [True, False])
def test_planners_in_every_form(device, sort, monkeypatch):
    """The planners are the first readers of ``indices`` on the grouped, planned xqa and splitk routes (whose
    default forms on the CPU the route test runs). In their other forms too the plan with counts is the
    compact copy's, and no load touches an entry past a count: the row planner in steps of 16 (the
    streaming scan and the sorting planner, the scan-free steps, a row sorted in its own program), the
    token lists in steps of 16, the grouped planner with the sector summary and the table checked late,
    and over its byte map."""
    c = counted_case(device, sort=sort, seed=5)
    inputs, compact = c.case.plan_inputs(), c.compact.plan_inputs()
    with watched_loads(c) as seen:
        for steps, hint in ((False, False), (True, False), (True, True)):
            kw = dict(chunk=16, ascending_steps=steps, rows_sorted=hint)
            got = plan_single_rows(**inputs, **kw, index_counts=c.counts)
            assert compare_plans(got, plan_single_rows(**compact, **kw)) == [], kw
        for cfg in (qsa.settings.PLANNER, qsa.settings.PLANNER_MAP):
            got = plan_groups(**inputs, config=cfg, index_counts=c.counts)
            assert compare_plans(got, plan_groups(**compact, config=cfg)) == [], cfg
        monkeypatch.setattr(qsa.attention.planning.plan, "row_plan_chunk", lambda *a, **kw: 16)
        tokens, counts = token_lists(**inputs, index_counts=c.counts)
        want_tokens, want_counts = token_lists(**compact)
    assert seen == [], seen[:4]
    assert torch.equal(counts, want_counts)
    for r, n in enumerate(want_counts.tolist()):
        assert torch.equal(tokens[r, :n], want_tokens[r, :n]), r


def test_the_reference_reads_each_rows_count():
    c = counted_case("cpu", seed=7)
    for dtype in (torch.float64, torch.float16):
        got = c.case.run(reference_attention, compute_dtype=dtype, index_counts=c.counts)
        want = c.compact.run(reference_attention, compute_dtype=dtype)
        assert_bitwise(got, want, f"reference {dtype}")
        assert torch.isfinite(got[0]).all()
    assert not torch.isfinite(c.case.run(reference_attention)[0]).all(), "the poison is never reached without counts"


def test_the_plan_records_the_counts(device):
    """The plan holds ``index_counts`` (``plan.inputs.index_counts``) and watches it: a count changed in place
    after planning is refused by name; planned again into the plan, the new counts are read."""
    c = counted_case(device, seed=9)
    counts = c.counts.clone()  # a tensor of its own, so that its own version counter moves
    cache = c.case.cache
    shape = dict(block_size=cache.block_size, num_blocks=cache.num_blocks, num_q_heads=2, num_kv_heads=1,
                 head_dim=16)
    plan = qsa.plan_attention(c.case.indices, c.case.block_table, c.case.token_to_req, c.case.positions,
                              c.case.seq_lens, route="xqa", index_counts=counts, **shape)
    assert plan.inputs.index_counts is counts and plan.inputs.counts_version == counts._version
    assert len(plan.inputs) == 5  # iterates as the five planner inputs, as before
    run = lambda: qsa.run_attention(plan, c.case.q, cache.k, cache.v, kv_cache_dtype=cache.kv_cache_dtype)  # noqa: E731
    want = c.compact.run(qsa.sparse_paged_attention, route="xqa")
    assert torch.equal(run(), want)
    counts.add_(0)
    with pytest.raises(ValueError, match="plan's index_counts was modified in place"):
        run()
    counts.fill_(W)  # every row whole: the poison is read
    qsa.plan_attention(c.case.indices, c.case.block_table, c.case.token_to_req, c.case.positions, c.case.seq_lens,
                       route="xqa", index_counts=counts, out=plan, **shape)
    assert not torch.isfinite(run()).all()


@pytest.mark.parametrize("name", ["xqa-direct", "splitk"])
def test_a_replay_takes_the_new_counts(device, name, monkeypatch):
    """A recorded eager step (``qsa.attention.replay``) binds ``index_counts`` like every input: a second call
    with new tensors of the same shapes (every input at a new address, other counts and other poison)
    replays with its own counts and gives the compact copy's bits; a call without counts is another
    fingerprint."""
    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    monkeypatch.setattr(qsa.settings, "REPLAY_STEPS", True)
    api._STEPS.clear()
    sort = name == "xqa-direct"
    first = counted_case(device, seed=11, sort=sort)
    call(first.case, name, index_counts=first.counts)
    assert [type(e) for e in api._STEPS.entries.values()] == [replay.Replay]
    second = counted_case(device, seed=11, sort=sort, raw_counts=RAW_COUNTS[3:] + RAW_COUNTS[:3])
    with watched_loads(second) as seen:
        got = call(second.case, name, index_counts=second.counts)
    assert api._STEPS.hits == 1, "the second call was not replayed"
    assert seen == [], seen[:4]
    assert torch.isfinite(got[0]).all()
    assert_bitwise(got, call(second.compact, name), "replay vs the compact copy")
    assert len(api._STEPS.entries) == 2  # the compact call (no counts) is a fingerprint of its own


def test_counts_of_any_stride(device):
    """One count for every row (an expanded tensor, stride 0) is a ``[rows]`` tensor like any other."""
    c = counted_case(device, seed=13)
    rows = c.case.q.shape[0]
    five = torch.full((1,), 5, dtype=torch.int32, device=device).expand(rows)
    cut = c.compact.indices.clone()
    cut[:, 5:] = -1
    assert_bitwise(call(c.compact, "splitk", index_counts=five),
                   call(dataclasses.replace(c.compact, indices=cut), "splitk"), "counts of stride 0")


def test_bad_index_counts_are_named(device):
    c = counted_case(device, seed=13)
    case = c.case
    rows = case.q.shape[0]
    bad = [(c.counts.long(), TypeError, "index_counts must have dtype int32, got int64"),
           (c.counts.tolist(), TypeError, "index_counts must be a torch.Tensor"),
           (c.counts[:-1], ValueError, rf"index_counts must have shape \[{rows}\]"),
           (c.buf[:, W:], ValueError, r"index_counts must be 1-D \[rows\] int32"),
           (torch.zeros(rows, dtype=torch.int32, device="meta"), ValueError, "index_counts must be on")]
    cache = case.cache
    shape = dict(block_size=cache.block_size, num_blocks=cache.num_blocks, num_q_heads=2, num_kv_heads=1,
                 head_dim=16)
    for value, err, msg in bad:
        with pytest.raises(err, match=msg):
            case.run(qsa.sparse_paged_attention, index_counts=value)
        with pytest.raises(err, match=msg):
            qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                               index_counts=value, **shape)
    for value, err in ((c.counts.float(), TypeError), (c.counts[:-1], ValueError)):
        with pytest.raises(err, match="index_counts"):
            case.run(reference_attention, index_counts=value)
