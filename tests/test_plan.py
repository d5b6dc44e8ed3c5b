"""Page4 planner kernels against the loop reference planners: exact ids, masks and counts."""

import dataclasses

import numpy as np
import pytest
import torch

import qsa
import qsa.attention.planning.kernels
import qsa.attention.planning.plan
import qsa.settings
import qsa.utils
from qsa.cache.paged import random_mapping
from qsa.attention.planning.plan import (grouped_capacity, GroupedPlan, PAD, physical_order, plan_groups, plan_single_rows, PlanWorkspace, single_row_capacity)
from helpers import make_attention_case, slow
from qsa.attention.planning.reference import compare_plans, reference_grouped_plan, reference_single_row_plan
from qsa.attention.reference import kept_tokens as _kept_tokens

from helpers import ascending_rows


def plans(case, *, group_rows=8, num_rows=None):
    inputs = case.plan_inputs()
    single = plan_single_rows(**inputs)
    grouped = plan_groups(**inputs, group_rows=group_rows, num_rows=num_rows)
    return single, grouped


def reference_plans(case, *, group_rows=8, num_rows=None):
    inputs = case.plan_inputs()
    return (reference_single_row_plan(**inputs),
            reference_grouped_plan(**inputs, group_rows=group_rows, num_rows=num_rows))


@pytest.mark.parametrize("block_size,seed", [(4, 0), (16, 0), (32, 0), slow(4, 1), slow(16, 1), slow(32, 1)])
def test_planners_match_reference(block_size, seed):
    case = make_attention_case(rows=21, num_reqs=4, block_size=block_size, width=29, max_seq_len=90,
                               seed=seed)
    single, grouped = plans(case)
    ref_single, ref_grouped = reference_plans(case)
    assert compare_plans(single, ref_single) == []
    assert compare_plans(grouped, ref_grouped) == []
    assert single.capacity == single_row_capacity(29)
    assert grouped.num_groups == 3 and grouped.capacity >= grouped_capacity(29, 8)


