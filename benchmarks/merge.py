"""Cost of ``qsa.merge_attention_states``: merging P partial attention outputs (decode context parallelism).

For each case of a grid (parts P in 2, 4, 8, 16; rows 1, 64, 256, 8192; Hq 6 and 24 heads of 256; bf16
outputs, one case also fp16) it builds P parts ``out_i [rows, Hq, D]`` and ``lse_i [rows, Hq]`` fp32 on the
device, with empty shares scattered (``lse_i = -inf``, ``out_i = 0`` for random rows of each part), in two
forms: ``list`` (P separate tensors; past ``MAX_POINTER_PARTS`` of them the call stacks them first, a copy
the timing includes) and ``stacked`` (one ``[P, rows, Hq, D]`` tensor and one ``[P, rows, Hq]``). Then:

* the merge is checked first, into a NaN-filled ``out=``, against ``merge_reference`` (fp64): the largest
  absolute error must be within ``eps(dtype) * max|ref| + 8 * P * eps(fp32) * max|out_i|`` (one rounding
  of the output plus fp32 rounding of the P folds, the bound of tests/test_merge.py); a case that fails is
  recorded as failed and not timed;
* ``graph_ms``: median of CUDA-graph replays, the L2 flushed before each (``Timer.time``); ``eager_ms``: one
  eager call on an idle device (``Timer.time_eager``); ``host_us``: the host time of one call
  (``Timer.host_us``);
* ``gbps``: nominal bytes read and written, ``P * rows * Hq * (D * elem + 4) + rows * Hq * D * elem`` (plus
  ``rows * Hq * 4`` with ``--return-lse``), over ``graph_ms`` (an empty part's ``out`` rows are counted
  although the kernel skips them); ``copy_fraction``: that over ``copy_gbps``, the rate of a 1 GiB
  device-to-device ``copy_`` replayed from a CUDA graph the same way, measured once per run (bytes read
  plus bytes written, as ``benchmarks.timing`` counts them);
* a PyTorch baseline, the same merge composed of torch ops (stack, max, exp, sum, division in fp32, rounded
  once; checked against the reference like the merge), timed the same way: ``torch_graph_ms`` and
  ``x_torch = torch_graph_ms / graph_ms``.

Every case runs in its own ``try``: an error is recorded and the run goes on. ``--max-seconds`` bounds the
run: cases not started by then are recorded as skipped. Run from the checkout root on a GPU machine::

    PYTHONPATH=src python3 -m benchmarks.merge --out merge.json --md merge.md [--quick]

Without CUDA (``--device cpu``, or ``auto`` on a machine without a GPU) only a tiny grid runs (rows 1 and
3, Hq 2, D 16, P 2 and 3) under the Triton interpreter, timed by the wall clock, so that the tool can be
tested: the JSON says ``device: cpu`` and the GPU figures (``copy_gbps``, ``gbps``, ``copy_fraction``,
``x_torch``) are null. The tool exits 1 when a case failed its check or raised, else 0.

JSON: ``{schema: 1, tool: "benchmarks.merge", device, date, versions: {torch, triton, qsa}, timing,
merge_path, quick, return_lse, max_seconds, copy_gbps, cases: [{parts, rows, num_q_heads, head_dim, dtype,
form, return_lse, stacked_by_call, bytes, passed, max_abs_err, bound, method, graph_ms, eager_ms, host_us,
gbps, copy_fraction, torch_graph_ms, torch_max_abs_err, x_torch, skipped, error}]}``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SCHEMA = 1
TOOL = "benchmarks.merge"

PARTS = (2, 4, 8, 16)
ROWS = (1, 64, 256, 8192)
HEADS = (6, 24)
HEAD_DIM = 256
FORMS = ("list", "stacked")
FP16_CASE = (4, 256, 6)  # (parts, rows, Hq) also run in fp16, both forms

CPU_PARTS = (2, 3)
CPU_ROWS = (1, 3)
CPU_HEADS = 2
CPU_HEAD_DIM = 16

EMPTY_FRACTION = 0.25
"""Fraction of the rows of each part whose share is empty (lse -inf and out 0 for every head)."""

COPY_BYTES = 1 << 30
REF_CHUNK_ELEMENTS = 1 << 27
"""Most elements of the stacked fp64 parts ``merge_reference`` is given at once (the check goes by rows)."""

GPU_TIMING = dict(budget_s=0.02, min_reps=10, max_reps=50)
EAGER_REPS = 10
HOST_CALLS = {"cuda": 50, "cpu": 5}
DEFAULT_MAX_SECONDS = 100.0

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    parts: int
    rows: int
    num_q_heads: int
    head_dim: int
    dtype: str
    form: str


def grid(device_type: str, quick: bool) -> list[Case]:
    """The cases of a run: the tiny CPU grid, the quick handful, or the full GPU grid."""
    if device_type != "cuda":
        shapes = [(p, r, CPU_HEADS, CPU_HEAD_DIM, "bf16") for r in CPU_ROWS for p in CPU_PARTS]
        shapes.append((CPU_PARTS[-1], CPU_ROWS[-1], CPU_HEADS, CPU_HEAD_DIM, "fp16"))
    elif quick:
        shapes = [(2, 64, 6, HEAD_DIM, "bf16"), (4, 256, 24, HEAD_DIM, "bf16"), (8, 8192, 24, HEAD_DIM, "bf16"),
                  (16, 64, 6, HEAD_DIM, "bf16"), (*FP16_CASE[:2], FP16_CASE[2], HEAD_DIM, "fp16")]
    else:
        shapes = [(p, r, h, HEAD_DIM, "bf16") for r, p, h in itertools.product(ROWS, PARTS, HEADS)]
        shapes.append((*FP16_CASE[:2], FP16_CASE[2], HEAD_DIM, "fp16"))
    return [Case(p, r, h, d, dt, form) for p, r, h, d, dt in shapes for form in FORMS]


def merge_under_test():
    """The merge the tool checks and times: ``qsa.merge_attention_states`` (tests replace this function to
    hand the tool a wrong merge)."""
    import qsa

    return qsa.merge_attention_states


def torch_merge(outs, lses, out: torch.Tensor) -> torch.Tensor:
    """The PyTorch baseline: the merge composed of torch ops, fp32, rounded once into ``out``. Empty parts
    get weight ``exp(-inf) = 0`` and their ``out_i`` (0 by the contract) is multiplied by it; a head empty
    in every part divides by 1 (out 0)."""
    o = outs if isinstance(outs, torch.Tensor) else torch.stack(outs)
    ls = lses if isinstance(lses, torch.Tensor) else torch.stack(lses)
    m = ls.amax(dim=0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(ls - m)  # [P, rows, Hq]
    s = w.sum(dim=0)
    acc = (w.unsqueeze(-1) * o.float()).sum(dim=0)
    out.copy_(acc / torch.where(s == 0, torch.ones_like(s), s).unsqueeze(-1))
    return out


# ------------------------------------------------------------------------------------------ inputs


def make_parts(case: Case, device: torch.device, seed: int = 0):
    """``(outs, lses)`` of ``case`` on ``device``: N(0, 1) outputs, lses N(0, 4^2), and in each part a
    random ``EMPTY_FRACTION`` of the rows empty (lse -inf, out 0). ``form`` ``list`` gives P separate
    tensors, ``stacked`` one ``[P, rows, Hq, D]`` and one ``[P, rows, Hq]``."""
    p, r, h, d = case.parts, case.rows, case.num_q_heads, case.head_dim
    dtype = DTYPES[case.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    o = torch.randn((p, r, h, d), generator=gen, device=device, dtype=torch.float32).to(dtype)
    ls = torch.randn((p, r, h), generator=gen, device=device, dtype=torch.float32) * 4
    empty = torch.rand((p, r), generator=gen, device=device) < EMPTY_FRACTION
    ls.masked_fill_(empty[..., None], -math.inf)
    o.masked_fill_(empty[..., None, None], 0)
    if case.form == "stacked":
        return o, ls
    outs, lses = [t.clone() for t in o.unbind(0)], [t.clone() for t in ls.unbind(0)]  # separate allocations
    return outs, lses


def nominal_bytes(case: Case, return_lse: bool) -> int:
    elem = torch.empty((), dtype=DTYPES[case.dtype]).element_size()
    rh = case.rows * case.num_q_heads
    total = case.parts * rh * (case.head_dim * elem + 4) + rh * case.head_dim * elem
    return total + (rh * 4 if return_lse else 0)


# ---------------------------------------------------------------------------------------- the check


def _rows_of(x, lo: int, hi: int):
    return x[:, lo:hi] if isinstance(x, torch.Tensor) else [t[lo:hi] for t in x]


def check(outs, lses, got: torch.Tensor) -> tuple[bool, float | None, float, str | None]:
    """``(passed, max_abs_err, bound, why)`` of ``got`` against ``merge_reference``, taken by row chunks so
    the fp64 copies stay small. A non-finite output fails (its error is None)."""
    from qsa.attention.merge import merge_reference

    parts = outs.shape[0] if isinstance(outs, torch.Tensor) else len(outs)
    rows, hq, d = got.shape
    scale = max(float(t.abs().max()) if t.numel() else 0.0 for t in (outs if isinstance(outs, list) else [outs]))
    chunk = max(1, REF_CHUNK_ELEMENTS // max(1, parts * hq * d))
    err, ref_max, finite = 0.0, 0.0, True
    for lo in range(0, rows, chunk):
        hi = min(rows, lo + chunk)
        ref, _ = merge_reference(_rows_of(outs, lo, hi), _rows_of(lses, lo, hi))
        g = got[lo:hi]
        if not bool(torch.isfinite(g).all()):
            finite = False
            break
        ref_max = max(ref_max, float(ref.abs().max()))
        err = max(err, float((g.double() - ref).abs().max()))
        del ref
    eps32 = torch.finfo(torch.float32).eps
    bound = torch.finfo(got.dtype).eps * ref_max + 8 * parts * eps32 * scale
    if not finite:
        return False, None, bound, "non-finite output"
    if not err <= bound:
        return False, err, bound, f"max abs error {err:.3e} > bound {bound:.3e}"
    return True, err, bound, None


# ------------------------------------------------------------------------------------------ one case


def _empty_record(case: Case, return_lse: bool) -> dict:
    from qsa.attention.merge import MAX_POINTER_PARTS

    return dict(parts=case.parts, rows=case.rows, num_q_heads=case.num_q_heads, head_dim=case.head_dim,
                dtype=case.dtype, form=case.form, return_lse=return_lse,
                stacked_by_call=case.form == "list" and case.parts > MAX_POINTER_PARTS,
                bytes=nominal_bytes(case, return_lse), passed=False, max_abs_err=None, bound=None, method=None,
                graph_ms=None, eager_ms=None, host_us=None, gbps=None, copy_fraction=None, torch_graph_ms=None,
                torch_max_abs_err=None, x_torch=None, skipped=False, error=None)


def run_case(case: Case, timer, copy_gbps: float | None, return_lse: bool) -> dict:
    rec = _empty_record(case, return_lse)
    dev = timer.device
    on_gpu = timer.is_cuda
    outs, lses = make_parts(case, dev)
    out = torch.empty((case.rows, case.num_q_heads, case.head_dim), dtype=DTYPES[case.dtype], device=dev)
    merge = merge_under_test()

    def call():
        merge(outs, lses, out=out, return_lse=return_lse)

    # Correctness first, into a NaN-filled out: a merge that writes nothing, or not everything, fails.
    out.fill_(math.nan)
    call()
    if on_gpu:
        torch.cuda.synchronize(dev)
    passed, err, bound, why = check(outs, lses, out)
    rec.update(passed=passed, max_abs_err=err, bound=bound)
    if not passed:
        rec["error"] = f"check failed: {why}"
        return rec

    t = timer.time(call, graph=True)
    rec["method"] = t.method
    rec["graph_ms"] = t.median_ms
    rec["eager_ms"] = timer.time_eager(call, reps=EAGER_REPS).median_ms
    rec["host_us"] = timer.host_us(call, calls=HOST_CALLS["cuda" if on_gpu else "cpu"])
    if on_gpu:
        rec["gbps"] = rec["bytes"] / (t.median_ms * 1e-3) / 1e9
        if copy_gbps:
            rec["copy_fraction"] = rec["gbps"] / copy_gbps

    # The PyTorch baseline, checked the same way, then timed.
    base_out = torch.empty_like(out).fill_(math.nan)
    torch_merge(outs, lses, base_out)
    ok, terr, _, twhy = check(outs, lses, base_out)
    rec["torch_max_abs_err"] = terr
    if not ok:
        rec["error"] = f"torch baseline failed its check: {twhy}"
        return rec
    tt = timer.time(lambda: torch_merge(outs, lses, base_out), graph=True)
    rec["torch_graph_ms"] = tt.median_ms
    if on_gpu and t.method == tt.method:
        rec["x_torch"] = tt.median_ms / t.median_ms
    return rec


# --------------------------------------------------------------------------------------- the run


def copy_bandwidth(timer) -> float:
    """GB/s (bytes read + bytes written) of a ``COPY_BYTES`` device-to-device ``copy_`` replayed from a
    CUDA graph, the L2 flushed before each replay."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=timer.device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(5):  # wakes an idle GPU
        dst.copy_(src)
    t = timer.time(lambda: dst.copy_(src), graph=True)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / (t.median_ms * 1e-3) / 1e9


