"""The batch-invariant route: exact against the references; a row's bits independent of the batch it comes
in (the batch's size and other rows, the row's place in it, the index width, whether the kernel folds the
splits itself or a merge launch does); and the invariance check rejecting batch-dependent variants."""

import dataclasses

import pytest
import torch

import qsa
import qsa.attention.invariant.kernel
import qsa.attention.invariant.launch
import qsa.settings
from qsa.cache.paged import random_mapping
from helpers import AttentionCase, make_attention_case, slow

from helpers import assert_bitwise, check_against_reference

SMALL = qsa.settings.InvariantConfig(tile_tokens=16, split_tiles=2, num_warps=4, num_stages=2)
"""16-token tiles, splits of 32 list positions: the tests' 40-70-wide rows span several splits."""


def run(case: AttentionCase, *, fold=None, config=SMALL):
    """The route's launcher into NaN-filled buffers: (out, lse)."""
    c = case.cache
    fp8 = c.kv_cache_dtype == "fp8_e4m3"
    out = torch.full_like(case.q, float("nan"))
    lse = torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32)
    k, v = (c.k.view(torch.uint8), c.v.view(torch.uint8)) if fp8 else (c.k, c.v)
    qsa.attention.invariant.launch.invariant_attention(case.q, k, v, case.indices, case.block_table, case.token_to_req, case.positions,
                                  case.seq_lens, out=out, lse=lse, gate=case.gate,
                                  softmax_scale=case.q.shape[2] ** -0.5, k_scale=c.k_scale if fp8 else 1.0,
                                  v_scale=c.v_scale if fp8 else 1.0, kv_fp8=fp8, config=config, fold=fold)
    return out, lse


def _concat(a: AttentionCase, b: AttentionCase) -> AttentionCase:
    """The rows of ``a`` then those of ``b`` (the same cache, table and lengths) in one batch."""
    cat = lambda x, y: None if x is None else torch.cat([x, y])  # noqa: E731
    return dataclasses.replace(a, q=cat(a.q, b.q), gate=cat(a.gate, b.gate), indices=torch.cat([a.indices, b.indices]),
                               token_to_req=cat(a.token_to_req, b.token_to_req),
                               positions=cat(a.positions, b.positions))


def other_rows(case: AttentionCase, n: int, seed: int) -> AttentionCase:
    """``n`` rows that are not the case's: its rows in another order, with other queries and gates."""
    g = torch.Generator().manual_seed(seed)
    rows = case.take_rows(torch.randint(0, case.q.shape[0], (n,), generator=g))
    q = torch.randn(rows.q.shape, generator=g).to(rows.q.dtype)
    gate = None if rows.gate is None else torch.randn(rows.gate.shape, generator=g).to(rows.gate.dtype)
    return dataclasses.replace(rows, q=q, gate=gate)


def assert_batch_invariant(runner, case: AttentionCase, seed: int = 0):
    """Every row of ``case`` gets the bits it gets in the whole batch also: alone (the two of longest lists);
    in reverse order ahead of other rows; behind other rows, with wider ``indices`` (more -1 columns) and
    each row's entries shuffled; and with the cache's pages moved. ``runner(case) -> (out, lse)``."""
    n = case.q.shape[0]
    base_out, base_lse = runner(case)
    rows = list(range(n))

    def expect(got, at, which, what):
        assert_bitwise((got[0][at:at + len(which)], got[1][at:at + len(which)]), (base_out[which], base_lse[which]),
                        what)

    longest = torch.argsort((case.indices >= 0).sum(1), descending=True, stable=True)[:2].tolist()
    expect(runner(case.take_rows(longest)), 0, longest, "the two longest rows alone")
    back = rows[::-1]
    expect(runner(_concat(case.take_rows(back), other_rows(case, n + 3, seed))), 0, back,
           "rows in reverse order, ahead of other rows")
    g = torch.Generator().manual_seed(seed + 1)
    pad = torch.full((n, 20), -1, dtype=torch.int32)  # past a tile and a split more
    wide = dataclasses.replace(case, indices=torch.cat([case.indices, pad], 1)).with_permuted_indices(g)
    others = other_rows(case, 5, seed + 2)
    others.indices = torch.cat([others.indices, torch.full((5, pad.shape[1]), -1, dtype=torch.int32)], 1)
    expect(runner(_concat(others, wide)), 5, rows, "behind other rows, wider indices, entries shuffled")
    expect(runner(case.relocated(random_mapping(case.cache.num_blocks, generator=g))), 0, rows, "pages moved")


@pytest.mark.parametrize("dtype,kv_cache_dtype,halves", [
    slow(torch.float16, "auto", False), slow(torch.float16, "auto", True),
    slow(torch.bfloat16, "auto", True), (torch.float16, "fp8_e4m3", True)])
