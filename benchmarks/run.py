"""``qsa bench``: run named scenarios, check every route against the fp32 reference, then time it.

For each scenario, in one process: build the workload, compute the fp32 reference and the naive
PyTorch yardstick, then for each route: run it once eagerly (compiles its kernels), check it, and
only if the check passes time it (CUDA-graph replays, L2 flushed before each; ``do_bench`` for code
that cannot be captured). Every attention scenario also runs ``auto`` (the route the library picks with
the serving layer's hints), checked and timed like the forced routes. For ``auto`` and each forced qsa
route the run also measures what a caller without a CUDA graph pays: one eager call (``eager_ms``), the
host time to enqueue one ``sparse_paged_attention`` call (``host_us``) and one ``run_attention`` on a held
plan (``host_run_us``). The ceilings (copy bandwidth, fp16 matmul rate) are measured first.

Writes ``<out>/latest.json`` after every scenario (so a run cut short keeps what it measured), then
``<docs>/benchmarks.md`` and ``<docs>/benchmarks.png``. Each run replaces them: earlier runs are in git's
history of ``benchmarks/results/latest.json``, not in dated copies.

Run from the checkout root: ``qsa bench [--quick] [--scenario GLOB ...]`` or
``PYTHONPATH=src python -m benchmarks.run ...``. ``--help`` lists the options, ``--list`` the scenarios.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from . import registry
from .registry import Scenario
from .report import (RESULT_COLUMNS, SCENARIO_COLUMNS, TARGET_COLUMNS, _passed_ms, _record, build_report, cpu_text,
                     device_info, is_cpu, result_rows, sanitize, scenario_rows, target_rows, text_table,
                     write_json, write_markdown, write_plot)

ROOT = Path(__file__).resolve().parent.parent
AUTO = "auto"
"""The route the library chooses (``route="auto"``), run on every attention scenario."""
HOST_COST_ROUTES = registry.ATTENTION_ROUTES + (AUTO,)
"""Routes whose records carry the eager and host-cost columns (``eager_ms``, ``host_us``, ``host_run_us``)."""
FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure",
              "misaligned address", "illegal instruction", "CUDA error: an illegal")


# ------------------------------------------------------------------------------------------------
# correctness gate


def step_bytes(scn) -> tuple[int, int]:
    """(K and V bytes per kept token over the KV heads, bytes of q read plus out written) of a scenario."""
    import torch

    from .generators import TORCH_DTYPES

    act = torch.finfo(TORCH_DTYPES[scn.dtype]).bits // 8
    kv_elem = 1 if scn.kv_cache_dtype == "fp8_e4m3" else act
    return scn.num_kv_heads * scn.head_dim * 2 * kv_elem, 2 * scn.rows * scn.num_q_heads * scn.head_dim * act


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


def with_auto(routes) -> tuple:
    """``routes`` with ``auto`` after the qsa routes: before the first baseline or component (whose
    measurements do not depend on it), else at the end."""
    routes = tuple(routes)
    later = [i for i, r in enumerate(routes) if r in registry.BASELINES or r in registry.COMPONENTS]
    at = later[0] if later else len(routes)
    return routes[:at] + (AUTO,) + routes[at:]


class FatalDeviceError(RuntimeError):
    """A CUDA error that poisons the context: the rest of the run is skipped."""


def _is_fatal(exc: BaseException) -> bool:
    msg = str(exc)
    return any(s in msg for s in FATAL_CUDA)


def _err_text(exc: BaseException) -> str:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(tb[-3:]).strip()
    return f"{type(exc).__name__}: {exc}"[:500] + ("\n" + tail[-1500:] if tail else "")


class Suite:
    """Runs scenarios on one device and collects ``records`` and per-scenario ``scenarios`` metadata."""

    def __init__(self, device: str, *, quick: bool = False, route_globs=None, progress: Progress | None = None,
                 eager_reps: int | None = None, host_calls: int | None = None):
        import torch

        from .timing import QUICK_TIMING, Timer, TimingConfig

        self.torch = torch
        self.device = torch.device(device)
        self.quick = quick
        self.route_globs = route_globs
        cfg = QUICK_TIMING if quick else TimingConfig()
        self.timer = Timer(self.device, cfg)
        # Eager calls timed and host calls counted per route; under the interpreter a call of a tiny
        # scenario takes a tenth of a second or more, and its times mean nothing: as few as will do.
        self.eager_reps = eager_reps or 50
        self.host_calls = host_calls or (200 if self.device.type == "cuda" else 1)
        self.progress = progress
        self.records: list = []
        self.scenarios: dict = {}
        self.ceilings: dict | None = None
        self.fatal: str | None = None
        self.route_builders = {
            "grouped": self._kernel_route, "xqa": self._kernel_route, "splitk": self._kernel_route,
            "invariant": self._kernel_route, AUTO: self._kernel_route, "naive": self._naive_route,
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
        if scn.kind == "attention" and AUTO not in routes:
            routes = with_auto(routes)
        if self.route_globs:
            routes = tuple(r for r in routes if any(fnmatch.fnmatchcase(r, g) for g in self.route_globs))
        return routes

    def steps_of(self, scn: Scenario) -> int:
        return len(self.routes_of(scn)) + (2 if scn.kind == "attention" else 1)

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
                   max_ms=None, eager_ms=None, host_us=None, host_run_us=None, tflops=None,
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
        if not gate(yard, gate_bounds(ref, TORCH_DTYPES[scn.dtype], None)):
            yard = None  # a naive result that fails its own gate sets no route's bounds
        del naive_out
        meta["setup_s"] = round(time.time() - t0, 2)

        dtype = TORCH_DTYPES[scn.dtype]
        kv_per_token, qo_bytes = step_bytes(scn)
        row_bytes = st["tokens_total"] * kv_per_token + qo_bytes
        grouped_bytes = st["union_total"] * 4 * kv_per_token + qo_bytes
        bytes_of = {"grouped": grouped_bytes}

        state: dict = {}
        pending: list = []  # the eager and host-cost calls of the routes that passed, timed after the loop
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
                plan = state.pop("plan", None)
                extra = {} if plan is None else dict(plan_route=plan.routes.route,
                                                     grouped_rows=plan.routes.grouped_rows,
                                                     direct=plan.routes.direct)
                costs = (functools.partial(self._eager_calls, scn, w, route, pending)
                         if route in HOST_COST_ROUTES else None)
                bounds = gate_bounds(ref, dtype, None if route == "naive" else yard)
                # auto reads what the route it took reads (grouped: groups of 8 rows from row 0, as
                # the grouped bytes count them; rows left to xqa are a last group's few rows)
                nbytes = bytes_of.get(extra.get("plan_route") if route == AUTO else route, row_bytes)
                self._check_and_time(scn, route, kind, fn, out, ref, bounds, graph=graph,
                                     flops=flops, nbytes=nbytes, extra=extra, costs=costs)
            except Exception as e:
                self._add(scn, route, "baseline" if route in registry.BASELINES else "route",
                          error=_err_text(e), passed=False)
                if _is_fatal(e):
                    raise
            finally:
                state.pop("fn", None)

        self._step(f"{scn.name}: eager and host costs")
        self._eager_costs(pending)
        self._add_floors(scn, flops, row_bytes, grouped_bytes if "grouped" in self.routes_of(scn) else None)
        self._fill_ratios(scn.name, "splitk", "vs_splitk")

    def _check_and_time(self, scn, route, kind, fn, out, ref, bounds, *, graph, flops, nbytes, extra=None,
                        costs=None):
        """Check ``fn``'s output against ``ref``, and only if it passes time it; then, with ``costs``
        (``costs(fn, out, checked_output, timing) -> fields``), add its eager and host-cost fields."""
        torch = self.torch
        out.fill_(float("nan"))
        fn()
        self._sync()
        err = output_errors(out, ref)
        passed = gate(err, bounds)
        fields = dict(extra or {}, passed=passed, flops=flops, bytes=nbytes, max_abs_err=err["max_abs_err"],
                      rel_l2_err=err["rel_l2_err"], bound_abs=bounds["bound_abs"], bound_rel=bounds["bound_rel"])
        if not passed:
            fields["error"] = (f"correctness gate failed: max abs {err['max_abs_err']:.3g} (bound "
                               f"{bounds['bound_abs']:.3g}), rel L2 {err['rel_l2_err']:.3g} (bound "
                               f"{bounds['bound_rel']:.3g}); not timed")
            return self._add(scn, route, kind, **fields)
        eager = out.clone()
        t = self.timer.time(fn, graph=graph)
        self._sync()
        fields = self._timed(fields, t, bool(torch.equal(out, eager)), flops, nbytes)
        rec = self._add(scn, route, kind, **fields)
        if costs is not None and rec["passed"]:
            costs(rec, fn, out, eager, t)
        return rec

    EAGER_ROUNDS = 5
    """Rounds of the eager and host-cost timing on a GPU: in each, every route of the scenario takes its share
    of the calls in turn (the first route of each round rotates), so that a drift of the host's speed over
    the scenario weighs on every route alike."""

    def _eager_calls(self, scn, w, route, pending: list, rec: dict, fn, out, checked, timed) -> None:
        """Queue what a caller without a CUDA graph pays for ``route`` for :meth:`_eager_costs`: ``fn``
        (the plan + run step the graph column replays), one ``qsa.sparse_paged_attention`` call (plan +
        run) with the scenario's hints and one ``qsa.run_attention`` on a plan held from one
        ``plan_attention`` (``benchmarks.host_cost.calls_of``), all writing ``out``, whose checked output is
        ``checked``. An error fails the record, its graph time kept."""
        from .host_cost import calls_of

        try:
            plan_run, run_only = calls_of(scn, w, route, out=out)
        except Exception as e:
            if _is_fatal(e):
                raise
            rec.update(passed=False, error=f"eager / host-cost timing: {_err_text(e)}")
            return
        pending.append(self.queued_costs(rec, fn, out, checked, timed, plan_run, run_only))

    @staticmethod
    def queued_costs(rec: dict, fn, out, checked, timed, plan_run, run_only) -> dict:
        """One route's entry for :meth:`_eager_costs`: its record, its three calls, its output and the checked
        one, the graph column's timing, and the samples and differing calls gathered so far."""
        return dict(rec=rec, fn=fn, out=out, checked=checked, timed=timed, plan_run=plan_run, run_only=run_only,
                    eager=[], host=[], host_run=[], differ={})

    def _eager_costs(self, pending: list) -> None:
        """The eager and host-cost fields of each queued record (see ``benchmarks.host_cost``):

        * ``eager_ms``: one eager call of the step, the L2 flushed and the device idle before each
          (``Timer.eager_samples``), median of ``eager_reps``. On the CPU both that and the graph column's
          ``Timer.time`` are the same wall-clock median of eager calls: the graph column's is taken;
        * ``host_us``: host time to enqueue one ``sparse_paged_attention`` call (plan + run), median of
          ``host_calls`` (``Timer.host_samples``);
        * ``host_run_us``: the same for ``run_attention`` on a held plan.

        On a GPU the calls are spread over :attr:`EAGER_ROUNDS` rounds that interleave the routes. Every
        call writes the route's output, which must then still equal the checked output bitwise (what was
        timed is what was checked); otherwise the record fails and keeps no eager or host figures. An error
        fails its record (the graph time kept) and takes the route out of the later rounds."""
        torch = self.torch
        timer = self.timer
        rounds = self.EAGER_ROUNDS if timer.is_cuda else 1
        eager_reps = -(-self.eager_reps // rounds)
        host_calls = -(-self.host_calls // rounds)
        def checked(item, call: str) -> None:  # the output the call left must be the checked one
            self._sync()
            if not bool(torch.equal(item["out"], item["checked"])):
                item["differ"].setdefault(call)

        live = list(pending)
        for r in range(rounds):
            if not live:
                break
            for item in live[r % len(live):] + live[:r % len(live)]:
                try:
                    if timer.is_cuda:
                        item["eager"] += timer.eager_samples(item["fn"], eager_reps)
                        checked(item, "eager")
                    item["host"] += timer.host_samples(item["plan_run"], host_calls)
                    checked(item, "sparse_paged_attention")
                    item["host_run"] += timer.host_samples(item["run_only"], host_calls)
                    checked(item, "run_attention")
                except Exception as e:
                    if _is_fatal(e):
                        raise
                    item["rec"].update(passed=False, error=f"eager / host-cost timing: {_err_text(e)}")
                    live.remove(item)
        for item in live:
            rec = item["rec"]
            if item["differ"]:
                rec.update(passed=False, eager_equal=False,
                           error=f"the output of the {' and '.join(item['differ'])} calls timed for the eager "
                                 "columns differs from the checked output; not counted")
                continue
            if timer.is_cuda:
                eager = item["eager"]
                rec.update(eager_ms=statistics.median(eager), eager_min_ms=min(eager), eager_max_ms=max(eager),
                           eager_reps=len(eager))
            else:
                t = item["timed"]
                rec.update(eager_ms=t.median_ms, eager_min_ms=t.min_ms, eager_max_ms=t.max_ms, eager_reps=t.reps)
            rec.update(host_us=statistics.median(item["host"]), host_run_us=statistics.median(item["host_run"]),
                       host_calls=len(item["host"]), eager_rounds=rounds, eager_equal=True)

    def _timed(self, fields: dict, t, replay_equal: bool, flops, nbytes) -> dict:
        """A checked record's fields with its times, or, when the timed replays' output differs from the
        checked one (what was timed is not what was checked), failed and without times."""
        fields = dict(fields, replay_equal=replay_equal)
        if not replay_equal:
            return dict(fields, passed=False,
                        error="the timed replays' output differs from the checked output; not counted")
        return dict(fields, **self._rates(t, flops, nbytes))

    @staticmethod
    def _rates(t, flops, nbytes) -> dict:
        s = t.median_ms * 1e-3
        return dict(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, timing=t.method, reps=t.reps,
                    tflops=flops / s / 1e12 if flops and s > 0 else None,
                    gbps=nbytes / s / 1e9 if nbytes and s > 0 else None)

    def _kernel_route(self, route, scn, w, state):
        """plan + run of a qsa route (or of ``auto``) into fixed buffers (the planner is part of what is
        timed)."""
        import qsa

        from .host_cost import hints_of

        torch = self.torch
        cache = w.cache
        # The scenarios' rows are sorted as select_tokens emits them, and the caller says so, as the
        # layer does: small xqa batches then take the direct kernel. The most rows of one request is
        # passed too (it only steers auto: one row per request takes xqa).
        plan_kw = dict(block_size=cache.block_size, num_blocks=cache.num_blocks, num_q_heads=scn.num_q_heads,
                       num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim, route=route,
                       kv_cache_dtype=cache.kv_cache_dtype, **hints_of(scn))
        plan_in = (w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens)
        plan = qsa.plan_attention(*plan_in, **plan_kw)
        ws = self._workspace(plan)
        out = torch.empty_like(w.q)
        kw = w.cache_kwargs

        def fn():
            p = qsa.plan_attention(*plan_in, **plan_kw, out=plan, workspace=ws)
            qsa.run_attention(p, w.q, cache.k, cache.v, out=out, **kw)

        if route == "grouped":
            state["grouped_plan"], state["grouped_ws"] = plan, ws
        state["plan"] = plan  # which rows took which kernel, for the record
        return fn, out, True

    def _workspace(self, plan):
        """A grouped-planner workspace for ``plan`` to reuse across calls, or None (then the planner
        allocates its own scratch on every call, which graph capture also accepts)."""
        if plan.grouped is None:
            return None
        from qsa.attention.planning.plan import PlanWorkspace

        return PlanWorkspace.for_plan(plan.inputs[1], block_size=plan.block_size, num_groups=plan.grouped.num_groups)

    def _naive_route(self, route, scn, w, state):
        from .baselines import naive_attention

        out = self.torch.empty_like(w.q)

        def fn():
            naive_attention(w.q, *w.args, **w.cache_kwargs, out=out)

        return fn, out, True

    def _planner(self, scn, w, state, flops):
        """The grouped planner alone (grouped unions, plus single-row plans of rows left over), into
        the grouped route's buffers. Reported only when the grouped route passed its check (or was not
        run)."""
        from qsa.attention.planning.plan import plan_groups, plan_single_rows

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
                                      head_dim=scn.head_dim, route="grouped", kv_cache_dtype=w.cache.kv_cache_dtype)
            ws = self._workspace(plan)
        cache = w.cache

        inputs = (w.indices, w.block_table, w.token_to_req, w.positions, w.seq_lens)
        geometry = dict(block_size=cache.block_size, num_blocks=cache.num_blocks)

        def fn():
            plan_groups(*inputs, **geometry, group_rows=plan.grouped.group_rows, num_rows=plan.grouped.num_rows,
                        out=plan.grouped, workspace=ws)
            if plan.grouped.num_rows < w.indices.shape[0]:
                plan_single_rows(*inputs, **geometry, out=plan.single, row_start=plan.grouped.num_rows,
                                 rows_sorted=True)

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
        from qsa.selection.api import select_tokens

        from .baselines import exact_selection, selection_check, torch_select_baseline
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
                        select_tokens(*sw.args, block_size=scn.block_size, k=scn.topk, out=buf)

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
                self._add(scn, route, kind, **self._timed(fields, t, bool(torch.equal(got, eager)), flops, nbytes))
            except Exception as e:
                self._add(scn, route, "route" if route == "select" else "baseline", error=_err_text(e),
                          passed=False)
                if _is_fatal(e):
                    raise
        self._fill_ratios(scn.name, "torch-select", "vs_torch")


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
    p.add_argument("--out", type=Path, default=None,
                   help="directory of latest.json, replaced by each run (default: benchmarks/results on a "
                        "GPU; on the CPU a new temporary directory, so that the GPU results stay)")
    p.add_argument("--docs", type=Path, default=None,
                   help="directory of benchmarks.md and benchmarks.png (default: docs on a GPU; on the CPU "
                        "the --out directory)")
    p.add_argument("--no-plot", action="store_true", help="do not draw docs/benchmarks.png")
    p.add_argument("--no-docs", action="store_true", help="write the JSON only")
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:N] (default: auto, the GPU if there is one)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new scenario after this many minutes (the rest is recorded as skipped)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = p.parse_args(argv)
    args.parser = p
    return args


