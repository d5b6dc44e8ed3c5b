"""Tensor parallelism: the layer with its heads sharded over 2 and 4 processes (gloo on the CPU, NCCL on
two GPUs) against the same layer at TP1.

Per-rank shapes at the reference head counts (24 query heads, 2 KV heads): TP2 12/1, TP4 6/1 with
each KV head replicated on two ranks. The selection is computed on every rank and must be identical
to TP1's bit for bit; the all-reduced outputs must be identical on every rank and within the
reference bound of TP1 (only the o_proj summation order differs).
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from qsa.layer import QSAAttention, QSAConfig, layer_reference
from qsa.reference import rounding_floor
from qsa.serving import run_layer
from qsa.tp import TPInfo, all_reduce, destroy, free_port, init_local_group, shard_heads

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
    torch.save({"out": out.cpu(), "indices": [s["indices"].cpu() for s in steps],
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


def test_tensor_parallel_two_processes_gloo(tmp_path):
    results = run_tp(2, tmp_path)
    check_tp(results, 2)


def test_tensor_parallel_four_processes_gloo(tmp_path):
    """TP4: 6 query heads and 1 KV head per rank; KV head 0 replicated on ranks 0-1, head 1 on 2-3."""
    assert [shard_heads(24, 2, TPInfo(r, 4)).kv_start for r in range(4)] == [0, 0, 1, 1]
    results = run_tp(4, tmp_path)
    check_tp(results, 4)


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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_two_gpus_nccl(tmp_path):
    """TP2 over NCCL on two GPUs with the Triton routes, against TP1 on GPU 0."""
    run_kw = dict(RUN, route="auto")
    results = run_tp(2, tmp_path, backend="nccl", run_kw=run_kw)
    check_tp(results, 2, run_kw=run_kw, device="cuda:0")
