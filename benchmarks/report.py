"""Reports of a benchmark run: the targets, ``latest.json``, the text and Markdown tables, the plot."""

from __future__ import annotations

import datetime
import fnmatch
import json
import math
import os
import platform
import re
from pathlib import Path

SCHEMA_VERSION = 1


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
    # worst cases over several scenarios (host_cost_targets): the "scenario" column names the set; the
    # evaluated target names the scenario (and route) of the worst case
    ("eager-host-plan-run-us", "host-cost steps", "<=", 30.0, "us",
     "worst host time to enqueue one sparse_paged_attention call (plan + run), auto and forced routes"),
    ("eager-host-run-us", "host-cost steps", "<=", 15.0, "us",
     "worst host time of one run_attention call on a held plan, auto and forced routes"),
    ("eager-over-graph-us", "host-cost steps", "<=", 20.0, "us",
     "worst (eager call - CUDA-graph replay) time of one plan + run step, auto and forced routes"),
    ("auto-vs-best-route", "attention scenarios", "<=", 1.05, "x",
     "worst auto time / fastest forced route (grouped, xqa, splitk) time, the worse of graph and eager"),
)

HOST_COST_STEPS = ("decode-1", "decode-16", "decode-64*", "decode-256", "mtp-*", "mixed-185", "chunk-2048",
                   "prefill-64k-o80*")
"""The steps of the host-cost goal (globs over scenario names): the eager and host targets take their
worst case over the scenarios of this set that a run measured."""
HOST_COST_ROUTES = ("auto", "grouped", "xqa", "splitk", "invariant")
"""Routes whose eager and host figures the host-cost targets take."""
AUTO_RIVALS = ("grouped", "xqa", "splitk")
"""The forced routes ``auto`` chooses among, against whose fastest ``auto-vs-best-route`` measures it
(``invariant`` is never auto's choice: its promise, not its speed, is why a caller forces it)."""
HOST_TARGETS = ("eager-host-plan-run-us", "eager-host-run-us", "eager-over-graph-us", "auto-vs-best-route")

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


def _in_steps(scenario: str) -> bool:
    return any(fnmatch.fnmatchcase(scenario, p) for p in HOST_COST_STEPS)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def host_cost_values(records: list) -> dict:
    """The values of the host-cost targets (``HOST_TARGETS``) from a run's records: ``{name: (value,
    scenario, route, note)}``, value None where nothing was measured.

    * ``eager-host-plan-run-us``, ``eager-host-run-us``, ``eager-over-graph-us``: the largest
      ``host_us``, ``host_run_us`` and ``(eager_ms - median_ms) * 1000`` over the passed records of the
      ``HOST_COST_ROUTES`` on the scenarios matching ``HOST_COST_STEPS``;
    * ``auto-vs-best-route``: over every scenario with an ``auto`` record, the larger of auto's graph
      median over the fastest passed ``AUTO_RIVALS`` graph median and the same ratio of the eager
      times (where both sides have one); the largest such ratio.

    A record of those routes that failed its check or errored is not counted, and the note names it.
    """
    per = {name: [] for name in HOST_TARGETS}  # (value, scenario, route)
    skipped = {name: [] for name in HOST_TARGETS}
    for r in records:
        if r.get("route") not in HOST_COST_ROUTES or not _in_steps(r.get("scenario", "")):
            continue
        where = (r["scenario"], r["route"])
        if not r.get("passed"):
            for name in HOST_TARGETS[:3]:
                skipped[name].append(where)
            continue
        if _num(r.get("host_us")):
            per["eager-host-plan-run-us"].append((r["host_us"], *where))
        if _num(r.get("host_run_us")):
            per["eager-host-run-us"].append((r["host_run_us"], *where))
        if _num(r.get("eager_ms")) and _num(r.get("median_ms")):
            per["eager-over-graph-us"].append(((r["eager_ms"] - r["median_ms"]) * 1e3, *where))
    for auto in (r for r in records if r.get("route") == "auto"):
        scn = auto["scenario"]
        rivals = [r for r in records if r.get("scenario") == scn and r.get("route") in AUTO_RIVALS
                  and r.get("passed")]
        best_graph = min((r["median_ms"] for r in rivals if _num(r.get("median_ms"))), default=None)
        best_eager = min((r["eager_ms"] for r in rivals if _num(r.get("eager_ms"))), default=None)
        if not auto.get("passed") or not _num(auto.get("median_ms")) or not best_graph:
            skipped["auto-vs-best-route"].append((scn, "auto"))
            continue
        ratios = [auto["median_ms"] / best_graph]
        if _num(auto.get("eager_ms")) and best_eager:
            ratios.append(auto["eager_ms"] / best_eager)
        per["auto-vs-best-route"].append((max(ratios), scn, "auto"))
    out = {}
    for name in HOST_TARGETS:
        miss = skipped[name]
        why = "auto failed or errored, or no forced route passed" if name == "auto-vs-best-route" \
            else "failed or errored"
        note = (f"not counted ({why}): {', '.join(f'{s}:{r}' for s, r in miss[:6])}{' ...' if len(miss) > 6 else ''}" if miss else "")
        if not per[name]:
            out[name] = (None, None, None, note or "not measured (no scenario of the set run, or no eager and "
                                                   "host figures: they need a CUDA GPU)")
            continue
        value, scn, route = max(per[name], key=lambda x: x[0])
        counted = len(per[name])
        what = f"worst: {scn} {route}, of {counted} {'scenarios' if name == 'auto-vs-best-route' else 'records'}"
        out[name] = (value, scn, route, what + (f"; {note}" if note else ""))
    return out