def _on_cpu(parser, text: str | None) -> bool:
    """Whether ``--device`` names the CPU (auto: no GPU), read with torch alone: qsa must not be imported
    before the interpreter is switched on."""
    import torch

    if text in (None, "auto"):
        return not torch.cuda.is_available()
    try:
        return torch.device(text).type == "cpu"
    except RuntimeError:
        parser.error(f"--device must be auto, cpu or cuda, got {text!r}")


def failures(report: dict) -> list[str]:
    """What failed in a run: every route or baseline that failed its check or errored, and every scenario
    that errored (a scenario left out by ``--max-minutes`` is not a failure)."""
    bad = [f"{r['scenario']}:{r['route']}" for r in report["records"]
           if r.get("kind") != "floor" and (not r.get("passed") or r.get("error"))]
    bad += [f"{s['name']} ({s['error']})" for s in report["scenarios"]
            if s.get("error") and not str(s["error"]).startswith("skipped: --max-minutes")]
    return bad


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

    if _on_cpu(args.parser, args.device) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # Triton kernels run on the CPU only under the interpreter, and the flag is read when a kernel is
        # defined: set it before qsa's kernels load, or (qsa already imported, as by `qsa bench`) rerun.
        if "qsa" in sys.modules:
            import subprocess

            path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            return subprocess.call([sys.executable, "-m", "benchmarks.run", *argv],
                                   env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path))
        os.environ["TRITON_INTERPRET"] = "1"
    if str(ROOT / "src") not in sys.path:
        import importlib

        try:
            importlib.import_module("qsa")
        except ImportError:
            sys.path.insert(0, str(ROOT / "src"))
    from qsa.utils import cli_device

    device = str(cli_device(args.parser, args.device or "auto"))
    if torch.device(device).type == "cpu":
        if not args.scenario:  # the GPU-sized scenarios would take hours under the interpreter
            scenarios = registry.select(["tiny-*"])
            print("qsa bench on the CPU: the tiny scenarios (name others with --scenario)", file=sys.stderr)
        if args.out is None:  # the repository's results are the GPU's
            import tempfile

            args.out = Path(tempfile.mkdtemp(prefix="qsa-bench-cpu-"))
        if args.docs is None:
            args.docs = args.out
    args.out = args.out or ROOT / "benchmarks" / "results"
    args.docs = args.docs or ROOT / "docs"
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
        report = sanitize(build_report(suite, started=started, quick=args.quick, complete=complete, argv=argv))
        write_json(latest, report)
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
    if is_cpu(report):  # what the interpreter run measured; the GPU's rates, floors and targets left out
        print("\n" + cpu_text(report))
    else:
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
        write_markdown(report, docs / "benchmarks.md", plot=plot)
    print(f"\nwrote {latest}" + ("" if args.no_docs else f" and {Path(args.docs) / 'benchmarks.md'}"))
    bad = failures(report)
    if bad:
        print(f"qsa bench: {len(bad)} failed or errored: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
