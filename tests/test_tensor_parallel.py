"""Tensor parallelism: the layer with its heads sharded over 2 and 4 processes (gloo on the CPU, NCCL on
2 and 4 GPUs) against the same layer at TP1; on the GPUs also the tiny model, and every rank's outputs
under moved pages.

Per-rank shapes at the reference head counts (24 query heads, 2 KV heads): TP2 12/1, TP4 6/1 with
each KV head replicated on two ranks. The selection is computed on every rank and must be identical
to TP1's bit for bit; the all-reduced outputs must be identical on every rank and within the
reference bound of TP1 (only the o_proj summation order differs).
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from qsa.model.layer import QSAAttention, QSAConfig
from qsa.model.reference import layer_reference
from qsa.model.tiny import TinyConfig, TinyQSAModel
from qsa.attention.reference import rounding_floor
from qsa.model.serving import Engine, run_layer, ServingConfig
from qsa.model.tp import all_reduce, destroy, free_port, init_local_group, shard_heads, TPInfo

CFG = QSAConfig(hidden_size=64, num_heads=24, num_kv_heads=2, head_dim=16, rotary_dim=8, index_heads=4,
                index_head_dim=16, index_rotary_dim=8, index_topk=4, rope_theta=10000.0)
LENS = (29, 18)
RUN = dict(chunk_size=12, decode_tokens=3, block_size=8, pad_rows=1, route="reference")
SEED = 3


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(L, CFG.hidden_size, generator=g).to(CFG.dtype).to(device) for L in LENS]


def _worker(rank, world, port, backend, out_dir, run_kw):
    torch.set_num_threads(1)
    tp = init_local_group(rank, world, port, backend=backend)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    layer = QSAAttention(CFG, tp=tp, seed=SEED, device=device)
    out, steps, _ = run_layer(layer, _inputs(device), **run_kw, capture=True)
    # all_reduce sums into a tensor of its own, whatever the input's dtype and layout.
    reduced = []
    for x in (torch.full((3, 2), rank + 1.0, device=device), torch.full((2, 3), rank + 1.0, device=device).t(),
              torch.full((3, 2), rank + 1.0, device=device, dtype=torch.bfloat16)):
        given = x.clone()
        y = all_reduce(x, tp)
        reduced.append(torch.equal(x, given) and y.dtype == x.dtype and y.shape == x.shape
                       and bool((y == world * (world + 1) / 2).all()))
    torch.save({"out": out.cpu(), "reduced": reduced, "indices": [s["indices"].cpu() for s in steps],
                "shape": (layer.num_q_heads, layer.num_kv_heads, tuple(layer.k_proj.shape))},
               os.path.join(out_dir, f"rank{rank}.pt"))
    destroy()


def run_tp(world, tmp_path, backend="gloo", run_kw=RUN):
    mp.spawn(_worker, args=(world, free_port(), backend, str(tmp_path), run_kw), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def check_tp(results, world, run_kw=RUN, device="cpu"):
    full = QSAAttention(CFG, seed=SEED, device=device)
    xs = _inputs(device)
    out1, steps1, _ = run_layer(full, xs, **run_kw, capture=True)
    out1 = out1.cpu()
    want_heads = (CFG.num_heads // world, 1)
    for r, res in enumerate(results):
        assert res["shape"][:2] == want_heads, f"rank {r} holds {res['shape'][:2]} heads"
        assert res["shape"][2] == (CFG.head_dim, CFG.hidden_size)
        assert len(res["indices"]) == len(steps1) > 0, f"rank {r} ran {len(res['indices'])} steps"
        for a, b in zip(res["indices"], steps1):
            assert torch.equal(a, b["indices"].cpu()), "the selection must be replicated exactly"
        assert torch.equal(res["out"].view(torch.int16), results[0]["out"].view(torch.int16)), \
            "ranks disagree after the all-reduce"
    # tolerance: twice the error of the same layer done by PyTorch in bf16, plus one rounding
    idx = torch.full((sum(LENS), steps1[0]["indices"].shape[1]), -1, dtype=torch.int32)
    for s in steps1:
        idx[s["rows"]] = s["indices"][:len(s["rows"])].cpu()
    xs_cpu = [x.cpu() for x in xs]
    full_cpu = full.cpu()
    ref = layer_reference(full_cpu, torch.cat(xs_cpu), list(LENS), idx)
    low = layer_reference(full_cpu, torch.cat(xs_cpu), list(LENS), idx, compute_dtype=CFG.dtype)
    bound = 2 * float((low.double() - ref).abs().max()) + rounding_floor(ref, CFG.dtype)
    out_tp = results[0]["out"]
    assert torch.isfinite(out_tp).all()
    err_tp = float((out_tp.double() - ref).abs().max())
    err_1 = float((out1.double() - ref).abs().max())
    diff = float((out_tp.double() - out1.double()).abs().max())
    assert err_1 <= bound, f"TP1 vs fp64: {err_1:.3e} > {bound:.3e}"
    assert err_tp <= bound, f"TP{world} vs fp64: {err_tp:.3e} > {bound:.3e}"
    assert diff <= bound, f"TP{world} vs TP1: {diff:.3e} > {bound:.3e}"
    return diff, bound


def test_tensor_parallel_shards_and_all_reduce_single_process():
    """Without processes: the partial outputs of the TP2 shards sum to TP1's (fp64 references)."""
    full = QSAAttention(CFG, seed=SEED)
    parts = [QSAAttention(CFG, tp=TPInfo(r, 2), seed=SEED) for r in range(2)]
    xs = _inputs()
    idx = torch.randint(-1, 29, (sum(LENS), CFG.index_width), generator=torch.Generator().manual_seed(1))
    idx = idx.to(torch.int32)
    ref = layer_reference(full, torch.cat(xs), list(LENS), idx)
    summed = sum(layer_reference(p, torch.cat(xs), list(LENS), idx) for p in parts)
    assert torch.allclose(summed, ref, rtol=1e-10, atol=1e-12)
    assert all_reduce(ref, TPInfo()) is ref  # TP1: no communication


