"""The fused per-head RMSNorm and partial NeoX RoPE of q, k and iq (``qsa.model.kernels.norm_rope``) against
the PyTorch composition the layer uses (``rms_norm`` then ``apply_rope`` of ``qsa.model.functional``)."""

import math

import pytest
import torch
import triton
import triton.language as tl

import qsa.backend
import qsa.model.kernels
from qsa.attention.replay import Recorder
from qsa.model.functional import apply_rope, rms_norm, rope_cos_sin
from qsa.model.kernels import norm_rope, norm_rope_kernel, round_to

EPS = 1e-6
LOW = (torch.float16, torch.bfloat16)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GEOMETRIES = {
    # name: (T, Hq, Hkv, D, half, Hi, Di, ihalf)
    "partial": (7, 4, 2, 32, 4, 2, 16, 4),  # rotary dims 8 of 32 (q, k) and 8 of 16 (iq)
    "no_rope": (5, 4, 2, 16, 0, 2, 16, 0),
    "odd": (6, 4, 2, 24, 3, 2, 12, 2),  # head dims that are not powers of two
}


def _case(geometry, dtype, device, *, seed=0, strided_cos=False, weight_dtype=None):
    """Inputs as the layer passes them: q the view ``qg[..., :D]`` of ``qg [T, Hq, 2D]``, k and iq
    contiguous, cos/sin of positions with a padding position -1. Returns a dict of norm_rope's arguments."""
    T, hq, hkv, d, half, hi, di, ihalf = GEOMETRIES[geometry]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    qg = rand(T, hq, 2 * d, scale=3.0)
    positions = torch.tensor([-1, 0, 1, 5, 4097, 123456, 77][:T])
    cos, sin = rope_cos_sin(positions, 2 * half, 10_000.0)
    icos, isin = rope_cos_sin(positions, 2 * ihalf, 10_000.0)
    if strided_cos:  # rows of a wider buffer: row stride 2 * half, last dim contiguous
        cos = torch.cat([cos, torch.full_like(cos, float("nan"))], dim=1)[:, :half]
        sin = torch.cat([sin, torch.full_like(sin, float("nan"))], dim=1)[:, :half]
    wd = weight_dtype or dtype
    args = dict(q=qg[..., :d], q_weight=(torch.randn(d, generator=g) * 0.1).to(wd), k=rand(T, hkv, d),
                k_weight=(torch.randn(d, generator=g) * 0.1).to(wd), iq=rand(T, hi, di, scale=0.5),
                iq_weight=(torch.randn(di, generator=g) * 0.1).to(wd), cos=cos, sin=sin, icos=icos, isin=isin)
    args = {name: t.to(device) for name, t in args.items()}
    args["q"] = qg.to(device)[..., :d]  # the strided view on the device too
    args["eps"] = EPS
    return args


def _composition(a, *, norm=rms_norm, rope=apply_rope):
    """What the layer computes in PyTorch: ``rope(norm(x))`` of q, k (cos, sin) and iq (icos, isin)."""
    return tuple(rope(norm(a[x], a[w], a["eps"]), a[c], a[s]) for x, w, c, s in
                 (("q", "q_weight", "cos", "sin"), ("k", "k_weight", "cos", "sin"),
                  ("iq", "iq_weight", "icos", "isin")))


def _norm_times_w(x, weight, eps):
    """Wrong: the weight used as ``w`` instead of ``1 + w``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _norm_unrounded(x, weight, eps):
    """Wrong: the norm left in fp32 (one rounding at the end of the rope instead of two)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def _rope_swapped(x, cos, sin):
    """Wrong: the two halves of each rotated pair swapped."""
    half = cos.shape[-1]
    xf, c, s = x.float(), cos[:, None, :], sin[:, None, :]
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    return torch.cat([x2 * c - x1 * s, x1 * c + x2 * s, rest], dim=-1)


