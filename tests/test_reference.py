"""The attention references: two independent paths agree, known-wrong variants are rejected,
the tolerance checker accepts PyTorch-level error and rejects real bugs, invariances hold."""

import math

import pytest
import torch

from qsa.cache.paged import allocate_kv_cache, collision_prone_num_blocks, dequantize_e4m3, random_mapping
from helpers import AttentionCase, make_attention_case
from qsa.attention.reference import assert_close_like_torch, reference_attention, rounding_floor, sdpa_attention

CONFIGS = [
    # (Hq, Hkv, block_size, kv_cache_dtype, layout, dtype, gate)
    (1, 1, 16, "auto", "interleaved", torch.float16, False),
    (2, 2, 4, "auto", "separate", torch.bfloat16, True),
    (6, 1, 16, "fp8_e4m3", "interleaved", torch.float16, True),
    (12, 2, 32, "auto", "interleaved", torch.bfloat16, False),
    (12, 1, 4, "fp8_e4m3", "separate", torch.bfloat16, False),
    (24, 2, 16, "auto", "separate", torch.float16, True),
    (6, 1, 32, "fp8_e4m3", "separate", torch.float16, False),
]


def _case(cfg, seed=0, **kw):
    hq, hkv, bs, kvd, layout, dtype, gate = cfg
    return make_attention_case(num_q_heads=hq, num_kv_heads=hkv, block_size=bs, kv_cache_dtype=kvd,
                               layout=layout, dtype=dtype, with_gate=gate, seed=seed, **kw)


def _agree(a, b, width):
    """fp64 results of two summation orders over at most ``width`` tokens: a few ulps per token."""
    (oa, la), (ob, lb) = a, b
    assert torch.equal(torch.isneginf(la), torch.isneginf(lb)), "empty sets differ"
    fin = torch.isfinite(la)
    assert torch.isfinite(oa).all() and torch.isfinite(ob).all()
    tol = width * rounding_floor(oa, torch.float64)
    lse_tol = width * rounding_floor(la[fin], torch.float64) if fin.any() else 0.0
    assert (oa - ob).abs().max() <= tol, f"out differs by {(oa - ob).abs().max():.3e} > {tol:.3e}"
    if fin.any():
        assert (la[fin] - lb[fin]).abs().max() <= lse_tol, "lse differs"