def test_tp_info_and_local_group_check_their_arguments():
    """Bad ranks, sizes and reduce dtypes are refused by name, before any process group is joined (a rank
    past the world size would otherwise wait for its peers)."""
    for kw, err, match in ((dict(rank=1, world_size=1), ValueError, "rank"),
                           (dict(rank=-1, world_size=2), ValueError, "rank"),
                           (dict(rank=0, world_size=0), ValueError, "world_size"),
                           (dict(rank=1.0, world_size=2), TypeError, "rank"),
                           (dict(rank=True, world_size=2), TypeError, "rank"),
                           (dict(rank=0, world_size=2.0), TypeError, "world_size"),
                           (dict(rank=0, world_size=2, reduce_dtype="float32"), TypeError, "reduce_dtype"),
                           (dict(rank=0, world_size=2, reduce_dtype=torch.int32), TypeError, "reduce_dtype")):
        with pytest.raises(err, match=match):
            TPInfo(**kw)
    assert TPInfo(1, 2, reduce_dtype=None).reduce_dtype is None
    for rank, world in ((1, 1), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank|world_size"):
            init_local_group(rank, world, free_port())
    assert not torch.distributed.is_initialized()


def test_tensor_parallel_two_processes_gloo(tmp_path):
    results = run_tp(2, tmp_path)
    check_tp(results, 2)
    for r, res in enumerate(results):  # fp32, transposed and bf16 inputs left as given, sums right
        assert res["reduced"] == [True] * 3, f"rank {r}: all_reduce {res['reduced']}"


@pytest.mark.slow
def test_tensor_parallel_four_processes_gloo(tmp_path):
    """TP4: 6 query heads and 1 KV head per rank; KV head 0 replicated on ranks 0-1, head 1 on 2-3."""
    assert [shard_heads(24, 2, TPInfo(r, 4)).kv_start for r in range(4)] == [0, 0, 1, 1]
    results = run_tp(4, tmp_path)
    check_tp(results, 4)
    assert all(res["reduced"] == [True] * 3 for res in results)


def test_tensor_parallel_check_rejects_a_missing_all_reduce():
    """The comparison fails when a rank's partial output is used without the all-reduce (and passes
    for TP1's own output in the same form)."""
    full = QSAAttention(CFG, seed=SEED)
    part = QSAAttention(CFG, tp=TPInfo(0, 2), seed=SEED)
    xs = _inputs()
    out1, steps, _ = run_layer(full, xs, **RUN, capture=True)
    idx = torch.full((sum(LENS), CFG.index_width), -1, dtype=torch.int32)
    for s in steps:
        idx[s["rows"]] = s["indices"][:len(s["rows"])]
    shape = (CFG.num_heads // 2, 1, (CFG.head_dim, CFG.hidden_size))
    good = dict(out=out1, indices=[s["indices"] for s in steps], shape=shape)
    check_tp([good, good], 2)
    partial = layer_reference(part, torch.cat(xs), list(LENS), idx, compute_dtype=CFG.dtype)
    with pytest.raises(AssertionError, match="TP2 vs fp64"):
        check_tp([dict(good, out=partial)] * 2, 2)


MODEL = TinyConfig(vocab_size=128, num_layers=2, attn=CFG)
PROMPTS = [[(7 * i + 3) % 128 for i in range(n)] for n in (26, 15)]
NEW_TOKENS = 4


def _serve(model, allocator_seed, num_blocks):
    cfg = ServingConfig(num_blocks=num_blocks, block_size=8, max_reqs=2, max_blocks_per_req=4, chunk_size=12,
                        allocator_seed=allocator_seed)
    return Engine(model, cfg).generate(PROMPTS, NEW_TOKENS)


# (allocator seed, pool size): the first is the placement compared with TP1, the others move the pages
PLACEMENTS = ((0, 12), (5, 12), (11, 40))


def _gpu_worker(rank, world, port, out_dir):
    """One NCCL rank: the layer (Triton routes) and the tiny model, each under three page placements."""
    tp = init_local_group(rank, world, port, backend="nccl")
    device = f"cuda:{rank}"
    layer = QSAAttention(CFG, tp=tp, seed=SEED, device=device)
    run_kw = dict(RUN, route="auto")
    layer_runs = []
    for seed, extra in ((0, 0), (5, 0), (11, 30)):
        nb = sum(-(-L // RUN["block_size"]) for L in LENS) + 4 + extra
        out, steps, _ = run_layer(layer, _inputs(device), **run_kw, allocator_seed=seed, num_blocks=nb,
                                  capture=True)
        layer_runs.append((out.cpu(), [s["indices"].cpu() for s in steps]))
    model = TinyQSAModel(MODEL, tp=tp, device=device)
    model_runs = [_serve(model, seed, nb) for seed, nb in PLACEMENTS]
    out, indices = layer_runs[0]
    torch.save({"out": out, "indices": indices,
                "shape": (layer.num_q_heads, layer.num_kv_heads, tuple(layer.k_proj.shape)),
                "layer_stable": all(torch.equal(o.view(torch.int16), out.view(torch.int16))
                                    and all(torch.equal(a, b) for a, b in zip(i, indices))
                                    for o, i in layer_runs[1:]),
                "logits": model_runs[0].logits, "tokens": model_runs[0].tokens,
                "model_stable": all(torch.equal(r.logits, model_runs[0].logits) and r.tokens == model_runs[0].tokens
                                    for r in model_runs[1:])},
               os.path.join(out_dir, f"rank{rank}.pt"))
    destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_gpus_nccl(tmp_path, world):
    """TP2 and TP4 over NCCL with the Triton routes: the layer against TP1 on GPU 0 and fp64, the tiny
    model's logits against TP1, and on every rank bitwise equal outputs under three page placements."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    mp.spawn(_gpu_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(results):
        assert res["layer_stable"], f"rank {r}: the layer's output moved with the pages"
        assert res["model_stable"], f"rank {r}: the model's logits moved with the pages"
        assert torch.equal(res["logits"], results[0]["logits"]), f"rank {r} disagrees with rank 0"
    check_tp(results, world, run_kw=dict(RUN, route="auto"), device="cuda:0")
    ref = _serve(TinyQSAModel(MODEL, device="cuda:0"), *PLACEMENTS[0])
    compare_generations(results[0]["tokens"], results[0]["logits"], ref.tokens, ref.logits, f"TP{world}")


def compare_generations(tokens, logits, ref_tokens, ref_logits, what, rel_tol=0.02):
    """Greedy generations of the two prompts against TP1's: while a request's tokens agree, its logits
    must agree within ``rel_tol`` of their scale; where a token first differs, TP1's own logits must
    call it a near tie (the two tokens within twice that tolerance); later positions are not compared."""
    n = len(PROMPTS)
    assert logits.shape == ref_logits.shape == (n * NEW_TOKENS, MODEL.vocab_size)
    assert torch.isfinite(logits).all()
    tol = rel_tol * float(ref_logits.abs().max())
    for r in range(n):
        for j in range(NEW_TOKENS):
            # emission order: first tokens in prompt order (both end in the last chunks), then decode steps
            row = j * n + r
            diff = float((logits[row] - ref_logits[row]).abs().max())
            assert diff <= tol, f"{what} request {r} token {j}: logits differ by {diff:.3e} > {tol:.3e}"
            a, b = tokens[r][j], ref_tokens[r][j]
            if a != b:
                gap = float(ref_logits[row, b] - ref_logits[row, a])
                assert gap <= 2 * tol, f"{what} request {r} token {j}: {a} vs TP1's {b}, not a near tie ({gap:.3e})"
                break


def test_compare_generations_rejects_wrong_logits():
    """The TP-vs-TP1 generation check passes a near tie and rejects shifted logits and a clear flip."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(len(PROMPTS) * NEW_TOKENS, MODEL.vocab_size, generator=g) * 4
    toks = [[int(ref[j * 2 + r].argmax()) for j in range(NEW_TOKENS)] for r in range(2)]
    compare_generations(toks, ref.clone(), toks, ref, "same")
    tie = ref.clone()
    second = int(tie[1].topk(2).indices[1])
    tie[1, second] = tie[1, toks[1][0]] - 1e-3  # request 1's first token: a near tie
    flipped = [toks[0], [second] + toks[1][1:]]
    compare_generations(flipped, tie, toks, tie, "tie")
    with pytest.raises(AssertionError, match="logits differ"):
        compare_generations(toks, ref + 0.5, toks, ref, "shifted")
    far = [toks[0], [int(ref[1].argmin())] + toks[1][1:]]
    with pytest.raises(AssertionError, match="not a near tie"):
        compare_generations(far, ref.clone(), toks, ref, "flip")
