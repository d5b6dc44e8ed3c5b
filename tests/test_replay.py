"""Replayed eager calls (qsa.attention.replay): the second call of a shape launches what the first recorded.

A replay must give the bits the full path gives on the same inputs, for every route and cache dtype, with
every input at a new address; it must never run with a stale pointer, never serve a call whose settings
changed, and leave every bad-input check in force. On the CPU the replay runs under the Triton
interpreter (``replay.ON_INTERPRETER``); on a GPU the same tests run the compiled handles.
"""

from dataclasses import replace

import pytest
import torch

import qsa
from helpers import HAS_CUDA, assert_bitwise, check_against_reference, make_attention_case, poisoned, slow
from qsa import settings
from qsa.attention import api, replay
from qsa.cache.paged import random_mapping

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                               pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])]


@pytest.fixture(autouse=True)
def replays_on(monkeypatch):
    monkeypatch.setattr(replay, "ON_INTERPRETER", True)
    monkeypatch.setattr(settings, "REPLAY_STEPS", True)
    api._STEPS.clear()
    yield
    api._STEPS.clear()


def case_for(device, kv="auto", seed=1, **kw):
    return make_attention_case(rows=10, num_reqs=2, num_q_heads=2, num_kv_heads=1, head_dim=16, width=24,
                               kv_cache_dtype=kv, seed=seed, device=device, **kw)


