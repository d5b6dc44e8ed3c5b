"""The direct xqa kernel (each row's list built inside the attention kernel from ``indices``): exact
against the references on sorted rows (its fast path) and on any other rows (its in-kernel sort),
bitwise the same for both orders and under page moves, and chosen only where admission says."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import qsa
import qsa.attention.kernels
import qsa.attention.launch
import qsa.attention.routing
import qsa.attention.xqa.kernel
import qsa.attention.xqa.launch
import qsa.settings
import qsa.utils
from qsa.cache.paged import random_mapping
from qsa.attention.kernels import attend_tile_halves
from helpers import ascending_rows, assert_bitwise, check_against_reference, make_attention_case, slow



def run_direct(case, *, splits=1, scratch=None, indices=None, prefetch=False, resolve_split=False, defer_check=False,
               qk_halves=False, config=None, **kw):
    c = case.cache
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32)
    k, v = (c.k.view(torch.uint8), c.v.view(torch.uint8)) if c.kv_cache_dtype == "fp8_e4m3" else (c.k, c.v)
    qsa.attention.xqa.launch.xqa_direct_attention(
        case.q, k, v, case.indices if indices is None else indices, case.block_table, case.token_to_req,
        case.positions, case.seq_lens, row_start=0, out=out, lse=lse, gate=case.gate,
        softmax_scale=case.q.shape[2] ** -0.5, k_scale=c.k_scale, v_scale=c.v_scale,
        kv_fp8=c.kv_cache_dtype == "fp8_e4m3", num_splits=splits, scratch=scratch,
        config=config or qsa.settings.SplitConfig(tile_tokens=16, num_warps=4, num_stages=2, prefetch=prefetch,
                                            resolve_split=resolve_split or defer_check, defer_check=defer_check,
                                            qk_halves=qk_halves),
        **kw)
    return out, lse


def check(case, got):
    check_against_reference(case, got, "xqa-direct")


@pytest.mark.parametrize("order,dtype,kv_cache_dtype", [
    ("sorted", torch.float16, "auto"), slow("sorted", torch.bfloat16, "auto"), ("sorted", torch.float16, "fp8_e4m3"),
    slow("as-given", torch.float16, "auto"), slow("as-given", torch.bfloat16, "auto"),
    slow("as-given", torch.float16, "fp8_e4m3")])
def test_direct_matches_reference(order, dtype, kv_cache_dtype):
    """Messy rows (duplicates, -1, tokens past the position, the length and the table, table entries -1
    and past the cache, padding rows), as given and sorted; splits merged."""
    case = make_attention_case(rows=7, num_reqs=3, num_q_heads=6, num_kv_heads=2, head_dim=32, width=40,
                               max_seq_len=150, dtype=dtype, kv_cache_dtype=kv_cache_dtype, with_gate=True,
                               seed=21)
    if order == "sorted":
        case.indices = ascending_rows(case.indices)
    for splits in (1, 3):
        check(case, run_direct(case, splits=splits))
    check(case, run_direct(case, splits=3, defer_check=True))


@pytest.mark.parametrize("dtype,kv_cache_dtype", [slow(torch.float16, "auto"),
                                                  slow(torch.bfloat16, "auto"),
                                                  (torch.float16, "fp8_e4m3")])
def test_direct_score_halves_match_reference(dtype, kv_cache_dtype):
    """``qk_halves`` (K/V as four tiles of half the head, the scores summed from two products): the messy
    rows above, as given and sorted, splits merged, with and without the deferred check."""
    case = make_attention_case(rows=5, num_reqs=3, num_q_heads=4, num_kv_heads=2, head_dim=32, width=40,
                               max_seq_len=150, dtype=dtype, kv_cache_dtype=kv_cache_dtype, with_gate=True,
                               seed=27)
    check(case, run_direct(case, splits=1, qk_halves=True))
    check(case, run_direct(case, splits=3, qk_halves=True, resolve_split=True))
    case.indices = ascending_rows(case.indices)
    check(case, run_direct(case, splits=3, qk_halves=True, defer_check=True))


@triton.jit
def _one_half_twice(b_q0, b_q1, o_ktok, o_vtok, m_load, m_attend, k_ptr, v_ptr, o_h, b_m, b_l, b_acc0, b_acc1,
                    qk_scale, KV_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Known-wrong ``attend_tile_halves``: the first column half of the query stands in for both."""
    return attend_tile_halves(b_q0, b_q0, o_ktok, o_vtok, m_load, m_attend, k_ptr, v_ptr, o_h, b_m, b_l, b_acc0,
                              b_acc1, qk_scale, KV_FP8, DOT_DTYPE)


def test_direct_score_halves_check_rejects_one_half_twice(monkeypatch):
    """The reference check above rejects scores that take one column half of the query twice."""
    import qsa

    monkeypatch.setattr(qsa.attention.kernels, "attend_tile_halves", _one_half_twice)
    case = make_attention_case(rows=7, num_reqs=3, num_q_heads=6, num_kv_heads=2, head_dim=32, width=40,
                               max_seq_len=150, with_gate=True, seed=27)
    with pytest.raises(AssertionError):
        check(case, run_direct(case, splits=1, qk_halves=True))


def test_sorted_rows_take_the_fast_path():
    """The scratch rows of sorted rows are never written; those of other rows hold their sorted lists.
    (A kernel that always sorted would write every row; one that never did would miscount duplicates.)"""
    case = make_attention_case(rows=8, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=24,
                               max_seq_len=100, padding_rows=0, seed=22)
    idx = ascending_rows(case.indices)
    unsorted = [1, 4]
    for r in unsorted:
        idx[r] = idx[r].flip(0)
    scratch = torch.full((8, 32), -7, dtype=torch.int32)
    got = run_direct(case, indices=idx, scratch=scratch)
    case.indices = idx
    check(case, got)
    for r in range(8):
        touched = bool((scratch[r] != -7).any())
        assert touched == (r in unsorted), (r, scratch[r])



