"""``qsa bench``: run named scenarios, check every route against the fp32 reference, then time it.

For each scenario, in one process: build the workload, compute the fp32 reference and the naive
PyTorch yardstick, then for each route: run it once eagerly (compiles its kernels), check it, and
only if the check passes time it (CUDA-graph replays, L2 flushed before each; ``do_bench`` for code
that cannot be captured). The ceilings (copy bandwidth, fp16 matmul rate) are measured first.

Writes ``<out>/latest.json`` after every scenario (so a run cut short keeps what it measured), a dated
copy ``<out>/<date>-<device>.json`` at the end, ``<docs>/benchmarks.md`` and ``<docs>/benchmarks.png``.

Run from the checkout root: ``qsa bench [--quick] [--scenario GLOB ...]`` or
``PYTHONPATH=src python -m benchmarks.run ...``. ``--help`` lists the options, ``--list`` the scenarios.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from . import registry
from .registry import Scenario

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1
KERNEL_ROUTES = registry.ATTENTION_ROUTES
FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure",
              "misaligned address", "illegal instruction", "CUDA error: an illegal")


# ------------------------------------------------------------------------------------------------
# targets


TARGETS = (
    # name, scenario, op, goal, unit, what
    ("splitk-vs-naive-prefill-64k", "prefill-64k-o80", ">=", 10.0, "x",
     "naive PyTorch time / splitk time"),
    ("prefill-64k-o98-grouped-vs-splitk", "prefill-64k-o98", ">=", 5.0, "x",
     "splitk time / grouped time (planner included)"),
    ("prefill-64k-o80-grouped-vs-splitk", "prefill-64k-o80", ">=", 3.0, "x",
     "splitk time / grouped time (planner included)"),
    ("prefill-128k-o80-grouped-vs-splitk", "prefill-128k-o80", ">=", 3.0, "x",
     "splitk time / grouped time (planner included)"),
    ("prefill-64k-o98-grouped-tflops", "prefill-64k-o98", ">=", 150.0, "TFLOP/s",
     "effective TFLOP/s of grouped on useful FLOPs, planner included"),
    ("prefill-64k-planner-share", "prefill-64k-o80", "<=", 0.15, "fraction",
     "planner time / grouped time (planner included)"),
    ("decode-64-xqa-bandwidth", "decode-64", ">=", 0.80, "fraction",
     "xqa effective GB/s / measured copy GB/s"),
    ("decode-256-xqa-bandwidth", "decode-256", ">=", 0.80, "fraction",
     "xqa effective GB/s / measured copy GB/s"),
    ("mtp-8-best-vs-splitk", "mtp-8", ">=", 1.5, "x", "splitk time / best route time"),
    ("mtp-16-best-vs-splitk", "mtp-16", ">=", 1.5, "x", "splitk time / best route time"),
    ("selection-8192x16384-vs-torch", "selection-8192x16384", ">=", 5.0, "x",
     "torch_select_baseline time / select_tokens time; select_tokens must be exact"),
)

OVERLAP_BANDS = {0.8: (0.75, 0.85), 0.98: (0.97, 1.0)}
"""Measured overlap a scenario must show for its requested overlap to count ("0.8" and "0.98")."""


def _passed_ms(records, scenario, route):
    for r in records:
        if r["scenario"] == scenario and r["route"] == route and r.get("passed") and r.get("median_ms"):
            return r["median_ms"]
    return None


def _record(records, scenario, route):
    for r in records:
        if r["scenario"] == scenario and r["route"] == route:
            return r
    return None


def overlap_ok(meta: dict | None) -> tuple[bool, str]:
    """Whether a scenario's measured overlap is inside the band of its requested overlap."""
    if meta is None:
        return False, "scenario not run"
    want, got = meta.get("overlap_requested"), meta.get("overlap")
    band = OVERLAP_BANDS.get(want)
    if band is None:
        return True, ""
    if got is None or not band[0] <= got <= band[1]:
        return False, f"measured overlap {got} outside [{band[0]}, {band[1]}]"
    return True, ""


