"""Merging partial attention states (``qsa.merge_attention_states``): attention over disjoint shares of each
row's tokens, merged, against attention over the union and the fp64 merge reference; empty parts, NaN in an
empty part, every output element written, bitwise determinism whatever way the parts are passed, input
checks; and the checks rejecting known-wrong merges (one that averages the parts, one that forgets to
subtract the max, one that multiplies an empty part's output by its zero weight)."""

import functools
import math
from dataclasses import replace

import pytest
import torch

import qsa
import qsa.attention.merge as merge_mod
from qsa.attention import replay
from qsa.attention.merge import merge_reference
from helpers import check_against_reference, make_attention_case, poisoned, slow

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
INF = math.inf


def split_indices(indices: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` disjoint shares of each row's entries, as context-parallel ranks hold them: token ``t`` goes
    to share ``(t // 4) % parts`` (whole 4-token groups), except in rows ``r % 5 == 1``, whose tokens all go
    to the last share (the others are empty there). A token's duplicates go where it goes; -1 stays -1 in
    every share."""
    rows = torch.arange(indices.shape[0])[:, None]
    owner = torch.where(rows % 5 == 1, parts - 1, (indices.clamp(min=0) // 4) % parts)
    return [torch.where((indices >= 0) & (owner == p), indices, -1) for p in range(parts)]


@functools.lru_cache(maxsize=None)
def split_case(dtype, parts: int, seed: int):
    """A random attention case, its shares' ``(out_i, lse_i)`` by the xqa route, and the attention over
    the union of the shares (the case itself). Cached: several tests read one computation."""
    case = make_attention_case(rows=13, num_q_heads=4, num_kv_heads=2, head_dim=16, width=24, dtype=dtype,
                               seed=seed)
    outs, lses = [], []
    for share in split_indices(case.indices, parts):
        o, lse = replace(case, indices=share).run(qsa.sparse_paged_attention, route="xqa", return_lse=True)
        outs.append(o)
        lses.append(lse)
    return case, outs, lses


def assert_close_to_merge_reference(got, outs, lses, name="merge"):
    """``got = (out, lse)`` within rounding of :func:`merge_reference`: the ``-inf`` lse positions exact with
    out exactly 0 there; out within one ulp of its dtype at the largest value plus fp32 rounding of the P
    folds; lse within the fp32 rounding of the folds."""
    out, lse = got
    ref, ref_lse = merge_reference(outs, lses)
    parts = len(outs) if isinstance(outs, (list, tuple)) else outs.shape[0]
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{name}: -inf lse positions differ from the reference"
    assert bool((out[empty] == 0).all()), f"{name}: heads with every part empty must be exactly 0"
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[~empty]).all()), f"{name}: non-finite"
    eps32 = torch.finfo(torch.float32).eps
    stacked = torch.stack([o.double() for o in outs]).abs()
    scale = float(stacked[torch.isfinite(stacked)].max())  # an empty part's NaN out is no scale
    bound = torch.finfo(out.dtype).eps * float(ref.abs().max()) + 8 * parts * eps32 * scale
    err = float((out.double() - ref).abs().max())
    assert err <= bound, f"{name}: max abs error {err:.3e} > {bound:.3e}"
    if (~empty).any():
        lse_err = float((lse[~empty].double() - ref_lse[~empty]).abs().max())
        lse_bound = 8 * parts * eps32 * max(1.0, float(ref_lse[~empty].abs().max()))
        assert lse_err <= lse_bound, f"{name} lse: max abs error {lse_err:.3e} > {lse_bound:.3e}"


def random_parts(parts, rows=6, heads=3, head_dim=16, dtype=FP16, seed=0):
    """Random ``(outs, lses)`` with empty parts (lse -inf, out 0) scattered, row 0 empty in every part and a
    wide spread of lse values (weights from 1 down to underflow)."""
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(rows, heads, head_dim, generator=g).to(dtype) for _ in range(parts)]
    lses = [torch.randn(rows, heads, generator=g) * 8 for _ in range(parts)]
    for i in range(parts):
        gone = torch.rand(rows, heads, generator=g) < 0.3
        gone[0] = True
        lses[i][gone] = -INF
        outs[i][gone] = 0
    return outs, lses


# ------------------------------------------------------------------------------- against the union


@pytest.mark.parametrize("dtype,parts", [slow(FP16, 2), (FP16, 3), (BF16, 3)])
def test_merged_shares_match_attention_over_the_union(dtype, parts):
    """Each share attended by the xqa route, merged: attention over the union within the project's
    tolerance of the fp64 reference (docs/spec.md section 4), lse included, padding rows 0 / -inf; and
    within rounding of the fp64 merge of the same parts."""
    case, outs, lses = split_case(dtype, parts, seed=parts)
    empties = [torch.isneginf(lse[:, 0]) for lse in lses]
    assert all(e.any() for e in empties), "every share should be empty for some row"
    assert (~torch.stack(empties)).all(dim=0).any(), "some row should have tokens in every share"
    got = qsa.merge_attention_states(outs, lses, return_lse=True)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    check_against_reference(case, got, name=f"merged {parts} shares")
    assert_close_to_merge_reference(got, outs, lses)
    padding = case.token_to_req.lt(0) | case.token_to_req.ge(case.seq_lens.numel()) | case.positions.lt(0)
    assert padding.any() and bool(torch.isneginf(got[1][padding]).all()) and bool((got[0][padding] == 0).all())


def test_checks_reject_known_wrong_merges():
    """The comparisons above fail for wrong merges: the parts averaged (the union check and the reference
    check), and weights ``exp(lse_i) / sum exp(lse_j)`` without subtracting the max, which overflows once
    the lses are large (every lse + 100: the exact merge only shifts its lse)."""
    case, outs, lses = split_case(FP16, 3, seed=3)
    used = torch.stack([l != -INF for l in lses])
    avg = (torch.stack([o.float() for o in outs]) * used[..., None]).sum(0) / used.sum(0).clamp(min=1)[..., None]
    avg = avg.to(FP16)
    lse = qsa.merge_attention_states(outs, lses, return_lse=True)[1]
    with pytest.raises(AssertionError, match="max abs error"):
        check_against_reference(case, (avg, lse), name="average")
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close_to_merge_reference((avg, lse), outs, lses, name="average")

    shifted = [l + 100.0 for l in lses]
    got = qsa.merge_attention_states(outs, shifted, return_lse=True)
    assert_close_to_merge_reference(got, outs, shifted)
    exact = qsa.merge_attention_states(outs, lses, return_lse=True)
    assert float((got[0].float() - exact[0].float()).abs().max()) <= 2 * torch.finfo(FP16).eps * 4

    def no_max(outs, lses):
        e = torch.stack([torch.exp(l) for l in lses])  # fp32: exp(100 + x) overflows
        s = e.sum(0)
        o = (e[..., None] * torch.stack([x.float() for x in outs])).sum(0) / s[..., None]
        return torch.where(s[..., None] == 0, 0.0, o).to(FP16), torch.log(s)

    assert_close_to_merge_reference(no_max(outs, lses), outs, lses, name="no max, small lses")
    with pytest.raises(AssertionError, match="non-finite|differ"):
        assert_close_to_merge_reference(no_max(outs, shifted), outs, shifted, name="no max")


# ---------------------------------------------------------------------- against the merge reference


@pytest.mark.parametrize("dtype,parts,heads,head_dim", [
    (FP16, 1, 3, 16), (FP16, 2, 3, 16), (BF16, 4, 3, 16), (FP32, 3, 3, 16), (FP16, 8, 3, 16), (FP16, 9, 3, 16),
    (BF16, 3, 3, 24), (FP16, 2, 11, 256)])
def test_merge_matches_the_reference(dtype, parts, heads, head_dim):
    """Random parts (empty ones scattered, a row empty in all) for one to nine parts (nine separate tensors
    are stacked first), a head dim that is not a power of two, and 11 heads at 256 (two head blocks of 8,
    the second partly masked)."""
    assert merge_mod.merge_states_config(11, 256)[0] == 8
    outs, lses = random_parts(parts, heads=heads, head_dim=head_dim, dtype=dtype, seed=parts)
    got = qsa.merge_attention_states(outs, lses, return_lse=True)
    assert_close_to_merge_reference(got, outs, lses)
    assert bool(torch.isneginf(got[1][0]).all()) and bool((got[0][0] == 0).all())
    if parts == 1:  # one part: itself, its lse exactly
        assert torch.equal(got[1], lses[0])
        assert float((got[0].float() - outs[0].float()).abs().max()) <= torch.finfo(dtype).eps * 4


def test_empty_parts_never_leak_nan():
    """A part with lse -inf whose out holds NaN (the contract says 0) changes nothing: its weight is a
    select, not a multiply by 0, and a head empty in every part is 0 / -inf even with NaN outs. A merge that
    multiplies by the zero weight instead leaks the NaN."""
    outs, lses = random_parts(3, seed=11)
    clean = qsa.merge_attention_states(outs, lses, return_lse=True)
    dirty = [torch.where(torch.isneginf(l)[..., None], torch.full_like(o, float("nan")), o)
             for o, l in zip(outs, lses)]
    assert all(bool(d.isnan().any()) for d in dirty)
    got = qsa.merge_attention_states(dirty, lses, return_lse=True)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])
    assert_close_to_merge_reference(got, dirty, lses)

    m = torch.stack(lses).amax(0)
    w = torch.stack([torch.exp(l - m) for l in lses])  # 0 for empty parts, NaN where all are empty
    naive = (w[..., None] * torch.stack([d.float() for d in dirty])).sum(0) / w.sum(0)[..., None]
    assert bool(naive.isnan().any()), "a multiply by the zero weight should leak the NaN"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_nonfinite_lse_propagates_nan():
    """A NaN or +inf lse of a part makes that row and head NaN (out and lse), other heads untouched."""
    outs, lses = random_parts(3, seed=5)
    lses[1][2, 1] = float("nan")
    lses[2][3, 0] = INF
    lses[0][4, 2] = float("nan")  # with the others maybe -inf
    lses[1][4, 2] = lses[2][4, 2] = -INF
    out, lse = qsa.merge_attention_states(outs, lses, return_lse=True)
    bad = torch.zeros_like(lse, dtype=torch.bool)
    bad[2, 1] = bad[3, 0] = bad[4, 2] = True
    assert bool(lse[bad].isnan().all()) and bool(out[bad].isnan().all())
    assert not bool(lse[~bad].isnan().any()) and not bool(out[~bad].isnan().any())


def test_every_element_of_out_is_written():
    """A NaN-poisoned ``out=``, a row-strided view of a larger buffer, is written everywhere (heads empty in
    every part included), and the call returns it."""
    outs, lses = random_parts(3, rows=5, heads=5, dtype=BF16, seed=2)
    big = poisoned((5, 7, 16), BF16, "cpu")
    out = big[:, 1:6]
    got, lse = qsa.merge_attention_states(outs, lses, out=out, return_lse=True)
    assert got is out and not bool(out.isnan().any())
    assert bool(big[:, 0].isnan().all()) and bool(big[:, 6].isnan().all()), "wrote outside out"
    assert torch.equal(out, qsa.merge_attention_states(outs, lses))


# ----------------------------------------------------------------------------------- determinism


def test_bits_depend_on_the_values_alone():
    """Two calls give the same bits; so do the parts as a list, a tuple, one stacked tensor, a stacked out
    with listed lses, parts of different layouts (stacked by the call), strided lses, and a row's merge
    alone or in the batch (every element's arithmetic is its own)."""
    outs, lses = random_parts(4, rows=7, heads=5, seed=9)
    base = qsa.merge_attention_states(outs, lses, return_lse=True)

    def same(got, what):
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), f"{what}: not bitwise equal"

    same(qsa.merge_attention_states(outs, lses, return_lse=True), "a second call")
    same(qsa.merge_attention_states(tuple(outs), tuple(lses), return_lse=True), "tuples")
    same(qsa.merge_attention_states(torch.stack(outs), torch.stack(lses), return_lse=True), "stacked")
    same(qsa.merge_attention_states(torch.stack(outs), lses, return_lse=True), "stacked outs, listed lses")
    strided = [torch.empty(7, 6, 16, dtype=FP16)[:, :5].copy_(o) for o in outs]
    strided_l = [torch.empty(5, 7).t().copy_(l) for l in lses]
    for i in range(4):  # one part of other strides than the rest, first, in the middle or last
        mixed = outs[:i] + [strided[i]] + outs[i + 1:]
        mixed_l = lses[:i] + [strided_l[i]] + lses[i + 1:]
        same(qsa.merge_attention_states(mixed, lses, return_lse=True), f"outs of two layouts ({i})")
        same(qsa.merge_attention_states(outs, mixed_l, return_lse=True), f"lses of two layouts ({i})")
        same(qsa.merge_attention_states(torch.stack(outs), mixed_l, return_lse=True), f"stacked outs ({i})")
    same(qsa.merge_attention_states(strided, strided_l, return_lse=True), "strided parts")
    lse_t = torch.stack(lses, dim=2).transpose(0, 2).transpose(1, 2)  # [P, rows, Hq], not contiguous
    assert not lse_t.is_contiguous()
    same(qsa.merge_attention_states(outs, lse_t, return_lse=True), "strided stacked lses")
    rows = [5, 2]
    alone = qsa.merge_attention_states([o[rows] for o in outs], [l[rows] for l in lses], return_lse=True)
    assert torch.equal(alone[0], base[0][rows]) and torch.equal(alone[1], base[1][rows]), "rows alone"
    # Nine parts: past the pointer arguments, as a list (stacked by the call) and stacked.
    outs9, lses9 = random_parts(9, seed=4)
    a = qsa.merge_attention_states(outs9, lses9, return_lse=True)
    b = qsa.merge_attention_states(torch.stack(outs9), torch.stack(lses9), return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_merge_is_recorded_for_replay(device):
    """Launched through ``qsa.attention.replay.launch``, so a recorded eager step sees it: one launch."""
    outs, lses = random_parts(2, seed=1)
    outs, lses = [o.to(device) for o in outs], [x.to(device) for x in lses]
    with replay.Recorder() as rec:
        qsa.merge_attention_states(outs, lses)
    launches = [s for s in rec.steps if s[0] == "launch"]
    assert len(launches) == 1 and launches[0][1] is merge_mod.merge_attention_states_kernel


def test_pytorch_fallback_matches(monkeypatch):
    """Where Triton cannot run, the same arithmetic in PyTorch: within rounding of the reference."""
    outs, lses = random_parts(3, seed=6)
    outs[1] = torch.where(torch.isneginf(lses[1])[..., None], float("nan"), outs[1].float()).half()
    monkeypatch.setattr(merge_mod.backend, "triton_available", lambda device: "no backend (test)")
    monkeypatch.setattr(merge_mod.backend, "log_once", lambda message: None)
    got = qsa.merge_attention_states(outs, lses, return_lse=True)
    assert_close_to_merge_reference(got, outs, lses, name="fallback")


# ----------------------------------------------------------------------------------------- inputs


def _bad(outs, lses):
    """Variants of valid (outs, lses) that must be refused: (kwargs, error type, message pattern)."""
    o, l = outs, lses
    out = torch.empty_like(o[0])
    return [
        (dict(outs=[], lses=[]), ValueError, r"^outs must hold at least one part"),
        (dict(outs=torch.stack(o)[:0], lses=torch.stack(l)[:0]), ValueError, r"^outs must hold at least one part"),
        (dict(outs=o[0], lses=l), ValueError, r"^outs must be a sequence .* stacked \[P, rows, Hq, D\]"),
        (dict(outs=5, lses=l), TypeError, r"^outs must be a sequence"),
        (dict(outs=[o[0], "x"], lses=l), TypeError, r"^outs\[1\] must be a torch.Tensor"),
        (dict(outs=o, lses=l[:1]), ValueError, r"^lses must hold one \[rows, Hq\] tensor per part"),
        (dict(outs=[o[0], o[1][:, :1]], lses=l), ValueError, r"^outs\[1\] must have shape \[4, 3, 16\]"),
        (dict(outs=[o[0], o[1].float()], lses=l), TypeError, r"^outs\[1\] must have dtype float16"),
        (dict(outs=[x.int() for x in o], lses=l), TypeError, r"^outs\[0\] must have dtype float16, bfloat16, float32"),
        (dict(outs=[x.transpose(1, 2).contiguous().transpose(1, 2) for x in o], lses=l), ValueError,
         r"^outs\[0\] must be contiguous in its last"),
        (dict(outs=o, lses=[l[0], l[1].half()]), TypeError, r"^lses\[1\] must have dtype float32"),
        (dict(outs=o, lses=[l[0], l[1][:2]]), ValueError, r"^lses\[1\] must have shape \[4, 3\]"),
        (dict(outs=o, lses=torch.stack(l)[..., None]), ValueError, r"^lses must be a sequence"),
        (dict(outs=o, lses=l, out=out[:2]), ValueError, r"^out must have shape \[4, 3, 16\]"),
        (dict(outs=o, lses=l, out=out.float()), TypeError, r"^out must have dtype float16"),
        (dict(outs=o, lses=l, out=torch.empty(4, 3, 32, dtype=FP16)[..., ::2]), ValueError,
         r"^out must be contiguous in its last"),
        (dict(outs=o, lses=l, out=o[1]), ValueError, r"^out must not share memory with outs\[1\]"),
        (dict(outs=o, lses=l, out=torch.empty(16, dtype=FP16).as_strided((4, 3, 16), (0, 0, 1))), ValueError,
         r"^out must not have elements that share memory"),
        (dict(outs=o, lses=l, return_lse=1), TypeError, r"^return_lse must be a bool"),
    ]


def test_bad_inputs_are_refused():
    """Every malformed argument raises TypeError/ValueError naming it and what was expected."""
    outs, lses = random_parts(2, rows=4, heads=3, seed=0)
    for kwargs, err, pattern in _bad(outs, lses):
        with pytest.raises(err, match=pattern):
            qsa.merge_attention_states(**kwargs)
    grad = [outs[0].float().requires_grad_(), outs[1].float()]
    with pytest.raises(ValueError, match=r"^outs requires grad, but merge_attention_states is forward-only"):
        qsa.merge_attention_states(grad, lses)
    with torch.no_grad():
        qsa.merge_attention_states(grad, lses)
    with pytest.raises(ValueError, match=r"^outs must hold at least one part"):
        merge_reference([], [])


def test_zero_rows():
    """No rows: empty results, no launch."""
    out, lse = qsa.merge_attention_states([torch.empty(0, 3, 16, dtype=FP16)] * 2,
                                          [torch.empty(0, 3)] * 2, return_lse=True)
    assert out.shape == (0, 3, 16) and lse.shape == (0, 3)


# -------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_gpu_context_parallel_decode(dtype):
    """On the GPU at a serving size: 64 decode rows (6/1/256) split over 4 ranks by 4-token group, merged,
    against attention over the union; then 1024 rows x 24 heads of random parts against the reference, the
    bits equal for a list, a stacked tensor and nine parts, and in a CUDA graph replayed with new data."""
    case = make_attention_case(rows=64, num_reqs=8, num_q_heads=6, num_kv_heads=1, head_dim=256, width=256,
                               max_seq_len=700, dtype=dtype, seed=21, device="cuda")
    outs, lses = [], []
    for share in split_indices(case.indices.cpu(), 4):
        o, lse = replace(case, indices=share.cuda()).run(qsa.sparse_paged_attention, route="xqa", return_lse=True)
        outs.append(o)
        lses.append(lse)
    got = qsa.merge_attention_states(outs, lses, return_lse=True)
    check_against_reference(case, got, name="merged ranks")
    assert_close_to_merge_reference(got, outs, lses)

    outs, lses = random_parts(4, rows=1024, heads=24, head_dim=256, dtype=dtype, seed=8)
    outs, lses = [o.cuda() for o in outs], [l.cuda() for l in lses]
    base = qsa.merge_attention_states(outs, lses, return_lse=True)
    assert_close_to_merge_reference(base, outs, lses)
    for got in (qsa.merge_attention_states(outs, lses, return_lse=True),
                qsa.merge_attention_states(torch.stack(outs), torch.stack(lses), return_lse=True)):
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
    nine = (outs * 3)[:9], (lses * 3)[:9]
    assert torch.equal(qsa.merge_attention_states(*nine),
                       qsa.merge_attention_states(torch.stack(nine[0]), torch.stack(nine[1])))

    static_o, static_l = [o.clone() for o in outs], [l.clone() for l in lses]
    out = torch.empty_like(outs[0])
    lse = qsa.merge_attention_states(static_o, static_l, out=out, return_lse=True)[1]  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lse = qsa.merge_attention_states(static_o, static_l, out=out, return_lse=True)[1]
    new_o, new_l = random_parts(4, rows=1024, heads=24, head_dim=256, dtype=dtype, seed=9)
    for s, n in zip(static_o + static_l, new_o + new_l):
        s.copy_(n)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = qsa.merge_attention_states(static_o, static_l, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), "CUDA-graph replay"