def row_check_reference(case, idx):
    """The row check as defined (``_direct_row_list``): with key t for a token ``_table_safe`` keeps
    (valid row, 0 <= t <= pos, block inside the table) and INT32_MAX for any other entry, a row ascends
    when every key after the first exceeds the one before it or is INT32_MAX."""
    big = 2 ** 31 - 1
    limit = case.block_table.shape[1] * case.cache.block_size
    verdicts = []
    for r in range(idx.shape[0]):
        req, pos = int(case.token_to_req[r]), int(case.positions[r])
        ok = 0 <= req < case.seq_lens.shape[0] and pos >= 0
        keys = [t if ok and 0 <= t <= pos and t < limit else big for t in idx[r].tolist()]
        verdicts.append(all(b == big or a < b for a, b in zip(keys, keys[1:])))
    return verdicts


@pytest.mark.parametrize("defer_check", [False, True])
def test_row_check_verdict_matches_its_definition(defer_check):
    """Rows built at the edges of the check: an adjacent duplicate, a dropped entry (negative, past the
    position, past the table) before kept ones or only at the end, a padding row in any order. A row
    is sorted in the kernel (its scratch row written) exactly when the defined check fails, and the
    outputs match the reference either way; with ``defer_check`` the splits check their own positions
    and the merge sorts the row. (Checks that accept duplicates, compare signed or skip the table bound
    give other verdicts here.)"""
    case = make_attention_case(rows=10, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=12,
                               max_seq_len=90, padding_rows=1, seed=23)
    limit = case.block_table.shape[1] * case.cache.block_size
    case.positions[4] = limit + 8  # a position past the table's end: its bound drops what pos keeps
    idx = torch.full((10, 12), -1, dtype=torch.int32)
    for r in range(10):
        pos = max(int(case.positions[r]), 11)
        base = list(range(pos - 10, pos + 1, 2)) if r != 4 else [1, 3, 5]  # kept when the row is valid
        padding = not 0 <= int(case.token_to_req[r]) < case.seq_lens.shape[0]
        rows = {1: base[:2] + [base[1]] + base[2:],  # adjacent duplicate
                2: [-3] + base,  # dropped (negative) before kept
                3: base[:2] + [pos + 2] + base[2:],  # dropped (past the position) before kept
                4: base + [limit + 5, limit + 3],  # past the table, below the position: dropped, at the end
                5: base + [pos + 1, limit + 1, -2],  # dropped entries only at the end
                6: base[::-1],  # descending
                7: base[:2] + [limit + 1] + base[2:],  # dropped (past the table and the position) before kept
                8: [pos + 1] + base[:1]}.get(r, base)  # dropped first, then one kept
        if padding:
            rows = base[::-1]  # a padding row keeps nothing, in any order
        idx[r, :len(rows)] = torch.tensor(rows[:12], dtype=torch.int32)
    verdicts = row_check_reference(case, idx)
    assert not all(verdicts) and any(verdicts), verdicts
    scratch = torch.full((10, 16), -7, dtype=torch.int32)
    got = run_direct(case, indices=idx, scratch=scratch, splits=2, defer_check=defer_check)
    case.indices = idx
    check(case, got)
    for r in range(10):
        assert bool((scratch[r] != -7).any()) == (not verdicts[r]), (r, idx[r], verdicts[r], scratch[r])

@pytest.mark.parametrize("splits,defer_check", [(1, False), (3, False), (3, True)])
def test_position_token_repeated_is_attended_once(splits, defer_check):
    """Rows that repeat the token at their own position (the last one a row keeps): ``[pos, pos, ...]``,
    ``[pos, -1, pos]``, ``[..., pos, pos]``, also past a split boundary. The row check's bound must keep
    the position token, so that such a row fails the check and is sorted (its duplicate dropped):
    attended twice, the LSE moves by ln 2."""
    case = make_attention_case(rows=6, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=40,
                               max_seq_len=120, messy=False, padding_rows=0, seed=29)
    lens = case.seq_lens.tolist()
    long_req = max(range(len(lens)), key=lambda q: lens[q])
    assert lens[long_req] >= 48, lens
    idx = torch.full((6, 40), -1, dtype=torch.int32)
    for r in range(6):
        case.token_to_req[r] = long_req
        case.positions[r] = pos = lens[long_req] - 1 - 2 * r
        below = list(range(pos - 35, pos))
        rows = {0: [pos, pos], 1: [pos, -1, pos], 2: below[-10:] + [pos, pos], 3: below[:20] + [pos] * 3,
                4: below[:18] + [pos, -1, pos], 5: below + [pos]}[r]
        idx[r, :len(rows)] = torch.tensor(rows[:40], dtype=torch.int32)
    case.indices = idx
    check(case, run_direct(case, splits=splits, defer_check=defer_check))