def _mismatch(got, want, what):
    """None where ``got`` equals ``want`` as the kernel's contract allows, else why not.

    NaN exactly where ``want`` has NaN; every other element within one ulp of its dtype at its head's largest
    ``|want|`` (eight for fp32: there the other summation order of ``mean(x^2)`` passes through unrounded)
    and, for fp16/bf16, at least 99% of them equal bit for bit."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return f"{what}: NaN at other places"
    g, w = got.double().masked_fill(nan, 0), want.double().masked_fill(nan, 0)
    info = torch.finfo(want.dtype)
    head_max = w.abs().amax(-1, keepdim=True).clamp(min=info.tiny)
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(head_max)))
    allowed = 1 if want.dtype in LOW else 8
    worst = ((g - w).abs() / ulp).max().item()
    if worst > allowed:
        return f"{what}: {worst:.3g} ulps off (at most {allowed})"
    if want.dtype in LOW:
        differ = ((got != want) & ~nan).double().mean().item()
        if differ > 0.01:
            return f"{what}: {100 * differ:.2f}% of the elements differ (at most 1%)"
    return None


def _assert_matches(got, want):
    for name, g, w in zip(("q", "k", "iq"), got, want):
        why = _mismatch(g, w, name)
        assert why is None, why


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every ``torch.empty`` of the launcher returns NaN-filled memory, so an element it does not write
    shows."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    monkeypatch.setattr(qsa.model.kernels.torch, "empty", empty)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_composition(device, poisoned_outputs, dtype, geometry):
    a = _case(geometry, dtype, device, strided_cos=geometry == "partial")
    assert not a["q"].is_contiguous()
    got = norm_rope(**a)
    T, hq, hkv, d, _, hi, di, _ = GEOMETRIES[geometry]
    for t, shape in zip(got, ((T, hq, d), (T, hkv, d), (T, hi, di))):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.isfinite().all()
    _assert_matches(got, _composition(a))


@pytest.mark.parametrize("dtype", LOW)
def test_known_wrong_variants_are_rejected(device, dtype):
    """The comparison can fail: references with a wrong weight, swapped halves, or a single rounding
    are each more than the tolerance away from the kernel's output."""
    a = _case("partial", dtype, device, seed=1)
    got = norm_rope(**a)
    _assert_matches(got, _composition(a))
    wrong = {
        "w instead of 1 + w": _composition(a, norm=_norm_times_w),
        "rope halves swapped": _composition(a, rope=lambda x, c, s: _rope_swapped(x, c, s).to(x.dtype)),
        "norm not rounded": tuple(y.to(dtype) for y in _composition(a, norm=_norm_unrounded)),
    }
    for variant, want in wrong.items():
        for name, g, w in zip(("q", "k", "iq"), got, want):
            assert _mismatch(g, w, name) is not None, f"{variant} passes for {name}"


def test_weights_of_another_dtype(device):
    """bf16 activations with fp32 weights: ``1 + w`` of the fp32 weights, as the composition does."""
    a = _case("partial", torch.bfloat16, device, seed=2, weight_dtype=torch.float32)
    _assert_matches(norm_rope(**a), _composition(a))


def test_nan_stays_in_its_head(device):
    """A NaN in one head of q, k and iq makes that head NaN and nothing else."""
    a = _case("partial", torch.bfloat16, device, seed=3)
    a["q"][2, 1, 5] = float("nan")
    a["k"][4, 0, 30] = float("nan")
    a["iq"][0, 1, 0] = float("nan")
    got = norm_rope(**a)
    for t, (row, head) in zip(got, ((2, 1), (4, 0), (0, 1))):
        assert t[row, head].isnan().all()
        t[row, head] = 0
        assert t.isfinite().all()
    want = _composition(a)
    for w, (row, head) in zip(want, ((2, 1), (4, 0), (0, 1))):
        w[row, head] = 0
    _assert_matches(got, want)


def test_one_recorded_launch_and_none_for_no_rows(device):
    a = _case("partial", torch.float16, device)
    T, hq, hkv, _, _, hi, _, _ = GEOMETRIES["partial"]
    with Recorder() as rec:
        norm_rope(**a)
    assert len(rec.steps) == 1
    kind, kernel, grid, args, kwargs, _ = rec.steps[0]
    assert (kind, kernel, grid) == ("launch", norm_rope_kernel, (T, hq + hkv + hi))
    assert not any(isinstance(v, torch.Tensor) for v in kwargs.values())
    assert args[0] is a["q"]

    empty = {name: (t[:0] if isinstance(t, torch.Tensor) and t.dim() > 1 else t) for name, t in a.items()}
    with Recorder() as rec:
        got = norm_rope(**empty)
    assert rec.steps == []
    assert [tuple(t.shape) for t in got] == [(0, hq, 32), (0, hkv, 32), (0, hi, 16)]


