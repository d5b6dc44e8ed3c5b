"""The balanced-schedule prototype of grouped attention (benchmarks/lab/balanced_grouped.py): its
host plans and its kernels under the interpreter, against the fp64 reference. A prototype outside the
library: marked ``lab``, left out of the default run (``python -m pytest -m lab``)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.lab.balanced_grouped import balanced_grouped, host_plan  # noqa: E402
from qsa.attention.planning.plan import plan_groups  # noqa: E402
from helpers import make_attention_case
from qsa.attention.reference import assert_close_like_torch
from qsa.attention.reference import reference_attention  # noqa: E402

pytestmark = pytest.mark.lab


def _case(seed=0, rows=37):
    # Valid tables and rows (the host plan's scope), duplicates and dropped entries in the rows.
    case = make_attention_case(rows=rows, num_reqs=3, num_q_heads=3, head_dim=16, width=24, max_seq_len=90,
                               messy=False, padding_rows=0, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    idx = case.indices.clone()
    idx[:, 5] = idx[:, 4]  # a repeated index
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    case.indices = idx
    return case


def _plan(case, rows):
    return host_plan(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                     block_size=case.cache.block_size, group_rows=rows)


def _check(case, out, name):
    ref, _ = case.run(reference_attention, compute_dtype=torch.float64)
    low, _ = case.run(reference_attention, compute_dtype=case.q.dtype)
    assert_close_like_torch(out, ref, low, name=name)


def test_host_plan_of_8_rows_is_the_library_plan():
    """The same entries per group (a group's requests may come in another order)."""
    case = _case()
    mine = _plan(case, 8)
    lib = plan_groups(**case.plan_inputs())
    assert torch.equal(mine.counts, lib.counts)
    assert mine.masks.shape[0] == 1
    for g in range(lib.num_groups):
        n = int(lib.counts[g])
        pairs = sorted(zip(mine.mb_ids[g, :n].tolist(), mine.masks[0, g, :n].tolist()))
        assert pairs == sorted(zip(lib.mb_ids[g, :n].tolist(), lib.masks[g, :n].tolist()))


def test_host_plan_words_hold_their_rows():
    """A 21-row group's masks: three words, row q's nibble in word q // 8; the 8-row plans of the same rows
    have the same tokens per row."""
    case = _case(rows=42)
    wide = _plan(case, 21)
    narrow = _plan(case, 8)
    assert wide.masks.shape[0] == 3
    assert not (wide.masks[2] >> 20).any(), "word 2 holds rows 16-20 only"

    def row_tokens(plan, r):
        g, q = divmod(r, plan.group_rows)
        w, nib = divmod(q, 8)
        n = int(plan.counts[g])
        ids = plan.mb_ids[g, :n].tolist()
        bits = ((plan.masks[w, g, :n] >> (4 * nib)) & 15).tolist()
        return sorted((i, b) for i, b in zip(ids, bits) if b)

    for r in range(42):
        assert row_tokens(wide, r) == row_tokens(narrow, r), r


@pytest.mark.parametrize("rows", [8, 10, 21])
@pytest.mark.parametrize("programs", [1, 2, 3, 7, 40])
def test_balanced_kernel_matches_reference(rows, programs):
    case = _case(seed=rows + programs)
    plan = _plan(case, rows)
    # Whole groups in rounds of `programs`, then the rest's tiles cut into `programs` runs.
    n = ((plan.counts + 7) // 8).clamp(min=1).tolist()
    rest = n[len(n) // programs * programs:]
    ends = [sum(rest[:i + 1]) for i in range(len(rest))]
    cuts = {p * ends[-1] // programs for p in range(1, programs)} if rest else set()
    cut = [g for g in range(len(rest)) if any(ends[g] - rest[g] < c < ends[g] for c in cuts)]
    assert bool(cut) == (programs > 1 and len(rest) > 0), (rest, cut)
    assert len(rest) < len(n) or programs > len(n), "some rounds of whole groups"
    out = torch.full_like(case.q, float("nan"))
    balanced_grouped(case.q, case.cache.k, case.cache.v, plan, out, case.q.shape[-1] ** -0.5,
                     programs=programs)
    _check(case, out, f"balanced {rows} rows, {programs} programs")


@pytest.mark.parametrize("rows,prefetch,lazy", [(8, False, False), (16, True, True), (21, True, False)])
def test_one_program_per_group_matches_reference(rows, prefetch, lazy):
    case = _case(seed=rows)
    plan = _plan(case, rows)
    out = torch.full_like(case.q, float("nan"))
    balanced_grouped(case.q, case.cache.k, case.cache.v, plan, out, case.q.shape[-1] ** -0.5, balanced=False,
                     prefetch=prefetch, lazy_rescale=lazy)
    _check(case, out, f"{rows} rows, one program per group")


@pytest.mark.parametrize("rows,lost_word", [(10, 1), (21, 2)])
def test_check_rejects_a_lost_mask_word(rows, lost_word):
    """A plan whose rows past the first word (or the last word's) lose their bits must fail the same check."""
    case = _case(seed=5)
    plan = _plan(case, rows)
    plan.masks[lost_word].zero_()
    out = torch.full_like(case.q, float("nan"))
    balanced_grouped(case.q, case.cache.k, case.cache.v, plan, out, case.q.shape[-1] ** -0.5, programs=3)
    with pytest.raises(AssertionError):
        _check(case, out, f"word {lost_word} dropped")


@pytest.mark.parametrize("rows,balanced,programs,mb", [(16, False, None, 4), (21, False, None, 16), (21, True, 3, 16)])
def test_wider_k_v_tiles_match_reference(rows, balanced, programs, mb):
    """16 microblocks (64 tokens) per K/V tile, or 4, in both schedules; some group spans two tiles, so the
    tile loop and (balanced) the cut groups' fixup run."""
    case = _case(seed=30 + rows)
    plan = _plan(case, rows)
    assert int(plan.counts.max()) > mb, "some group needs two tiles"
    out = torch.full_like(case.q, float("nan"))
    balanced_grouped(case.q, case.cache.k, case.cache.v, plan, out, case.q.shape[-1] ** -0.5,
                     balanced=balanced, programs=programs, mb=mb, num_stages=2)
    _check(case, out, f"{rows} rows, {mb}-microblock tiles, balanced={balanced}")