def _versions() -> dict:
    import triton

    import qsa

    return dict(torch=torch.__version__, triton=triton.__version__, qsa=qsa.__version__)


def _clean(x):
    """JSON-safe: non-finite floats as None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


COLUMNS = (("P", "parts", "d"), ("rows", "rows", "d"), ("Hq", "num_q_heads", "d"), ("D", "head_dim", "d"),
           ("dtype", "dtype", "s"), ("form", "form", "s"), ("ok", None, None), ("max err", "max_abs_err", ".2e"),
           ("bound", "bound", ".2e"), ("graph ms", "graph_ms", ".4f"), ("eager ms", "eager_ms", ".4f"),
           ("host us", "host_us", ".1f"), ("GB/s", "gbps", ".0f"), ("of copy", "copy_fraction", ".2f"),
           ("torch ms", "torch_graph_ms", ".4f"), ("x torch", "x_torch", ".2f"))


def _status(c: dict) -> str:
    if c.get("skipped"):
        return "skip"
    if c.get("passed"):
        return "yes" if c.get("error") is None else "yes*"
    return "FAIL" if (c.get("error") or "").startswith("check failed") else "ERR"


def _row(c: dict) -> list[str]:
    return [_status(c) if key is None else _fmt(c.get(key), spec) for _, key, spec in COLUMNS]


def text_table(report: dict) -> str:
    head = [h for h, _, _ in COLUMNS]
    rows = [_row(c) for c in report["cases"]]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head, *rows]]
    errors = [f"  {i}: {c['error']}" for i, c in enumerate(report["cases"]) if c.get("error")]
    return "\n".join(lines + (["errors (case index: message):"] + errors if errors else []))


def markdown(report: dict) -> str:
    v = report["versions"]
    copy = _fmt(report["copy_gbps"], ".0f")
    lines = [f"# merge_attention_states on {report['device']}", "",
             f"{report['date']}; torch {v['torch']}, triton {v['triton']}, qsa {v['qsa']}; timing: {report['timing']}; "
             f"copy bandwidth {copy} GB/s (1 GiB copy_, read + write); return_lse {report['return_lse']}.", "",
             "| " + " | ".join(h for h, _, _ in COLUMNS) + " | error |",
             "|" + "---|" * (len(COLUMNS) + 1)]
    for c in report["cases"]:
        lines.append("| " + " | ".join(_row(c)) + f" | {c.get('error') or ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.merge", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.add_argument("--md", type=Path, help="also write a Markdown table of the cases here")
    p.add_argument("--quick", action="store_true", help="a handful of cases")
    p.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda[:N]")
    p.add_argument("--return-lse", action="store_true", help="time the merge with return_lse=True")
    p.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS,
                   help="start no new case after this many seconds; the rest are recorded as skipped")
    args = p.parse_args(argv)

    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        # Triton kernels run on the CPU only under the interpreter, read when a kernel is defined.
        if "qsa" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
    from qsa import backend
    from qsa.utils import cli_device

    from .timing import Timer, TimingConfig

    device = cli_device(p, args.device)
    on_gpu = device.type == "cuda"
    timer = Timer(device, TimingConfig(**GPU_TIMING) if on_gpu else TimingConfig())
    why = backend.triton_available(device)
    report = dict(schema=SCHEMA, tool=TOOL,
                  device=torch.cuda.get_device_name(device) if on_gpu else "cpu",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  versions=_versions(),
                  timing=("CUDA-graph replay medians, L2 flushed before each" if on_gpu
                          else "wall clock (Triton interpreter); GPU figures null"),
                  merge_path="triton" if why is None else f"pytorch fallback: {why}",
                  quick=args.quick, return_lse=args.return_lse, max_seconds=args.max_seconds,
                  copy_gbps=None, cases=[])
    t0 = time.monotonic()

    def write():
        if args.out is not None:
            args.out.write_text(json.dumps(_clean(report), indent=1) + "\n")

    if on_gpu:
        try:
            report["copy_gbps"] = copy_bandwidth(timer)
        except Exception as e:  # recorded; the cases still run, without copy fractions
            report["copy_error"] = f"{type(e).__name__}: {e}"[:300]
    cases = grid(device.type, args.quick)
    for i, case in enumerate(cases):
        if time.monotonic() - t0 >= args.max_seconds:
            rec = _empty_record(case, args.return_lse)
            rec.update(skipped=True, error=f"skipped: --max-seconds {args.max_seconds:g} spent")
        else:
            try:
                rec = run_case(case, timer, report["copy_gbps"], args.return_lse)
            except Exception as e:  # recorded, the run goes on
                rec = _empty_record(case, args.return_lse)
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            if on_gpu:
                try:
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()
                except Exception:
                    pass
        report["cases"].append(rec)
        print(f"[{i + 1}/{len(cases)} {time.monotonic() - t0:5.1f}s] P={case.parts} rows={case.rows} "
              f"Hq={case.num_q_heads} {case.dtype} {case.form}: {_status(rec)}", file=sys.stderr, flush=True)
        write()  # after every case: a run cut short keeps what it measured
    report["elapsed_s"] = round(time.monotonic() - t0, 2)
    write()
    if args.md is not None:
        args.md.write_text(markdown(_clean(report)))
    print(f"merge_attention_states on {report['device']} ({report['timing']}); copy "
          f"{_fmt(report['copy_gbps'], '.0f')} GB/s; merge path: {report['merge_path']}")
    print(text_table(_clean(report)))
    bad = [c for c in report["cases"] if not c["skipped"] and (not c["passed"] or c["error"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