def moved(case, seed):
    """The same shapes with every input a new tensor at a new address and new values: the cache's pages
    moved (a new table), a new selection in every row (out-of-range and -1 entries included), new q.
    A replay that skipped any planning step, or kept any pointer of the first call, gives other bits."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    case = case.relocated(random_mapping(case.cache.num_blocks, generator=g).to(case.q.device))
    q = torch.randn(case.q.shape, generator=g).to(case.q.dtype).to(case.q.device)
    hi = int(case.seq_lens.max()) + 3
    indices = torch.randint(-1, hi, case.indices.shape, generator=g, dtype=torch.int32).to(case.q.device)
    return replace(case, q=q, gate=None if case.gate is None else case.gate.clone(), indices=indices,
                   token_to_req=case.token_to_req.clone(), positions=case.positions.clone(),
                   seq_lens=case.seq_lens.clone())


def call(case, **kw):
    return case.run(qsa.sparse_paged_attention, return_lse=True, **kw)


def entries():
    return list(api._STEPS.entries.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route,kv", [(route, "auto") for route in ("auto", "grouped", "xqa", "splitk", "invariant")]
                         + [("auto", "fp8_e4m3"), slow("grouped", "fp8_e4m3"), slow("xqa", "fp8_e4m3"),
                            slow("splitk", "fp8_e4m3"), slow("invariant", "fp8_e4m3")])
def test_a_replay_gives_the_full_paths_bits(device, kv, route):
    first = case_for(device, kv, with_gate=route == "auto")
    call(first, route=route, out=poisoned(first.q.shape, first.q.dtype, first.q.device))
    assert len(entries()) == 1 and isinstance(entries()[0], replay.Replay), "the first call recorded no replay"
    second = moved(first, seed=7)
    out = poisoned(second.q.shape, second.q.dtype, second.q.device)
    got = call(second, route=route, out=out)
    assert got[0] is out and api._STEPS.hits == 1, "the second call was not replayed"
    api._STEPS.clear()
    full = call(second, route=route, out=poisoned(second.q.shape, second.q.dtype, second.q.device))
    assert_bitwise(got, full, f"{route} replay vs full path")
    check_against_reference(second, got, name=f"{route} replay")


@pytest.mark.parametrize("device", DEVICES)
def test_a_held_plan_replays_its_run(device):
    case = case_for(device)
    c = case.cache
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                              block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2, num_kv_heads=1,
                              head_dim=16)
    first = qsa.run_attention(plan, case.q, c.k, c.v, return_lse=True)
    assert any(isinstance(e, replay.Replay) for e in plan.replays.entries.values())
    q2 = torch.randn_like(case.q)
    got = qsa.run_attention(plan, q2, c.k, c.v, return_lse=True)
    assert plan.replays.hits == 1, "the second run was not replayed"
    plan.replays.clear()
    full = qsa.run_attention(plan, q2, c.k, c.v, return_lse=True)
    assert_bitwise(got, full, "run replay vs full run")
    assert not torch.equal(first[0], got[0])
    # an input changed in place is still refused on the replayed path
    qsa.run_attention(plan, q2, c.k, c.v)
    case.positions.add_(0)
    with pytest.raises(ValueError, match="positions"):
        qsa.run_attention(plan, q2, c.k, c.v)
    # a plan refilled in place drops the launches recorded for its old buffers
    plan2 = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                               block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2, num_kv_heads=1,
                               head_dim=16, route="splitk", out=plan)
    assert plan2 is plan and not plan.replays.entries
    assert_bitwise(qsa.run_attention(plan, q2, c.k, c.v, return_lse=True),
                   call(case_like(case, q2), route="splitk"), "refilled plan")


def case_like(case, q):
    return replace(case, q=q)


def plan_into(case, plan=None, route="auto"):
    c = case.cache
    return qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                              block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2, num_kv_heads=1,
                              head_dim=16, route=route, out=plan, max_query_len=5)


def test_a_plans_input_pointers_are_its_run_inputs_in_their_order():
    """A replayed run on the GPU takes the plan's inputs as the pointers ``PlanInputs.pointers`` read once:
    they must be the data pointers of the run's inputs after the activations, in ``RUN_INPUTS`` order
    (counts included), and a refill's pointers are the new inputs'."""
    case = case_for("cpu")
    counts = torch.full((case.q.shape[0],), 20, dtype=torch.int32)
    c = case.cache
    plan = qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens,
                              block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2, num_kv_heads=1,
                              head_dim=16, index_counts=counts)
    values = api._run_values(plan, case.q, c.k, c.v, None, case.q, None)
    assert api.RUN_INPUTS[6:] == api.PlanInputs.NAMES + ("index_counts",)
    assert plan.inputs.pointers() == tuple(t.data_ptr() for t in values[6:])
    assert values[6:] == (case.indices, case.block_table, case.token_to_req, case.positions, case.seq_lens, counts)
    other = moved(case, seed=5)
    plan_into(other, plan)
    assert plan.inputs.pointers() == (other.indices.data_ptr(), other.block_table.data_ptr(),
                                      other.token_to_req.data_ptr(), other.positions.data_ptr(),
                                      other.seq_lens.data_ptr(), 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["auto", "grouped", "xqa", "splitk", "invariant"])
def test_a_refilled_plan_replays_its_planning_and_its_run(device, route):
    """A plan refilled (``out=``) with a new selection of the same shapes, pages moved, replays the planner
    launches into its buffers and then its recorded run: the full path's bits, checked against the
    reference."""
    first = case_for(device)
    plan = plan_into(first, plan_into(first, route=route), route=route)  # recorded by the second planning
    recorded = plan.plan_replay
    assert recorded is not None and isinstance(recorded[2], replay.Replay), "the refill recorded no replay"
    qsa.run_attention(plan, first.q, first.cache.k, first.cache.v, return_lse=True)
    second = moved(first, seed=11)
    assert plan_into(second, plan, route=route) is plan and plan.plan_replay is recorded, "the refill was not replayed"
    assert plan.inputs.indices is second.indices
    got = qsa.run_attention(plan, second.q, second.cache.k, second.cache.v, return_lse=True)
    assert plan.replays.hits == 1, "the run of the refilled plan was not replayed"
    full = call(second, route=route, max_query_len=5)
    assert_bitwise(got, full, f"{route} refilled plan replay vs full path")
    check_against_reference(second, got, name=f"{route} refilled plan replay")


@pytest.mark.parametrize("device", DEVICES)
def test_a_refill_with_the_plans_own_workspace_is_replayed(device):
    """An engine that keeps the grouped planner's workspace and passes it back with ``out=`` gets the
    replayed planning (the workspace is one of the plan's own buffers); a workspace the plan does not
    hold takes the full path, and the plan keeps it for the next refill."""
    from qsa.attention.planning.plan import PlanWorkspace

    first = case_for(device)
    c = first.cache

    def refill(case, plan, ws):
        return qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions,
                                  case.seq_lens, block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2,
                                  num_kv_heads=1, head_dim=16, route="grouped", out=plan, workspace=ws,
                                  max_query_len=5)

    plan = refill(first, None, None)
    ws = PlanWorkspace.for_plan(first.block_table, block_size=c.block_size, num_groups=plan.grouped.num_groups)
    assert plan.workspace is not ws
    refill(first, plan, ws)  # another workspace: the full path, which the plan then holds
    assert plan.workspace is ws and plan.plan_replay is None
    refill(first, plan, ws)
    recorded = plan.plan_replay
    assert recorded is not None and isinstance(recorded[2], replay.Replay), "the plan's own workspace was not recorded"
    second = moved(first, seed=19)
    assert refill(second, plan, ws) is plan and plan.plan_replay is recorded, "the refill was not replayed"
    got = qsa.run_attention(plan, second.q, second.cache.k, second.cache.v, return_lse=True)
    assert_bitwise(got, call(second, route="grouped", max_query_len=5), "workspace refill replay vs full path")
    check_against_reference(second, got, name="workspace refill replay")
    other = PlanWorkspace.for_plan(first.block_table, block_size=c.block_size, num_groups=plan.grouped.num_groups)
    refill(second, plan, other)
    assert plan.workspace is other and plan.plan_replay is None, "a foreign workspace was replayed"


def test_a_planning_that_cannot_be_replayed_is_not_recorded_again():
    """A plan in physical order is sorted through a temporary (no input, not owned): its layout is marked
    unreplayable once, and later refills take the full path without recording (the mark stays)."""
    first = case_for("cpu")
    c = first.cache

    def physical(case, plan):
        return qsa.plan_attention(case.indices, case.block_table, case.token_to_req, case.positions,
                                  case.seq_lens, block_size=c.block_size, num_blocks=c.num_blocks, num_q_heads=2,
                                  num_kv_heads=1, head_dim=16, route="grouped", order="physical", out=plan)

    plan = physical(first, physical(first, None))
    mark = plan.plan_replay
    assert mark is not None and mark[2] is None
    second = moved(first, seed=17)
    assert physical(second, plan).plan_replay is mark, "an unreplayable layout was recorded again"
    assert plan.inputs.indices is second.indices
    got = qsa.run_attention(plan, second.q, second.cache.k, second.cache.v, return_lse=True)
    assert_bitwise(got, qsa.run_attention(physical(second, None), second.q, second.cache.k, second.cache.v,
                                          return_lse=True), "unreplayed refill vs a new plan")


@pytest.mark.parametrize("device", DEVICES)
def test_a_planning_replay_that_read_the_old_selection_is_caught(device):
    """Known-wrong variant: a planning replay whose launches lost the slot of ``indices`` plans the first
    selection again; the comparison with the full path above must reject it."""
    first = case_for(device)
    plan = plan_into(first, plan_into(first, route="grouped"), route="grouped")
    step = plan.plan_replay[2]
    step.drop_input("indices")
    second = moved(first, seed=13)
    plan_into(second, plan, route="grouped")
    stale = qsa.run_attention(plan, second.q, second.cache.k, second.cache.v, return_lse=True)
    full = call(second, route="grouped", max_query_len=5)
    assert not torch.equal(stale[0].nan_to_num(), full[0].nan_to_num()), "a stale selection went unnoticed"


@pytest.mark.parametrize("device", DEVICES)
def test_a_temporary_argument_is_never_replayed(device):
    """A negative softmax scale makes the launchers pass a negated copy of q: no input, no owned buffer.
    Such a shape keeps the full path (its entry is None) and stays correct."""
    case = case_for(device)
    a = call(case, softmax_scale=-0.25)
    assert entries() == [None]
    b = call(case, softmax_scale=-0.25)
    assert_bitwise(a, b, "negative scale, twice")


@pytest.mark.parametrize("device", DEVICES)
def test_a_settings_change_drops_every_replay(device, monkeypatch):
    case = case_for(device)
    call(case, route="xqa")
    assert len(entries()) == 1
    monkeypatch.setattr(settings, "MAX_SPLITS", settings.MAX_SPLITS + 1)
    call(case, route="xqa")
    assert len(entries()) == 1 and api._STEPS.hits == 0, "a replay served a call under other settings"
    monkeypatch.setattr(settings, "REPLAY_STEPS", False)
    api._STEPS.clear()
    call(case, route="xqa")
    assert entries() == [], "REPLAY_STEPS off still recorded"


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_is_refused_after_a_replayed_shape(device):
    case = case_for(device)
    call(case)
    call(case)
    with pytest.raises((TypeError, ValueError), match="indices"):
        qsa.sparse_paged_attention(case.q, case.cache.k, case.cache.v, case.indices.long(), case.block_table,
                                   case.token_to_req, case.positions, case.seq_lens)
    with pytest.raises((TypeError, ValueError), match="q"):
        qsa.sparse_paged_attention(case.q.float(), case.cache.k, case.cache.v, case.indices, case.block_table,
                                   case.token_to_req, case.positions, case.seq_lens)


@pytest.mark.parametrize("device", DEVICES)
def test_a_replay_that_kept_a_stale_pointer_is_caught(device):
    """Known-wrong variant: a replay whose launches lost the slot of ``q`` keeps reading the first call's q.
    The bitwise comparison with the full path, as the tests above make it, must reject it."""
    first = case_for(device)
    call(first, route="xqa")
    (step,) = entries()
    step.drop_input("q")
    second = moved(first, seed=3)
    stale = call(second, route="xqa")
    api._STEPS.clear()
    full = call(second, route="xqa")
    assert not torch.equal(stale[0], full[0]), "a stale q went unnoticed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["grouped", "splitk"])
def test_a_replay_that_skipped_a_planning_launch_is_caught(device, route):
    """Known-wrong variant: a replay without its first launch that reads ``indices`` (the planner's) runs
    the attention kernels on the first call's work lists. The new selection of :func:`moved` must make that
    visible. (A launch that reads only the row metadata, which :func:`moved` keeps, would change nothing.)"""
    first = case_for(device)
    call(first, route=route)
    (step,) = entries()
    first_launch = next(i for i, s in enumerate(step.steps)
                        if s[0] == "launch" and any(slot[1] == "indices" for slot in s[1].slots))
    step.drop_launch(first_launch)
    second = moved(first, seed=5)
    stale = call(second, route=route)
    assert api._STEPS.hits == 1
    api._STEPS.clear()
    full = call(second, route=route)
    assert not torch.equal(stale[0].nan_to_num(), full[0].nan_to_num()), "a skipped planning launch went unnoticed"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_misaligned_input_takes_the_full_path():
    """The compiled kernels assume 16-byte aligned pointers where the recording call had them: a q at an
    odd offset with the same strides must not be launched through the replay."""
    case = case_for("cuda")
    rows, hq, d = case.q.shape
    base = torch.randn(rows * hq * d + 1, device="cuda").to(case.q.dtype)
    aligned = base[:-1].view(rows, hq, d)
    odd = base[1:].view(rows, hq, d)
    call(case_like(case, aligned.copy_(case.q)), route="xqa")
    got = call(case_like(case, odd), route="xqa")
    assert api._STEPS.hits == 0, "a refused replay was counted as served"
    api._STEPS.clear()
    full = call(case_like(case, odd.clone()), route="xqa")
    assert_bitwise(got, full, "misaligned q")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_graph_capture_records_nothing_and_replays_bitwise():
    case = case_for("cuda")
    out = torch.empty_like(case.q)
    lse = None
    eager = call(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        case.run(qsa.sparse_paged_attention, out=out)
    torch.cuda.current_stream().wait_stream(side)
    before = len(entries())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        case.run(qsa.sparse_paged_attention, out=out)
    assert len(entries()) == before, "a call under capture was recorded"
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and lse is None


class StandInCompiled:
    """Stands in for a compiled Triton kernel: its launcher records what it is called with."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class StandInKernel:
    """Stands in for a JIT kernel: one device cache whose binder orders the arguments as Triton's does
    (runtime arguments, then constexprs by name)."""

    def __init__(self, names):
        self.names = names
        self.fn = self.binder
        self.device_caches = {0: (None, None, None, None, self.binder)}

    def binder(self, *args, **kwargs):
        bound = dict(zip(self.names, args))
        bound.update((k, v) for k, v in kwargs.items() if k.isupper())
        return bound, None, None


def recorded(kernel, compiled, args, kwargs, owned=()):
    rec = replay.Recorder()
    rec.steps.append(("launch", kernel, (3, 2), args, kwargs, compiled))
    rec.owned.extend(owned)
    return rec


def test_the_compiled_path_launches_new_pointers_into_the_recorded_arguments():
    """The GPU path of a replay, against a stand-in launcher: each input slot gets the new input's
    pointer, owned buffers and integers keep theirs, constexprs follow in order, hooks are None."""
    q, out, scratch = torch.zeros(64), torch.zeros(64), torch.zeros(32)
    kernel, compiled = StandInKernel(["q", "out", "scratch", "n", "scale"]), StandInCompiled()
    rec = recorded(kernel, compiled, (q, out, scratch, 7, 0.5), dict(BLOCK=16, num_warps=4), owned=[scratch])
    step = replay.Replay(rec, dict(q=q, out=out), [], cuda=True)
    q2, out2 = torch.zeros(64), torch.zeros(64)
    assert step(dict(q=q2, out=out2), stream=11)
    (call,) = compiled.calls
    assert call[:10] == (3, 2, 1, 11, "function", "metadata", None, None, None, q2.data_ptr())
    assert call[10:] == (out2.data_ptr(), scratch.data_ptr(), 7, 0.5, 16)


class StandInLauncher:
    """Stands in for Triton 3.6's launcher object: scratch sizes, launch flags and a C ``launch`` that
    records its arguments; called itself, it records that it was."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, scratch=0):
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.direct, self.calls = [], []

    def launch(self, *args):
        self.direct.append(args)

    def __call__(self, *args):
        self.calls.append(args)


class StandInLaunched(StandInCompiled):
    def __init__(self, scratch=0):
        super().__init__()
        self.run = StandInLauncher(scratch)


def test_a_kernel_without_scratch_is_launched_through_the_c_launcher():
    """The C ``launch`` gets the grid, the call's stream, the function, the two launch flags, no scratch,
    the packed metadata, no launch metadata, no hooks, then the arguments with the new pointers."""
    q, out = torch.zeros(64), torch.zeros(64)
    kernel, compiled = StandInKernel(["q", "out", "n"]), StandInLaunched()
    step = replay.Replay(recorded(kernel, compiled, (q, out, 5), dict(BLOCK=8)), dict(q=q, out=out), [], cuda=True,
                         stream=11)
    q2, out2 = torch.zeros(64), torch.zeros(64)
    assert step(dict(q=q2, out=out2), stream=11) and step(dict(q=q, out=out2), stream=12)
    assert compiled.run.calls == []
    first, second = compiled.run.direct
    assert first == (3, 2, 1, 11, "function", False, True, None, None, "metadata", None, None, None,
                     q2.data_ptr(), out2.data_ptr(), 5, 8)
    assert second[3] == 12 and second[13:15] == (q.data_ptr(), out2.data_ptr())


def test_a_kernel_with_scratch_goes_through_the_launcher_object():
    """Known-wrong for the direct path: a kernel that needs global scratch must not be launched by the C
    function with no scratch pointer; Triton's launcher object allocates it."""
    q, out = torch.zeros(64), torch.zeros(64)
    kernel, compiled = StandInKernel(["q", "out"]), StandInLaunched(scratch=128)
    step = replay.Replay(recorded(kernel, compiled, (q, out), {}), dict(q=q, out=out), [], cuda=True)
    assert step(dict(q=q, out=out), stream=4)
    assert compiled.run.direct == []
    assert compiled.run.calls == [(3, 2, 1, 4, "function", "metadata", None, None, None, q.data_ptr(), out.data_ptr())]


def test_the_compiled_path_refuses_a_misaligned_input_before_launching():
    q, out = torch.zeros(64), torch.zeros(64)
    kernel, compiled = StandInKernel(["q", "out"]), StandInCompiled()
    step = replay.Replay(recorded(kernel, compiled, (q, out), {}), dict(q=q, out=out), [], cuda=True)
    odd = torch.zeros(65)[1:]
    assert odd.data_ptr() % 16 and not step(dict(q=odd, out=out), stream=0)
    assert compiled.calls == [], "launched with a pointer the kernel assumes aligned"


def test_a_cache_counts_the_calls_its_replays_served_not_those_they_refused():
    q, out = torch.zeros(64), torch.zeros(64)
    kernel, compiled = StandInKernel(["q", "out"]), StandInCompiled()
    step = replay.Replay(recorded(kernel, compiled, (q, out), {}), dict(q=q, out=out), [], cuda=True)
    cache = replay.ReplayCache()
    assert cache.get("key", ()) is cache  # never seen
    cache.put("key", step)
    entry = cache.get("key", ())
    assert entry is step and cache.hits == 0
    assert not cache.serve(entry, dict(q=torch.zeros(65)[1:], out=out), stream=0) and cache.hits == 0
    assert cache.serve(entry, dict(q=q, out=out), stream=0) and cache.hits == 1
    assert len(compiled.calls) == 1, "one launch, of the served call"


def test_a_launch_takes_its_inputs_in_the_records_order_tensors_or_pointers():
    """``Replay.launch`` takes the inputs as a tuple in the order of the recorded dict, each a tensor or its
    data pointer already read (GPU path); an unused input is never read. Known-wrong: the same values in
    another order launch other pointers."""
    q, out, unused = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    kernel, compiled = StandInKernel(["q", "out"]), StandInCompiled()
    step = replay.Replay(recorded(kernel, compiled, (q, out), {}), dict(unused=unused, q=q, out=out), [], cuda=True)
    assert step.inputs_order == ("unused", "q", "out")
    q2, out2 = torch.zeros(64), torch.zeros(64)
    assert step.launch(("never read", q2, out2.data_ptr()), stream=3)
    assert step.launch(("never read", out2, q2), stream=3)
    right, swapped = compiled.calls
    assert right[9:] == (q2.data_ptr(), out2.data_ptr())
    assert swapped[9:] != right[9:], "a launch ignored the order of its values"


def test_a_tensors_context_is_its_devices(monkeypatch):
    """``context_of(t)`` answers as ``context(t.device)``: on the interpreter's CPU (stream 0 and the
    environment), and None with replays off or inside a recording."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = torch.zeros(4)
    assert replay.context_of(t) == replay.context(t.device) == (0, replay.environment())
    with replay.Recorder():
        assert replay.context_of(t) is None
    monkeypatch.setattr(settings, "REPLAY_STEPS", False)
    assert replay.context_of(t) is None and replay.context(t.device) is None


def test_the_last_key_is_answered_without_the_table_and_follows_every_put_and_get():
    """The entry got or put last answers its key by comparison; another key still finds its own entry, a
    key never seen the cache itself, and a change of environment drops the remembered one with the rest."""
    cache = replay.ReplayCache()
    a, b = Held(1), Held(2)
    assert cache.get(("a", 1), ()) is cache
    cache.put(("a", 1), a)
    cache.put(("b", 1), b)
    assert cache.get(("b", 1), ()) is b and cache.get(("a", 1), ()) is a
    assert cache.get(("a", 1), ()) is a and cache.last is a
    assert cache.get(("a", 2), ()) is cache
    cache.put(("a", 1), None)  # now unreplayable: its calls take the full path
    assert cache.get(("a", 1), ()) is None
    assert cache.get(("a", 1), ("other",)) is cache and cache.last is None


@pytest.mark.parametrize("wrong", ["stranger", "keyword", "shared"])
def test_a_record_with_an_unknown_tensor_is_refused(wrong):
    """Known-wrong records: a tensor argument that is no input and not owned, a tensor passed by keyword
    (not substituted), two inputs at one address. Each must raise Uncacheable, never replay."""
    q, out, other = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    kernel, compiled = StandInKernel(["q", "out", "x"]), StandInCompiled()
    args, kwargs, inputs = (q, out, 0), {}, dict(q=q, out=out)
    if wrong == "stranger":
        args = (q, out, other)
    elif wrong == "keyword":
        kwargs = dict(x=other)
    else:
        inputs = dict(q=q, out=q)
    with pytest.raises(replay.Uncacheable):
        replay.Replay(recorded(kernel, compiled, args, kwargs), inputs, [], cuda=True)


def test_launch_hooks_unset_reads_an_empty_chain_as_unset():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert replay._unhooked(None) and replay._unhooked(Chain([]))
    assert not replay._unhooked(Chain([print])) and not replay._unhooked(print)


class Held:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def test_the_cache_drops_the_oldest_steps_past_its_byte_budget(monkeypatch):
    """Past ``REPLAY_CACHE_BYTES`` the least recently used steps go, the newest stays whatever its size;
    a step put again under its key is counted once."""
    monkeypatch.setattr(settings, "REPLAY_CACHE_BYTES", 100)
    cache = replay.ReplayCache()
    cache.get("a", ())
    cache.put("a", Held(40))
    cache.put("b", Held(40))
    cache.put("b", Held(40))
    assert list(cache.entries) == ["a", "b"] and cache.nbytes == 80
    cache.get("a", ())  # a is now the most recently used
    cache.put("c", Held(40))
    assert list(cache.entries) == ["a", "c"] and cache.nbytes == 80
    cache.put("d", None)  # an unreplayable key holds nothing
    cache.put("e", Held(500))
    assert list(cache.entries) == ["e"] and cache.nbytes == 500


def test_a_replay_counts_the_buffers_it_holds_not_its_inputs():
    q, out, scratch = torch.zeros(64), torch.zeros(64), torch.zeros(32, dtype=torch.float64)
    kernel, compiled = StandInKernel(["q", "out", "x"]), StandInCompiled()
    step = replay.Replay(recorded(kernel, compiled, (q, out, scratch), {}), dict(q=q, out=out), [scratch, scratch[8:]],
                         cuda=True)
    assert step.nbytes == 32 * 8


def test_a_launch_of_something_else_than_a_triton_kernel_is_never_replayed():
    """A launcher given a stand-in for a kernel (tests swap kernels for known-wrong variants) records a
    launch that has no compiled handle: the record is refused (Uncacheable), the call keeps its full path."""
    q, out = torch.zeros(64), torch.zeros(64)

    class NotAKernel:
        fn = print

        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    with pytest.raises(replay.Uncacheable, match="not a compiled Triton kernel"):
        replay.Replay(recorded(NotAKernel(), StandInCompiled(), (q, out, 0), {}), dict(q=q, out=out), [], cuda=True)


def test_the_environment_follows_every_change_of_the_variables(monkeypatch):
    """A replay's environment reads the variables the launchers read on every call: a change through
    ``os.environ`` (set, changed, removed) changes it, so the recorded steps are dropped."""
    monkeypatch.delenv("QSA_PDL", raising=False)
    before = replay.environment()
    monkeypatch.setenv("QSA_PDL", "0")
    off = replay.environment()
    monkeypatch.setenv("QSA_PDL", "1")
    on = replay.environment()
    monkeypatch.delenv("QSA_PDL")
    assert len({before, off, on}) == 3 and replay.environment() == before
    cache = replay.ReplayCache()
    cache.get("k", before)
    cache.put("k", Held(1))
    monkeypatch.setenv("QSA_PDL", "0")
    assert cache.get("k", replay.environment()) is cache, "a step recorded under other variables was kept"