def _buggy_reference(case: AttentionCase, bug=None):
    """A third, deliberately plain loop reference; ``bug`` switches on one known mistake."""
    c = case.cache
    q = case.q.double()
    rows, hq, d = q.shape
    group = hq // c.num_kv_heads
    table, lens = case.block_table.tolist(), case.seq_lens.tolist()
    out = torch.zeros(rows, hq, d, dtype=torch.float64)
    lse = torch.full((rows, hq), -math.inf, dtype=torch.float64)
    fp8 = c.kv_cache_dtype == "fp8_e4m3"

    def load(cache, blk, off, scale):
        x = cache[blk, off]
        return dequantize_e4m3(x, scale).double() if fp8 else x.double()

    for r in range(rows):
        req, pos = int(case.token_to_req[r]), int(case.positions[r])
        if not 0 <= req < len(lens) or pos < 0:
            continue
        toks = []
        for t in case.indices[r].tolist():
            if t < 0 or t >= lens[req] or t // c.block_size >= len(table[req]):
                continue
            if t > pos and bug != "causal_ignored":
                continue
            if 0 <= table[req][t // c.block_size] < c.num_blocks:
                toks.append(t)
        if bug != "duplicates_twice":
            toks = sorted(set(toks))
        if not toks:
            continue
        where = [(table[req][t // c.block_size], t % c.block_size) for t in toks]
        k = torch.stack([load(c.k, b, o, c.k_scale) for b, o in where])  # [n, Hkv, D]
        v_scale = 1.0 if bug == "v_scale_ignored" else c.v_scale
        v = torch.stack([load(c.v, b, o, v_scale) for b, o in where])
        for h in range(hq):
            j = h % c.num_kv_heads if bug == "gqa_modulo" else h // group
            s = k[:, j] @ q[r, h] * d ** -0.5
            lse[r, h] = torch.logsumexp(s, 0)
            out[r, h] = torch.softmax(s, 0) @ v[:, j]
    if case.gate is not None:
        out = out * torch.sigmoid(case.gate.double())
    return out, lse


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}x{c[1]}-bs{c[2]}-{c[3]}-{c[4]}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_references_agree(cfg, seed):
    case = _case(cfg, seed)
    width = case.indices.shape[1]
    ref = case.run(reference_attention)
    assert ref[0].dtype == torch.float64 and ref[1].dtype == torch.float64
    assert ref[0].shape == case.q.shape and ref[1].shape == case.q.shape[:2]
    _agree(ref, case.run(sdpa_attention), width)
    _agree(ref, _buggy_reference(case), width)
    # The case is not degenerate: some rows attend something, padding rows attend nothing.
    assert torch.isfinite(ref[1]).any() and torch.isneginf(ref[1][:2]).all()


@pytest.mark.parametrize("bug,cfg", [
    ("duplicates_twice", CONFIGS[0]),
    ("causal_ignored", CONFIGS[1]),
    ("gqa_modulo", CONFIGS[3]),
    ("v_scale_ignored", CONFIGS[2]),
])
def test_cross_check_rejects_known_wrong_references(bug, cfg):
    case = _case(cfg, seed=4)
    width = case.indices.shape[1]
    sdpa = case.run(sdpa_attention)
    _agree(_buggy_reference(case), sdpa, width)
    with pytest.raises(AssertionError):
        _agree(_buggy_reference(case, bug), sdpa, width)


def test_hand_computed_case():
    """One request, block_size 4, D 2: the answer written out by hand."""
    cache = allocate_kv_cache(3, 4, 1, 2, dtype=torch.float32, fill="nan")
    # Logical tokens 0..5 of the request live in physical blocks 2 (tokens 0-3) and 1 (tokens 4-5).
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    vals = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 10.0], [11.0, 12.0]])
    for t in range(6):
        cache.k[[2, 1][t // 4], t % 4, 0] = keys[t]
        cache.v[[2, 1][t // 4], t % 4, 0] = vals[t]
    table = torch.tensor([[2, 1]], dtype=torch.int32)
    q = torch.tensor([[[1.0, 2.0]], [[0.5, 0.5]], [[1.0, 1.0]]])
    # Row 0: tokens {0, 2, 4} (duplicate 2, -1, token 5 > pos 4 dropped).
    # Row 1: tokens {1} only (6 >= seq_len). Row 2: position -1, a padding row.
    indices = torch.tensor([[2, 0, -1, 5, 2, 4], [1, 6, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5]],
                           dtype=torch.int32)
    args = (q, cache.k, cache.v, indices, table, torch.tensor([0, 0, 0], dtype=torch.int32),
            torch.tensor([4, 5, -1]), torch.tensor([6], dtype=torch.int32))
    s = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)  # q0 . k[0, 2, 4]
    p = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
    want0 = p @ torch.tensor([[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]], dtype=torch.float64)
    for fn in (reference_attention, sdpa_attention):
        out, lse = fn(*args, softmax_scale=1.0)
        torch.testing.assert_close(out[0, 0], want0, rtol=0, atol=1e-15)
        torch.testing.assert_close(lse[0, 0].item(), math.log(math.exp(1) + math.exp(3) + math.exp(2)))
        assert out[1, 0].tolist() == [3.0, 4.0] and lse[1, 0].item() == 0.5
        assert (out[2] == 0).all() and lse[2, 0].item() == -math.inf


def test_default_scale_and_softmax_scale():
    case = _case(CONFIGS[2])
    d = case.q.shape[-1]
    base = case.run(reference_attention)
    explicit = case.run(reference_attention, softmax_scale=d ** -0.5)
    assert torch.equal(base[0], explicit[0])
    doubled = case.run(reference_attention, softmax_scale=2 * d ** -0.5)
    fin = torch.isfinite(base[1])
    assert not torch.allclose(doubled[1][fin], base[1][fin])
    _agree(doubled, case.run(sdpa_attention, softmax_scale=2 * d ** -0.5), case.indices.shape[1])


def test_never_reads_outside_the_token_sets():
    """Poison every slot that no row keeps: the outputs must not change (bitwise)."""
    for cfg in (CONFIGS[2], CONFIGS[3]):
        case = _case(cfg, seed=5)
        c = case.cache
        kept = set()
        table = case.block_table.tolist()
        for r in range(case.q.shape[0]):
            req, pos = int(case.token_to_req[r]), int(case.positions[r])
            if not 0 <= req < len(table) or pos < 0:
                continue
            for t in case.indices[r].tolist():
                lb = t // c.block_size
                if 0 <= t < int(case.seq_lens[req]) and t <= pos and lb < len(table[req]) \
                        and 0 <= table[req][lb] < c.num_blocks:
                    kept.add((table[req][lb], t % c.block_size))
        poisoned = allocate_kv_cache(c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, dtype=c.k.dtype,
                                     kv_cache_dtype=c.kv_cache_dtype, layout=c.layout, fill="nan",
                                     k_scale=c.k_scale, v_scale=c.v_scale)
        for b, o in kept:
            poisoned.k[b, o] = c.k[b, o]
            poisoned.v[b, o] = c.v[b, o]
        lean = AttentionCase(case.q, case.gate, poisoned, case.indices, case.block_table, case.token_to_req,
                             case.positions, case.seq_lens)
        for fn in (reference_attention, sdpa_attention):
            a, b = case.run(fn), lean.run(fn)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("collision_prone", [False, True])
def test_relocation_and_permutation_invariance(collision_prone):
    case = _case(CONFIGS[5], seed=6)
    nb = case.cache.num_blocks
    g = torch.Generator().manual_seed(1)
    n_out = collision_prone_num_blocks(nb, 64) if collision_prone else nb
    moved = case.relocated(random_mapping(nb, generator=g, collision_prone=collision_prone,
                                          num_blocks_out=n_out), num_blocks_out=n_out)
    assert moved.cache.num_blocks == n_out and not torch.equal(moved.block_table, case.block_table)
    shuffled = case.with_permuted_indices(g)
    assert not torch.equal(shuffled.indices, case.indices)
    for fn in (reference_attention, sdpa_attention):
        base = case.run(fn)
        for other in (moved, shuffled):
            out, lse = other.run(fn)
            assert torch.equal(out, base[0]) and torch.equal(lse, base[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_mode(dtype):
    cfg = (6, 1, 16, "auto", "interleaved", dtype, True)
    case = _case(cfg, seed=3)
    ref = case.run(reference_attention)
    lowp = case.run(reference_attention, compute_dtype=dtype)
    fp32 = case.run(reference_attention, compute_dtype=torch.float32)
    assert lowp[0].dtype == dtype and lowp[1].dtype == torch.float32 and fp32[0].dtype == torch.float32
    err_lowp = (lowp[0].double() - ref[0]).abs().max()
    err_fp32 = (fp32[0].double() - ref[0]).abs().max()
    # The low-precision mode really computes in `dtype`: clearly worse than fp32, yet of the order
    # of that dtype's resolution.
    assert err_fp32 * 16 < err_lowp < 16 * rounding_floor(ref[0], dtype)
    assert_close_like_torch(lowp[0], ref[0], lowp[0], lse=lowp[1], ref_lse=ref[1], torch_lse=lowp[1])


@pytest.fixture(scope="module")
def checker_setup():
    case = _case((6, 1, 16, "auto", "interleaved", torch.float16, True), seed=7)
    ref = case.run(reference_attention)
    torch_lp = case.run(reference_attention, compute_dtype=torch.float16)
    return case, ref, torch_lp


class TestChecker:
    """assert_close_like_torch accepts PyTorch-level error and rejects known-wrong results."""

    def test_accepts_torch_and_rounded_truth(self, checker_setup):
        case, ref, torch_lp = checker_setup
        stats = assert_close_like_torch(torch_lp[0], ref[0], torch_lp[0], lse=torch_lp[1], ref_lse=ref[1],
                                        torch_lse=torch_lp[1])
        assert 0 < stats["err"] <= stats["bound"]
        assert_close_like_torch(ref[0].half(), ref[0], torch_lp[0], lse=ref[1].float(), ref_lse=ref[1],
                                torch_lse=torch_lp[1])

    def _wrong(self, name, case, ref, torch_lp):
        out, lse = ref[0].half().clone(), ref[1].float().clone()
        fin = torch.isfinite(lse)
        if name == "zeros":
            out.zero_()
        elif name == "nan":
            out[3, 0, 0] = float("nan")
        elif name == "causal_ignored":
            out = _buggy_reference(case, "causal_ignored")[0].half()
        elif name == "wrong_scale":
            out = case.run(reference_attention, softmax_scale=1.0)[0].half()
        elif name == "lse_off_by_log2":
            lse[fin] += math.log(2)
        elif name == "empty_row_attends":
            out[0] = 1e-3
        elif name == "lse_finite_on_empty_row":
            lse[0] = 0.0
        elif name == "lse_missing_on_full_row":
            lse[fin.nonzero()[0, 0]] = -math.inf
        return out, lse

    @pytest.mark.parametrize("name", ["zeros", "nan", "causal_ignored", "wrong_scale", "lse_off_by_log2",
                                      "empty_row_attends", "lse_finite_on_empty_row",
                                      "lse_missing_on_full_row"])
    def test_rejects_wrong_results(self, checker_setup, name):
        case, ref, torch_lp = checker_setup
        out, lse = self._wrong(name, case, ref, torch_lp)
        with pytest.raises(AssertionError):
            assert_close_like_torch(out, ref[0], torch_lp[0], lse=lse, ref_lse=ref[1], torch_lse=torch_lp[1])


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.zeros(3, 3, 16)), ValueError, "multiple of Hkv"),
    (dict(q=torch.zeros(3, 2, 8)), ValueError, "k_cache must have shape"),
    (dict(indices=torch.zeros(3, 4)), TypeError, "indices must have dtype"),
    (dict(indices=torch.zeros(2, 4, dtype=torch.int32)), ValueError, r"indices must have shape \[3, \*\]"),
    (dict(positions=torch.zeros(4, dtype=torch.int64)), ValueError, "positions must have shape"),
    (dict(seq_lens=torch.zeros(2, dtype=torch.int32)), ValueError, r"seq_lens must have shape \[1\]"),
    (dict(gate=torch.zeros(3, 2)), ValueError, "gate must have shape"),
    (dict(kv_cache_dtype="fp8_e4m3"), TypeError, "k_cache must have dtype uint8"),
])
def test_bad_arguments(change, exc, match):
    cache = allocate_kv_cache(4, 4, 2, 16, fill="zeros")
    args = dict(q=torch.zeros(3, 2, 16), k_cache=cache.k, v_cache=cache.v,
                indices=torch.zeros(3, 4, dtype=torch.int32),
                block_table=torch.zeros(1, 2, dtype=torch.int32),
                token_to_req=torch.zeros(3, dtype=torch.int32), positions=torch.zeros(3, dtype=torch.int64),
                seq_lens=torch.ones(1, dtype=torch.int32), gate=None, kv_cache_dtype="auto")
    args.update(change)
    for fn in (reference_attention, sdpa_attention):
        with pytest.raises(exc, match=match):
            fn(args["q"], args["k_cache"], args["v_cache"], args["indices"], args["block_table"],
               args["token_to_req"], args["positions"], args["seq_lens"], gate=args["gate"],
               kv_cache_dtype=args["kv_cache_dtype"])
