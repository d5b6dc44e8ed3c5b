"""benchmarks.dense_floor: the dense kernel on the grouped step's work, its reference, and the CLI.
Benchmark tooling: marked ``lab``, left out of the default run (``python -m pytest -m lab``)."""

import json

import pytest
import torch

from benchmarks import dense_floor
from benchmarks.report import slug

pytestmark = pytest.mark.lab


def _problem(device, groups=3, group_rows=2, hq=4, d=16, mb=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = groups * group_rows - 1  # the last group one row short
    q = torch.randn(rows, hq, d, generator=gen).half().to(device)
    counts = torch.tensor([5, 1, 7][:groups], dtype=torch.int32)  # with 4 microblocks a tile: 2, 1, 2 tiles
    cap = 8
    masks = torch.randint(0, 1 << (4 * group_rows), (groups, cap), generator=gen, dtype=torch.int32)
    masks[:, 0] |= 0x11  # every row keeps a token
    n_tok = 4 * mb * ((int(counts.max()) + mb - 1) // mb)
    k = torch.randn(n_tok, d, generator=gen).half().to(device)
    v = torch.randn(n_tok, d, generator=gen).half().to(device)
    return q, k, v, masks.to(device), counts.to(device)


def _brute(q, k, v, masks, counts, group_rows, mb, masked):
    """fp64, one row and head at a time, from the definitions in dense_attention_kernel's docstring."""
    rows, hq, d = q.shape
    out = torch.zeros(rows, hq, d, dtype=torch.float64)
    for r in range(rows):
        g, qr = divmod(r, group_rows)
        n = int(counts[g])
        toks = []
        for t in range(4 * mb * ((n + mb - 1) // mb)):
            e = t // 4
            if not masked or (e < n and (int(masks[g, e]) >> (4 * qr + t % 4)) & 1):
                toks.append(t)
        kk, vv = k[toks].double().cpu(), v[toks].double().cpu()
        for h in range(hq):
            p = torch.softmax(kk @ q[r, h].double().cpu() * d ** -0.5, 0)
            out[r, h] = p @ vv
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_dense_kernel_and_reference_agree_with_the_definition(device, masked):
    q, k, v, masks, counts = _problem(device)
    kw = dict(group_rows=2, num_kv_heads=1, mb=4, masked=masked)  # 16-token tiles: the GPU's smallest dot
    out = torch.full_like(q, float("nan"))
    dense_floor.dense_attention(q, k, v, masks, counts, block_m=16, out=out, **kw)
    want = _brute(q, k, v, masks.cpu(), counts.cpu(), 2, 4, masked)
    ref = dense_floor.dense_reference(q, k, v, masks, counts, **kw)
    assert torch.allclose(ref.double().cpu(), want, atol=1e-5)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double().cpu(), want, atol=2e-3, rtol=1e-2)
    # Known-wrong readings must not pass: the other mask rule, and every row's mask taken from the next row.
    other = _brute(q, k, v, masks.cpu(), counts.cpu(), 2, 4, not masked)
    assert not torch.allclose(out.double().cpu(), other, atol=2e-3, rtol=1e-2)
    if masked:
        shifted = _brute(q, k, v, (masks >> 4).cpu(), counts.cpu(), 2, 4, True)
        assert not torch.allclose(out.double().cpu(), shifted, atol=2e-3, rtol=1e-2)


def test_dense_attention_rejects_bad_input(device):
    q, k, v, masks, counts = _problem(device)
    kw = dict(group_rows=2, num_kv_heads=1, mb=4, masked=True, block_m=16)
    with pytest.raises(ValueError, match="k and v hold"):
        dense_floor.dense_attention(q, k[:16], v[:16], masks, counts, **kw)
    with pytest.raises(ValueError, match="k and v must be contiguous"):
        dense_floor.dense_attention(q, k[:, :8], v[:, :8], masks, counts, **kw)
    with pytest.raises(ValueError, match="masks must have one row per group"):
        dense_floor.dense_attention(q, k, v, masks[:2], counts, **kw)
    with pytest.raises(ValueError, match="block_m"):
        dense_floor.dense_attention(q, k, v, masks, counts, **{**kw, "group_rows": 8})


def test_sdpa_reference_is_attention():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, n, 8, generator=gen) for n in (10, 6, 6))
    want = torch.softmax(q[0, 0].double() @ k[0, 0].double().T / 8 ** 0.5, -1) @ v[0, 0].double()
    assert torch.allclose(dense_floor.sdpa_reference(q, k, v, chunk=3)[0, 0].double(), want, atol=1e-5)


def test_dense_floor_cli_writes_its_report(tmp_path, capsys, device):
    """The grouped step's parts and the dense variants measured after their checks (on the CPU, the SDPA
    backends it lacks are recorded as failed, not timed); JSON and Markdown written; a decode scenario is
    refused."""
    assert dense_floor.main(["tiny-prefill", "--quick", "--device", device, "--out", str(tmp_path)]) == 0
    name = "cpu" if device == "cpu" else slug(torch.cuda.get_device_name())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"dense-floor-{name}.json", f"dense-floor-{name}.md"]
    js = tmp_path / f"dense-floor-{name}.json"
    (rec,) = json.load(open(js))["scenarios"]
    assert rec["scenario"] == "tiny-prefill" and rec["flops_executed"] > 0
    assert min(rec[k] for k in ("planner_ms", "attention_ms", "products_ms")) > 0
    by = {v["variant"]: v for v in rec["variants"]}
    for name in ("triton-dense", "triton-masked", "triton-dense-128", "sdpa-flash-16"):
        assert by[name]["median_ms"] > 0 and by[name]["errors"]["finite"], by[name]
    for v in rec["variants"]:  # each either checked and timed, or failed with its reason and no time
        assert (v["median_ms"] is None) == ("error" in v) == ("errors" not in v), v
    if device == "cpu":
        assert by["sdpa-cudnn-16"]["median_ms"] is None and "error" in by["sdpa-cudnn-16"]
    assert "tiny-prefill" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        dense_floor.main(["tiny-decode", "--device", device])
