"""GPU tests at real sizes: every route against an fp32 reference, bitwise determinism under page
relocation and index permutation, and plan + attention replayed from a CUDA graph."""

import dataclasses
import os
import sys

import pytest
import torch

import qsa
import qsa.attention.grouped.launch
import qsa.attention.invariant.kernel
import qsa.attention.invariant.launch
import qsa.attention.launch
import qsa.attention.xqa.launch
import qsa.settings
from qsa.cache.paged import random_mapping, relocate
from qsa.attention.planning.plan import PlanWorkspace
from qsa.attention.reference import assert_close_like_torch
from qsa.utils import dependent_launch

pytestmark = pytest.mark.gpu


def qsa_case(*, rows, context, num_q_heads=6, num_kv_heads=1, head_dim=256, block_size=16, k=512,
             dtype=torch.float16, kv_cache_dtype="auto", num_reqs=1, seed=0):
    """Rows at the end of ``num_reqs`` contexts, each selecting k random 4-blocks plus its causal tail."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    blocks_per_req = -(-context // block_size)
    num_blocks = num_reqs * blocks_per_req + 8
    perm = torch.randperm(num_blocks - 1, device=dev, generator=g)[:num_reqs * blocks_per_req] + 1
    table = perm.view(num_reqs, blocks_per_req).to(torch.int32)
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == "fp8_e4m3":
        kv = (torch.randn(shape, device=dev, generator=g) * 4).to(torch.float8_e4m3fn).view(torch.uint8)
        kv[0] = 0x7F  # block 0 holds NaN: never read
    else:
        kv = torch.randn(shape, device=dev, generator=g).to(dtype)
        kv[0] = float("nan")
    token_to_req = torch.arange(rows, device=dev, dtype=torch.int32) % num_reqs
    positions = (context - rows // num_reqs + torch.arange(rows, device=dev) // num_reqs).to(torch.int64)
    seq_lens = torch.full((num_reqs,), context, dtype=torch.int32, device=dev)
    visible = (positions + 1) // 4
    noise = torch.rand(rows, context // 4, device=dev, generator=g)
    noise = noise.masked_fill(torch.arange(context // 4, device=dev)[None, :] >= visible[:, None], -1.0)
    blocks = torch.sort(torch.topk(noise, k, dim=1).indices, dim=1).values
    toks = (blocks[:, :, None] * 4 + torch.arange(4, device=dev)).reshape(rows, 4 * k)
    tail = visible[:, None] * 4 + torch.arange(3, device=dev)
    tail = torch.where(tail <= positions[:, None], tail, -1)
    indices = torch.cat([toks, tail], dim=1).to(torch.int32)
    q = torch.randn(rows, num_q_heads, head_dim, device=dev, generator=g).to(dtype)
    gate = torch.randn(rows, num_q_heads, head_dim, device=dev, generator=g).to(dtype)
    return dict(q=q, kv=kv, indices=indices, block_table=table, token_to_req=token_to_req,
                positions=positions, seq_lens=seq_lens, gate=gate, kv_cache_dtype=kv_cache_dtype,
                k_scale=0.5 if kv_cache_dtype == "fp8_e4m3" else 1.0,
                v_scale=0.25 if kv_cache_dtype == "fp8_e4m3" else 1.0)


def run(c, route, **kw):
    args = (c["q"], c["kv"][:, 0], c["kv"][:, 1], c["indices"], c["block_table"], c["token_to_req"],
            c["positions"], c["seq_lens"])
    return qsa.sparse_paged_attention(*args, kv_cache_dtype=c["kv_cache_dtype"], k_scale=c["k_scale"],
                                      v_scale=c["v_scale"], route=route, **kw)


def check_against_reference(c, route):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.baselines import chunked_attention, full_fp32_matmul

    args = (c["q"], c["kv"][:, 0], c["kv"][:, 1], c["indices"], c["block_table"], c["token_to_req"],
            c["positions"], c["seq_lens"])
    kw = dict(kv_cache_dtype=c["kv_cache_dtype"], k_scale=c["k_scale"], v_scale=c["v_scale"])
    with full_fp32_matmul():
        ref = chunked_attention(*args, compute_dtype=torch.float32, **kw).double()
    low = chunked_attention(*args, compute_dtype=c["q"].dtype, **kw)
    out = torch.full_like(c["q"], float("nan"))
    run(c, route, out=out)
    return assert_close_like_torch(out, ref, low, name=route)


@pytest.mark.parametrize("route", ["grouped", "xqa", "splitk"])
def test_prefill_8192_rows_6_1_256(route):
    c = qsa_case(rows=8192, context=65536)
    check_against_reference(c, route)


@pytest.mark.parametrize("shape", [(12, 1), (24, 2)])
@pytest.mark.parametrize("route", ["auto", "xqa", "splitk"])
def test_other_tp_shapes_185_rows(shape, route):
    c = qsa_case(rows=185, context=16384, num_q_heads=shape[0], num_kv_heads=shape[1], num_reqs=3)
    check_against_reference(c, route)


@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, "auto"), (torch.float16, "fp8_e4m3"),
                                      (torch.bfloat16, "fp8_e4m3")])
def test_dtypes_at_real_size(dtype, kv):
    c = qsa_case(rows=1024, context=32768, dtype=dtype, kv_cache_dtype=kv, seed=1)
    for route in ("grouped", "xqa", "splitk"):
        check_against_reference(c, route)


@pytest.mark.parametrize("num_q_heads,kv", [(6, "fp8_e4m3"), (12, "auto"), (6, "auto")])
def test_lazy_rescale_with_moving_maxima(num_q_heads, kv, monkeypatch):
    """Queries x 8 spread the scores over tens of log2 units, so each row's reference max moves in some
    tiles and not in others, and warps differ in whether any of their rows moves. The lazily rescaled
    grouped kernel (shipped for an FP8 cache and 12/1; forced for 6/1 fp16) against the fp32 reference,
    and bitwise equal without the warp-skipped multiplies (they skip multiplies by 1 only)."""
    c = qsa_case(rows=1024, context=16384, num_q_heads=num_q_heads, kv_cache_dtype=kv, seed=3)
    c["q"] = c["q"] * 8
    cfg = qsa.attention.grouped.launch.grouped_config(num_q_heads, 256, kv == "fp8_e4m3")
    monkeypatch.setattr(qsa.attention.grouped.launch, "grouped_config",
                        lambda G, D, kv_fp8=False: dataclasses.replace(cfg, lazy_rescale=True))
    check_against_reference(c, "grouped")
    base = run(c, "grouped", return_lse=True)
    assert qsa.attention.grouped.launch.rescale_ptx(c["q"], cfg)
    monkeypatch.setattr(qsa.attention.grouped.launch, "rescale_ptx", lambda q, cfg: False)
    out = run(c, "grouped", return_lse=True)
    assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1])


def _relocated(c, mapping, num_blocks_out=None):
    kv, table = relocate(c["kv"], c["block_table"], mapping.cuda(), num_blocks_out=num_blocks_out, fill="nan")
    return {**c, "kv": kv, "block_table": table}


# xqa at 200 rows: one to two rows per SM on an H200, so the row planner takes its scan-free steps, and
# the permuted rows leave them for the sorting planner (or, with rows_sorted, are sorted in their programs)
@pytest.mark.parametrize("route,rows", [("grouped", 2048), ("xqa", 2048), ("auto", 185), ("xqa", 200)])
def test_bitwise_under_relocation_and_permutation(route, rows):
    c = qsa_case(rows=rows, context=65536, num_reqs=2, seed=2)
    base = run(c, route, gate=c["gate"], return_lse=True)
    again = run(c, route, gate=c["gate"], return_lse=True)
    assert torch.equal(base[0], again[0]) and torch.equal(base[1], again[1])
    g = torch.Generator().manual_seed(0)
    perm = torch.argsort(torch.rand(c["indices"].shape, generator=g), dim=1).cuda()
    shuffled = {**c, "indices": torch.gather(c["indices"], 1, perm)}
    for hint in (False, True):
        out = run(shuffled, route, gate=c["gate"], return_lse=True, rows_sorted=hint)
        assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1]), f"permuted indices, {hint=}"
    n = c["kv"].shape[0]
    for collision in (False, True):
        mapping = random_mapping(n, generator=g, collision_prone=collision, stride=64 if collision else None)
        moved = _relocated(c, mapping, int(mapping.max()) + 1)
        out = run(moved, route, gate=c["gate"], return_lse=True)
        assert torch.equal(base[0], out[0]) and torch.equal(base[1], out[1]), f"relocation {collision=}"


@pytest.mark.parametrize("rows,num_reqs,dtype,kv", [(1, 1, torch.float16, "auto"), (8, 1, torch.float16, "auto"),
                                                   (16, 16, torch.bfloat16, "auto"), (13, 4, torch.float16, "fp8_e4m3"),
                                                   (64, 64, torch.float16, "auto")])
def test_direct_xqa_at_real_width(rows, num_reqs, dtype, kv):
    """Decode and MTP batches with sorted rows take the direct kernel: exact, and bitwise the same with
    the rows shuffled (in-kernel sort), under page moves, over repeated runs of one plan, and over
    repeated CUDA-graph replays."""
    c = qsa_case(rows=rows, context=65536, num_reqs=num_reqs, dtype=dtype, kv_cache_dtype=kv, seed=9)
    # A decode batch (one row per request) says so, as a serving engine does: 64 rows then stay on xqa.
    hint = dict(rows_sorted=True, max_query_len=1 if num_reqs == rows else None)
    plan = qsa.plan_attention(c["indices"], c["block_table"], c["token_to_req"], c["positions"], c["seq_lens"],
                              block_size=16, num_blocks=c["kv"].shape[0], num_q_heads=6, num_kv_heads=1,
                              head_dim=256, kv_cache_dtype=kv, **hint)
    assert plan.routes.direct and plan.single is None
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.baselines import chunked_attention, full_fp32_matmul

    args = (c["q"], c["kv"][:, 0], c["kv"][:, 1], c["indices"], c["block_table"], c["token_to_req"],
            c["positions"], c["seq_lens"])
    kw = dict(kv_cache_dtype=kv, k_scale=c["k_scale"], v_scale=c["v_scale"])
    with full_fp32_matmul():
        ref = chunked_attention(*args, compute_dtype=torch.float32, **kw).double()
    low = chunked_attention(*args, compute_dtype=dtype, **kw)
    base = run(c, "auto", **hint, gate=None, return_lse=True)
    assert_close_like_torch(base[0], ref, low, name="xqa-direct")
    g = torch.Generator().manual_seed(1)
    perm = torch.argsort(torch.rand(c["indices"].shape, generator=g), dim=1).cuda()
    shuffled = run({**c, "indices": torch.gather(c["indices"], 1, perm)}, "auto", **hint, return_lse=True)
    assert torch.equal(base[0], shuffled[0]) and torch.equal(base[1], shuffled[1]), "shuffled rows"
    moved = run(_relocated(c, random_mapping(c["kv"].shape[0], generator=g)), "auto", **hint,
                return_lse=True)
    assert torch.equal(base[0], moved[0]) and torch.equal(base[1], moved[1]), "relocation"
    out = torch.full_like(c["q"], float("nan"))
    for i in range(3):
        out.fill_(float("nan"))
        qsa.run_attention(plan, c["q"], c["kv"][:, 0], c["kv"][:, 1], kv_cache_dtype=kv, k_scale=c["k_scale"],
                          v_scale=c["v_scale"], out=out)
        assert torch.equal(out, base[0]), f"run {i} of one plan"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(c, "auto", **hint, out=out)
    for i in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, base[0]), f"CUDA-graph replay {i}"


FP16, BF16 = torch.float16, torch.bfloat16


@pytest.mark.parametrize("rows,num_reqs,dtype,kv,heads", [
    (1, 1, FP16, "auto", (6, 1)), (2, 1, FP16, "auto", (6, 1)), (4, 1, FP16, "auto", (6, 1)),
    (8, 1, FP16, "auto", (6, 1)), (13, 1, FP16, "auto", (6, 1)), (16, 1, FP16, "auto", (6, 1)),
    (64, 1, FP16, "auto", (6, 1)), (16, 16, FP16, "auto", (6, 1)), (64, 64, FP16, "auto", (6, 1)),
    (8, 1, BF16, "auto", (6, 1)), (13, 4, FP16, "fp8_e4m3", (6, 1)), (24, 24, FP16, "fp8_e4m3", (6, 1)),
    (5, 1, FP16, "auto", (12, 1)), (16, 16, BF16, "auto", (24, 2))])
def test_hint_changes_no_bit_at_real_width(rows, num_reqs, dtype, kv, heads):
    """Rows of whole blocks at 64K through the planned xqa kernel (no ``rows_sorted`` hint) and the direct
    one (the hint): the same bits, out and LSE, at the GPU's own split counts (``qsa.attention.xqa.launch.xqa_cut``), for
    each cache dtype and per-rank head shape."""
    c = qsa_case(rows=rows, context=65536, num_reqs=num_reqs, num_q_heads=heads[0], num_kv_heads=heads[1],
                 dtype=dtype, kv_cache_dtype=kv, seed=5)
    hint = dict(max_query_len=1 if num_reqs == rows else None)
    planned = run(c, "xqa", gate=c["gate"], return_lse=True, **hint)
    direct = run(c, "xqa", gate=c["gate"], return_lse=True, rows_sorted=True, **hint)
    assert torch.equal(planned[0], direct[0]) and torch.equal(planned[1], direct[1])
    check_against_reference(c, "xqa")


@pytest.mark.parametrize("splits", [3, 5, 9, 17, 33, 65])
def test_direct_xqa_resolved_splits_at_real_width(splits):
    """MTP rows at 64K through the direct kernel at many split counts, each split's entries resolved before
    its loop: exact, and bitwise the same as the tile-by-tile loads. (Before the gather index was clamped,
    the software pipeline's look-ahead read past the resolved entries: 9 splits faulted on the H200.)"""
    import qsa

    c = qsa_case(rows=8, context=65536, seed=12)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.baselines import chunked_attention, full_fp32_matmul

    k, v = c["kv"][:, 0], c["kv"][:, 1]
    args = (c["indices"], c["block_table"], c["token_to_req"], c["positions"], c["seq_lens"])
    with full_fp32_matmul():
        ref = chunked_attention(c["q"], k, v, *args, compute_dtype=torch.float32).double()
    low = chunked_attention(c["q"], k, v, *args, compute_dtype=torch.float16)
    outs = []
    for resolve in (True, False):
        out = torch.full_like(c["q"], float("nan"))
        cfg = dataclasses.replace(qsa.attention.xqa.launch.xqa_direct_config(6, 256, 8), resolve_split=resolve, prefetch=False)
        qsa.attention.xqa.launch.xqa_direct_attention(c["q"], k, v, *args, row_start=0, out=out, lse=None, gate=None,
                                       softmax_scale=256 ** -0.5, k_scale=1.0, v_scale=1.0, kv_fp8=False,
                                       config=cfg, num_splits=splits)
        torch.cuda.synchronize()
        outs.append(out)
    assert_close_like_torch(outs[0], ref, low, name=f"xqa-direct, {splits} resolved splits")
    assert torch.equal(outs[0], outs[1]), f"{splits} splits: resolved vs tile by tile"


@pytest.mark.parametrize("rows", [8, 5])
def test_deferred_merge_of_rows_out_of_order_over_many_replays(rows):
    """MTP rows at 64K, shuffled, with the ``rows_sorted`` hint: every direct split finds its row out of
    order and the deferred merge, two 128-column programs per head (``qsa.attention.launch.merge_config``), recomputes
    it. 400 CUDA-graph replays, each bitwise the output of the sorted rows: the column programs of a head
    must agree on recomputing whatever order they run in (their recomputed partials have a buffer of
    their own)."""
    import qsa

    c = qsa_case(rows=rows, context=65536, seed=21)
    assert qsa.attention.launch.merge_config(17, 256, xqa_lists=rows)[0] == 128
    hint = dict(rows_sorted=True, return_lse=True)
    base = run(c, "xqa", **hint)
    check_against_reference(c, "xqa")
    perm = torch.argsort(torch.rand(c["indices"].shape, generator=torch.Generator().manual_seed(2)), dim=1)
    shuffled = {**c, "indices": torch.gather(c["indices"], 1, perm.cuda())}
    plan = qsa.plan_attention(shuffled["indices"], c["block_table"], c["token_to_req"], c["positions"],
                              c["seq_lens"], block_size=16, num_blocks=c["kv"].shape[0], num_q_heads=6,
                              num_kv_heads=1, head_dim=256, rows_sorted=True)
    assert plan.routes.direct
    out = torch.full_like(c["q"], float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qsa.run_attention(plan, c["q"], c["kv"][:, 0], c["kv"][:, 1], out=out)
    wrong = 0
    for _ in range(400):
        out.fill_(float("nan"))
        graph.replay()
        wrong += not torch.equal(out, base[0])
    assert wrong == 0, f"{wrong} of 400 replays differ from the sorted rows"


@pytest.mark.parametrize("route", ["auto", "invariant"])
def test_cuda_graph_replay_matches_eager(route):
    rows, context = 257, 32768
    a = qsa_case(rows=rows, context=context, num_reqs=2, seed=3)
    b = qsa_case(rows=rows, context=context, num_reqs=2, seed=4)
    mapping = random_mapping(b["kv"].shape[0], generator=torch.Generator().manual_seed(5))
    b = _relocated(b, mapping)
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    nb, bs = static["kv"].shape[0], static["kv"].shape[2]
    plan_args = lambda: (static["indices"], static["block_table"], static["token_to_req"],  # noqa: E731
                         static["positions"], static["seq_lens"])
    shape = dict(block_size=bs, num_blocks=nb, num_q_heads=6, num_kv_heads=1, head_dim=256, route=route)
    ws = PlanWorkspace.for_plan(static["block_table"], block_size=bs, num_groups=-(-static["indices"].shape[0] // 8))
    out = torch.empty_like(static["q"])

    def step(plan):
        plan = qsa.plan_attention(*plan_args(), **shape, out=plan, workspace=ws)
        qsa.run_attention(plan, static["q"], static["kv"][:, 0], static["kv"][:, 1], gate=static["gate"],
                          out=out)
        return plan

    plan = step(None)  # compile and allocate outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(plan)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(plan)
    for case in (a, b, a):
        for key in ("q", "kv", "indices", "block_table", "token_to_req", "positions", "seq_lens", "gate"):
            static[key].copy_(case[key])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = run(case, route, gate=case["gate"])
        assert torch.equal(out, eager), "graph replay differs from eager"


@pytest.mark.parametrize("config,ptx", [(qsa.settings.PLANNER, True), (qsa.settings.PLANNER, False),
                                        (qsa.settings.PLANNER_FEW, True), (qsa.settings.PLANNER_SHORT, True),
                                        (qsa.settings.PlannerConfig(shared_map=True, programs_per_sm=2), True),
                                        (qsa.settings.PlannerConfig(shared_map=True, scan=512), False),
                                        (qsa.settings.PLANNER_MAP, True),
                                        (dataclasses.replace(qsa.settings.PLANNER_MAP, scan=2048), True)])
def test_planners_match_reference_at_real_width(config, ptx, monkeypatch):
    """Rows of 2051 indices (shuffled, with duplicates and wild values) over 3 requests and an
    aliased prefix page: the GPU planners equal the loop reference planners exactly (the grouped
    planner's scans with and without inline PTX, of flagged sectors or of every word)."""
    from qsa.attention.planning.plan import plan_groups, plan_single_rows
    from qsa.attention.planning.reference import compare_plans, reference_grouped_plan, reference_single_row_plan

    monkeypatch.setattr(qsa.settings, "PTX_SCAN", ptx)

    c = qsa_case(rows=75, context=16384, num_reqs=3, head_dim=16, seed=9)
    idx = c["indices"].clone()
    g = torch.Generator(device="cuda").manual_seed(1)
    perm = torch.argsort(torch.rand(idx.shape, device="cuda", generator=g), dim=1)
    idx = torch.gather(idx, 1, perm)
    idx[::5, :40] = idx[::5, 40:80]  # duplicates
    idx[1::7, :6] = torch.tensor([-5, 2**31 - 1, 16384, 10**6, -2**31, 70000], dtype=torch.int32, device="cuda")
    table = c["block_table"].clone()
    table[1, :4] = table[0, :4]  # a shared prefix page run
    table[2, 7] = -1  # an invalid entry
    inputs = dict(indices=idx, block_table=table, token_to_req=c["token_to_req"], positions=c["positions"],
                  seq_lens=c["seq_lens"], block_size=16, num_blocks=c["kv"].shape[0])
    grouped = plan_groups(**inputs, num_rows=72, config=config)
    single = plan_single_rows(**inputs, row_start=72)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    assert compare_plans(grouped, reference_grouped_plan(**cpu, num_rows=72)) == []
    ref_single = reference_single_row_plan(**cpu)
    tail = lambda p: type(p)(p.mb_ids[72:].cpu(), p.masks[72:].cpu(), p.counts[72:].cpu(),  # noqa: E731
                             p.block_size, p.num_blocks)
    assert compare_plans(tail(single), tail(ref_single)) == []


@pytest.mark.parametrize("shipped", [False, True])
def test_shared_map_planner_whole_microblocks(shipped):
    """The planner over a shared-memory map with rows as select_tokens writes them (whole microblocks: the
    shared-memory path), partial quads mixed in, over 3 requests and an invalid table entry, at 16K and at
    the map's full width: the reference plan, the same plan again from the same workspace, and the
    workspace left zero (the default settings, and the shipped ones with their register cap)."""
    from qsa.attention.planning.kernels import SHARED_MAP_MICROBLOCKS as KERNEL_WIDTH
    from qsa.attention.planning.plan import plan_groups, PlanWorkspace
    from qsa.settings import PLANNER_MAP, PlannerConfig, SHARED_MAP_MICROBLOCKS
    from qsa.attention.planning.reference import compare_plans, reference_grouped_plan

    assert KERNEL_WIDTH.value == SHARED_MAP_MICROBLOCKS
    cfg = dataclasses.replace(PLANNER_MAP if shipped else PlannerConfig(shared_map=True), programs_per_sm=1)
    for context in (16384, 4 * SHARED_MAP_MICROBLOCKS):
        c = qsa_case(rows=75, context=context, num_reqs=3, head_dim=16, seed=10)
        idx = c["indices"].clone()
        idx[3::9, 100:103] = idx[3::9, 101:104]  # a few partial quads
        table = c["block_table"].clone()
        table[2, 7] = -1
        inputs = dict(indices=idx, block_table=table, token_to_req=c["token_to_req"], positions=c["positions"],
                      seq_lens=c["seq_lens"], block_size=16, num_blocks=c["kv"].shape[0])
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        ref = reference_grouped_plan(**cpu)
        assert table.shape[1] * 4 <= SHARED_MAP_MICROBLOCKS
        ws = PlanWorkspace.for_plan(table, block_size=16, num_groups=10, config=cfg)
        for _ in range(2):
            assert compare_plans(plan_groups(**inputs, config=cfg, workspace=ws), ref) == []
            assert int(ws.state.count_nonzero()) == 0


@pytest.mark.parametrize("rows,route", [(8, "auto"), (300, "xqa"), (300, "splitk"), (2048, "grouped")])
def test_dependent_launch_changes_no_bit(rows, route, monkeypatch):
    """Every kernel on sm_90 launches with programmatic dependent launch and waits for its predecessor
    before its first global access. Outputs with it and without it, eagerly and replayed from a CUDA
    graph on new inputs (not those of the capture, so stale plans or partials would show), are bitwise
    equal. A race is not sure to show in any one run; this checks the results, the PTX check in
    tests/sm90.py that every kernel waits."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    assert dependent_launch("cuda")
    a = qsa_case(rows=rows, context=65536, num_reqs=2 if rows > 8 else 1, seed=11)
    b = qsa_case(rows=rows, context=65536, num_reqs=2 if rows > 8 else 1, seed=12)
    hint = dict(rows_sorted=True) if route == "auto" else {}
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("QSA_PDL", pdl)
        assert dependent_launch("cuda") == (pdl == "1")
        outs[pdl] = [run(c, route, **hint, gate=c["gate"], return_lse=True) for c in (a, b)]
    for i in range(2):
        assert torch.equal(outs["0"][i][0], outs["1"][i][0]) and torch.equal(outs["0"][i][1], outs["1"][i][1])
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    out = torch.empty_like(static["q"])
    run(static, route, **hint, gate=static["gate"], out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(static, route, **hint, gate=static["gate"], out=out)
    for case, want in ((b, outs["0"][1][0]), (a, outs["0"][0][0])):
        for key in ("q", "kv", "indices", "block_table", "token_to_req", "positions", "seq_lens", "gate"):
            static[key].copy_(case[key])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), "graph replay with dependent launch"


def _take(c, rows):
    """The case of rows ``rows`` (in that order) of ``c``: the same cache, table and lengths."""
    return {**c, **{k: c[k][rows] for k in ("q", "gate", "indices", "token_to_req", "positions")}}


def _cat(a, b):
    return {**a, **{k: torch.cat([a[k], b[k]]) for k in ("q", "gate", "indices", "token_to_req", "positions")}}


@pytest.mark.parametrize("dtype,kv,heads,head_dim", [
    (torch.float16, "auto", (6, 1), 256), (torch.bfloat16, "auto", (6, 1), 256),
    (torch.float16, "fp8_e4m3", (6, 1), 256), (torch.float16, "auto", (24, 2), 256),
    # below 256 the scores are one product over the whole head (no column halves)
    (torch.float16, "auto", (6, 1), 128), (torch.bfloat16, "fp8_e4m3", (12, 1), 64)])
def test_invariant_route_at_real_size(dtype, kv, heads, head_dim):
    """The batch-invariant route against the fp32 reference at real width, folding in one program per row
    (1024 rows) and through the merge (64 rows, from the same rows: the same bits)."""
    c = qsa_case(rows=1024, context=32768, dtype=dtype, kv_cache_dtype=kv, num_q_heads=heads[0],
                 num_kv_heads=heads[1], head_dim=head_dim, num_reqs=3, seed=6)
    assert qsa.attention.invariant.launch.invariant_config(heads[0] // heads[1], head_dim).qk_halves == (head_dim >= 256)
    assert qsa.attention.invariant.launch.invariant_folds(1024) and not qsa.attention.invariant.launch.invariant_folds(64 * heads[1])
    check_against_reference(c, "invariant")
    base = run(c, "invariant", gate=c["gate"], return_lse=True)
    few = torch.arange(0, 1024, 16, device="cuda")
    out = run(_take(c, few), "invariant", gate=c["gate"][few], return_lse=True)
    assert torch.equal(out[0], base[0][few]) and torch.equal(out[1], base[1][few]), "64 rows vs 1024"


def test_invariant_rows_get_the_same_bits_in_any_batch():
    """Rows of three 64K requests: each row's out and lse bitwise equal whatever batch it comes in: alone,
    in a few, in reverse order, among rows of other queries, with wider indices and its entries shuffled,
    with the pages moved; whether the launch folds in one program per row or merges its splits."""
    c = qsa_case(rows=1100, context=65536, num_reqs=3, seed=7)
    every = torch.arange(1100, device="cuda")
    base = run(c, "invariant", gate=c["gate"], return_lse=True)

    def expect(case, rows, at, what):
        out = run(case, "invariant", gate=case["gate"], return_lse=True)
        n = len(rows)
        assert torch.equal(out[0][at:at + n], base[0][rows]), f"{what}: out"
        assert torch.equal(out[1][at:at + n], base[1][rows]), f"{what}: lse"

    for rows in ([0], [1099], [5, 700, 1099], list(range(0, 1100, 11)), list(range(300))):
        rows = torch.tensor(rows, device="cuda")
        expect(_take(c, rows), rows, 0, f"{len(rows)} rows")
    expect(_take(c, every.flip(0)), every.flip(0), 0, "reverse order")
    g = torch.Generator(device="cuda").manual_seed(8)
    others = _take(c, torch.randint(0, 1100, (77,), device="cuda", generator=g))
    others["q"] = torch.randn(others["q"].shape, device="cuda", generator=g).half()
    expect(_cat(others, _take(c, every[:150])), every[:150], 77, "behind 77 other rows")
    wide = {**c, "indices": torch.cat([c["indices"], torch.full((1100, 200), -1, dtype=torch.int32, device="cuda")], 1)}
    perm = torch.argsort(torch.rand(wide["indices"].shape, device="cuda", generator=g), dim=1)
    wide["indices"] = torch.gather(wide["indices"], 1, perm)
    expect(_take(wide, every[:40]), every[:40], 0, "wider indices, entries shuffled")
    mapping = random_mapping(c["kv"].shape[0], generator=torch.Generator().manual_seed(9))
    expect(_relocated(c, mapping), every, 0, "pages moved")
    out = torch.empty_like(c["q"])
    lse = torch.empty(c["q"].shape[:2], dtype=torch.float32, device="cuda")
    qsa.attention.invariant.launch.invariant_attention(c["q"], c["kv"][:, 0], c["kv"][:, 1], c["indices"], c["block_table"],
                                      c["token_to_req"], c["positions"], c["seq_lens"], out=out, lse=lse,
                                      gate=c["gate"], softmax_scale=256 ** -0.5, k_scale=1.0, v_scale=1.0,
                                      kv_fp8=False, fold=False)
    assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), "merge vs fold on the whole batch"


def test_invariant_checks_see_a_tree_merge(monkeypatch):
    """The check above is sensitive at this size: with the splits summed by the other routes' tree merge
    instead of folded in order, rows alone (merged) differ from the same rows in a folding batch."""
    import qsa

    c = qsa_case(rows=512, context=32768, num_reqs=2, seed=10)
    base = run(c, "invariant", gate=c["gate"], return_lse=True)

    class TreeMerge:
        def __getitem__(self, grid):
            def launch(part_acc, part_ml, gate, out, lse, hq, v_scale, *strides, HAS_GATE, RETURN_LSE, NUM_SPLITS,
                       **kw):
                qsa.attention.launch.merge_splits(part_acc, part_ml, out=out, lse=lse if RETURN_LSE else None,
                                     gate=gate if HAS_GATE else None, row_offset=0, v_scale=v_scale,
                                     num_splits=NUM_SPLITS)
            return launch

    monkeypatch.setattr(qsa.attention.invariant.kernel, "invariant_merge_kernel", TreeMerge())
    rows = torch.arange(0, 512, 8, device="cuda")
    out = run(_take(c, rows), "invariant", gate=c["gate"][rows], return_lse=True)
    assert not (torch.equal(out[0], base[0][rows]) and torch.equal(out[1], base[1][rows]))