def test_invariant_matches_reference_with_fold_and_merge(dtype, kv_cache_dtype, halves):
    """Messy rows (duplicates, -1, tokens past the position, the length and the table, table entries -1
    and past the cache, padding rows) over several splits: exact when the kernel folds the splits and
    when the merge does, and bitwise the same either way."""
    case = make_attention_case(rows=6, num_reqs=3, num_q_heads=6, num_kv_heads=2, head_dim=32, width=56,
                               max_seq_len=150, dtype=dtype, kv_cache_dtype=kv_cache_dtype, with_gate=True,
                               seed=41)
    config = dataclasses.replace(SMALL, qk_halves=halves)
    split = SMALL.tile_tokens * SMALL.split_tiles
    assert int((case.indices >= 0).sum(1).max()) > split, "a row's list must span several splits"
    folded = run(case, fold=True, config=config)
    check_against_reference(case, folded)
    assert_bitwise(folded, run(case, fold=False, config=config), "fold vs merge")


@pytest.mark.parametrize("fold", [slow(False), True])
def test_a_row_gets_the_same_bits_in_any_batch(fold):
    """The invariance check on the route's launcher with either kind of program."""
    case = make_attention_case(rows=5, num_reqs=3, num_q_heads=4, num_kv_heads=2, head_dim=32, width=40,
                               max_seq_len=150, with_gate=True, seed=42)
    assert_batch_invariant(lambda c: run(c, fold=fold), case, seed=43)


def test_the_public_route_is_batch_invariant_across_its_fold_threshold(monkeypatch):
    """Through ``sparse_paged_attention``: batches below ``INVARIANT_FOLD_LISTS`` lists take a program per
    split and the merge, larger ones fold in one program per row: the same bits for every row."""
    case = make_attention_case(rows=5, num_reqs=3, num_q_heads=6, num_kv_heads=2, head_dim=32, width=40,
                               max_seq_len=160, with_gate=True, seed=44)
    monkeypatch.setattr(qsa.attention.invariant.launch, "invariant_config", lambda G, D, lists=None, kv_fp8=False: SMALL)
    monkeypatch.setattr(qsa.settings, "INVARIANT_FOLD_LISTS", 8)
    seen = []
    launcher = qsa.attention.invariant.launch.invariant_attention

    def spy(*args, **kw):
        seen.append(qsa.attention.invariant.launch.invariant_folds(args[0].shape[0] * args[1].shape[2]))
        return launcher(*args, **kw)
    monkeypatch.setattr(qsa.attention.invariant.launch, "invariant_attention", spy)
    def public(c):
        return c.run(qsa.sparse_paged_attention, route="invariant", return_lse=True,
                     out=torch.full_like(c.q, float("nan")))
    assert_batch_invariant(public, case, seed=45)
    assert True in seen and False in seen, "both kinds of program must have run"


class _ReversedMerge:
    """Known-wrong merge launch: the splits folded in reverse order (a fixed order, but not the kernel's)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(part_acc, part_ml, *args, **kw):
            self.kernel[grid](part_acc.flip(2).contiguous(), part_ml.flip(2).contiguous(), *args, **kw)
        return launch


LONG_ROWS = 4
"""Rows of :func:`_long_rows`: a batch of this many rows is the whole batch."""


def _long_rows() -> AttentionCase:
    """4 rows at the end of one request, 64 distinct tokens each (4 splits of 16 with 1-tile splits), 16
    heads on one KV head: a row's 16 LSEs show in their last bits how its sums were cut and folded."""
    case = make_attention_case(rows=LONG_ROWS, num_reqs=1, num_q_heads=16, num_kv_heads=1, head_dim=16, width=64,
                               max_seq_len=400, messy=False, padding_rows=0, share_prefix=False, seed=46)
    n = int(case.seq_lens[0])
    assert n > 64 + LONG_ROWS
    g = torch.Generator().manual_seed(46)
    case.positions = n - 1 - torch.arange(LONG_ROWS)
    case.indices = torch.stack([torch.randperm(int(p) + 1, generator=g)[:64] for p in case.positions]).to(torch.int32)
    return case


_ONE_SPLIT = dataclasses.replace(SMALL, split_tiles=1)


def _folded_in_the_whole_batch(c):
    """The route with one-tile splits, folded in the kernel for the whole batch of ``_long_rows`` (``LONG_ROWS``
    rows) and merged by the merge kernel in every other batch."""
    return run(c, fold=c.q.shape[0] == LONG_ROWS, config=_ONE_SPLIT)


def test_the_invariance_check_rejects_splits_sized_by_the_batch():
    """A known-wrong variant that the check must reject: splits sized by the batch (as the other routes
    size theirs)."""
    def by_batch(c):
        return run(c, config=dataclasses.replace(_ONE_SPLIT, split_tiles=1 if c.q.shape[0] == LONG_ROWS else 3))

    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_batch_invariant(by_batch, _long_rows())


def test_the_invariance_check_rejects_a_merge_in_another_order(monkeypatch):
    """A known-wrong variant that the check must reject: a merge that folds the splits in another order
    than the kernel's fold (a row's bits then depend on which side of the fold threshold its batch falls)."""
    import qsa

    monkeypatch.setattr(qsa.attention.invariant.kernel, "invariant_merge_kernel", _ReversedMerge(qsa.attention.invariant.kernel.invariant_merge_kernel))
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_batch_invariant(_folded_in_the_whole_batch, _long_rows())