def host_cost_targets(records: list) -> list:
    """The host-cost targets (``HOST_TARGETS``) as entries of the ``targets`` list, each met when its
    worst case is within its goal: a pure function of the records (``host_cost_values``)."""
    values = host_cost_values(records)
    out = []
    for name, scn, op, goal, unit, what in TARGETS:
        if name not in values:
            continue
        value, worst, route, note = values[name]
        met = None if value is None else bool(value >= goal if op == ">=" else value <= goal)
        out.append(dict(name=name, value=value, goal=goal, op=op, unit=unit, met=met, scenario=worst or scn,
                        route=route, what=what, note=note))
    return out


def evaluate_targets(records: list, scenarios: dict, ceilings: dict | None) -> list:
    """The ``targets`` list: ``{name, value, goal, op, unit, met, scenario, what, note}`` (the host-cost
    targets add ``route``, that of their worst case).

    ``met`` is None when the value could not be measured (scenario not run, a route failed its check
    or errored); ``note`` says why.
    """
    out = []
    host = {t["name"]: t for t in host_cost_targets(records)}
    for name, scn, op, goal, unit, what in TARGETS:
        if name in host:
            out.append(host[name])
            continue
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
        if value is not None and not math.isfinite(value):
            value, note = None, "not measured (the value is not finite)"
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
# files and tables


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


def device_info(device) -> dict:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return dict(name=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1))
    return dict(name="cpu", capability=None, sm_count=os.cpu_count(), memory_gib=None, cores=os.cpu_count(),
                processor=_cpu_model(), triton_interpreter=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def is_cpu(report: dict) -> bool:
    """Whether ``report`` is of a run on the CPU (the Triton kernels under the interpreter)."""
    return report.get("device") == "cpu"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def build_report(suite, *, started: datetime.datetime, quick: bool, complete: bool, argv) -> dict:
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
        targets=(cpu_targets() if info["name"] == "cpu"
                 else evaluate_targets(suite.records, suite.scenarios, suite.ceilings)),
        fatal_error=suite.fatal,
    )


CPU_TARGET_NOTE = "needs a CUDA GPU (an H200 goal): not evaluated on the CPU"