def evaluate_targets(records: list, scenarios: dict, ceilings: dict | None) -> list:
    """The ``targets`` list: ``{name, value, goal, op, unit, met, scenario, what, note}``.

    ``met`` is None when the value could not be measured (scenario not run, a route failed its check
    or errored); ``note`` says why.
    """
    out = []
    for name, scn, op, goal, unit, what in TARGETS:
        value, note, extra_ok = None, "", True
        meta = scenarios.get(scn)
        try:
            if name == "splitk-vs-naive-prefill-64k":
                for s in ("prefill-64k-o80", "prefill-64k-o98"):
                    naive, splitk = _passed_ms(records, s, "naive"), _passed_ms(records, s, "splitk")
                    if naive and splitk:
                        value, scn = naive / splitk, s
                        break
            elif name.endswith("-grouped-vs-splitk"):
                g, s = _passed_ms(records, scn, "grouped"), _passed_ms(records, scn, "splitk")
                value = s / g if g and s else None
                extra_ok, note = overlap_ok(meta)
            elif name == "prefill-64k-o98-grouped-tflops":
                rec = _record(records, scn, "grouped")
                value = rec.get("tflops") if rec and rec.get("passed") else None
                extra_ok, note = overlap_ok(meta)
            elif name == "prefill-64k-planner-share":
                p, g = _passed_ms(records, scn, "planner"), _passed_ms(records, scn, "grouped")
                value = p / g if p and g else None
                extra_ok, note = overlap_ok(meta)
            elif name.endswith("-xqa-bandwidth"):
                rec = _record(records, scn, "xqa")
                if rec and rec.get("passed") and rec.get("gbps") and ceilings and ceilings.get("copy_gbps"):
                    value = rec["gbps"] / ceilings["copy_gbps"]
            elif name.endswith("-best-vs-splitk"):
                s = _passed_ms(records, scn, "splitk")
                best = [t for t in (_passed_ms(records, scn, r) for r in ("grouped", "xqa")) if t]
                value = s / min(best) if s and best else None
            elif name == "selection-8192x16384-vs-torch":
                sel, base = _passed_ms(records, scn, "select"), _passed_ms(records, scn, "torch-select")
                rec = _record(records, scn, "select")
                value = base / sel if sel and base else None
                extra_ok = bool(rec and rec.get("exact"))
                if rec is not None and not extra_ok:
                    note = "select_tokens is not exact"
        except (TypeError, ZeroDivisionError) as e:  # malformed records: report, do not crash
            value, note = None, f"could not evaluate: {e}"
        if value is None:
            met = None
            if not note:
                note = "not measured (scenario not run, or a route failed its check or errored)"
        else:
            met = bool((value >= goal) if op == ">=" else (value <= goal)) and extra_ok
        out.append(dict(name=name, value=value, goal=goal, op=op, unit=unit, met=met, scenario=scn,
                        what=what, note=note))
    return out


# ------------------------------------------------------------------------------------------------
# correctness gate


def output_errors(out, ref) -> dict:
    """``max_abs_err``, ``rel_l2_err`` of ``out`` against the fp32 ``ref``, and ``finite``."""
    import torch

    o = out.float()
    finite = bool(torch.isfinite(o).all())
    if not finite:
        return dict(max_abs_err=math.inf, rel_l2_err=math.inf, finite=False)
    d = o - ref
    ref_norm = float(ref.norm())
    return dict(max_abs_err=float(d.abs().max()) if d.numel() else 0.0,
                rel_l2_err=float(d.norm()) / ref_norm if ref_norm > 0 else float(d.norm()),
                finite=True)


def gate_bounds(ref, dtype, yardstick: dict | None) -> dict:
    """Allowed errors of a route (flash-attention style, no magic numbers where a yardstick exists).

    With the naive PyTorch result as the yardstick (the same computation in the activation dtype):
    ``max_abs <= 2 * naive_max_abs + eps * max|ref|`` and ``rel_l2 <= 2 * naive_rel_l2 + eps``, eps the
    activation dtype's machine epsilon (one rounding of the output). Without one (the yardstick itself,
    or if it failed): ``max_abs <= 8 * eps * max|ref|`` and ``rel_l2 <= 4 * eps``.
    """
    import torch

    eps = torch.finfo(dtype).eps
    peak = float(ref.abs().max()) if ref.numel() else 0.0
    if yardstick and yardstick.get("finite"):
        return dict(bound_abs=2 * yardstick["max_abs_err"] + eps * peak,
                    bound_rel=2 * yardstick["rel_l2_err"] + eps, yardstick="naive")
    return dict(bound_abs=8 * eps * peak, bound_rel=4 * eps, yardstick="fixed")


def gate(errors: dict, bounds: dict) -> bool:
    return (errors["finite"] and errors["max_abs_err"] <= bounds["bound_abs"]
            and errors["rel_l2_err"] <= bounds["bound_rel"])


# ------------------------------------------------------------------------------------------------
# progress


