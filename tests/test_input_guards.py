"""Guards on inputs the kernels cannot see are wrong: stale plans, rows out of order or with missing group
members in the compressed-key feed, a compressed-key cache of another block size, tensors that require
grad, and the default device of the constructors.

Each guard is also shown to matter: with the guard disabled (monkeypatched) or with the old behaviour,
the bad case goes through and gives a wrong answer.
"""

import dataclasses
import functools

import pytest
import torch

import qsa
import qsa.attention.api
import qsa.model.ops
import qsa.selection.api
import qsa.selection.reference
from helpers import HAS_CUDA
from helpers import make_attention_case
from qsa.attention.reference import reference_attention

NAN = float("nan")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# 1. plans whose inputs changed after planning


def _two_cases(device="cpu"):
    """Two problems of the same shapes and cache: ``b``'s selection and positions differ from ``a``'s."""
    a = make_attention_case(rows=6, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=12, seed=3,
                            device=device)
    b = make_attention_case(rows=6, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=12, seed=3,
                            device=device)
    g = _gen(9)
    b.indices = torch.randint(-1, 40, b.indices.shape, generator=g).to(torch.int32).to(device)
    return a, b


def _plan(case, route, **kw):
    c = case.cache
    return qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                              block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=case.q.shape[1],
                              num_kv_heads=c.num_kv_heads, head_dim=case.q.shape[2], route=route, **kw)


def _run(plan, case):
    return qsa.run_attention(plan, case.q, case.cache.k, case.cache.v, gate=case.gate)


def _reference(case):
    return reference_attention(case.q, case.cache.k, case.cache.v, case.indices, case.block_table,
                               case.token_to_req, case.positions, case.seq_lens, gate=case.gate)[0]


def test_plan_inputs_are_a_typed_record(device):
    a, _ = _two_cases(device)
    plan = _plan(a, "xqa")
    inputs = plan.inputs
    assert isinstance(inputs, qsa.attention.api.PlanInputs)
    assert inputs.indices is a.indices and inputs.seq_lens is a.seq_lens
    assert tuple(inputs) == (a.indices, a.block_table, a.token_to_req, a.positions, a.seq_lens)
    assert inputs[1] is a.block_table and len(inputs) == 5
    assert inputs.versions == tuple(t._version for t in inputs)
    # a tuple given to the plan (dataclasses.replace, a hand-built plan) becomes the record
    moved = dataclasses.replace(plan, inputs=tuple(inputs))
    assert isinstance(moved.inputs, qsa.attention.api.PlanInputs) and moved.inputs.positions is a.positions


@pytest.mark.parametrize("route", ["xqa", "grouped", "splitk", "invariant", "reference"])
@pytest.mark.parametrize("name", qsa.attention.api.PlanInputs.NAMES)
def test_run_refuses_a_plan_whose_inputs_changed(device, route, name):
    a, _ = _two_cases(device)
    plan = _plan(a, route)
    want = _run(plan, a)
    getattr(a, name).add_(0)  # any in-place torch op bumps the version counter, even one that changes no value
    with pytest.raises(ValueError, match=rf"plan's {name} was modified in place.*plan_attention\(\.\.\., out=plan\)"):
        _run(plan, a)
    assert _plan(a, route, out=plan) is plan  # planning again into the same plan clears it
    assert torch.equal(_run(plan, a), want)


def test_a_stale_plan_gives_a_wrong_answer_without_the_check(device, monkeypatch):
    """The bad case the check catches: a plan of ``a``'s selection run after ``b``'s selection was copied
    into the planned tensors reads ``a``'s tokens (the error against ``b``'s reference is large). With the
    check, the same call raises; planned again, the output is right."""
    a, b = _two_cases(device)
    for route in ("xqa", "grouped", "splitk"):
        held = a.indices.clone()
        plan = _plan(a, route)
        a.indices.copy_(b.indices)
        with pytest.raises(ValueError, match="indices was modified in place"):
            _run(plan, a)
        with monkeypatch.context() as m:
            m.setattr(qsa.attention.api.PlanInputs, "check_unchanged", lambda self: None)
            stale = _run(plan, a)
        err = (stale.double() - _reference(b).double()).abs().max().item()
        assert err > 0.05, (route, err)
        _plan(a, route, out=plan)
        fresh = _run(plan, a)
        assert (fresh.double() - _reference(b).double()).abs().max().item() < 1e-2, route
        a.indices.copy_(held)