def test_pytorch_where_triton_cannot_run(device, monkeypatch):
    """Where Triton cannot run the composition computes the same contract (outputs new and contiguous)."""
    monkeypatch.setattr(qsa.backend, "triton_available", lambda device: "no Triton here (test)")
    a = _case("partial", torch.bfloat16, device, seed=4)
    got = norm_rope(**a)
    for g, w in zip(got, _composition(a)):
        assert g.is_contiguous() and torch.equal(g, w)


def _bad_inputs():
    """(argument changes, exception, argument name the message must hold)."""
    return [
        (lambda a: dict(q=a["q"][0]), ValueError, "q"),
        (lambda a: dict(q=a["q"].float()), TypeError, "k"),  # k no longer in q's dtype
        (lambda a: dict(q=a["q"].to(torch.int32)), TypeError, "q"),
        (lambda a: dict(q=a["q"].contiguous().transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q"),
        (lambda a: dict(k=a["k"][..., :16]), ValueError, "k"),
        (lambda a: dict(iq=a["iq"][:3]), ValueError, "iq"),
        (lambda a: dict(iq=torch.empty_strided(a["iq"].shape, (64, 32, 2), dtype=a["iq"].dtype)), ValueError, "iq"),
        (lambda a: dict(k_weight=a["k_weight"][:8]), ValueError, "k_weight"),
        (lambda a: dict(iq_weight=a["iq_weight"].to(torch.int64)), TypeError, "iq_weight"),
        (lambda a: dict(q_weight=a["q"]), ValueError, "q_weight"),
        (lambda a: dict(cos=a["cos"].double()), TypeError, "cos"),
        (lambda a: dict(cos=a["cos"][:3], sin=a["sin"][:3]), ValueError, "cos"),
        (lambda a: dict(sin=a["sin"][:, :2]), ValueError, "sin"),
        (lambda a: dict(icos=torch.zeros(7, 9), isin=torch.zeros(7, 9)), ValueError, "icos"),
        (lambda a: dict(isin=torch.zeros(7, 8)[:, ::2]), ValueError, "isin"),
        (lambda a: dict(eps=float("nan")), ValueError, "eps"),
        (lambda a: dict(eps=-1e-6), ValueError, "eps"),
        (lambda a: dict(q=a["q"].float().numpy()), TypeError, "q"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_inputs())))
def test_bad_input_names_the_argument(index):
    change, error, name = _bad_inputs()[index]
    a = _case("partial", torch.bfloat16, "cpu")
    a.update(change(a))
    with pytest.raises(error, match=rf"^{name} "):
        norm_rope(**a)


def test_ulp_helper_sees_one_ulp():
    """The tolerance is one ulp at the head's largest value: a bf16 output one ulp off there passes, two
    do not."""
    want = torch.full((1, 1, 200), -0.25, dtype=torch.bfloat16)
    want[0, 0, 0] = 1.5
    step = torch.zeros(want.shape)
    step[0, 0, 1] = math.ldexp(1.0, -7)  # the bf16 ulp in [1, 2)
    assert _mismatch((want + step).to(torch.bfloat16), want, "x") is None
    assert _mismatch((want + 2 * step).to(torch.bfloat16), want, "x") is not None


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, round_to(tl.load(x_ptr + o, mask=m, other=0.0), DTYPE), mask=m)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy's fp16 cast of 1e38
@pytest.mark.parametrize("dtype", LOW)
def test_round_to_is_torchs_cast(device, dtype):
    """The kernel's rounding of fp32 to bf16 (on the bits) and fp16 gives torch's cast: ties to even,
    carries into the exponent, overflow to inf, subnormals, signed zeros, NaN."""
    info = torch.finfo(dtype)
    grid = torch.tensor([1.0, 1.5, 3.0, info.max, info.tiny, info.smallest_normal / 8, 2.0 ** -133])
    grid = torch.cat([grid, -grid])
    step = grid.abs() * info.eps  # one ulp of dtype at the grid points (not for the subnormal ones)
    ties = grid + step / 2
    x = torch.cat([grid, ties, ties - step, torch.nextafter(ties, grid), torch.nextafter(ties, 2 * ties),
                   torch.randn(512) * 100, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e38, -3e38])])
    x = x.to(device)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), DTYPE=tl.bfloat16 if dtype == torch.bfloat16
                                                   else tl.float16, BLOCK=256)
    want = x.to(dtype).float()
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))
    nan = torch.tensor([float("nan")], device=device)
    _round_kernel[(1,)](nan, y, 1, DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, BLOCK=256)
    assert y[0].isnan()