class Progress:
    """A one-line progress bar on a terminal, one line per step otherwise (logs stay readable)."""

    def __init__(self, total: int, stream=None, width: int = 28):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.time()

    def step(self, label: str, advance: int = 1):
        """Announce the step now starting; the count shows the steps finished before it."""
        frac = self.done / self.total
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        line = f"[{bar}] {self.done:3d}/{self.total} {time.time() - self.t0:6.1f}s  {label}"
        if self.tty:
            self.stream.write("\r" + line[:140].ljust(140))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done = min(self.total, self.done + advance)

    def close(self):
        self.done = self.total
        self.step("done", advance=0)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------------------------------------
# the runner


class FatalDeviceError(RuntimeError):
    """A CUDA error that poisons the context: the rest of the run is skipped."""


def _is_fatal(exc: BaseException) -> bool:
    msg = str(exc)
    return any(s in msg for s in FATAL_CUDA)


def _err_text(exc: BaseException) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(tb[-3:]).strip()
    return f"{type(exc).__name__}: {exc}"[:500] + ("\n" + tail[-1500:] if tail else "")


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        return format(x, spec)
    return str(x)


class Suite:
    """Runs scenarios on one device and collects ``records`` and per-scenario ``scenarios`` metadata."""

    def __init__(self, device: str, *, quick: bool = False, route_globs=None, progress: Progress | None = None):
        import torch

        from .timing import QUICK_TIMING, Timer, TimingConfig

        self.torch = torch
        self.device = torch.device(device)
        self.quick = quick
        self.route_globs = route_globs
        cfg = QUICK_TIMING if quick else TimingConfig()
        self.timer = Timer(self.device, cfg)
        self.progress = progress
        self.records: list = []
        self.scenarios: dict = {}
        self.ceilings: dict | None = None
        self.fatal: str | None = None
        self.route_builders = {
            "grouped": self._kernel_route, "xqa": self._kernel_route, "splitk": self._kernel_route,
            "naive": self._naive_route,
        }

    # -- helpers ---------------------------------------------------------------------------------

    def _step(self, label):
        if self.progress is not None:
            self.progress.step(label)

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _free(self):
        import gc

        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def routes_of(self, scn: Scenario) -> tuple:
        import fnmatch

        routes = scn.routes_for(self.quick)
        if self.route_globs:
            routes = tuple(r for r in routes if any(fnmatch.fnmatchcase(r, g) for g in self.route_globs))
        return routes

    def steps_of(self, scn: Scenario) -> int:
        return len(self.routes_of(scn)) + 1

    def measure_ceilings(self):
        from .timing import measure_ceilings

        self._step("ceilings (copy bandwidth, fp16 matmul)")
        self.ceilings = measure_ceilings(self.timer)
        return self.ceilings

    # -- scenarios -------------------------------------------------------------------------------

    def run(self, scn: Scenario) -> dict:
        """Run one scenario; never raises except on a fatal device error (recorded first)."""
        meta = self._scenario_meta(scn)
        self.scenarios[scn.name] = meta
        if self.fatal:
            meta["error"] = f"skipped after a fatal device error: {self.fatal}"
            if self.progress is not None:
                self.progress.step(f"{scn.name}: skipped", advance=self.steps_of(scn))
            return meta
        t0 = time.time()
        try:
            if scn.kind == "attention":
                self._run_attention(scn, meta)
            elif scn.kind == "selection":
                self._run_selection(scn, meta)
            else:
                raise ValueError(f"unknown scenario kind {scn.kind!r}")
        except Exception as e:  # fail soft: record and go on
            meta["error"] = _err_text(e)
            if _is_fatal(e):
                self.fatal = str(e)[:200]
        finally:
            meta["elapsed_s"] = round(time.time() - t0, 2)
            self._free()
        return meta

    def _scenario_meta(self, scn: Scenario) -> dict:
        d = asdict(scn)
        meta = {k: d[k] for k in ("name", "kind", "rows", "context", "num_reqs", "num_q_heads", "num_kv_heads",
                                  "head_dim", "dtype", "kv_cache_dtype", "block_size", "topk", "selection")}
        meta.update(description=scn.describe(), overlap_requested=scn.overlap, overlap=None,
                    avg_union_per_group=None, sharing=None, tokens_total=None, useful_flops=None,
                    error=None, elapsed_s=None)
        return meta

    def _add(self, scn: Scenario, route: str, kind: str, **fields) -> dict:
        rec = dict(scenario=scn.name, route=route, kind=kind, passed=None, median_ms=None, min_ms=None,
                   max_ms=None, tflops=None,
                   gbps=None, bytes=None, flops=None, vs_splitk=None, vs_torch=None, max_abs_err=None,
                   rel_l2_err=None, bound_abs=None, bound_rel=None, timing=None, reps=None,
                   replay_equal=None, error=None)
        rec.update(fields)
        self.records.append(rec)
        return rec

    # -- attention -------------------------------------------------------------------------------

    def _run_attention(self, scn: Scenario, meta: dict):
        from .baselines import naive_attention, reference_attention_fp32
        from .generators import TORCH_DTYPES, attention_workload

        torch = self.torch
        self._step(f"{scn.name}: workload + fp32 reference")
        t0 = time.time()
        w = attention_workload(scn, self.device)
        st = w.stats
        flops = 4 * scn.num_q_heads * scn.head_dim * st["tokens_total"]
        meta.update(overlap=st["overlap"], avg_union_per_group=st["avg_union_per_group"], sharing=st["sharing"],
                    tokens_total=st["tokens_total"], useful_flops=flops,
                    avg_set_size=st["tokens_total"] / scn.rows)
        ref = reference_attention_fp32(w.q, *w.args, **w.cache_kwargs)
        naive_out = naive_attention(w.q, *w.args, **w.cache_kwargs)
        self._sync()
        yard = output_errors(naive_out, ref)
        del naive_out
        meta["setup_s"] = round(time.time() - t0, 2)

        dtype = TORCH_DTYPES[scn.dtype]
        act = torch.finfo(dtype).bits // 8
        kv_elem = 1 if scn.kv_cache_dtype == "fp8_e4m3" else act
        kv_per_token = scn.num_kv_heads * scn.head_dim * 2 * kv_elem
        qo_bytes = 2 * scn.rows * scn.num_q_heads * scn.head_dim * act
        row_bytes = st["tokens_total"] * kv_per_token + qo_bytes
        grouped_bytes = st["union_total"] * 4 * kv_per_token + qo_bytes
        bytes_of = {"grouped": grouped_bytes}

        state: dict = {}
        for route in self.routes_of(scn):
            self._step(f"{scn.name}: {route}")
            try:
                if route == "planner":
                    self._planner(scn, w, state, flops)
                    continue
                builder = self.route_builders.get(route)
                if builder is None:
                    raise ValueError(f"unknown route {route!r}")
                kind = "baseline" if route in registry.BASELINES else "route"
                fn, out, graph = builder(route, scn, w, state)
                bounds = gate_bounds(ref, dtype, None if route == "naive" else yard)
                self._check_and_time(scn, route, kind, fn, out, ref, bounds, graph=graph,
                                     flops=flops, nbytes=bytes_of.get(route, row_bytes))
            except Exception as e:
                self._add(scn, route, "baseline" if route in registry.BASELINES else "route",
                          error=_err_text(e), passed=False)
                if _is_fatal(e):
                    raise
            finally:
                state.pop("fn", None)

        self._add_floors(scn, flops, row_bytes, grouped_bytes if "grouped" in self.routes_of(scn) else None)
        self._fill_ratios(scn.name, "splitk", "vs_splitk")

    def _check_and_time(self, scn, route, kind, fn, out, ref, bounds, *, graph, flops, nbytes):
        torch = self.torch
        out.fill_(float("nan"))
        fn()
        self._sync()
        err = output_errors(out, ref)
        passed = gate(err, bounds)
        fields = dict(passed=passed, flops=flops, bytes=nbytes, max_abs_err=err["max_abs_err"],
                      rel_l2_err=err["rel_l2_err"], bound_abs=bounds["bound_abs"], bound_rel=bounds["bound_rel"])
        if not passed:
            fields["error"] = (f"correctness gate failed: max abs {err['max_abs_err']:.3g} (bound "
                               f"{bounds['bound_abs']:.3g}), rel L2 {err['rel_l2_err']:.3g} (bound "
                               f"{bounds['bound_rel']:.3g}); not timed")
            return self._add(scn, route, kind, **fields)
        eager = out.clone()
        t = self.timer.time(fn, graph=graph)
        self._sync()
        fields.update(self._rates(t, flops, nbytes), replay_equal=bool(torch.equal(out, eager)))
        return self._add(scn, route, kind, **fields)

    @staticmethod
    def _rates(t, flops, nbytes) -> dict:
        s = t.median_ms * 1e-3
        return dict(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, timing=t.method, reps=t.reps,
                    tflops=flops / s / 1e12 if flops and s > 0 else None,
                    gbps=nbytes / s / 1e9 if nbytes and s > 0 else None)

    def _kernel_route(self, route, scn, w, state):
        """plan + run of a qsa route into fixed buffers (the planner is part of what is timed)."""
        import qsa
        from qsa.plan import PlanWorkspace, planner_programs

        torch = self.torch
        cache = w.cache
        plan_kw = dict(block_size=cache.block_size, num_blocks=cache.num_blocks, num_q_heads=scn.num_q_heads,
                       num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim, route=route)
        plan_in = (w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens)
        plan = qsa.plan_attention(*plan_in, **plan_kw)
        ws = None
        if plan.grouped is not None:
            ws = PlanWorkspace.allocate(index_width=plan.single.capacity, group_rows=plan.grouped.group_rows,
                                        programs=planner_programs(plan.grouped.num_groups, self.device),
                                        device=self.device)
        out = torch.empty_like(w.q)
        kw = w.cache_kwargs

        def fn():
            p = qsa.plan_attention(*plan_in, **plan_kw, out=plan, workspace=ws)
            qsa.run_attention(p, w.q, cache.k, cache.v, out=out, **kw)

        if route == "grouped":
            state["grouped_plan"], state["grouped_ws"] = plan, ws
        return fn, out, True

    def _naive_route(self, route, scn, w, state):
        from .baselines import naive_attention

        out = self.torch.empty_like(w.q)

        def fn():
            naive_attention(w.q, *w.args, **w.cache_kwargs, out=out)

        return fn, out, True

    def _planner(self, scn, w, state, flops):
        """The grouped planner alone (single-row plans + grouped unions), into the grouped route's
        buffers. Reported only when the grouped route passed its check (or was not run)."""
        from qsa.plan import plan_groups, plan_single_rows

        grouped = _record(self.records, scn.name, "grouped")
        if grouped is not None and not grouped.get("passed"):
            self._add(scn, "planner", "component", passed=False,
                      error="grouped route failed or errored: planner not timed")
            return
        plan, ws = state.get("grouped_plan"), state.get("grouped_ws")
        if plan is None:
            import qsa

            plan = qsa.plan_attention(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                                      block_size=w.cache.block_size, num_blocks=w.cache.num_blocks,
                                      num_q_heads=scn.num_q_heads, num_kv_heads=scn.num_kv_heads,
                                      head_dim=scn.head_dim, route="grouped")
            from qsa.plan import PlanWorkspace, planner_programs

            ws = PlanWorkspace.allocate(index_width=plan.single.capacity, group_rows=plan.grouped.group_rows,
                                        programs=planner_programs(plan.grouped.num_groups, self.device),
                                        device=self.device)
        cache = w.cache

        def fn():
            single = plan_single_rows(w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens,
                                      block_size=cache.block_size, num_blocks=cache.num_blocks, out=plan.single)
            plan_groups(single, group_rows=plan.grouped.group_rows, num_rows=plan.grouped.num_rows,
                        out=plan.grouped, workspace=ws)

        fn()
        self._sync()
        t = self.timer.time(fn)
        self._add(scn, "planner", "component", passed=None if grouped is None else True,
                  **self._rates(t, None, None))

    def _add_floors(self, scn, flops, row_bytes, grouped_bytes):
        c = self.ceilings or {}
        bw, mm = c.get("copy_gbps"), c.get("matmul_tflops")
        if bw:
            if grouped_bytes is not None:
                self._add(scn, "floor-bytes-grouped", "floor", median_ms=grouped_bytes / (bw * 1e9) * 1e3,
                          bytes=grouped_bytes, gbps=bw, timing="model")
            self._add(scn, "floor-bytes-row", "floor", median_ms=row_bytes / (bw * 1e9) * 1e3, bytes=row_bytes,
                      gbps=bw, timing="model")
        if mm:
            self._add(scn, "floor-flops", "floor", median_ms=flops / (mm * 1e12) * 1e3, flops=flops,
                      tflops=mm, timing="model")

    def _fill_ratios(self, scenario: str, base_route: str, key: str):
        base = _passed_ms(self.records, scenario, base_route)
        if not base:
            return
        for r in self.records:
            if r["scenario"] == scenario and r.get("median_ms") and r["kind"] in ("route", "baseline", "floor",
                                                                                  "component"):
                r[key] = base / r["median_ms"]

    # -- selection -------------------------------------------------------------------------------

    def _run_selection(self, scn: Scenario, meta: dict):
        from qsa.indexer import select_tokens, torch_select_baseline

        from .baselines import exact_selection, selection_check
        from .generators import INDEX_DIM, INDEX_HEADS, selection_workload

        torch = self.torch
        self._step(f"{scn.name}: workload + exact selection")
        t0 = time.time()
        sw = selection_workload(scn, self.device)
        exact, scores_of = exact_selection(*sw.args, k=scn.topk)
        self._sync()
        vis_total = int(torch.minimum((sw.positions + 1) // 4, sw.seq_lens.long()[sw.token_to_req.long()] // 4)
                        .sum())
        flops = 2 * INDEX_HEADS * INDEX_DIM * vis_total
        nbytes = (sw.index_q.numel() * sw.index_q.element_size()
                  + scn.num_reqs * (scn.context // 4) * INDEX_DIM * sw.kc_cache.element_size()
                  + exact.numel() * exact.element_size())
        meta.update(useful_flops=flops, setup_s=round(time.time() - t0, 2))

        for route in self.routes_of(scn):
            self._step(f"{scn.name}: {route}")
            try:
                if route == "select":
                    buf = torch.full_like(exact, -7)

                    def fn():
                        select_tokens(*sw.args, k=scn.topk, out=buf)

                    graph = True
                elif route == "torch-select":
                    holder = {}

                    def fn():
                        holder["out"] = torch_select_baseline(*sw.args, k=scn.topk)

                    graph = False  # synchronises with the host
                else:
                    raise ValueError(f"unknown selection route {route!r}")
                fn()
                self._sync()
                got = buf if route == "select" else holder["out"]
                chk = selection_check(got, exact, scores_of, sw.token_to_req, k=scn.topk)
                passed = chk["exact"] if route == "select" else chk["tie_equivalent"]
                fields = dict(passed=passed, flops=flops, bytes=nbytes, exact=chk["exact"],
                              rows_differ=chk["rows_differ"], tie_equivalent=chk["tie_equivalent"])
                kind = "route" if route == "select" else "baseline"
                if not passed:
                    fields["error"] = (f"selection check failed: {chk['rows_differ']} rows differ from the exact "
                                       f"top-k{'' if route == 'select' else ' beyond ties'}; not timed")
                    self._add(scn, route, kind, **fields)
                    continue
                eager = got.clone()
                t = self.timer.time(fn, graph=graph)
                self._sync()
                got = buf if route == "select" else holder["out"]
                fields.update(self._rates(t, flops, nbytes), replay_equal=bool(torch.equal(got, eager)))
                self._add(scn, route, kind, **fields)
            except Exception as e:
                self._add(scn, route, "route" if route == "select" else "baseline", error=_err_text(e),
                          passed=False)
                if _is_fatal(e):
                    raise
        self._fill_ratios(scn.name, "torch-select", "vs_torch")


# ------------------------------------------------------------------------------------------------
# reports


def device_info(device) -> dict:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return dict(name=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1))
    return dict(name="cpu", capability=None, sm_count=os.cpu_count(), memory_gib=None)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def build_report(suite: Suite, *, started: _dt.datetime, quick: bool, complete: bool, argv) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton missing: the report still says what ran
        triton_version = None
    try:
        import qsa

        qsa_version = qsa.__version__
    except Exception:
        qsa_version = None
    info = device_info(suite.device)
    return dict(
        schema=SCHEMA_VERSION,
        device=info["name"],
        device_info=info,
        date=started.isoformat(timespec="seconds"),
        complete=complete,
        quick=quick,
        argv=list(argv),
        versions=dict(python=platform.python_version(), torch=torch.__version__, triton=triton_version,
                      qsa=qsa_version),
        ceilings=suite.ceilings,
        scenarios=list(suite.scenarios.values()),
        records=suite.records,
        targets=evaluate_targets(suite.records, suite.scenarios, suite.ceilings),
        fatal_error=suite.fatal,
    )


def _write_json(path: Path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _sanitize(obj):
    """JSON has no inf/NaN: write them as strings."""
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    return obj


RESULT_COLUMNS = ("scenario", "route", "ms", "TFLOP/s", "GB/s", "x splitk", "max abs", "rel L2", "check")


def result_rows(report: dict) -> list:
    rows = []
    for r in report["records"]:
        ratio = r.get("vs_splitk") if r.get("vs_splitk") is not None else r.get("vs_torch")
        if r["kind"] == "floor":
            check = "model"
        elif r.get("error") and not r.get("passed"):
            check = "FAIL" if r.get("max_abs_err") is not None or r.get("rows_differ") else "ERROR"
        else:
            check = {True: "ok", False: "FAIL", None: "-"}[r.get("passed")]
        rows.append((r["scenario"], r["route"], _fmt(r.get("median_ms"), ".4g"), _fmt(r.get("tflops"), ".1f"),
                     _fmt(r.get("gbps"), ".0f"), _fmt(ratio, ".2f"), _fmt(r.get("max_abs_err"), ".2e"),
                     _fmt(r.get("rel_l2_err"), ".2e"), check))
    return rows


def text_table(columns, rows) -> str:
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c))
              for i, c in enumerate(columns)]
    line = "  ".join(str(c).ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def md_table(columns, rows) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    out += ["| " + " | ".join(str(v).replace("|", "/") for v in r) + " |" for r in rows]
    return "\n".join(out)


def target_rows(report: dict) -> list:
    return [(t["name"], _fmt(t["value"], ".3g"), f"{t['op']} {t['goal']:g} {t['unit']}",
             {True: "yes", False: "NO", None: "not measured"}[t["met"]], t.get("note") or "")
            for t in report["targets"]]


def scenario_rows(report: dict) -> list:
    return [(s["name"], s["description"], _fmt(s.get("overlap"), ".3f"), _fmt(s.get("avg_union_per_group"), ".0f"),
             _fmt(s.get("sharing"), ".2f"), _fmt(s.get("elapsed_s"), ".1f"),
             (s.get("error") or "").splitlines()[0][:120] if s.get("error") else "")
            for s in report["scenarios"]]


SCENARIO_COLUMNS = ("scenario", "workload", "overlap", "avg union / group (microblocks)", "sharing", "s", "error")
TARGET_COLUMNS = ("target", "value", "goal", "met", "note")


def write_markdown(report: dict, path: Path, *, plot: Path | None, history: list):
    c = report.get("ceilings") or {}
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `qsa bench` (`benchmarks/run.py`) on **{report['device']}**, {report['date']}"
        f"{' (`--quick`)' if report['quick'] else ''}{'' if report['complete'] else ' (incomplete run)'}. "
        "Definitions of every column: `benchmarks/README.md`. Times are medians of CUDA-graph replays with "
        "L2 flushed before each; grouped times include the planner; no time is reported for a route that "
        "fails its check against the fp32 reference.",
        "",
        f"Ceilings measured in this run: copy **{_fmt(c.get('copy_gbps'), '.0f')} GB/s** (bytes read + "
        f"written), fp16 matmul **{_fmt(c.get('matmul_tflops'), '.0f')} TFLOP/s**.",
        "",
        "## Targets",
        "",
        md_table(TARGET_COLUMNS, target_rows(report)),
        "",
        "## Scenarios",
        "",
        md_table(SCENARIO_COLUMNS, scenario_rows(report)),
        "",
        "## Results",
        "",
        "`x splitk`: splitk time / route time (selection: torch baseline time / route time). Floors: bytes "
        "the route must read at the copy bandwidth, useful FLOPs at the matmul rate.",
        "",
        md_table(RESULT_COLUMNS, result_rows(report)),
        "",
    ]
    if plot is not None:
        lines += [f"![time per route per scenario]({os.path.relpath(plot, path.parent)})", ""]
    if history:
        lines += ["## History", ""]
        lines += [f"- [{h.name}]({os.path.relpath(h, path.parent)})" for h in history]
        lines += [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


PLOT_ROUTES = ("grouped", "xqa", "splitk", "naive", "floor-bytes-grouped", "floor-bytes-row", "floor-flops",
               "select", "torch-select")


def write_plot(report: dict, path: Path) -> str | None:
    """Bar chart of time per route per scenario (log scale); returns a note when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib missing: skip the plot
        return f"plot skipped: matplotlib not importable ({type(e).__name__})"
    recs = [r for r in report["records"] if r.get("median_ms") and r["route"] in PLOT_ROUTES]
    if not recs:
        return "plot skipped: no timed records"
    kinds = [("attention", [s["name"] for s in report["scenarios"] if s["kind"] == "attention"]),
             ("selection", [s["name"] for s in report["scenarios"] if s["kind"] == "selection"])]
    kinds = [(k, names) for k, names in kinds if any(r["scenario"] in names for r in recs)]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(max(8, 0.9 * max(len(n) for _, n in kinds) + 3),
                                                      4.5 * len(kinds)), squeeze=False)
    for ax, (kind, names) in zip(axes[:, 0], kinds):
        routes = [r for r in PLOT_ROUTES if any(x["route"] == r and x["scenario"] in names for x in recs)]
        width = 0.8 / max(len(routes), 1)
        for i, route in enumerate(routes):
            xs, ys = [], []
            for j, name in enumerate(names):
                ms = _passed_or_model_ms(recs, name, route)
                if ms:
                    xs.append(j + (i - (len(routes) - 1) / 2) * width)
                    ys.append(ms)
            hatch = "//" if route.startswith("floor") else None
            ax.bar(xs, ys, width, label=route, hatch=hatch)
        ax.set_yscale("log")
        shown = [r["median_ms"] for r in recs if r["scenario"] in names]
        ax.set_ylim(min(shown) / 3, max(shown) * 3)
        ax.set_ylabel("median time (ms, log)")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{kind}: time per route ({report['device']}, {report['date'][:10]})")
        ax.legend(fontsize=7, ncol=4)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _passed_or_model_ms(recs, scenario, route):
    for r in recs:
        if r["scenario"] == scenario and r["route"] == route and (r.get("passed") or r["kind"] in ("floor",)):
            return r["median_ms"]
    return None


# ------------------------------------------------------------------------------------------------
# entry point


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="qsa bench",
        description="Benchmark the qsa routes and baselines on named scenarios (correctness first).")
    p.add_argument("--scenario", "-s", action="append", metavar="GLOB",
                   help="run scenarios matching GLOB (repeatable; default: all but the tiny test ones)")
    p.add_argument("--route", "-r", action="append", metavar="GLOB",
                   help="measure only routes matching GLOB (repeatable); the reference always runs")
    p.add_argument("--quick", action="store_true",
                   help="the key targets only (prefill-64k o80/o98, decode-64, mtp-8, selection), "
                        "fewer routes and repetitions")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                   help="directory of latest.json and the dated copies (default: benchmarks/results)")
    p.add_argument("--docs", type=Path, default=ROOT / "docs",
                   help="directory of benchmarks.md and benchmarks.png (default: docs)")
    p.add_argument("--no-plot", action="store_true", help="do not draw docs/benchmarks.png")
    p.add_argument("--no-docs", action="store_true", help="write the JSON only")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new scenario after this many minutes (the rest is recorded as skipped)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    scenarios = registry.select(args.scenario, quick=args.quick)
    if args.list:
        for s in registry.SCENARIOS:
            flags = ("quick " if s.quick else "") + ("test " if s.test_only else "")
            print(f"{s.name:28s} {flags:11s} {s.describe()}  routes: {','.join(s.routes)}")
        return 0
    if not scenarios:
        print(f"no scenario matches {args.scenario}; --list shows them", file=sys.stderr)
        return 2

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        # Triton kernels run on the CPU only under the interpreter; set before qsa's kernels load.
        os.environ["TRITON_INTERPRET"] = "1"
    if str(ROOT / "src") not in sys.path:
        try:
            import qsa  # noqa: F401
        except ImportError:
            sys.path.insert(0, str(ROOT / "src"))
    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))

    started = _dt.datetime.now(_dt.timezone.utc)
    probe = Suite(device, quick=args.quick, route_globs=args.route)
    total = 1 + sum(probe.steps_of(s) for s in scenarios)
    progress = Progress(total)
    suite = probe
    suite.progress = progress
    out_dir = Path(args.out)
    latest = out_dir / "latest.json"

    def save(complete: bool) -> dict:
        report = _sanitize(build_report(suite, started=started, quick=args.quick, complete=complete, argv=argv))
        _write_json(latest, report)
        return report

    print(f"qsa bench: {len(scenarios)} scenarios on {device_info(device)['name']}"
          f"{' (quick)' if args.quick else ''}; results -> {latest}", file=sys.stderr)
    try:
        suite.measure_ceilings()
    except Exception as e:  # the run goes on; rates against the ceilings are left out
        suite.ceilings = dict(error=_err_text(e))
    t_start = time.time()
    for scn in scenarios:
        if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
            suite.scenarios[scn.name] = dict(suite._scenario_meta(scn), error="skipped: --max-minutes reached")
            progress.step(f"{scn.name}: skipped", advance=suite.steps_of(scn))
            continue
        suite.run(scn)
        save(complete=False)
    progress.close()

    report = save(complete=True)
    stamp = started.strftime("%Y-%m-%d-%H%M")
    dated = out_dir / f"{stamp}-{slug(report['device'])}.json"
    _write_json(dated, report)
    print("\n" + text_table(SCENARIO_COLUMNS, scenario_rows(report)))
    print("\n" + text_table(RESULT_COLUMNS, result_rows(report)))
    print("\n" + text_table(TARGET_COLUMNS, target_rows(report)))
    if not args.no_docs:
        docs = Path(args.docs)
        plot = None
        if not args.no_plot:
            png = docs / "benchmarks.png"
            note = write_plot(report, png)
            if note:
                print(note, file=sys.stderr)
            else:
                plot = png
        history = sorted(p for p in out_dir.glob("*.json") if p.name != "latest.json")
        write_markdown(report, docs / "benchmarks.md", plot=plot, history=history)
    print(f"\nwrote {latest} and {dated}" + ("" if args.no_docs else f", {Path(args.docs) / 'benchmarks.md'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
