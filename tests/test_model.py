"""The tiny model and the serving loop: scheduling, greedy decode, bitwise equality across page
placements, CUDA-graph decode on the GPU."""

import numpy as np
import pytest
import torch

from qsa.model.layer import QSAConfig, StepMetadata
from qsa.model.tiny import TinyConfig, TinyQSAModel
from qsa.model.serving import Engine, prefill_schedule, ServingConfig

MICRO = TinyConfig(vocab_size=96, num_layers=2, attn=QSAConfig(
    hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, index_heads=4, index_head_dim=16,
    index_rotary_dim=8, index_topk=4, rope_theta=10000.0))


def prompts(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def serve(model, ps, new_tokens, **kw):
    lens = [len(p) + new_tokens for p in ps]
    bs = kw.pop("block_size", 8)
    cfg = ServingConfig(num_blocks=sum(-(-n // bs) for n in lens) + 6, block_size=bs, max_reqs=kw.pop("max_reqs", 4),
                        max_blocks_per_req=-(-max(lens) // bs), **kw)
    return Engine(model, cfg).generate(ps, new_tokens)


def test_prefill_schedule_covers_prompts():
    steps = prefill_schedule([5, 0, 12, 3], 4)
    assert all(sum(c.end - c.start for c in s) <= 4 for s in steps)
    covered = {r: [] for r in range(4)}
    for s in steps:
        for c in s:
            covered[c.slot] += range(c.start, c.end)
    assert covered == {0: list(range(5)), 1: [], 2: list(range(12)), 3: list(range(3))}
    assert [[(c.slot, c.start, c.end) for c in s] for s in steps][:2] == [[(0, 0, 4)], [(0, 4, 5), (2, 0, 3)]]


def test_serving_config_and_schedule_refuse_nonsense():
    for kw, match in ((dict(chunk_size=0), "chunk_size"), (dict(chunk_size=-4), "chunk_size"),
                      (dict(num_blocks=-3), "num_blocks"), (dict(max_reqs=0), "max_reqs"),
                      (dict(block_size=6), "block_size"), (dict(route="bogus"), "route"),
                      (dict(backend="cuda"), "backend"), (dict(plan_order="any"), "plan_order"),
                      (dict(cuda_graph=True, route="reference"), "cuda_graph needs the Triton"),
                      (dict(cuda_graph=True, backend="torch"), "cuda_graph needs the Triton")):
        with pytest.raises(ValueError, match=match):
            ServingConfig(**{"num_blocks": 8, **kw})
    with pytest.raises(ValueError, match="chunk_size"):
        prefill_schedule([5], 0)
    with pytest.raises(TypeError, match="cuda_graph must be a bool"):
        ServingConfig(num_blocks=8, cuda_graph=1)
    flag = ServingConfig(num_blocks=8, cuda_graph=np.bool_(False)).cuda_graph
    assert flag is False  # stored as a python bool


def test_engine_recovers_from_a_failed_generation():
    """A request too long for the table fails before anything is allocated, an empty prompt is refused,
    and the engine serves the next batch as a fresh one would."""
    model = TinyQSAModel(MICRO)
    cfg = ServingConfig(num_blocks=12, block_size=8, max_reqs=2, max_blocks_per_req=4, chunk_size=12,
                        route="reference")
    engine = Engine(model, cfg)
    with pytest.raises(ValueError, match=r"needs \d+ blocks, more than max_blocks_per_req=4"):
        engine.generate([list(range(100))], 2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5, 6, 7], []], 3)
    ps = prompts([20, 9], 96)
    got = engine.generate(ps, 2)
    want = Engine(model, cfg).generate(ps, 2)
    assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
    assert engine.allocator.num_free_blocks == Engine(model, cfg).allocator.num_free_blocks
    assert engine.lengths == [0, 0] and bool((engine.block_table == -1).all())


def test_tiny_config_and_forward_check_their_arguments():
    for kw, err, match in ((dict(vocab_size=0), ValueError, "vocab_size"),
                           (dict(num_layers=-1), ValueError, "num_layers"),
                           (dict(intermediate_size=-5), ValueError, "intermediate_size"),
                           (dict(num_layers=2.0), TypeError, "num_layers"),
                           (dict(attn="small"), TypeError, "attn")):
        with pytest.raises(err, match=match):
            TinyConfig(**kw)
    model = TinyQSAModel(MICRO)
    caches = model.allocate_caches(4, 8, 1)
    meta = StepMetadata.build([0], [0], [1], [[0, -1]], [0], block_size=8, device="cpu", route="reference")
    with pytest.raises(ValueError, match="caches"):
        model(torch.zeros(1, dtype=torch.long), meta, caches[:1])


def test_model_shapes_and_padding():
    model = TinyQSAModel(MICRO)
    assert len(model.layers) == 2 and model.layers[0].num_q_heads == 4
    res = serve(model, prompts([13, 21], 96), 4, chunk_size=10, route="reference")
    assert [len(t) for t in res.tokens] == [4, 4]
    assert res.logits.shape == (8, 96) and torch.isfinite(res.logits).all()
    assert [s.kind for s in res.steps] == ["prefill"] * 4 + ["decode"] * 3
    assert res.prefill_tokens == 34 and res.decode_tokens == 6
    assert all(s.rows == 4 for s in res.steps if s.kind == "decode")  # padded to max_reqs


@pytest.mark.parametrize("route", ["reference", pytest.param("auto", marks=pytest.mark.slow)])  # auto: also the demo's check
def test_engine_bitwise_across_allocations(device, route):
    """Two block allocators with different shuffles: the same logits bit for bit (caches start NaN)."""
    model = TinyQSAModel(MICRO, device=device)
    ps = prompts([11, 17, 6], 96, seed=1)
    runs = [serve(model, ps, 2, chunk_size=16, route=route, allocator_seed=s, max_reqs=3) for s in (3, 4)]
    assert torch.equal(runs[0].logits.view(torch.int32), runs[1].logits.view(torch.int32))
    assert runs[0].tokens == runs[1].tokens


def test_engine_greedy_tokens_follow_logits():
    model = TinyQSAModel(MICRO)
    ps = prompts([9, 14], 96, seed=2)
    res = serve(model, ps, 3, chunk_size=32, route="reference")
    # logits rows: prefill (request order of completion), then each decode step's requests
    assert res.logits[:2].argmax(-1).tolist() == [res.tokens[0][0], res.tokens[1][0]]
    assert res.logits[2:4].argmax(-1).tolist() == [res.tokens[0][1], res.tokens[1][1]]


def test_engine_decode_matches_a_longer_prefill():
    """Decoding token t after a prefill equals prefilling the prompt extended by the generated tokens
    (same logits up to bf16 rounding of differently batched matmuls), so the cache, the compressed
    keys and the positions carry over between steps."""
    model = TinyQSAModel(MICRO)
    p = prompts([23], 96, seed=3)
    res = serve(model, p, 3, chunk_size=8, route="reference")
    longer = serve(model, [p[0] + res.tokens[0][:2]], 1, chunk_size=8, route="reference")
    assert longer.tokens[0][0] == res.tokens[0][2]
    scale = float(res.logits[2].abs().max())
    assert float((longer.logits[0] - res.logits[2]).abs().max()) <= 0.05 * scale


def test_engine_capture():
    model = TinyQSAModel(MICRO)
    ps = prompts([13, 10], 96)
    lens = [16, 13]
    engine = Engine(model, ServingConfig(num_blocks=12, block_size=8, max_reqs=2, max_blocks_per_req=2,
                                         chunk_size=12, route="reference"))
    res = engine.generate(ps, 3, capture_step=1, capture_layer=1)
    cap = res.capture
    assert cap["q"].shape == (11, 4, 16) and cap["indices"].shape == (11, MICRO.attn.index_width)
    assert cap["kv"].shape == (12, 2, 8, 2, 16) and cap["kc"].shape == (12, 2, 16)
    assert cap["positions"].tolist() == [12] + list(range(10))
    assert cap["seq_lens"].tolist() == [13, 10]
    # after 3 new tokens the requests hold lens tokens, which fill their 2 blocks of 8 at most
    assert [len(p) + len(t) for p, t in zip(ps, res.tokens)] == lens and max(lens) <= 2 * 8
    with pytest.raises(ValueError, match="prompts"):
        engine.generate([[1]] * 3, 1)


@pytest.mark.gpu
def test_gpu_engine_cuda_graph_decode_is_bitwise_eager():
    """Reference layer shape, 2 layers: decode replayed from a CUDA graph gives the eager bits, and both
    are bitwise equal across page placements."""
    model = TinyQSAModel(TinyConfig.reference(vocab_size=2048, num_layers=2), device="cuda")
    ps = prompts([2500, 3100, 700], 2048, seed=4)
    kw = dict(chunk_size=1024, block_size=64, route="auto", max_reqs=4)
    eager = serve(model, ps, 8, cuda_graph=False, allocator_seed=1, **kw)
    graph = serve(model, ps, 8, cuda_graph=True, allocator_seed=1, **kw)
    moved = serve(model, ps, 8, cuda_graph=True, allocator_seed=2, **kw)
    assert torch.isfinite(eager.logits).all()
    assert torch.equal(eager.logits.view(torch.int32), graph.logits.view(torch.int32))
    assert torch.equal(graph.logits.view(torch.int32), moved.logits.view(torch.int32))