def test_inference_mode_tensors_are_planned_and_run_unchecked(device):
    """Tensors made under ``torch.inference_mode()`` have no version counter: the plan records None for
    them and runs (the check cannot see their in-place changes)."""
    a, _ = _two_cases(device)
    with torch.inference_mode():
        idx = a.indices.clone()
        pos = a.positions.clone()
        case = dataclasses.replace(a, indices=idx, positions=pos)
        plan = _plan(case, "xqa")
        assert plan.inputs.versions[0] is None and plan.inputs.versions[3] is None
        want = _run(plan, case)
        idx.add_(0)
        assert torch.equal(_run(plan, case), want)
    # the others still are checked
    a.block_table.add_(0)
    with torch.inference_mode(), pytest.raises(ValueError, match="block_table was modified"):
        _run(plan, case)


def test_custom_op_and_fake_tensors_still_plan_and_run(device):
    """The functional custom op plans inside (fresh versions every call); fake tensors carry versions."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, _ = _two_cases(device)
    want = a.run(qsa.sparse_paged_attention, route="xqa")
    assert torch.equal(a.run(qsa.model.ops.sparse_paged_attention, route="xqa"), want)
    with FakeTensorMode():
        t = torch.empty(3, dtype=torch.int32)
        rec = qsa.attention.api.PlanInputs(t, t[None], t, t.long(), t)
        assert rec.versions == (0, 0, 0, 0, 0)
        rec.check_unchanged()


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_of_plan_and_run():
    """Plan + run captured in one CUDA graph: replay after new inputs are copied into the planned tensors
    runs no Python (nothing checked) and matches eager; an eager run of the plan afterwards is refused
    until it is planned again."""
    a, b = _two_cases("cuda")
    static = dataclasses.replace(a, indices=a.indices.clone(), positions=a.positions.clone())
    out = torch.empty_like(a.q)
    plan = _plan(static, "auto")
    qsa.run_attention(plan, static.q, static.cache.k, static.cache.v, gate=static.gate, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _plan(static, "auto", out=plan)
        qsa.run_attention(plan, static.q, static.cache.k, static.cache.v, gate=static.gate, out=out)
    static.indices.copy_(b.indices)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _run(_plan(b, "auto"), b))
    with pytest.raises(ValueError, match="indices was modified in place"):
        _run(plan, static)
    _plan(static, "auto", out=plan)
    assert torch.equal(_run(plan, static), out)


# ---------------------------------------------------------------------------------------------
# 2. compressed-key feeding: rows in any order, groups with members never fed


D, BS = 16, 8  # key width; the main KV cache's block size (2 compressed rows per block)


def _feed_steps(seed=0):
    """Three requests fed over four steps of mixed chunk sizes (positions consecutive per request,
    every step starting where the last one stopped), plus padding rows."""
    g = _gen(seed)
    lengths = (23, 14, 9)
    raw = [torch.randn(L, D, generator=g) for L in lengths]
    chunks = {0: (5, 3, 14, 1), 1: (2, 9, 1, 2), 2: (4, 0, 3, 2)}
    done = [0, 0, 0]
    steps = []
    for s in range(4):
        ks, reqs, poss = [], [], []
        for r in range(3):
            n = chunks[r][s]
            ks.append(raw[r][done[r]:done[r] + n])
            reqs += [r] * n
            poss += list(range(done[r], done[r] + n))
            done[r] += n
        ks.append(torch.randn(2, D, generator=g))
        reqs += [-1, 1]
        poss += [3, -1]
        steps.append((torch.cat(ks), torch.tensor(reqs, dtype=torch.int32), torch.tensor(poss)))
    assert done == list(lengths)
    return raw, steps


def _shuffled(step, seed):
    raw, req, pos = step
    p = torch.randperm(req.shape[0], generator=_gen(seed))
    return raw[p], req[p], pos[p]


def _fresh_state(device, num_reqs=3, stale=NAN):
    kc = torch.full((3 * 6 + 2, BS // 4, D), NAN, device=device)
    partial = torch.full((num_reqs, 3, D), stale, device=device)
    bt = torch.randperm(3 * 6 + 2, generator=_gen(5))[:18].reshape(3, 6).to(torch.int32).to(device)
    return kc, partial, bt


def _feed(update, steps, device, *, track=True, transform=None, **kw):
    kc, partial, bt = _fresh_state(device)
    next_pos = torch.zeros(3, dtype=torch.int64, device=device) if track else None
    for raw, req, pos in steps:
        if transform is not None:
            kw["transform"] = transform
        update(raw.to(device), req.to(device), pos.to(device), kc, bt, partial, block_size=BS,
               next_pos=next_pos, **kw)
    return kc.cpu(), partial.cpu(), None if next_pos is None else next_pos.cpu(), bt.cpu()


def _keys_of(kc, bt, r, n_groups):
    return torch.stack([kc[int(bt[r, b // (BS // 4)]), b % (BS // 4)] for b in range(n_groups)])


def _same_state(x, y):
    (kc_x, part_x, nxt_x, _), (kc_y, part_y, nxt_y, _) = x, y
    return (torch.equal(kc_x.nan_to_num(7.0), kc_y.nan_to_num(7.0)) and torch.equal(part_x.nan_to_num(7.0),
            part_y.nan_to_num(7.0)) and (nxt_x is None and nxt_y is None or torch.equal(nxt_x, nxt_y)))


def _rope_like(kc, block_idx):
    ang = (4 * block_idx).double()[:, None] * torch.arange(kc.shape[1], dtype=torch.float64, device=kc.device) * 0.01
    return kc * torch.cos(ang).float() + 0.5


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("track,transform", [(True, None), (False, None), (True, _rope_like)])
def test_shuffled_rows_give_the_in_order_keys_bitwise(device, backend, track, transform):
    raw, steps = _feed_steps()
    update = functools.partial(qsa.selection.api.update_compressed_keys, backend=backend)
    in_order = _feed(update, steps, device, track=track, transform=transform)
    for seed in (1, 2):
        shuffled = _feed(update, [_shuffled(s, seed + i) for i, s in enumerate(steps)], device, track=track,
                         transform=transform)
        assert _same_state(shuffled, in_order), seed
    kc, partial, nxt, bt = in_order
    for r, x in enumerate(raw):
        want = qsa.selection.reference.compressed_keys_reference(x, transform)
        assert torch.equal(_keys_of(kc, bt, r, want.shape[0]), want), r
        open_ = x.shape[0] % 4
        assert torch.equal(partial[r, :open_], x[x.shape[0] - open_:]), r
    if track:
        assert nxt.tolist() == [23, 14, 9]


def test_both_backends_and_the_op_write_the_same_bits(device):
    raw, steps = _feed_steps(seed=3)
    steps = [_shuffled(s, 10 + i) for i, s in enumerate(steps)]
    got = [_feed(functools.partial(qsa.selection.api.update_compressed_keys, backend=b), steps, device) for b in ("torch", "triton")]
    assert _same_state(got[0], got[1])
    w = torch.randn(D, generator=_gen(4)) * 0.1
    via_op = [_feed(functools.partial(qsa.model.ops.update_compressed_keys, norm_weight=w.to(device), rotary_dim=8,
                                      backend=b), steps, device) for b in ("torch", "triton")]
    assert _same_state(via_op[0], via_op[1])


def _old_adjacent_update(raw_k, token_to_req, positions, kc_cache, block_table, partial, *, block_size,
                         next_pos=None, transform=None):
    """The former algorithm (a known-wrong variant for shuffled rows): a member of a row's group is the row
    ``back`` places before it in the batch when that row has the expected request and position, else the
    saved partial; the open group is saved by the row whose successor is not its next position."""
    T, Dk = raw_k.shape
    num_reqs = block_table.shape[0]
    req, pos = token_to_req.long(), positions.long()
    ok = (req >= 0) & (req < num_reqs) & (pos >= 0)
    req_c, pos_c = torch.where(ok, req, 0), torch.where(ok, pos, 0)
    j = pos_c % 4
    t = torch.arange(T)
    x = raw_k.float()
    grp = torch.zeros(T, 4, Dk)
    for m in range(4):
        back = j - m
        src = (t - back).clamp(0, T - 1)
        in_step = (back >= 0) & (t - back >= 0) & (req[src] == req) & (pos[src] == pos_c - back)
        grp[:, m] = torch.where(in_step[:, None], x[src],
                                torch.where(((back >= 0) & (m < 3))[:, None], partial[req_c, min(m, 2)], 0.0))
    kc_new = (((grp[:, 0] + grp[:, 1]) + grp[:, 2]) + grp[:, 3]) * 0.25
    rpb = kc_cache.shape[1]
    b = pos_c // 4
    page = block_table.long()[req_c, (b // rpb).clamp(max=block_table.shape[1] - 1)]
    close = ok & (j == 3) & (b // rpb < block_table.shape[1]) & (page >= 0) & (page < kc_cache.shape[0])
    kc_cache[page[close], (b % rpb)[close]] = kc_new[close].to(kc_cache.dtype)
    nxt = (t + 1).clamp(max=T - 1)
    last = (t + 1 >= T) | (req[nxt] != req) | (pos[nxt] != pos + 1)
    for m in range(3):
        sel = ok & (j != 3) & last & (j >= m)
        partial[req_c[sel], m] = grp[sel, m]


def test_the_adjacency_assumption_is_rejected_by_the_shuffled_test():
    """The former algorithm is right on rows in order and wrong on the same rows shuffled: the shuffled
    comparison above rejects it."""
    _, steps = _feed_steps()
    in_order = _feed(qsa.selection.api.update_compressed_keys, steps, "cpu", track=False)
    assert _same_state(_feed(_old_adjacent_update, steps, "cpu", track=False), in_order)
    shuffled = _feed(_old_adjacent_update, [_shuffled(s, 1 + i) for i, s in enumerate(steps)], "cpu", track=False)
    assert not _same_state(shuffled, in_order)
    err = (shuffled[0].nan_to_num(0.0) - in_order[0].nan_to_num(0.0)).abs().max().item()
    assert err > 0.1


def _cache(device):
    return qsa.selection.api.CompressedKeyCache(6, BS, 2, dim=D, dtype=torch.float32, device=device)


def _bt(device):
    return torch.tensor([[3, 1, 4], [0, 2, 5]], dtype=torch.int32, device=device)


def _t(values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_first_row_at_position_2_is_refused_at_once(device, backend):
    """No earlier step fed positions 0-1 of request 0: on the CPU and with the torch backend a ValueError
    names the request and the position, and nothing is written."""
    if device == "cuda" and backend == "triton":
        pytest.skip("the GPU kernel path records refusals instead (see the next test)")
    c = _cache(device)
    c.partial.fill_(5.0)  # stale: an earlier request's open group in this slot
    before = (c.kc_cache.clone(), c.partial.clone(), c.next_pos.clone())
    raw = torch.randn(3, D, generator=_gen(1)).to(device)
    with pytest.raises(ValueError, match=r"refused position 2 of request 0: the earlier members 0\.\.1"):
        c.update(raw, _t([0, 0, 1], device, torch.int32), _t([2, 3, 0], device), _bt(device), backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(before, (c.kc_cache, c.partial, c.next_pos)))


def test_the_gpu_path_records_refusals_for_check(device, monkeypatch):
    """The kernel path on a GPU does not synchronise: refused groups are skipped and counted on the device,
    and ``check()`` raises the same ValueError (here forced on the CPU interpreter)."""
    monkeypatch.setattr(qsa.selection.api, "_refuses_at_once", lambda backend, dev: False)
    c = _cache(device)
    c.partial.fill_(5.0)
    raw = torch.randn(4, D, generator=_gen(2)).to(device)
    bt = _bt(device)
    c.update(raw, _t([1, 0, 1, 0], device, torch.int32), _t([1, 2, 0, 3], device), bt, backend="triton")
    assert bool((c.kc_cache[int(bt[0, 0]), 0] == 0).all())       # block 0 of request 0: not written
    assert c.next_pos.tolist() == [4, 2] and c.refusals.tolist() == [2, 0, 2]
    assert torch.equal(c.partial[1, :2].cpu(), raw[[2, 0]].cpu())  # request 1 is fine
    with pytest.raises(ValueError, match=r"refused position 2 of request 0.*1 more row"):
        c.check()
    c.check()  # cleared
    # the next group of request 0 starts clean; a gap (position 5 never fed) leaves its open group broken
    c.update(raw[:2], _t([0, 1], device, torch.int32), _t([4, 2], device), bt, backend="triton")
    assert c.next_pos.tolist() == [5, 3] and c.refusals.tolist() == [0, 0, 0]
    c.update(raw[:1], _t([0], device, torch.int32), _t([6], device), bt, backend="triton")
    assert c.next_pos.tolist() == [-1, 3]
    with pytest.raises(ValueError, match="refused position 6 of request 0"):
        c.check()


def test_without_the_check_a_stale_group_is_written():
    """The bad case the refusal prevents: with no tracking (the former behaviour), block 0 of a request whose
    first row is at position 2 is built from the stale partial group."""
    c = _cache("cpu")
    raw = torch.randn(2, D, generator=_gen(3))
    args = (raw, _t([0, 0], "cpu", torch.int32), _t([2, 3], "cpu"), c.kc_cache, _bt("cpu"), c.partial.fill_(5.0))
    with pytest.raises(ValueError, match="refused position 2 of request 0"):
        qsa.selection.api.update_compressed_keys(*args, block_size=BS, next_pos=c.next_pos)
    qsa.selection.api.update_compressed_keys(*args, block_size=BS)
    written = c.kc_cache[3, 0]
    assert torch.equal(written, (((torch.full((D,), 5.0) + 5.0) + raw[0]) + raw[1]) * 0.25)


def _refused(c, device, backend, match, call):
    """``call()`` is refused: at once, or (the GPU kernel path) recorded for ``c.check()``."""
    if device == "cuda" and backend == "triton":
        call()
        with pytest.raises(ValueError, match=match):
            c.check()
    else:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gaps_prefix_hits_and_resets(device, backend):
    c = _cache(device)
    bt = _bt(device)
    raw = torch.randn(8, D, generator=_gen(4)).to(device)
    # a prefix-cache hit of whole groups: the first step starts at position 8 (block 2), accepted
    c.update(raw[:5], _t([1] * 5, device, torch.int32), _t([8, 9, 10, 11, 12], device), bt, backend=backend)
    assert torch.equal(c.kc_cache[int(bt[1, 1]), 0].cpu(), qsa.selection.reference.compressed_keys_reference(raw[:4].cpu())[0])
    assert c.next_pos.tolist() == [0, 13]
    # a gap inside a step: position 14 of request 1 misses position 13
    _refused(c, device, backend, "refused position 14 of request 1",
             lambda: c.update(raw[:2], _t([1, 1], device, torch.int32), _t([15, 14], device), bt, backend=backend))
    # a slot given to a new request: its open group is forgotten
    c.reset(1)
    assert c.next_pos.tolist() == [0, 0]
    _refused(c, device, backend, "refused position 13 of request 1",
             lambda: c.update(raw[:1], _t([1], device, torch.int32), _t([13], device), bt, backend=backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_duplicated_rows_last_wins(device, backend):
    """Several rows with one (request, position): the last in the batch is used, the others ignored."""
    raw = torch.randn(7, D, generator=_gen(6))
    req = _t([0, 0, 0, 0, 0, 0, 0], "cpu", torch.int32)
    pos = _t([0, 1, 2, 1, 3, 4, 4], "cpu")
    kept = [0, 2, 3, 4, 6]  # rows 1 (position 1) and 5 (position 4) are shadowed by later duplicates
    first_wins = [0, 1, 2, 4, 5]  # a known-wrong rule: the test below tells it apart
    states = []
    for rows in (list(range(7)), kept, first_wins):
        c = _cache(device)
        c.update(raw[rows].to(device), req[rows].to(device), pos[rows].to(device), _bt(device), backend=backend)
        states.append((c.kc_cache.cpu(), c.partial.cpu(), c.next_pos.cpu(), None))
    assert _same_state(states[0], states[1])
    assert not _same_state(states[0], states[2])
    want = (((raw[0] + raw[3]) + raw[2]) + raw[4]) * 0.25
    assert torch.equal(states[0][0][3, 0], want) and torch.equal(states[0][1][0, 0], raw[6])


def test_feeding_checks_its_state_tensors(device, monkeypatch):
    c = _cache(device)
    args = (torch.zeros(2, D, device=device), _t([0, 0], device), _t([0, 1], device), c.kc_cache, _bt(device),
            c.partial)
    for kw, exc, match in ((dict(next_pos=torch.zeros(2, dtype=torch.int32, device=device)), TypeError, "next_pos"),
                           (dict(next_pos=torch.zeros(3, dtype=torch.int64, device=device)), ValueError,
                            r"next_pos must have shape \[2\]"),
                           (dict(next_pos=torch.zeros(2, 2, dtype=torch.int64, device=device)[:, 0]), ValueError,
                            "next_pos must be contiguous"),
                           (dict(refusals=torch.zeros(2, dtype=torch.int64, device=device)), ValueError, "refusals")):
        with pytest.raises(exc, match=match):
            qsa.selection.api.update_compressed_keys(*args, block_size=BS, **kw)
    # without the shape check, a next_pos shorter than the table is indexed out of bounds
    short = torch.zeros(1, dtype=torch.int64)
    cpu_args = (torch.zeros(2, D), _t([1, 1], "cpu"), _t([0, 1], "cpu"), c.kc_cache.cpu(), _bt("cpu"), c.partial.cpu())
    monkeypatch.setattr(qsa.selection.api, "check_tensor", lambda *a, **k: None)
    with pytest.raises(IndexError):
        qsa.selection.api.update_compressed_keys(*cpu_args, block_size=BS, next_pos=short, backend="torch")


# ---------------------------------------------------------------------------------------------
# 3. the compressed-key cache's geometry is given, not inferred


def _selection_args(device, rows_per_block=3, seed=0):
    """A selection over a kc_cache of ``rows_per_block`` rows per block (3: a cache made for block size 12)."""
    g = _gen(seed)
    kc = torch.randint(-2, 3, (7, rows_per_block, 16), generator=g).float()
    bt = torch.tensor([[4, 1, 6], [2, 0, 5]], dtype=torch.int32)
    q = torch.randint(-2, 3, (3, 2, 16), generator=g).float()
    return tuple(t.to(device) for t in (q, kc, bt, _t([0, 1, 0], "cpu", torch.int32), _t([40, 30, 20], "cpu"),
                                        _t([41, 35], "cpu", torch.int32)))


def test_a_kc_cache_of_another_block_size_is_refused(device, monkeypatch):
    args = _selection_args(device)
    match = r"kc_cache must have block_size // 4 = 4 rows per block \(block_size=16\), got shape \(7, 3, 16\)"
    for fn in (qsa.selection.api.select_tokens, qsa.selection.api.block_scores, qsa.model.ops.select_tokens):
        with pytest.raises(ValueError, match=match):
            fn(*args, block_size=16)
        with pytest.raises(TypeError, match="block_size"):
            fn(*args)  # required: never inferred
        with pytest.raises(ValueError, match="block_size .* must be a positive multiple of 4"):
            fn(*args, block_size=14)
    raw = torch.zeros(2, 16, device=device)
    for fn in (qsa.selection.api.update_compressed_keys, qsa.model.ops.update_compressed_keys):
        with pytest.raises(ValueError, match=match):
            fn(raw, args[3][:2], args[4][:2], args[1], args[2], torch.zeros(2, 3, 16, device=device), block_size=16)
    # what the check prevents: the old inference read this cache as block size 12 and selected silently
    monkeypatch.setattr(qsa.selection.api, "_check_block_size", lambda block_size, kc: block_size)
    qsa.selection.api.select_tokens(*args, block_size=16, k=2)


def test_the_right_block_size_is_accepted_and_the_cache_knows_its_own(device):
    q, kc, bt, req, pos, seq = _selection_args(device, rows_per_block=4)
    want = qsa.selection.reference.select_tokens_reference(q, kc, bt, req, pos, seq, k=3)
    assert torch.equal(qsa.selection.api.select_tokens(q, kc, bt, req, pos, seq, block_size=16, k=3), want)
    assert torch.equal(qsa.model.ops.select_tokens(q, kc, bt, req, pos, seq, block_size=16, k=3, backend="torch"), want)
    c = qsa.selection.api.CompressedKeyCache(7, 16, 2, dim=16, dtype=torch.float32, device=device)
    c.kc_cache.copy_(kc)
    assert c.block_size == 16 and torch.equal(c.select(q, bt, req, pos, seq, k=3), want)


# ---------------------------------------------------------------------------------------------
# 4. forward only


def _grad_case(device):
    return make_attention_case(rows=4, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=8, seed=2,
                               with_gate=True, device=device)


@pytest.mark.parametrize("what", ["q", "gate"])
def test_inputs_that_require_grad_are_refused(device, what):
    c = _grad_case(device)
    setattr(c, what, getattr(c, what).clone().requires_grad_(True))
    plan = _plan(c, "xqa")
    match = rf"{what} requires grad, but qsa attention is forward-only.*torch.no_grad\(\)"
    for call in (lambda: c.run(qsa.sparse_paged_attention), lambda: c.run(qsa.model.ops.sparse_paged_attention),
                 lambda: _run(plan, c)):
        with pytest.raises(ValueError, match=match):
            call()
    want = _grad_case(device).run(qsa.sparse_paged_attention)
    with torch.no_grad():
        assert torch.equal(c.run(qsa.sparse_paged_attention), want)
        assert torch.equal(_run(plan, c), want)
    with torch.inference_mode():
        assert torch.equal(c.run(qsa.model.ops.sparse_paged_attention), want)
    detached = dataclasses.replace(c, **{what: getattr(c, what).detach()})
    assert torch.equal(detached.run(qsa.sparse_paged_attention), want)


def test_without_the_check_the_output_is_silently_detached(device, monkeypatch):
    c = _grad_case(device)
    c.q = c.q.clone().requires_grad_(True)
    monkeypatch.setattr(qsa.attention.api, "check_forward_only", lambda *a, **k: None)
    out = c.run(qsa.sparse_paged_attention)
    assert not out.requires_grad and out.grad_fn is None  # a loss on it would never reach q


def test_the_layer_refuses_grad_too():
    """The layer's attention goes through the same checks (its weights never require grad; x may)."""
    from qsa.model.layer import QSAAttention, QSAConfig, StepMetadata

    cfg = QSAConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, index_heads=4,
                    index_head_dim=16, index_rotary_dim=8, index_topk=4, rope_theta=10000.0)
    layer = QSAAttention(cfg, device="cpu")
    cache = layer.allocate_cache(4, 8, 1, device="cpu")
    meta = StepMetadata.build([0] * 5, list(range(5)), [5], [[1, 2, -1, -1]], list(range(8, 13)), block_size=8,
                              device="cpu", route="reference")
    x = torch.randn(5, 64, generator=_gen(8)).to(cfg.dtype).requires_grad_(True)
    with pytest.raises(ValueError, match="forward-only"):
        layer(x, meta, cache)
    with torch.no_grad():
        assert layer(x, meta, cache).shape == (5, 64)