@pytest.mark.parametrize("block_size", [4, 16])
def test_planners_match_reference_on_sorted_rows_past_the_length(block_size):
    """Rows sorted as the selection emits them but holding duplicates (the position token repeated, other
    tokens twice), and rows whose position is at, one past or well past their request's length: the
    scan-free ascending paths and the row check must drop what the reference drops, no more, no less."""
    case = make_attention_case(rows=21, num_reqs=4, block_size=block_size, width=29, max_seq_len=90, seed=4)
    idx = ascending_rows(case.indices)
    lens = case.seq_lens.tolist()
    for r in range(case.indices.shape[0]):
        req = int(case.token_to_req[r])
        if not 0 <= req < len(lens):
            continue
        if r % 3 == 0:  # position at, one past and well past the length, with tokens up to it
            case.positions[r] = lens[req] - 1 + (r // 3) % 3 * 4
        pos = int(case.positions[r])
        row = sorted(t for t in idx[r].tolist() if t >= 0)[:20]
        row = sorted(row + row[:3] + [pos, pos] + [pos + 1])  # duplicates, the position token twice
        idx[r] = torch.tensor((row + [-1] * 29)[:29], dtype=idx.dtype)
    case.indices = idx
    single, grouped = plans(case)
    ref_single, ref_grouped = reference_plans(case)
    assert compare_plans(single, ref_single) == []
    assert compare_plans(grouped, ref_grouped) == []


@pytest.mark.parametrize("group_rows,num_rows", [(3, None), (1, 5), (8, 16), (5, 13)])
def test_group_sizes_and_partial_groups(group_rows, num_rows):
    case = make_attention_case(rows=17, num_reqs=3, block_size=16, width=20, seed=3)
    single, grouped = plans(case, group_rows=group_rows, num_rows=num_rows)
    _, ref_grouped = reference_plans(case, group_rows=group_rows, num_rows=num_rows)
    assert compare_plans(grouped, ref_grouped) == []


def test_rows_of_one_request_merge_and_requests_keep_their_entries():
    # Rows of two requests whose tables share their first physical block select tokens of it.
    table = torch.tensor([[5, 2, 9], [5, 7, 3]], dtype=torch.int32)
    indices = torch.tensor([[0, 1, 17, -1], [2, 1, 33, 34], [0, 3, -1, -1]], dtype=torch.int32)
    token_to_req = torch.tensor([0, 1, 0], dtype=torch.int32)
    positions = torch.tensor([40, 40, 40])
    seq_lens = torch.tensor([48, 48], dtype=torch.int32)
    kw = dict(block_size=16, num_blocks=10)
    grouped = plan_groups(indices, table, token_to_req, positions, seq_lens, group_rows=4, **kw)
    # Request 0 first (its first row is row 0): logical microblock 0 (id 5 * 4 + 0 = 20) with rows 0
    # and 2 OR-ed, then microblock 4 (token 17: id 2 * 4 + 0 = 8). Then request 1: its microblock 0 is
    # the same physical microblock 20 but another request's, so it keeps its own entry; token 33, 34:
    # id 3 * 4 + 0 = 12.
    assert grouped.counts.tolist() == [4]
    assert grouped.mb_ids[0, :4].tolist() == [20, 8, 20, 12]
    assert grouped.masks[0, :4].tolist() == [0b1001_0000_0011, 0b0010, 0b0110 << 4, 0b0110 << 4]
    assert grouped.mb_ids[0, 4:PAD].tolist() == [20] * (PAD - 4)
    assert grouped.masks[0, 4:PAD].tolist() == [0] * (PAD - 4)
    ref = reference_grouped_plan(indices, table, token_to_req, positions, seq_lens, group_rows=4, **kw)
    assert compare_plans(grouped, ref) == []


def test_self_aliasing_keeps_both_copies():
    """Two logical blocks of one request on one physical block: both are tokens of the row's set
    (docs/spec.md section 4), so the group keeps two entries, like the single-row plan."""
    args = (torch.tensor([[0, 1, 6], [6, -1, -1]], dtype=torch.int32), torch.tensor([[3, 3]], dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32), torch.tensor([7, 7]), torch.tensor([8], dtype=torch.int32))
    grouped = plan_groups(*args, block_size=4, num_blocks=4, group_rows=2)
    assert grouped.counts.tolist() == [2]
    assert grouped.mb_ids[0, :2].tolist() == [3, 3]
    assert grouped.masks[0, :2].tolist() == [0b0011, 0b0100_0100]
    assert compare_plans(grouped, reference_grouped_plan(*args, block_size=4, num_blocks=4, group_rows=2)) == []


def test_row_start_plans_only_the_rows_after_it():
    case = make_attention_case(rows=13, num_reqs=3, block_size=16, width=18, seed=13)
    ref = reference_single_row_plan(**case.plan_inputs())
    single = plan_single_rows(**case.plan_inputs(), row_start=8)
    tail = lambda p: type(p)(p.mb_ids[8:], p.masks[8:], p.counts[8:], p.block_size, p.num_blocks)  # noqa: E731
    assert compare_plans(tail(single), tail(ref)) == []


def test_invalid_rows_and_empty_groups():
    case = make_attention_case(rows=24, num_reqs=2, block_size=16, width=12, padding_rows=0, seed=4)
    case.token_to_req[0:8] = -1  # a whole group of invalid requests: empty group
    case.indices[8:16] = -1  # a whole group of all -1 rows
    case.positions[16] = -1
    case.token_to_req[17] = 99
    single, grouped = plans(case)
    ref_single, ref_grouped = reference_plans(case)
    assert compare_plans(single, ref_single) == []
    assert compare_plans(grouped, ref_grouped) == []
    assert grouped.counts[:2].tolist() == [0, 0]
    assert single.counts[[0, 8, 16, 17]].tolist() == [0, 0, 0, 0]


def test_widest_group():
    """Every row: 512 complete blocks + a 3-token tail (width 2051), 8 rows of one request."""
    g = torch.Generator().manual_seed(5)
    seq = 8192
    block_size, nb = 16, seq // 16 + 1
    table = (torch.randperm(nb - 1, generator=g) + 1).to(torch.int32)[None, :]
    rows = []
    for r in range(8):
        pos = seq - 8 + r - 1 if r < 7 else seq - 2  # tails of 0..3 tokens
        blocks = torch.sort(torch.randperm((pos + 1) // 4, generator=g)[:512]).values
        toks = (blocks[:, None] * 4 + torch.arange(4)).flatten().tolist()
        tail = list(range((pos + 1) // 4 * 4, pos + 1))
        rows.append((toks + tail + [-1] * 3)[:2051])
    indices = torch.tensor(rows, dtype=torch.int32)
    positions = torch.tensor([seq - 9 + r for r in range(7)] + [seq - 2])
    args = (indices, table, torch.zeros(8, dtype=torch.int32), positions,
            torch.tensor([seq], dtype=torch.int32))
    single = plan_single_rows(*args, block_size=block_size, num_blocks=nb)
    grouped = plan_groups(*args, block_size=block_size, num_blocks=nb)
    ref_single = reference_single_row_plan(*args, block_size=block_size, num_blocks=nb)
    ref_grouped = reference_grouped_plan(*args, block_size=block_size, num_blocks=nb)
    assert compare_plans(single, ref_single) == []
    assert compare_plans(grouped, ref_grouped) == []
    assert single.counts.max().item() == 513


def test_every_index_its_own_microblock():
    """Capacity: a row whose W indices all open distinct microblocks still fits."""
    width = 40
    indices = (torch.arange(width, dtype=torch.int32) * 4 + 1)[None, :].repeat(9, 1)
    table = torch.arange(12, dtype=torch.int32)[None, :]
    args = (indices, table, torch.zeros(9, dtype=torch.int32), torch.full((9,), 1000),
            torch.tensor([192], dtype=torch.int32))
    single = plan_single_rows(*args, block_size=16, num_blocks=12)
    grouped = plan_groups(*args, block_size=16, num_blocks=12)
    assert single.counts.tolist() == [40] * 9
    assert grouped.counts.tolist() == [40, 40]
    assert compare_plans(grouped, reference_grouped_plan(*args, block_size=16, num_blocks=12)) == []


@pytest.mark.parametrize("collision_prone", [False, True])
def test_relocation_changes_only_ids(collision_prone):
    case = make_attention_case(rows=19, num_reqs=4, block_size=16, width=24, seed=6)
    single, grouped = plans(case)
    n = case.cache.num_blocks
    mapping = random_mapping(n, generator=torch.Generator().manual_seed(1), collision_prone=collision_prone)
    out_blocks = int(mapping.max()) + 1
    moved = case.relocated(mapping, num_blocks_out=out_blocks)
    single2, grouped2 = plans(moved)
    assert compare_plans(single, single2, mapping=mapping) == []
    assert compare_plans(grouped, grouped2, mapping=mapping) == []
    ref_single, ref_grouped = reference_plans(moved)
    assert compare_plans(grouped2, ref_grouped) == []


def test_permuted_entries_give_the_same_plan():
    case = make_attention_case(rows=16, num_reqs=2, block_size=32, width=30, seed=7)
    single, grouped = plans(case)
    shuffled = case.with_permuted_indices(torch.Generator().manual_seed(2))
    assert not torch.equal(shuffled.indices, case.indices)
    single2, grouped2 = plans(shuffled)
    assert compare_plans(single, single2) == []
    assert compare_plans(grouped, grouped2) == []


def test_workspace_is_reusable():
    case = make_attention_case(rows=16, num_reqs=3, block_size=16, width=20, seed=8)
    ws = PlanWorkspace.for_plan(case.block_table, block_size=16, num_groups=2)
    first = plan_groups(**case.plan_inputs(), workspace=ws)
    assert first.counts.min() > 0 and int(ws.state.count_nonzero()) == 0, "scratch must be left zero"
    second = plan_groups(**case.plan_inputs(), workspace=ws)
    assert compare_plans(first, second) == []
    torn = PlanWorkspace(bits=ws.bits[:, :-1])  # not a layout of scratch_words
    with pytest.raises(ValueError, match="workspace"):
        plan_groups(**case.plan_inputs(), workspace=torn)
    long = make_attention_case(rows=8, num_reqs=2, block_size=16, width=20, max_seq_len=20000, seed=9)
    small = PlanWorkspace.allocate(microblocks=1, programs=1, device="cpu")
    assert long.block_table.shape[1] * 4 > small.microblocks
    with pytest.raises(ValueError, match="workspace"):
        plan_groups(**long.plan_inputs(), workspace=small)


@pytest.mark.parametrize("summary,late", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("quads,scan", [(1, 16), slow(2, 32), (64, 2048)])
def test_planner_settings_give_one_plan(quads, scan, summary, late):
    """Steps of any size (one quad, a scan shorter than the table), the scan of flagged sectors or of
    every word, and the table checked in either pass give the same plan."""
    from qsa.settings import PlannerConfig

    case = make_attention_case(rows=19, num_reqs=3, block_size=16, width=22, seed=12)
    ref = reference_grouped_plan(**case.plan_inputs())
    cfg = PlannerConfig(quads=quads, scan=scan, num_warps=4, programs_per_sm=1, summary=summary,
                        late_table=late)
    assert compare_plans(plan_groups(**case.plan_inputs(), config=cfg), ref) == []


@pytest.mark.parametrize("quads,scan,emit,list_words", [(1, 32, 4, 1536), slow(2, 64, 16, 1536), (64, 2048, 128, 1536),
                                                         (1, 32, 2, 12), (2, 32, 4, 9)])
def test_map_planner_gives_the_plan(quads, scan, emit, list_words, monkeypatch):
    """The planner over a byte map (``shared_map``; in the interpreter the map lives in the workspace)
    gives the reference plan for messy rows: steps of one quad, listing steps shorter than the table,
    emission steps of a few words, lists that fill and flush every step or two."""
    import qsa
    from qsa.settings import PlannerConfig

    monkeypatch.setattr(qsa.settings, "MAP_LIST_WORDS", list_words)
    case = make_attention_case(rows=19, num_reqs=3, block_size=16, width=22, seed=12)
    ref = reference_grouped_plan(**case.plan_inputs())
    cfg = PlannerConfig(quads=quads, scan=scan, num_warps=4, programs_per_sm=1, shared_map=True, emit=emit)
    ws = PlanWorkspace.for_plan(case.block_table, block_size=16, num_groups=3, config=cfg)
    for _ in range(2):
        assert compare_plans(plan_groups(**case.plan_inputs(), config=cfg, workspace=ws), ref) == []
        assert int(ws.state.count_nonzero()) == 0, "the map and the nibble words must be left zero"


def test_map_planner_steps_must_be_powers_of_two():
    from qsa.settings import PlannerConfig

    case = make_attention_case(rows=8, num_reqs=1, block_size=16, width=8, seed=3)
    for bad, name in ((PlannerConfig(shared_map=True, emit=100), "emit"), (PlannerConfig(shared_map=True, scan=1000), "scan")):
        with pytest.raises(ValueError, match=f"config.{name} must be a power of two"):
            plan_groups(**case.plan_inputs(), config=bad)


def test_planner_register_cap_must_be_an_int():
    from qsa.settings import PlannerConfig

    case = make_attention_case(rows=8, num_reqs=1, block_size=16, width=8, seed=3)
    for bad in (0, 16, 128.0, "128"):
        with pytest.raises(ValueError, match="config.max_registers must be None or an int >= 24"):
            plan_groups(**case.plan_inputs(), config=PlannerConfig(shared_map=True, max_registers=bad))


@pytest.mark.parametrize("quads,scan,summary,late,shared_map", [
    (1, 16, True, False, False), slow(2, 32, True, True, False), (32, 1024, True, False, False),
    (32, 1024, False, False, False), (32, 1024, True, True, False), slow(1, 32, True, True, True),
    (32, 1024, True, True, True)])
def test_planner_whole_quads_over_long_contexts(quads, scan, summary, late, shared_map):
    """Contexts of thousands of tokens, odd rows as select_tokens writes them (whole microblocks, each in
    one index quad: the one-lookup path of the bitmap pass), even rows scattered tokens (the per-token
    path), invalid table entries included; many scan steps at the small settings. Scratch left zero."""
    from qsa.settings import PlannerConfig

    case = make_attention_case(rows=19, num_reqs=3, block_size=16, width=40, max_seq_len=6000, seed=22)
    g = torch.Generator().manual_seed(5)
    for r in range(1, 19, 2):
        mbs = torch.randperm(max(int(case.positions[r]), 0) // 4 + 1, generator=g)[:10]
        if int(case.token_to_req[r]) == 2 and not (mbs == 0).any():
            mbs[0] = 0  # block 0 of the last request has an out-of-range table entry: a dropped whole quad
        row = torch.full((40,), -1, dtype=torch.int32)
        row[:4 * len(mbs)] = (4 * mbs[:, None] + torch.arange(4)).reshape(-1)
        case.indices[r] = row
    ref = reference_grouped_plan(**case.plan_inputs())
    assert int(ref.counts.sum()) > 100 and case.block_table.shape[1] * 4 > 1024
    cfg = PlannerConfig(quads=quads, scan=scan, num_warps=4, programs_per_sm=1, summary=summary, late_table=late,
                        shared_map=shared_map)
    ws = PlanWorkspace.for_plan(case.block_table, block_size=16, num_groups=3, config=cfg)
    for _ in range(2):
        assert compare_plans(plan_groups(**case.plan_inputs(), config=cfg, workspace=ws), ref) == []
        assert int(ws.state.count_nonzero()) == 0


def test_planner_config_by_shape():
    """Many groups over a short table scan every word, over a longer one up to the shared map's width
    take the map, past it flagged sectors; the choice depends on shapes only (fixed for a CUDA graph)."""
    from qsa.attention.planning.plan import planner_config
    from qsa.settings import PLANNER, PLANNER_MAP, PLANNER_SHORT, SHARED_MAP_MICROBLOCKS, SHORT_MICROBLOCKS

    assert planner_config(1024, "cpu", SHORT_MICROBLOCKS) is PLANNER_SHORT
    assert planner_config(1024, "cpu", SHORT_MICROBLOCKS + 1) is PLANNER_MAP
    assert planner_config(1024, "cpu", SHARED_MAP_MICROBLOCKS) is PLANNER_MAP
    assert planner_config(1024, "cpu", SHARED_MAP_MICROBLOCKS + 1) is PLANNER
    assert planner_config(1024, "cpu") is PLANNER
    assert PLANNER.summary and not PLANNER_SHORT.summary and PLANNER_SHORT.late_table and PLANNER_MAP.shared_map


# Known-wrong planners: the checks above must reject each of them.

def _wrong_physical_order(plan: GroupedPlan) -> GroupedPlan:
    return physical_order(plan)


def _wrong_masks_not_ored(case) -> GroupedPlan:
    """Aliased entries keep only their first occurrence's mask."""
    single = reference_single_row_plan(**case.plan_inputs())
    ref = reference_grouped_plan(**case.plan_inputs())
    masks = ref.masks.clone()
    for g in range(ref.num_groups):
        seen = {}
        for q in range(8):
            r = g * 8 + q
            if r >= single.num_rows:
                break
            for j in range(int(single.counts[r])):
                seen.setdefault(int(single.mb_ids[r, j]), int(single.masks[r, j]) << (4 * q))
        for e in range(int(ref.counts[g])):
            masks[g, e] = torch.tensor(seen[int(ref.mb_ids[g, e])]).to(torch.int32)
    return GroupedPlan(ref.mb_ids, masks, ref.counts, 8, ref.num_rows, ref.block_size, ref.num_blocks)


def _wrong_padding_to_block0(plan: GroupedPlan) -> GroupedPlan:
    ids = plan.mb_ids.clone()
    for g, n in enumerate(plan.counts.tolist()):
        ids[g, n:(n + PAD - 1) // PAD * PAD] = 0
    return GroupedPlan(ids, plan.masks, plan.counts, plan.group_rows, plan.num_rows, plan.block_size,
                       plan.num_blocks)


def test_known_wrong_planners_are_rejected():
    case = make_attention_case(rows=16, num_reqs=3, block_size=16, width=24, seed=9)
    _, grouped = plans(case)
    _, ref = reference_plans(case)
    assert compare_plans(grouped, ref) == []
    assert compare_plans(_wrong_physical_order(grouped), ref) != []
    assert compare_plans(_wrong_masks_not_ored(case), ref) != []
    assert compare_plans(_wrong_padding_to_block0(grouped), ref) != []
    # Physical order is also caught by the relocation check: its order follows the pages.
    mapping = random_mapping(case.cache.num_blocks, generator=torch.Generator().manual_seed(3))
    moved = case.relocated(mapping)
    _, grouped2 = plans(moved)
    assert compare_plans(physical_order(grouped), physical_order(grouped2), mapping=mapping) != []


def test_bad_inputs_are_named():
    case = make_attention_case(rows=4, num_reqs=2, width=8, seed=10)
    kw = case.plan_inputs()
    with pytest.raises(TypeError, match="indices"):
        plan_single_rows(**{**kw, "indices": kw["indices"].long()})
    with pytest.raises(ValueError, match="token_to_req"):
        plan_single_rows(**{**kw, "token_to_req": kw["token_to_req"][:2]})
    with pytest.raises(TypeError, match="block_table"):
        plan_single_rows(**{**kw, "block_table": kw["block_table"].float()})
    with pytest.raises(ValueError, match="block_size"):
        plan_single_rows(**{**kw, "block_size": 6})
    with pytest.raises(ValueError, match="int32"):
        plan_single_rows(**{**kw, "num_blocks": 2**31})
    with pytest.raises(ValueError, match="group_rows"):
        plan_groups(**kw, group_rows=9)
    with pytest.raises(ValueError, match="num_rows"):
        plan_groups(**kw, num_rows=5)
    with pytest.raises(ValueError, match="row_start"):
        plan_single_rows(**kw, row_start=5)
    for name, fn in (("num_rows", plan_groups), ("group_rows", plan_groups), ("row_start", plan_single_rows),
                     ("chunk", plan_single_rows)):
        with pytest.raises(TypeError, match=f"{name} must be an int, got bool"):
            fn(**kw, **{name: True})
    with pytest.raises(TypeError, match="workspace must be a PlanWorkspace or None, got torch.Tensor"):
        plan_groups(**kw, workspace=torch.zeros(1, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="workspace.bits must have dtype int32"):
        plan_groups(**kw, workspace=PlanWorkspace(bits=torch.zeros(1, 64, dtype=torch.int64)))
    with pytest.raises(TypeError, match="config must be a PlannerConfig or None, got str"):
        plan_groups(**kw, config="fast")
    # numpy integers are integers: the same plans
    ref_single, ref_grouped = plan_single_rows(**kw, chunk=16), plan_groups(**kw, num_rows=3, group_rows=2)
    single = plan_single_rows(**kw, row_start=np.int64(0), chunk=np.int64(16))
    grouped = plan_groups(**kw, num_rows=np.int64(3), group_rows=np.int32(2))
    assert compare_plans(single, ref_single) == [] and compare_plans(grouped, ref_grouped) == []
    assert grouped.group_rows == 2 and type(grouped.group_rows) is int and type(grouped.num_rows) is int


def test_refilled_plans_must_have_the_planners_buffers():
    """``out=`` buffers are written by the kernels at the plan's shapes: a field of another shape, dtype or
    layout is refused, naming it (a [G, 1] masks buffer once took writes of [G, capacity])."""
    case = make_attention_case(rows=12, num_reqs=2, width=8, seed=10)
    kw = case.plan_inputs()
    single, grouped = plans(case)
    for fn, plan, mask_dtype in ((plan_single_rows, single, torch.uint8), (plan_groups, grouped, torch.int32)):
        n, cap = plan.mb_ids.shape
        other = torch.int32 if mask_dtype == torch.uint8 else torch.uint8
        bad = {"masks": [torch.zeros(n, 1, dtype=mask_dtype), torch.zeros(n, cap, dtype=other),
                         torch.zeros(cap, n, dtype=mask_dtype).t()],
               "counts": [torch.zeros(1, dtype=torch.int32), torch.zeros(n, dtype=torch.int64)],
               "mb_ids": [torch.zeros(n, cap, dtype=torch.int64), torch.zeros(n, 2 * cap, dtype=torch.int32)[:, ::2]]}
        for field, tensors in bad.items():
            for t in tensors:
                with pytest.raises((TypeError, ValueError), match=f"out.{field} must"):
                    fn(**kw, out=dataclasses.replace(plan, **{field: t}))
        with pytest.raises(TypeError, match="out must be a"):
            fn(**kw, out=grouped if plan is single else single)
        assert compare_plans(fn(**kw, out=plan), fn(**kw)) == []  # the right buffers are still taken


def test_zero_rows():
    kw = make_attention_case(rows=4, num_reqs=2, width=8, seed=11).plan_inputs()
    kw.update(indices=kw["indices"][:0], token_to_req=kw["token_to_req"][:0], positions=kw["positions"][:0])
    single = plan_single_rows(**kw)
    grouped = plan_groups(**kw)
    assert single.num_rows == 0 and grouped.num_groups == 0


@pytest.mark.parametrize("shuffle,one_chunk", [(False, False), slow(False, True),
                                               slow(True, False), slow(True, True)])
def test_runs_across_chunk_boundaries(shuffle, one_chunk, monkeypatch):
    """Long rows read in several chunks: runs of one microblock straddle chunk boundaries (sorted
    rows), or the row is out of order and goes through the sorting planner. With ``one_chunk`` the
    row planner reads each row in one step and sorts a row out of order itself."""
    if one_chunk:
        monkeypatch.setattr(qsa.attention.planning.plan, "row_plan_chunk", lambda rows, width, device, **kw: 2048)
    width = 700  # the row planner's 512-entry steps on the CPU: two of them, a run across the boundary
    toks = (torch.arange(width) + 1) // 3  # each token about 3 times; microblock runs of ~12 entries
    toks[-7:] = -1
    if shuffle:
        toks = toks[torch.randperm(width, generator=torch.Generator().manual_seed(0))]
    indices = torch.stack([toks, toks.flip(0), toks // 2]).to(torch.int32)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(1)).to(torch.int32)[None, :30]
    args = (indices, table, torch.zeros(3, dtype=torch.int32), torch.tensor([226, 161, 1000]),
            torch.tensor([248], dtype=torch.int32))
    chunk = qsa.attention.planning.plan.row_plan_chunk(3, width, "cpu")
    if not one_chunk:
        assert chunk < width, "the rows must take several steps"
        assert shuffle or toks[chunk - 1] // 4 == toks[chunk] // 4 >= 0, "a run must straddle a step"
    single = plan_single_rows(*args, block_size=16, num_blocks=40)
    ref = reference_single_row_plan(*args, block_size=16, num_blocks=40)
    assert compare_plans(single, ref) == []
    ref_grouped = reference_grouped_plan(*args, block_size=16, num_blocks=40)
    for summary in (True, False):
        cfg = qsa.settings.PlannerConfig(quads=64, scan=32, summary=summary)
        assert compare_plans(plan_groups(*args, block_size=16, num_blocks=40, config=cfg), ref_grouped) == []
    tokens, counts = qsa.attention.planning.plan.token_lists(*args, block_size=16, num_blocks=40)
    for r in range(3):
        kept = sorted({t for t in indices[r].tolist() if 0 <= t <= int(args[3][r]) and t < 248})
        assert counts[r].item() == len(kept) and tokens[r, :len(kept)].tolist() == kept


class _Unlaunchable:
    def __getitem__(self, grid):
        pytest.fail("the sorting planner was launched")


@pytest.mark.slow
def test_row_planner_settings_give_one_plan(monkeypatch):
    """Any step width and warp count of the row planner (as ``benchmarks.tune`` sweeps them) gives the
    reference plan: one step, several steps with runs across step boundaries, rows sorted and not. A
    given step width is the one used (the default choice is never consulted)."""
    case = make_attention_case(rows=9, num_reqs=3, block_size=16, width=70, max_seq_len=200, seed=5)
    key = torch.sort(torch.where(case.indices[::2] < 0, 1 << 30, case.indices[::2]), dim=1).values
    case.indices[::2] = key.masked_fill(key == 1 << 30, -1)  # even rows in order, odd rows as drawn
    inputs = case.plan_inputs()
    ref = reference_single_row_plan(**inputs)
    assert compare_plans(plan_single_rows(**inputs, num_warps=1), ref) == []
    monkeypatch.setattr(qsa.attention.planning.plan, "row_plan_chunk", lambda *a, **kw: pytest.fail("the given chunk was not used"))
    sort_kernel = qsa.attention.planning.kernels.single_row_sort_plan_kernel
    for chunk, warps in ((16, 4), (32, 2), (128, 8)):
        for steps in (False, True):
            for hint in (False, True):
                # rows_sorted on the scan-free steps: a row out of order is sorted by its own program,
                # with no launch of the sorting planner
                monkeypatch.setattr(qsa.attention.planning.kernels, "single_row_sort_plan_kernel",
                                    _Unlaunchable() if steps and hint else sort_kernel)
                plan = plan_single_rows(**inputs, chunk=chunk, num_warps=warps, ascending_steps=steps,
                                        rows_sorted=hint)
                assert compare_plans(plan, ref) == [], (chunk, warps, steps, hint)
    monkeypatch.setattr(qsa.attention.planning.kernels, "single_row_sort_plan_kernel", sort_kernel)
    with pytest.raises(ValueError, match="chunk"):
        plan_single_rows(**inputs, chunk=24)
    with pytest.raises(ValueError, match="num_warps"):
        plan_single_rows(**inputs, num_warps=3)
    with pytest.raises(TypeError, match="ascending_steps"):
        plan_single_rows(**inputs, ascending_steps=1)
    with pytest.raises(TypeError, match="rows_sorted"):
        plan_single_rows(**inputs, rows_sorted=1)


def test_row_planner_default_steps(monkeypatch):
    """One step for up to one row per SM (two for token lists, whose one-step program fits twice per
    SM), steps of 1024 on the scan-free path up to two rows per SM, steps of 512 on the streaming scan
    beyond; a narrow row is one step; the CPU takes short steps."""
    import qsa

    monkeypatch.setattr(qsa.utils, "device_facts", lambda d: {"kind": "cuda", "sm_count": 132})

    def pick(rows, width=2051, tokens=False):
        return (qsa.attention.planning.plan.row_plan_chunk(rows, width, "cuda", tokens=tokens),
                qsa.attention.planning.plan.row_plan_ascending_steps(rows, "cuda"))

    assert pick(8) == (4096, False) and pick(132) == (4096, False)
    assert pick(133) == (1024, True) and pick(256) == (1024, True) and pick(264) == (512, False)
    assert pick(256, tokens=True)[0] == 4096 and pick(264, tokens=True)[0] == 512
    assert pick(256, width=300) == (512, True)
    monkeypatch.setattr(qsa.utils, "device_facts", lambda d: {"kind": "cpu", "sm_count": 2})
    assert pick(1) == (512, False)


def test_ascending_rows_past_the_table():
    """A table narrower than its requests' lengths and positions: on the neighbour-read path (one step,
    several steps) tokens whose block lies past the table's end are dropped and their table entries
    never read (read, they are the next request's pages, or past the table for the last request)."""
    case = make_attention_case(rows=10, num_reqs=3, block_size=16, width=60, max_seq_len=150, padding_rows=0,
                               seed=14)
    case.seq_lens[:] = 150
    case.positions[:] = 149
    case.block_table = case.block_table[:, :4].contiguous()  # 64 tokens per request
    idx = ascending_rows(case.indices)
    idx[0] = torch.arange(30, 90)  # crosses the table's end at 64
    idx[9] = torch.arange(60, 120)  # the last row, of the last request: past the end of the table itself
    case.token_to_req[9] = 2
    case.indices = idx
    inputs = case.plan_inputs()
    ref = reference_single_row_plan(**inputs)
    assert ref.counts.sum() > 0
    assert compare_plans(plan_single_rows(**inputs, chunk=64), ref) == []
    for chunk in (16, 32):
        plan = plan_single_rows(**inputs, chunk=chunk, ascending_steps=True, rows_sorted=True)
        assert compare_plans(plan, ref) == [], chunk


@pytest.mark.parametrize("emit_tokens", [False, True])
def test_ascending_rows_in_one_step(emit_tokens):
    """Rows in ``select_tokens`` order planned in one step (microblock lists: the neighbour-read path;
    token lists: the gather path): microblocks of 1 to 4 kept tokens, a microblock cut by the row's
    position, tokens past the length, the table's end and pages whose table entry is -1 or past the
    cache, in the middle of the row; rows with nothing kept. Also as several steps and shuffled (the
    other paths): one plan."""
    case = make_attention_case(rows=12, num_reqs=3, block_size=16, width=60, max_seq_len=120, seed=12)
    idx = ascending_rows(case.indices)
    idx[0] = torch.cat([torch.arange(0, 45), torch.full((15,), -1)])  # dense: full microblocks then a cut one
    idx[1] = torch.arange(0, 240, 4)  # one token per microblock, past everything at the end
    idx[2] = torch.cat([torch.arange(1, 31, 2), torch.full((45,), -1)])
    idx[3] = torch.cat([torch.arange(0, 40), torch.tensor([3, 41, 42]), torch.full((17,), -1)])  # out of order late
    case.positions[0:4] = torch.tensor([41, 119, 28, 43])
    case.token_to_req[3] = 1
    case.indices = idx
    inputs = case.plan_inputs()
    if emit_tokens:
        tokens, counts = qsa.attention.planning.plan.token_lists(**inputs)
        for r in range(idx.shape[0]):
            kept = _kept_tokens(idx[r].tolist(), int(inputs["token_to_req"][r]), int(inputs["positions"][r]),
                                inputs["seq_lens"], inputs["block_table"], 16, inputs["num_blocks"])
            assert counts[r].item() == len(kept) and tokens[r, :len(kept)].tolist() == kept, r
        return
    ref = reference_single_row_plan(**inputs)
    assert compare_plans(plan_single_rows(**inputs, chunk=64), ref) == []
    assert compare_plans(plan_single_rows(**inputs, chunk=16), ref) == []
    # several steps on the neighbour-read path: runs straddle steps, and row 3 leaves it in a later step,
    # after the steps before were emitted (then the sorting planner, or with rows_sorted its own
    # program, sorts it and emits it again)
    for chunk in (16, 32):
        for hint in (False, True):
            plan = plan_single_rows(**inputs, chunk=chunk, ascending_steps=True, rows_sorted=hint)
            assert compare_plans(plan, ref) == [], (chunk, hint)
    shuffled = case.with_permuted_indices(torch.Generator().manual_seed(13)).plan_inputs()
    assert compare_plans(plan_single_rows(**shuffled, chunk=64), ref) == []


@pytest.mark.parametrize("ascending_steps", [False, True])
@pytest.mark.parametrize("width", [4, 40])
def test_row_planner_keeps_tokens_in_the_last_int32_microblock(ascending_steps, width):
    """Tokens 2**31-4 .. 2**31-2 share a microblock with INT32_MAX, the key a dropped entry sorts as: an
    unsorted row holding one of them and a dropped entry must still emit its microblock (in one step of
    the row planner, and at width 40 over steps of 16 indices)."""
    top = 2**31 - 2
    rows = [[top, 5], [top, top], [5, top, -1], [top - 2, top, 2], [top - 1, -1, top - 3, 9], [top, 2**31 - 1]]
    indices = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)
    n = len(rows)
    inputs = dict(indices=indices, block_table=torch.zeros(1, 2048, dtype=torch.int32),
                  token_to_req=torch.zeros(n, dtype=torch.int32),
                  positions=torch.full((n,), top, dtype=torch.int64),
                  seq_lens=torch.tensor([2**31 - 1], dtype=torch.int32), block_size=1 << 20, num_blocks=1)
    single = plan_single_rows(**inputs, ascending_steps=ascending_steps, chunk=16 if width > 16 else None)
    ref = reference_single_row_plan(**inputs)
    assert ref.counts.tolist() == [2, 1, 2, 2, 3, 1]
    assert compare_plans(single, ref) == []