@pytest.mark.slow
def test_the_shipped_merge_passes_the_check_the_wrong_ones_fail():
    """The shipped merge, on the rows and splits the known-wrong variants above fail on, passes the check:
    the kernel's fold and the merge give every row the same bits in any batch."""
    assert_batch_invariant(_folded_in_the_whole_batch, _long_rows())


def test_invariant_settings_and_admission():
    """Settings from the shape alone; the merge's columns within its register budget; a forced route that
    cannot run raises, naming why; ``auto`` never takes it; it plans nothing."""
    cfg = qsa.attention.invariant.launch.invariant_config(6, 256)
    assert (cfg.tile_tokens, cfg.split_tiles, cfg.num_warps, cfg.qk_halves) == (32, 4, 4, True)
    assert not qsa.attention.invariant.launch.invariant_config(6, 128).qk_halves
    # The launch's size may move only what schedules the work: the register cap and the stages.
    sums = lambda c: (c.tile_tokens, c.split_tiles, c.num_warps, c.qk_halves)  # noqa: E731
    for G, D in ((6, 256), (12, 256), (6, 128), (8, 64)):
        for kv_fp8 in (False, True):
            assert {sums(qsa.attention.invariant.launch.invariant_config(G, D, n, kv_fp8)) for n in (None, 1, 300, 1024, 9000)} \
                == {sums(qsa.attention.invariant.launch.invariant_config(G, D))}
    assert qsa.settings.INVARIANT_CAP_LISTS >= qsa.settings.INVARIANT_FOLD_LISTS  # the cap is a folding launch's
    capped = qsa.attention.invariant.launch.invariant_config(6, 256, qsa.settings.INVARIANT_CAP_LISTS)
    assert (capped.max_registers, capped.num_stages) == (168, 2)
    assert qsa.attention.invariant.launch.invariant_config(8, 256, 8192).max_registers == 168
    for args in ((6, 256, qsa.settings.INVARIANT_CAP_LISTS - 1), (6, 256, None), (6, 256, 8192, True), (12, 256, 8192),
                 (6, 128, 8192)):
        assert qsa.attention.invariant.launch.invariant_config(*args).max_registers is None, args
    assert not qsa.attention.invariant.launch.invariant_folds(qsa.settings.INVARIANT_FOLD_LISTS - 1) and qsa.attention.invariant.launch.invariant_folds(qsa.settings.INVARIANT_FOLD_LISTS)
    assert qsa.attention.invariant.launch.invariant_merge_columns(17, 256) == 32 and qsa.attention.invariant.launch.invariant_merge_columns(1, 256) == 256
    assert qsa.attention.invariant.launch.invariant_merge_columns(2000, 256) == 16 and qsa.attention.invariant.launch.invariant_merge_columns(2000, 16) == 16
    assert all(16 * qsa.attention.invariant.launch.invariant_merge_columns(n, 256) * n <= qsa.settings.INVARIANT_MERGE_ELEMENTS for n in (1, 5, 17, 33))
    assert qsa.attention.invariant.launch.invariant_merge_columns(17, 256, block_g=32) == 16
    kw = dict(rows=4, device=torch.device("cpu"))
    assert qsa.attention.routing.choose("invariant", G=6, head_dim=256, index_width=2051, **kw).route == "invariant"
    assert qsa.attention.routing.choose("auto", G=6, head_dim=256, index_width=2051, rows=100,
                    device=torch.device("cpu")).route != "invariant"
    with pytest.raises(ValueError, match="at most 4096 wide"):
        qsa.attention.routing.choose("invariant", G=6, head_dim=256, index_width=4097, **kw)
    with pytest.raises(ValueError, match="heads per tile"):
        qsa.attention.routing.choose("invariant", G=2 * qsa.attention.routing.MAX_TILE_ROWS, head_dim=16, **kw)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        qsa.attention.routing.choose("invariant", G=2, head_dim=24, **kw)
    case = make_attention_case(rows=5, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8, seed=47)
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                              block_size=16, num_blocks=case.cache.num_blocks, num_q_heads=2, num_kv_heads=1,
                              head_dim=16, route="invariant")
    assert plan.routes.route == "invariant" and (plan.single, plan.grouped, plan.tokens) == (None, None, None)
    got = qsa.run_attention(plan, case.q, case.cache.k, case.cache.v, return_lse=True)
    assert_bitwise(got, case.run(qsa.sparse_paged_attention, route="invariant", return_lse=True, gate=None),
                    "plan + run vs the op")
    with pytest.raises(ValueError, match="scratch"):
        qsa.attention.invariant.launch.invariant_attention(
            case.q, case.cache.k, case.cache.v, case.indices, case.block_table, case.token_to_req, case.positions,
            case.seq_lens, out=torch.empty_like(case.q), lse=None, gate=None, softmax_scale=0.25, k_scale=1.0,
            v_scale=1.0, kv_fp8=False, scratch=torch.empty(5, 4, dtype=torch.int32))
