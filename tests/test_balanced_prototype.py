"""The balanced-schedule prototype of grouped attention (benchmarks/prototypes/balanced_grouped.py): its
host plans and its kernels under the interpreter, against the fp64 reference."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.prototypes.balanced_grouped import balanced_grouped, host_plan  # noqa: E402
from qsa.plan import plan_groups  # noqa: E402
from qsa.reference import assert_close_like_torch, make_attention_case, reference_attention  # noqa: E402


def _case(seed=0):
    # Valid tables and rows (the host plan's scope), duplicates and dropped entries in the rows.
    case = make_attention_case(rows=37, num_reqs=3, num_q_heads=3, head_dim=16, width=24, max_seq_len=90,
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


def test_host_plan_of_8_rows_is_the_library_plan():
    """The same entries per group (a group's requests may come in another order)."""
    case = _case()
    mine = _plan(case, 8)
    lib = plan_groups(**case.plan_inputs())
    assert torch.equal(mine.counts, lib.counts)
    for g in range(lib.num_groups):
        n = int(lib.counts[g])
        pairs = sorted(zip(mine.mb_ids[g, :n].tolist(), mine.masks_lo[g, :n].tolist()))
        assert pairs == sorted(zip(lib.mb_ids[g, :n].tolist(), lib.masks[g, :n].tolist()))
    assert not mine.masks_hi.any()


@pytest.mark.parametrize("rows", [8, 10])
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
    ref, _ = case.run(reference_attention, compute_dtype=torch.float64)
    low, _ = case.run(reference_attention, compute_dtype=case.q.dtype)
    assert_close_like_torch(out, ref, low, name=f"balanced {rows} rows, {programs} programs")


def test_balanced_kernel_check_rejects_a_lost_row_of_a_10_row_group():
    """A plan whose rows 8-9 lose their bits (the 8-row mask alone) must fail the same check."""
    case = _case(seed=5)
    plan = _plan(case, 10)
    plan.masks_hi.zero_()
    out = torch.full_like(case.q, float("nan"))
    balanced_grouped(case.q, case.cache.k, case.cache.v, plan, out, case.q.shape[-1] ** -0.5, programs=3)
    ref, _ = case.run(reference_attention, compute_dtype=torch.float64)
    low, _ = case.run(reference_attention, compute_dtype=case.q.dtype)
    with pytest.raises(AssertionError):
        assert_close_like_torch(out, ref, low, name="rows 8-9 dropped")