def split_boundary_case(head_dim=16):
    """6 rows of 64 kept tokens (16-token tiles: with 2 or 4 splits, splits begin at positions 16, 32, 48),
    ascending as ``select_tokens`` emits them except rows 1-3, which break the order only between
    positions 31 and 32: two tokens swapped, a duplicate, a dropped entry before a kept one."""
    case = make_attention_case(rows=6, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=head_dim, width=64,
                               max_seq_len=300, messy=False, padding_rows=0, seed=31)
    g = torch.Generator().manual_seed(32)
    lens = case.seq_lens.tolist()
    long_req = max(range(len(lens)), key=lambda r: lens[r])
    assert lens[long_req] >= 80, lens
    idx = torch.empty((6, 64), dtype=torch.int32)
    for r in range(6):
        case.token_to_req[r] = long_req
        case.positions[r] = lens[long_req] - 1 - r
        idx[r] = torch.randperm(int(case.positions[r]) + 1, generator=g)[:64].sort().values.to(torch.int32)
    sorted_idx = idx.clone()
    idx[1, 31], idx[1, 32] = sorted_idx[1, 32], sorted_idx[1, 31]
    idx[2, 32] = idx[2, 31]
    sorted_idx[2] = ascending_rows(idx[2:3])[0]
    idx[3, 31] = int(case.positions[3]) + 1  # dropped (past the position), before kept entries
    sorted_idx[3] = ascending_rows(torch.where(idx[3:4] > case.positions[3], -1, idx[3:4]))[0]
    case.indices = idx
    return case, sorted_idx


@pytest.mark.parametrize("splits,qk_halves", [slow(2, False), (4, False), (2, True)])
def test_deferred_check_sees_the_split_boundaries(splits, qk_halves):
    """With the deferred check each split compares its first entry with the last of the split before.
    Rows out of order only across that boundary are sorted by the merge (their scratch rows written, no
    other), and every output is bitwise the same as for the sorted rows and as without the deferral
    (also with the scores over column halves, which the merge's recompute must follow)."""
    case, sorted_idx = split_boundary_case(head_dim=32 if qk_halves else 16)
    scratch = torch.full((6, 64), -7, dtype=torch.int32)
    kw = dict(splits=splits, qk_halves=qk_halves)
    got = run_direct(case, defer_check=True, scratch=scratch, **kw)
    check(case, got)
    assert [bool((scratch[r] != -7).any()) for r in range(6)] == [False, True, True, True, False, False]
    assert_bitwise(got, run_direct(case, resolve_split=True, **kw), "deferred vs whole-row check")
    assert_bitwise(got, run_direct(case, defer_check=True, indices=sorted_idx, **kw), "sorted rows")


@triton.jit
def _split_inner_pairs_only(b_t, u_prev, o_pos, n_pos, u_lim):
    """Known-wrong ``split_ascends``: skips the split's first position (the pair across the boundary)."""
    m_in = (o_pos >= 1) & (o_pos < n_pos) & (o_pos > tl.min(o_pos, 0))
    u_t = b_t.to(tl.uint32, bitcast=True)
    return tl.min((~m_in | (u_t >= u_lim) | (u_prev < u_t)).to(tl.int32), 0) != 0