def cpu_targets() -> list:
    """The ``targets`` list of a CPU run: every target unmeasured, with why. Its goals are H200 times at
    GPU sizes, and the CPU runs tiny scenarios under the Triton interpreter."""
    return [dict(name=name, value=None, goal=goal, op=op, unit=unit, met=None, scenario=scn, what=what,
                 note=CPU_TARGET_NOTE)
            for name, scn, op, goal, unit, what in TARGETS]


def write_json(path: Path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def sanitize(obj):
    """JSON has no inf/NaN: write them as strings."""
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj


RESULT_COLUMNS = ("scenario", "route", "ms", "eager ms", "host us", "host run us", "TFLOP/s", "GB/s", "x splitk",
                  "max abs", "rel L2", "check")


def route_label(r: dict, rows: int | None = None) -> str:
    """A record's route as the tables show it: ``auto`` with the route it took (``rows``: the scenario's
    rows), e.g. ``auto (xqa direct)``, ``auto (grouped 184 + xqa 1)``; other routes by name."""
    if r.get("route") != "auto" or not r.get("plan_route"):
        return r["route"]
    took, g, direct = r["plan_route"], r.get("grouped_rows") or 0, " direct" if r.get("direct") else ""
    if took == "grouped" and rows != g:
        took = f"grouped {g} + xqa{'' if rows is None else f' {rows - g}'}{direct}"
    elif took == "xqa":
        took += direct
    return f"auto ({took})"


def _rows_of(report: dict) -> dict:
    return {s["name"]: s.get("rows") for s in report.get("scenarios") or []}


def result_rows(report: dict) -> list:
    rows = []
    n_rows = _rows_of(report)
    for r in report["records"]:
        ratio = r.get("vs_splitk") if r.get("vs_splitk") is not None else r.get("vs_torch")
        if r["kind"] == "floor":
            check = "model"
        elif r.get("error") and not r.get("passed"):
            check = "FAIL" if r.get("max_abs_err") is not None or r.get("rows_differ") else "ERROR"
        else:
            check = {True: "ok", False: "FAIL", None: "-"}[r.get("passed")]
        rows.append((r["scenario"], route_label(r, n_rows.get(r["scenario"])), _fmt(r.get("median_ms"), ".4g"),
                     _fmt(r.get("eager_ms"), ".4g"), _fmt(r.get("host_us"), ".1f"), _fmt(r.get("host_run_us"), ".1f"),
                     _fmt(r.get("tflops"), ".1f"),
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


def target_value(value, goal) -> str:
    """A target's value to 3 significant digits, or as many more (up to 6) as it takes not to print a
    value that misses its goal as the goal itself (0.7995 against 0.8 prints 0.7995, not 0.8)."""
    text = _fmt(value, ".3g")
    if isinstance(value, float) and value != goal:
        for digits in (4, 5, 6):
            if text != format(goal, ".6g"):
                break
            text = _fmt(value, f".{digits}g")
    return text


def target_rows(report: dict) -> list:
    return [(t["name"], target_value(t["value"], t["goal"]), f"{t['op']} {t['goal']:g} {t['unit']}",
             {True: "yes", False: "NO", None: "not measured"}[t["met"]], t.get("note") or "")
            for t in report["targets"]]


def scenario_rows(report: dict) -> list:
    return [(s["name"], s["description"], _fmt(s.get("overlap"), ".3f"), _fmt(s.get("avg_union_per_group"), ".0f"),
             _fmt(s.get("sharing"), ".2f"), _fmt(s.get("elapsed_s"), ".1f"),
             (s.get("error") or "").splitlines()[0][:120] if s.get("error") else "")
            for s in report["scenarios"]]


SCENARIO_COLUMNS = ("scenario", "workload", "overlap", "avg union / group (microblocks)", "sharing", "s", "error")
TARGET_COLUMNS = ("target", "value", "goal", "met", "note")


# ------------------------------------------------------------------------------------------------
# the CPU report: what a run under the Triton interpreter measured, without the GPU's rates and targets


CPU_RESULT_COLUMNS = ("scenario", "route", "median ms", "min ms", "max ms", "calls", "max abs (bound)",
                      "rel L2 (bound)", "eager ms", "host us", "host run us", "check", "note")


def _check(r: dict) -> str:
    if r.get("error") and not r.get("passed"):
        return "FAIL" if r.get("max_abs_err") is not None or r.get("rows_differ") else "ERROR"
    return {True: "ok", False: "FAIL", None: "-"}[r.get("passed")]


def _err_and_bound(err, bound) -> str:
    if err is None:
        return "-"
    return _fmt(err, ".2e") + ("" if bound is None else f" ({_fmt(bound, '.2e')})")


def cpu_result_rows(report: dict) -> list:
    """The measured records of a CPU run: times (wall-clock, with the number of calls) and each check.

    Floors are left out (models built on the CPU's copy and matmul rates), and so are the rates and the
    ratios between routes: under the interpreter they measure the interpreter."""
    rows = []
    n_rows = _rows_of(report)
    for r in report["records"]:
        if r["kind"] == "floor":
            continue
        check = _check(r)
        if "exact" in r and r.get("passed"):  # selection: against the exact top-k
            check += " (exact)" if r.get("exact") else " (up to ties)"
        note = (str(r["error"]).splitlines() or [""])[0][:100] if r.get("error") else ""
        rows.append((r["scenario"], route_label(r, n_rows.get(r["scenario"])), _fmt(r.get("median_ms"), ".4g"),
                     _fmt(r.get("min_ms"), ".4g"), _fmt(r.get("max_ms"), ".4g"), _fmt(r.get("reps")),
                     _err_and_bound(r.get("max_abs_err"), r.get("bound_abs")),
                     _err_and_bound(r.get("rel_l2_err"), r.get("bound_rel")), _fmt(r.get("eager_ms"), ".4g"),
                     _fmt(r.get("host_us"), ".0f"), _fmt(r.get("host_run_us"), ".0f"), check, note))
    return rows


def cpu_summary(report: dict) -> list:
    """Lines that say what a CPU run was: the device, the versions, how it timed and checked, the targets."""
    d = report.get("device_info") or {}
    v = report.get("versions") or {}
    c = report.get("ceilings") or {}
    interp = d.get("triton_interpreter")
    reps = sorted({r["reps"] for r in report["records"] if r.get("reps")})
    calls = "/".join(str(n) for n in reps) or "-"
    passed = [r for r in report["records"] if r["kind"] in ("route", "baseline") and r.get("passed")]
    checked = [r for r in report["records"] if r["kind"] in ("route", "baseline")]
    lines = [
        f"device: cpu ({d.get('cores') or d.get('sm_count') or '?'} cores"
        f"{', ' + d['processor'] if d.get('processor') else ''}), Triton interpreter "
        f"{'on' if interp else 'off' if interp is not None else '-'}; python {v.get('python')}, torch "
        f"{v.get('torch')}, triton {v.get('triton')}, qsa {v.get('qsa')}",
        f"scenarios run: {len(report['scenarios'])}; routes and baselines checked: {len(passed)} of "
        f"{len(checked)} passed (attention against the fp32 reference within the bounds shown, selection "
        "against the exact top-k), each timed only after it passed",
        f"times: wall-clock medians of {calls} calls under the Triton interpreter (the eager and host columns "
        "too, of a few calls); they measure the interpreter, not the kernels' speed on a GPU",
    ]
    if c.get("copy_gbps") and c.get("matmul_tflops"):
        shape = "x".join(str(n) for n in c.get("matmul_shape") or [])
        lines.append(f"ceilings measured: copy {_fmt(c['copy_gbps'], '.3g')} GB/s, fp16 matmul "
                     f"{_fmt(c['matmul_tflops'] * 1e3, '.3g')} GFLOP/s{' at ' + shape if shape else ''} (the "
                     "GPU report's floors, built on them, are left out)")
    lines.append(f"targets: the {len(TARGETS)} targets of benchmarks/README.md are H200 goals at GPU sizes and "
                 "need a CUDA GPU; not evaluated on the CPU")
    return lines


def cpu_text(report: dict) -> str:
    """The text report of a CPU run (``qsa bench`` prints it at the end)."""
    return "\n\n".join(["\n".join(cpu_summary(report)), text_table(SCENARIO_COLUMNS, scenario_rows(report)),
                        text_table(CPU_RESULT_COLUMNS, cpu_result_rows(report))])


def _cpu_markdown(report: dict) -> list:
    summary = cpu_summary(report)
    return [
        "# Benchmarks (CPU)",
        "",
        f"Generated by `qsa bench` (`benchmarks/run.py`) on **cpu**, {report['date']}"
        f"{' (`--quick`)' if report['quick'] else ''}{'' if report['complete'] else ' (incomplete run)'}: the "
        "tiny scenarios, the Triton kernels under the interpreter. Definitions of the columns: "
        "`benchmarks/README.md`.",
        "",
        *[f"- {line}" for line in summary[:-1]],
        "",
        "## Targets",
        "",
        f"The {len(TARGETS)} targets (`benchmarks/README.md`) are H200 goals at GPU sizes and need a CUDA GPU: "
        "they are not evaluated on the CPU.",
        "",
        "## Scenarios",
        "",
        md_table(SCENARIO_COLUMNS, scenario_rows(report)),
        "",
        "## Results",
        "",
        "Times in ms, wall-clock; `max abs` and `rel L2`: errors against the fp32 reference, with the bounds "
        "a route must stay within in parentheses; `eager ms`, `host us`, `host run us`: one eager plan + run "
        "call, the host time of one `sparse_paged_attention` call and of one `run_attention` call on a held "
        "plan (`auto` and the qsa routes).",
        "",
        md_table(CPU_RESULT_COLUMNS, cpu_result_rows(report)),
        "",
    ]


RESULTS_NOTE = ("`qsa bench` rewrites this file and `benchmarks/results/latest.json` on every run; earlier runs "
                "are in their git history (`git log -p -- benchmarks/results/latest.json`), not in dated copies.")


def _routes_of(report: dict, kinds) -> list:
    """The routes of ``report``'s records of the given kinds, in the order they first appear."""
    return list(dict.fromkeys(r["route"] for r in report["records"] if r["kind"] in kinds))


def suite_lines(report: dict) -> list:
    """What the run measured and how (the section "The suite" of ``benchmarks.md``), from the report."""
    d, v = report.get("device_info") or {}, report.get("versions") or {}
    kinds = {}
    for s in report["scenarios"]:
        kinds.setdefault(s["kind"], []).append(s["name"])
    counted = ", ".join(f"{len(names)} {kind}" for kind, names in kinds.items())
    attention = [s for s in report["scenarios"] if s["kind"] == "attention"]
    shapes = sorted({f"{s['num_q_heads']}/{s['num_kv_heads']}/{s['head_dim']} {s.get('dtype')}"
                     + (f" ({s['kv_cache_dtype']} cache)" if s.get("kv_cache_dtype") not in (None, "auto") else "")
                     for s in attention if s.get("num_q_heads")})
    records = [r for r in report["records"] if r["kind"] in ("route", "baseline")]
    passed = [r for r in records if r.get("passed")]
    hw = ", ".join(x for x in (f"sm {d['capability']}" if d.get("capability") else "",
                               f"{d['sm_count']} SMs" if d.get("sm_count") else "",
                               f"{d['memory_gib']} GiB" if d.get("memory_gib") else "") if x)
    return [
        f"- **Device and versions**: {report['device']}{f' ({hw})' if hw else ''}; python {v.get('python')}, "
        f"torch {v.get('torch')}, Triton {v.get('triton')}, qsa {v.get('qsa')}.",
        f"- **Scenarios**: {len(report['scenarios'])} ({counted}){'; the `--quick` set' if report['quick'] else ''}"
        f"{'; attention shapes (Hq/Hkv/D, dtype) ' + ', '.join(shapes) if shapes else ''}. `qsa bench --list` "
        "names them, `benchmarks/README.md` defines their workloads.",
        f"- **Routes**: {', '.join(f'`{r}`' for r in _routes_of(report, ('route',)))}; baselines "
        f"{', '.join(f'`{r}`' for r in _routes_of(report, ('baseline',)))}; components "
        f"{', '.join(f'`{r}`' for r in _routes_of(report, ('component',))) or '-'}; floors (models, not timed) "
        f"{', '.join(f'`{r}`' for r in _routes_of(report, ('floor',))) or '-'}.",
        "- **Method**: each route runs once eagerly and is checked (attention against the fp32 reference, within "
        "twice the naive PyTorch result's error plus one rounding; selection against the exact top-k) before it "
        "is timed; a route that fails gets no time. Times are medians of CUDA-graph replays with the L2 flushed "
        "before each (`do_bench` for code that cannot be captured); grouped, xqa and splitk times include their "
        "planners. `auto` is the route the library picks (the one it took in parentheses). Beside the graph "
        "median, for `auto` and the qsa routes: `eager ms`, one eager plan + run call (L2 flushed, device idle "
        "before it); `host us`, the host time to enqueue one `sparse_paged_attention` call; `host run us`, one "
        f"`run_attention` on a held plan; these three are timed after the scenario's graph times, in rounds that "
        f"interleave its routes. Checked: {len(passed)} of {len(records)} routes and baselines passed.",
        "- **Rerun**: `qsa bench` (or `PYTHONPATH=src python -m benchmarks.run`) from the checkout root on the GPU; "
        "`--quick` for the key targets, `-s GLOB` / `-r GLOB` for some scenarios or routes. The tools beyond the "
        "suite (sweeps, floors, A/B, per-kernel breakdown): `benchmarks/README.md`; where each route stands and "
        "why: `docs/performance.md`.",
    ]


def write_markdown(report: dict, path: Path, *, plot: Path | None):
    """``benchmarks.md`` of a run (of a CPU run: what it measured, without the GPU's rates and targets)."""
    c = report.get("ceilings") or {}
    lines = _cpu_markdown(report) if is_cpu(report) else [
        "# Benchmarks",
        "",
        f"The results of the latest run of `qsa bench` (`benchmarks/run.py`): **{report['device']}**, "
        f"{report['date']}{' (`--quick`)' if report['quick'] else ''}"
        f"{'' if report['complete'] else ' (incomplete run)'}. " + RESULTS_NOTE,
        "",
        "## The suite",
        "",
        *suite_lines(report),
        "",
        f"Ceilings measured in this run: copy **{_fmt(c.get('copy_gbps'), '.0f')} GB/s** (bytes read + "
        f"written), fp16 matmul **{_fmt(c.get('matmul_tflops'), '.0f')} TFLOP/s**. Definitions of every column: "
        "`benchmarks/README.md`.",
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
        "`ms`: median CUDA-graph replay; `eager ms`: median eager plan + run call; `host us` / `host run us`: "
        "median host time of one `sparse_paged_attention` / `run_attention` call. `x splitk`: splitk time / "
        "route time (selection: torch baseline time / route time). Floors: bytes the route must read at the "
        "copy bandwidth, useful FLOPs at the matmul rate.",
        "",
        md_table(RESULT_COLUMNS, result_rows(report)),
        "",
    ]
    if plot is not None:
        lines += [f"![time per route per scenario]({os.path.relpath(plot, path.parent)})", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


PLOT_ROUTES = ("grouped", "xqa", "splitk", "invariant", "auto", "naive", "floor-bytes-grouped", "floor-bytes-row", "floor-flops",
               "select", "torch-select")


def write_plot(report: dict, path: Path) -> str | None:
    """Bar chart of time per route per scenario (log scale); returns a note when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib missing: skip the plot
        return f"plot skipped: matplotlib not importable ({type(e).__name__})"
    recs = [r for r in report["records"] if r.get("median_ms") and r["route"] in PLOT_ROUTES
            and not (is_cpu(report) and r["kind"] == "floor")]  # a CPU's floors mean nothing
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