# ---------------------------------------------------------------------------------------------
# 5. one default device for every constructor


def _tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for t in vars(obj).values() if isinstance(t, torch.Tensor)]


def _follows_default_device(make) -> bool:
    """Whether what ``make()`` builds with no device lands on torch's current default device ("meta" here)."""
    with torch.device("meta"):
        return all(t.device.type == "meta" for t in _tensors_of(make()))


def test_constructors_default_to_torch_default_device():
    alloc = qsa.BlockAllocator(8, 8)
    alloc.allocate("a", 10)
    makers = {
        "CompressedKeyCache": lambda: qsa.selection.api.CompressedKeyCache(4, 8, 2, dim=16),
        "allocate_kv_cache": lambda: qsa.allocate_kv_cache(4, 8, 1, 16),
        "BlockAllocator.block_table": lambda: alloc.block_table(["a"]),
        "BlockAllocator.slot_mapping": lambda: alloc.slot_mapping("a", 0, 5),
    }
    for name, make in makers.items():
        assert _follows_default_device(make), name
    c = qsa.selection.api.CompressedKeyCache(4, 8, 2, dim=16)  # on a CPU-only machine: the CPU, no CUDA error
    assert c.kc_cache.device == torch.get_default_device()
    # the former fixed defaults are rejected by the same test
    assert not _follows_default_device(lambda: qsa.allocate_kv_cache(4, 8, 1, 16, device="cpu"))
    if not HAS_CUDA:
        with pytest.raises((AssertionError, RuntimeError)):
            qsa.selection.api.CompressedKeyCache(4, 8, 2, dim=16, device="cuda")