def test_deferred_merge_by_column_blocks(monkeypatch):
    """The deferred merge with two column programs per head (``merge_config``), on rows out of order across
    a split boundary (each column program recomputes the row and stores the same partials): bitwise the
    same as one program per head."""
    case, _ = split_boundary_case()
    whole = run_direct(case, splits=2, defer_check=True)
    monkeypatch.setattr(qsa.attention.launch, "merge_config", lambda splits, d, xqa_lists=None: (d // 2, 2))
    assert_bitwise(whole, run_direct(case, splits=2, defer_check=True), "two column programs per head")


def test_deferred_merge_leaves_the_direct_partials(monkeypatch):
    """The deferred merge recomputes a row out of order into partials of its own: the direct kernel's
    partials, which every column program of a head reads to decide whether to recompute, are the same
    bits after the merge as before it. (Rewritten in place, a column program that loads after another
    has rewritten some splits on the GPU merges a mix of old and recomputed ones; the interpreter runs
    the programs one after another, so this is what the test can see.)"""
    import qsa

    case, _ = split_boundary_case()
    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(part_acc, part_ml, *args, **kw):
                before = (part_acc.clone(), part_ml.clone())
                self.kernel[grid](part_acc, part_ml, *args, **kw)
                seen.append((grid[2], before, (part_acc, part_ml), args[:2]))
            return launch

    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_direct_merge_kernel", Spy(qsa.attention.xqa.kernel.xqa_direct_merge_kernel))
    monkeypatch.setattr(qsa.attention.launch, "merge_config", lambda splits, d, xqa_lists=None: (d // 2, 2))
    check(case, run_direct(case, splits=2, defer_check=True))
    (columns, before, after, redo), = seen
    assert columns == 2
    for name, old, new in zip(("part_acc", "part_ml"), before, after):
        assert torch.equal(old.view(torch.int32), new.view(torch.int32)), f"the merge rewrote {name}"
    # Rows out of order were recomputed into the redo partials, with positive sums for every head.
    assert (redo[1][1:4, :, :, 1] >= 0).all() and not (before[1][1:4, :, :, 1] >= 0).all()


def test_deferred_check_without_the_boundary_is_caught(monkeypatch):
    """The test above rejects a split check that skips the boundary."""
    import qsa

    for module in (qsa.attention.kernels, qsa.attention.xqa.kernel):  # the deferred check and the row list
        monkeypatch.setattr(module, "split_ascends", _split_inner_pairs_only)
    with pytest.raises(AssertionError):
        test_deferred_check_sees_the_split_boundaries(2, False)


def mixed_order_case(seed, shuffled):
    """9 rows of 44 indices, sorted as ``select_tokens`` emits them except rows ``shuffled``."""
    case = make_attention_case(rows=9, num_reqs=3, num_q_heads=4, num_kv_heads=1, head_dim=16, width=44,
                               max_seq_len=140, padding_rows=1, seed=seed)
    idx = ascending_rows(case.indices)
    for r in shuffled:
        idx[r] = idx[r][torch.randperm(44, generator=torch.Generator().manual_seed(r))]
    case.indices = idx
    return case


def test_direct_prefetch_rechecks_the_first_tile():
    """With the prefetch, each split's first tile is read from the row as given while the row is
    checked; rows found out of order read it again from their sorted list. Sorted and shuffled rows in
    one batch: exact, and bitwise the same as without the prefetch."""
    case = mixed_order_case(25, (2, 5, 6))
    for splits in (1, 3):
        got = run_direct(case, splits=splits, prefetch=True)
        check(case, got)
        assert_bitwise(got, run_direct(case, splits=splits), f"prefetch vs none, {splits} splits")


@pytest.mark.parametrize("splits", [1, 2, slow(3), slow(4)])
def test_direct_split_entries_resolved_before_the_loop(splits):
    """With ``resolve_split`` each program reads all of its split's tokens and pages before its loop (from
    the row as given, again from the sorted list for rows out of order) and takes each tile's from
    registers: exact on messy rows, sorted and shuffled in one batch, and bitwise the same as the
    tile-by-tile loads."""
    case = mixed_order_case(26, (1, 4, 8))
    got = run_direct(case, splits=splits, resolve_split=True)
    check(case, got)
    assert_bitwise(got, run_direct(case, splits=splits), f"resolved vs tile by tile, {splits} splits")


def test_direct_drops_tokens_past_the_length_below_the_position():
    """Rows whose position lies past their request's length (``t <= pos`` keeps tokens that ``t <
    seq_len`` drops): the direct kernel reads their table entries before the length is known and must
    drop them before any K/V load (their cache slots hold NaN). Exact, sorted and shuffled, resolved
    and tile by tile, with the plan entries loaded a tile ahead, and bitwise the same for both orders."""
    case = make_attention_case(rows=5, num_reqs=3, num_q_heads=2, num_kv_heads=1, head_dim=16, width=44,
                               max_seq_len=140, padding_rows=1, seed=29)
    idx, pos = case.indices.clone(), case.positions.clone()
    for r in (2, 3, 4):  # a row of each request
        n = int(case.seq_lens[int(case.token_to_req[r])])
        pos[r] = n + 6
        past = torch.arange(n, n + 7, dtype=torch.int32)
        idx[r, :7] = past  # past the length, not past the position
    case.positions = pos
    case.indices = ascending_rows(idx)
    shuffled = case.with_permuted_indices(torch.Generator().manual_seed(30))
    for splits, kw in ((1, dict()), (3, dict()), (3, dict(resolve_split=True)), (3, dict(prefetch=True))):
        got = run_direct(case, splits=splits, **kw)
        check(case, got)
        assert_bitwise(got, run_direct(shuffled, splits=splits, **kw), f"shuffled, {splits} splits, {kw}")


@pytest.mark.parametrize("qk_halves", [slow(False), True])
def test_direct_is_bitwise_deterministic(qk_halves):
    """Sorted vs shuffled rows (fast path vs in-kernel sort), repeats, and page moves: the same bits."""
    case = make_attention_case(rows=5, num_reqs=3, num_q_heads=6, num_kv_heads=1, head_dim=32, width=32,
                               max_seq_len=160, with_gate=True, seed=23)
    case.indices = ascending_rows(case.indices)
    base = run_direct(case, splits=2, qk_halves=qk_halves)
    assert_bitwise(base, run_direct(case, splits=2, qk_halves=qk_halves), "repeat")
    g = torch.Generator().manual_seed(24)
    assert_bitwise(base, run_direct(case.with_permuted_indices(g), splits=2, qk_halves=qk_halves), "shuffled rows")
    mapping = random_mapping(case.cache.num_blocks, generator=g)
    assert_bitwise(base, run_direct(case.relocated(mapping), splits=2, qk_halves=qk_halves), "relocation")
    # The deferred check: the same bits on sorted rows (checked by each split) and shuffled ones (sorted by
    # the merge), and the same as without it.
    for name, c in (("sorted", case), ("shuffled rows", case.with_permuted_indices(g)),
                    ("relocation", case.relocated(mapping))):
        assert_bitwise(base, run_direct(c, splits=2, defer_check=True, qk_halves=qk_halves),
                        f"deferred check, {name}")


def test_admission_of_the_direct_kernel():
    cpu = torch.device("cpu")
    kw = dict(G=6, head_dim=256, device=cpu, index_width=2051)
    choose = qsa.attention.routing.choose
    assert choose("xqa", rows=16, rows_sorted=True, **kw).direct
    assert choose("auto", rows=1, rows_sorted=True, **kw).direct
    assert not choose("xqa", rows=16, **kw).direct  # no hint
    assert not choose("xqa", rows=qsa.settings.DIRECT_MAX_ROWS + 1, rows_sorted=True, **kw).direct
    assert not choose("xqa", rows=4, rows_sorted=True, **{**kw, "index_width": 4097}).direct
    mixed = choose("auto", rows=69, rows_sorted=True, **kw)
    assert (mixed.route, mixed.grouped_rows, mixed.direct) == ("grouped", 64, True)
    assert not choose("auto", rows=64, rows_sorted=True, **kw).direct  # no row left to xqa
    one_request = choose("auto", rows=69, rows_sorted=True, max_query_len=69, **kw)  # a partial last group
    assert (one_request.route, one_request.grouped_rows, one_request.direct) == ("grouped", 69, False)
    assert choose("auto", rows=69, rows_sorted=True, max_query_len=68, **kw).grouped_rows == 64
    assert not choose("splitk", rows=4, rows_sorted=True, **kw).direct
    with pytest.raises(TypeError, match="rows_sorted"):
        choose("xqa", rows=4, rows_sorted=1, **kw)


def test_public_op_with_sorted_rows(monkeypatch):
    """Through plan/run: no single-row plan is built, the rows left over by grouping (two groups of 8 rows,
    the grouping threshold lowered to 16 rows) take the direct kernel at their offset, and every row
    matches the references (also with forced splits)."""
    monkeypatch.setattr(qsa.settings, "GROUPED_MIN_ROWS", 16)
    case = make_attention_case(rows=21, num_reqs=4, num_q_heads=2, num_kv_heads=1, head_dim=16, width=12,
                               seed=25)
    case.indices = ascending_rows(case.indices)
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions,
                              case.seq_lens, block_size=16, num_blocks=case.cache.num_blocks,
                              num_q_heads=2, num_kv_heads=1, head_dim=16, rows_sorted=True)
    assert plan.routes.direct and plan.single is None and plan.routes.grouped_rows == 16
    out = torch.full_like(case.q, float("nan"))
    got = case.run(qsa.sparse_paged_attention, rows_sorted=True, out=out, return_lse=True)
    check(case, got)
    small = make_attention_case(rows=7, num_reqs=2, num_q_heads=4, num_kv_heads=2, head_dim=16, width=20,
                                with_gate=True, seed=26)
    calls = []
    monkeypatch.setattr(qsa.attention.xqa.launch, "direct_split_count", lambda *a: calls.append(a) or 2)
    check(small, small.run(qsa.sparse_paged_attention, route="xqa", rows_sorted=True, return_lse=True))
    assert calls, "the direct kernel's split count was not consulted"


@pytest.mark.parametrize("shape", [
    dict(num_q_heads=12, num_kv_heads=1, head_dim=64, block_size=4, layout="separate"),
    dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=32, layout="interleaved"),
    dict(num_q_heads=2, num_kv_heads=2, head_dim=16, block_size=784, layout="interleaved"),
])
@pytest.mark.parametrize("order", ["sorted", "as-given"])
def test_direct_shapes_layouts_and_block_sizes(shape, order):
    case = make_attention_case(rows=11, num_reqs=2, width=20, max_seq_len=120, seed=27, **shape)
    if order == "sorted":
        case.indices = ascending_rows(case.indices)
    out = torch.full_like(case.q, float("nan"))
    got = case.run(qsa.sparse_paged_attention, route="xqa", rows_sorted=True, out=out, return_lse=True)
    check(case, got)


@pytest.mark.parametrize("width", [0, 1, 3])
def test_direct_narrow_rows(width):
    """Index rows narrower than a tile (and empty): padding lanes of the row load are never kept."""
    case = make_attention_case(rows=6, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=max(width, 1),
                               seed=28)
    case.indices = ascending_rows(case.indices)[:, :width].contiguous()
    got = case.run(qsa.sparse_paged_attention, route="xqa", rows_sorted=True, return_lse=True)
    check(case, got)


def test_direct_split_count_leaves_no_split_empty(monkeypatch):
    """On a 132-SM GPU: about two programs per SM (one up to DIRECT_ALONE_LISTS lists), at most
    DIRECT_MAX_SPLITS, the most splits that fit one wave where more would put over 1/8 of a wave into a
    second one, and the fewest splits with the same most tiles per split (a 65-tile row cut 32 ways would
    leave 10 splits empty)."""
    monkeypatch.setattr(qsa.utils, "device_facts", lambda dev: dict(kind="cuda", sm_count=132))
    gpu = torch.device("cuda")
    # 5 lists: 22 splits of 3 tiles (110 programs); 8 lists: 17 of 4 (136, 4 past one per SM); 16 lists: 17
    # splits (272 programs, 8 past the wave of two per SM); 64 lists: 4 (one wave), not 5 (320)
    assert [qsa.attention.xqa.launch.direct_split_count(p, 65, 2, gpu) for p in (1, 5, 8, 9, 16, 32, 64, 128, 264)] == \
        [33, 22, 17, 22, 17, 9, 4, 2, 1]
    for programs in range(1, 300, 3):
        slots = (1 if programs <= qsa.settings.DIRECT_ALONE_LISTS else 2) * 132
        for tiles in (1, 2, 3, 17, 64, 65, 129):
            s = qsa.attention.xqa.launch.direct_split_count(programs, tiles, 2, gpu)
            per = -(-tiles // s)
            want = max(1, min(qsa.settings.DIRECT_MAX_SPLITS, tiles, -(-slots // programs))) if programs < slots else 1
            if programs <= slots and programs * want > slots + slots // 8:
                want = slots // programs
            assert 1 <= s <= want and per == -(-tiles // want) and (s - 1) * per < tiles, (programs, tiles, s)
            if programs <= slots and s * programs > slots:
                assert s * programs <= slots + slots // 8, (programs, tiles, s)


def test_direct_resolves_splits_up_to_the_cap(monkeypatch):
    """The default config resolves a split's entries before its loop where the split holds at most
    ``DIRECT_RESOLVE_MAX`` entries (a power of two), or at most ``DIRECT_RESOLVE_WAVE_MAX`` in a launch
    that fits one wave; other splits keep the tile-by-tile loads. Exact either way."""
    import qsa

    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid[2], kw["SPLIT_N"], kw["PREFETCH"]))
                return kx_kernel[grid](*args, **kw)
            return launch

    kx_kernel = qsa.attention.xqa.kernel.xqa_direct_kernel
    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_direct_kernel", Spy())
    cfg = qsa.attention.xqa.launch.xqa_direct_config(2, 16, 3)
    case = make_attention_case(rows=3, num_reqs=1, num_q_heads=2, num_kv_heads=1, head_dim=16, width=1500,
                               max_seq_len=1600, padding_rows=0, seed=27)
    case.indices = ascending_rows(case.indices)
    narrow = make_attention_case(rows=3, num_reqs=1, num_q_heads=2, num_kv_heads=1, head_dim=16, width=700,
                                 max_seq_len=900, padding_rows=0, seed=28)
    narrow.indices = ascending_rows(narrow.indices)
    for sm_count in (1, 2):  # 2 or 4 program slots for 3 lists
        monkeypatch.setattr(qsa.utils, "device_facts", lambda dev, n=sm_count: dict(kind="cuda", sm_count=n))
        for splits in (1, 2, 3):
            check(narrow, run_direct(narrow, splits=splits, config=cfg))
        check(case, run_direct(case, splits=1, config=cfg))
    # 700 entries = 22 tiles of 32: one split of 1024 is resolved only in one wave (4 slots), two of 512
    # and three of 256 always; 1500 entries (47 tiles): one split of 2048 in one wave only.
    assert seen == [(1, 0, True), (2, 512, False), (3, 256, False), (1, 0, True),
                    (1, 1024, False), (2, 512, False), (3, 256, False), (1, 2048, False)], seen


def test_direct_register_cap_and_programs_per_sm(monkeypatch):
    """The default config caps the direct kernel's registers for at most ``DIRECT_CAP_LISTS`` lists and
    for an FP8 cache, which past that cap counts three programs per SM; the launch passes the cap as
    ``maxnreg`` (and nothing otherwise), and the split count follows the programs per SM. Exact either way."""
    import qsa

    for lists in (1, 8, 16, 17, 64, 128):
        for fp8 in (False, True):
            cfg = qsa.attention.xqa.launch.xqa_direct_config(6, 256, lists, kv_fp8=fp8)
            capped = lists <= qsa.settings.DIRECT_CAP_LISTS or fp8
            assert cfg.max_registers == (qsa.settings.DIRECT_MAX_REGISTERS if capped else None), (lists, fp8)
            assert cfg.programs_per_sm == (3 if fp8 and lists > qsa.settings.DIRECT_CAP_LISTS else 2), (lists, fp8)

    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid[2], kw.get("maxnreg")))
                return kx_kernel[grid](*args, **kw)
            return launch

    kx_kernel = qsa.attention.xqa.kernel.xqa_direct_kernel
    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_direct_kernel", Spy())
    monkeypatch.setattr(qsa.utils, "device_facts", lambda dev: dict(kind="cuda", sm_count=4))
    monkeypatch.setattr(qsa.settings, "DIRECT_ALONE_LISTS", 0)  # 3 lists: the count for the config's programs per SM
    for cap_lists, kv_cache_dtype, want in ((16, "auto", (3, 168)), (1, "auto", (3, None)),
                                             (1, "fp8_e4m3", (4, 168))):
        # 3 lists of 22 tiles on 4 SMs: 3 splits at two programs per SM (9 programs on 8 slots, within
        # the one-program slack), 4 at three (12 slots).
        monkeypatch.setattr(qsa.settings, "DIRECT_CAP_LISTS", cap_lists)
        case = make_attention_case(rows=3, num_reqs=1, num_q_heads=2, num_kv_heads=1, head_dim=16, width=700,
                                   max_seq_len=900, padding_rows=0, kv_cache_dtype=kv_cache_dtype, seed=29)
        case.indices = ascending_rows(case.indices)
        seen.clear()
        check(case, run_direct(case, splits=None,
                               config=qsa.attention.xqa.launch.xqa_direct_config(2, 16, 3, kv_fp8=kv_cache_dtype != "auto")))
        assert seen == [want], (cap_lists, kv_cache_dtype, seen)


@pytest.mark.slow
def test_direct_merge_launch_settings(monkeypatch):
    """The direct kernel lets the next kernel begin launching at its start only with the deferred check;
    the deferred merge is then capped at ``DIRECT_MAX_REGISTERS`` where the direct launch fills its
    programs per SM (``qsa.attention.xqa.launch.direct_merge_registers``), so that its programs can wait beside the
    direct kernel's, and launched uncapped otherwise. Exact either way."""
    import qsa

    triggers, merges = [], []
    real_options = qsa.attention.xqa.launch.launch_options
    monkeypatch.setattr(qsa.attention.xqa.launch, "launch_options",
                        lambda dev, **kw: triggers.append(kw.get("early_trigger", True)) or real_options(dev, **kw))

    class Spy:
        def __init__(self, kernel, record):
            self.kernel, self.record = kernel, record

        def __getitem__(self, grid):
            def launch(*args, **kw):
                self.record(grid, kw)
                return self.kernel[grid](*args, **kw)
            return launch

    direct = []
    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_direct_kernel",
                        Spy(qsa.attention.xqa.kernel.xqa_direct_kernel, lambda g, kw: direct.append((g[0] * g[1] * g[2], kw["DEFER_CHECK"]))))
    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_direct_merge_kernel",
                        Spy(qsa.attention.xqa.kernel.xqa_direct_merge_kernel, lambda g, kw: merges.append(kw.get("maxnreg"))))
    case = make_attention_case(rows=3, num_reqs=1, num_q_heads=2, num_kv_heads=1, head_dim=16, width=700,
                               max_seq_len=900, padding_rows=0, seed=30)
    case.indices = ascending_rows(case.indices)
    caps = set()
    for sm_count in (1, 2, 4, 8):
        monkeypatch.setattr(qsa.utils, "device_facts", lambda dev, n=sm_count: dict(kind="cuda", sm_count=n))
        for defer, splits in ((False, None), (True, None), (True, 2)):  # 2 splits: 6 programs
            triggers.clear(), merges.clear(), direct.clear()
            config = dataclasses.replace(qsa.attention.xqa.launch.xqa_direct_config(2, 16, 3), defer_check=defer)
            check(case, run_direct(case, splits=splits, config=config))
            (programs, deferred), = direct
            assert deferred == (defer and programs > 3), (sm_count, defer, programs)  # deferred with splits
            assert triggers[0] is deferred, (sm_count, defer, triggers)  # the direct kernel's launch
            if deferred:
                want = qsa.settings.DIRECT_MAX_REGISTERS if programs >= config.programs_per_sm * sm_count else None
                assert merges == [want], (sm_count, programs, merges)
                caps.add(want)
            else:
                assert merges == []
    assert caps == {qsa.settings.DIRECT_MAX_REGISTERS, None}  # both settings were launched


def grid_spy(grids: list):
    """A wrapper class for a Triton kernel that appends each launch's grid to ``grids`` and launches it."""
    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return self.kernel[grid]
    return Spy


def whole_block_case(seed, dtype=torch.float16, kv_cache_dtype="auto", rows=5, k=9, max_seq_len=200,
                     at_end=False):
    """Rows that select whole 4-token blocks below their position (``k``, or all there are) and the tail of
    their own block (as the indexer does), ascending: the planned xqa kernel's microblock tiles then hold
    the same tokens in the same slots as the direct kernel's token tiles. ``at_end``: each row at the last
    position of its request."""
    case = make_attention_case(rows=rows, num_reqs=2, num_q_heads=6, num_kv_heads=1, head_dim=32, width=4,
                               max_seq_len=max_seq_len, messy=False, padding_rows=0, with_gate=True, dtype=dtype,
                               kv_cache_dtype=kv_cache_dtype, seed=seed)
    if at_end:
        case.positions = case.seq_lens[case.token_to_req.long()].long() - 1
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((rows, 4 * k + 4), -1, dtype=torch.int32)
    for r in range(rows):
        pos = int(case.positions[r])
        blocks = torch.randperm(pos // 4, generator=g)[:k].sort().values
        toks = (blocks[:, None] * 4 + torch.arange(4)).flatten().tolist() + list(range(pos // 4 * 4, pos + 1))
        idx[r, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
    case.indices = idx
    return case


@pytest.mark.parametrize("planned_halves,direct_halves,dtype,kv_cache_dtype", [
    (False, False, torch.float16, "auto"), (True, True, torch.float16, "auto"), (True, True, torch.bfloat16, "auto"),
    (True, True, torch.float16, "fp8_e4m3"), (False, True, torch.float16, "auto")])
def test_planned_and_direct_xqa_agree_bitwise(planned_halves, direct_halves, dtype, kv_cache_dtype):
    """The planned xqa kernel (microblock plan) and the direct kernel give a row the same bits when its
    selection is whole blocks, so the ``rows_sorted`` hint, which only picks the kernel, changes no bit:
    the scores take the same form in both (``qk_halves``). Mixed forms must differ (the known-wrong side)."""
    case = whole_block_case(33, dtype, kv_cache_dtype)
    c = case.cache
    fp8 = kv_cache_dtype == "fp8_e4m3"
    k, v = (c.k.view(torch.uint8), c.v.view(torch.uint8)) if fp8 else (c.k, c.v)
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                              block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=6, num_kv_heads=1,
                              head_dim=32, route="xqa")
    assert plan.single is not None and not plan.routes.direct
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32)
    qsa.attention.xqa.launch.xqa_attention(case.q, k, v, plan.single, row_start=0, out=out, lse=lse, gate=case.gate,
                            softmax_scale=case.q.shape[2] ** -0.5, k_scale=c.k_scale, v_scale=c.v_scale, kv_fp8=fp8,
                            config=qsa.settings.SplitConfig(tile_tokens=16, num_warps=4, num_stages=2, prefetch=True,
                                                      qk_halves=planned_halves), num_splits=1)
    check(case, (out, lse))
    # One split each: how the launches cut rows into splits is test_hint_changes_no_bit's.
    direct = run_direct(case, splits=1, resolve_split=True, qk_halves=direct_halves)
    if planned_halves == direct_halves:
        assert_bitwise((out, lse), direct, "planned vs direct xqa")
    else:
        assert not torch.equal(out, direct[0])


# 9 lists on 8 SMs: the direct kernel's two programs per SM against the planned kernel's one, rows shorter
# than the index width among them (cut by the width's tiles, not their own); 2 lists of 38 tiles on 132 SMs:
# its cap of 64 splits against 32 (at 64K, one list: 33 splits of 2 tiles against 32 of up to 3).
@pytest.mark.parametrize("rows,sm_count,k,seed,at_end", [(9, 8, 20, 41, False), slow(2, 132, 300, 47, True)])
def test_hint_changes_no_bit(rows, sm_count, k, seed, at_end, monkeypatch):
    """With and without the ``rows_sorted`` hint (direct kernel, planned kernel), a batch of whole-block
    rows gets the same bits at the split counts of a GPU (facts of a ``sm_count``-SM one): the planned
    launch of rows the direct kernel could take cuts them as the direct kernel does (``qsa.attention.xqa.launch.xqa_cut``),
    its split count over the index width's tiles, not its own over the plan's capacity. With the planned
    kernel's own rule (the known-wrong side) the launches take other split counts and the bits differ."""
    import qsa

    gpu = {"kind": "cuda", "sm_count": sm_count, "capability": (9, 0), "name": "fake"}
    monkeypatch.setattr(qsa.utils, "device_facts", lambda device: gpu)
    case = whole_block_case(seed, rows=rows, k=k, max_seq_len=10 * k, at_end=at_end)
    width = case.indices.shape[1]
    assert qsa.attention.routing.direct_admits(rows, width)
    grids = []
    Spy = grid_spy(grids)
    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_attention_kernel", Spy(qsa.attention.xqa.kernel.xqa_attention_kernel))
    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_direct_kernel", Spy(qsa.attention.xqa.kernel.xqa_direct_kernel))
    c = case.cache

    def attend(hint, indices=case.indices):
        return qsa.sparse_paged_attention(case.q, c.k, c.v, indices, case.block_table, case.token_to_req,
                                          case.positions, case.seq_lens, gate=case.gate, route="xqa",
                                          return_lse=True, rows_sorted=hint)

    planned, direct = attend(False), attend(True)
    assert len(grids) == 2 and grids[0] == grids[1], grids
    tiles = qsa.attention.launch.direct_tiles(width, qsa.attention.xqa.launch.xqa_config(6, 32).tile_tokens)
    assert grids[0][2] == qsa.attention.xqa.launch.direct_split_count(rows, tiles, qsa.attention.xqa.launch.xqa_direct_config(6, 32, rows).programs_per_sm,
                                                    case.q.device) > 1
    check(case, planned)
    assert_bitwise(planned, direct, "planned vs direct xqa")
    assert_bitwise(planned, attend(False, case.indices.flip(1)), "planned, rows reversed")
    monkeypatch.setattr(qsa.attention.xqa.launch, "xqa_cut", lambda *a: None)
    own = attend(False)
    assert grids[-1][2] != grids[0][2], grids
    check(case, own)
    assert not (torch.equal(own[0], direct[0]) and torch.equal(own[1], direct[1]))


def test_planned_and_direct_tiles_are_one_size():
    """``qsa.attention.xqa.launch.xqa_cut`` cuts planned launches as the direct kernel does only where their tiles are one
    size: the shipped settings of every shape the page4 routes take."""
    for G in (1, 2, 6, 12, 16):
        for d in qsa.attention.routing.HEAD_DIMS:
            for lists in (1, 8, 16, 64):
                for fp8 in (False, True):
                    assert qsa.attention.xqa.launch.xqa_config(G, d).tile_tokens == \
                        qsa.attention.xqa.launch.xqa_direct_config(G, d, lists, kv_fp8=fp8).tile_tokens


def test_merge_columns_by_xqa_lists():
    """``qsa.attention.launch.merge_config``: a head's columns in one program, except after an xqa launch of at most
    ``XQA_MERGE_FEW_LISTS`` lists (programs of ``XQA_MERGE_FEW_COLUMNS`` columns)."""
    assert qsa.attention.launch.merge_config(17, 256) == (256, 4)
    assert qsa.attention.launch.merge_config(17, 256, xqa_lists=1) == (128, 4)
    assert qsa.attention.launch.merge_config(17, 256, xqa_lists=qsa.settings.XQA_MERGE_FEW_LISTS) == (128, 4)
    assert qsa.attention.launch.merge_config(17, 256, xqa_lists=qsa.settings.XQA_MERGE_FEW_LISTS + 1) == (256, 4)
    assert qsa.attention.launch.merge_config(9, 128, xqa_lists=1) == (128, 4)


@pytest.mark.parametrize("few_lists", [slow(3), 2])
def test_xqa_merges_take_the_columns_of_their_lists(few_lists, monkeypatch):
    """Every xqa merge asks ``merge_config`` for its launch's lists (the direct step's deferred merge, its
    merge without the deferred check, and the planned kernel's): two column programs per head where the 3
    lists are few (columns patched to half the head), one otherwise. Exact either way; on rows out of
    order (each column program of the deferred merge recomputes the row) bitwise the same as in order."""
    monkeypatch.setattr(qsa.settings, "XQA_MERGE_FEW_COLUMNS", 8)
    monkeypatch.setattr(qsa.settings, "XQA_MERGE_FEW_LISTS", few_lists)
    grids = []
    Spy = grid_spy(grids)
    monkeypatch.setattr(qsa.attention.xqa.kernel, "xqa_direct_merge_kernel", Spy(qsa.attention.xqa.kernel.xqa_direct_merge_kernel))
    monkeypatch.setattr(qsa.attention.kernels, "merge_splits_kernel", Spy(qsa.attention.kernels.merge_splits_kernel))
    case = make_attention_case(rows=3, num_reqs=1, num_q_heads=2, num_kv_heads=1, head_dim=16, width=100,
                               max_seq_len=400, padding_rows=0, seed=31)
    config = qsa.attention.xqa.launch.xqa_direct_config(2, 16, 3)
    assert config.defer_check
    sorted_rows = ascending_rows(case.indices)
    case.indices = sorted_rows
    got = run_direct(case, splits=2, config=config)
    check(case, got)
    assert_bitwise(got, run_direct(case, splits=2, config=config, indices=sorted_rows.flip(1)), "rows out of order")
    check(case, run_direct(case, splits=2, config=dataclasses.replace(config, defer_check=False)))
    c = case.cache
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                              block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2, num_kv_heads=1,
                              head_dim=16, route="xqa")
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32)
    qsa.attention.xqa.launch.xqa_attention(case.q, c.k, c.v, plan.single, row_start=0, out=out, lse=lse, gate=case.gate,
                            softmax_scale=case.q.shape[2] ** -0.5, k_scale=c.k_scale, v_scale=c.v_scale,
                            kv_fp8=False, num_splits=2)
    check(case, (out, lse))
    assert grids == [(3, 2, 2 if few_lists >= 3 else 1)] * 4, grids
