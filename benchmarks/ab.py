"""A/B of two versions of the library on the same workloads, the way docs/performance.md judges a change.

Processes alternate (old, new, old, new, ...): each builds every (scenario, route) workload, checks the
step's output against the fp32 reference (``breakdown.checked_step_fn``: a step that fails stops the
process before anything is timed), captures plan + run (``breakdown.step_fn``) in a CUDA graph
and times the graphs in interleaved rounds with the L2 flushed, as ``qsa bench`` does. The last process
of each version saves its outputs, and the report says for each pair whether the two versions' outputs
are bitwise equal. Results go to ``--out`` as ``ab.json`` and ``ab.md``.

    python -m benchmarks.ab --old-rev HEAD~1 --pairs decode-256:xqa,mtp-8:splitk --out /tmp/ab
    python -m benchmarks.ab --old-src /tmp/old/src --pairs mtp-16:xqa --out /tmp/ab   # a copy made elsewhere
    python -m benchmarks.ab --old-rev HEAD~1 --pairs mtp-8:xqa-unsorted --out /tmp/ab   # no rows_sorted hint

``--old-rev`` extracts ``src/`` of a commit with ``git archive``; where the repository is not at hand (a
copy of the working tree without ``.git``), extract it beforehand and pass ``--old-src``. ``--new-src``
defaults to this checkout's ``src/``. Both versions run this checkout's ``benchmarks`` (scenarios, timing,
reference): only the library changes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``"decode-256:xqa,mtp-8:splitk"`` -> ``[("decode-256", "xqa"), ("mtp-8", "splitk")]``."""
    from .registry import BY_NAME

    pairs = []
    for item in text.split(","):
        name, sep, route = item.strip().partition(":")
        if not sep or not route:
            raise ValueError(f"--pairs entries are scenario:route, got {item!r}")
        if name not in BY_NAME:
            raise ValueError(f"unknown scenario {name!r}")
        if BY_NAME[name].kind != "attention":
            raise ValueError(f"{name!r} is not an attention scenario")
        pairs.append((name, route))
    return pairs


def worker(tag: str, pairs: list[tuple[str, str]], rounds: int, save: str | None) -> dict:
    """One process's measurements: ``{"tag", "qsa": its package path, "pairs": {pair: {...}}}``."""
    import torch

    import qsa

    from .baselines import reference_attention_fp32
    from .breakdown import checked_step_fn
    from .generators import attention_workload
    from .registry import BY_NAME
    from .timing import Timer

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(dev)
    steps = {}
    workloads = {}
    for name, route in pairs:
        scn = BY_NAME[name]
        if name not in workloads:
            w = attention_workload(scn, dev)
            workloads[name] = (w, reference_attention_fp32(w.q, *w.args, **w.cache_kwargs))
        w, ref = workloads[name]
        fn, out, err = checked_step_fn(scn, w, route, ref, what=f"{tag} ")  # nothing wrong is timed
        # A graph replays the addresses it captured: the closure (workload, plan, out) must stay alive.
        steps[(name, route)] = dict(fn=fn, out=out, err=err, graph=timer.capture(fn) if timer.is_cuda else None)
    times = {key: [] for key in steps}
    for _ in range(rounds):
        for key, s in steps.items():
            t = timer._time_replays(s["graph"]) if s["graph"] is not None else timer.time(s["fn"], graph=False)
            times[key].append(t.median_ms * 1e3)
    if save:
        os.makedirs(save, exist_ok=True)
        for (name, route), s in steps.items():
            torch.save(s["out"].cpu(), os.path.join(save, f"{name}.{route}.pt"))
    return dict(tag=tag, qsa=os.path.dirname(qsa.__file__),
                pairs={f"{n}:{r}": dict(us=times[(n, r)], **s["err"]) for (n, r), s in steps.items()})


def extract(rev: str, into: str) -> str:
    """``src/`` of commit ``rev`` under ``into``; returns the path of that ``src``."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "src")


def bitwise_equal(old_dir: str, new_dir: str, pairs) -> dict:
    """For each pair, whether the saved outputs of the two versions are the same bits."""
    import torch

    def bits(t):
        return t.contiguous().view(torch.uint8)  # NaN bits compare equal too

    out = {}
    for name, route in pairs:
        a = torch.load(os.path.join(old_dir, f"{name}.{route}.pt"))
        b = torch.load(os.path.join(new_dir, f"{name}.{route}.pt"))
        out[f"{name}:{route}"] = a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    return out


def summarize(runs: list[dict], equal: dict) -> list[dict]:
    """Per pair: each version's timings (all rounds of all its processes), their median and range, and the
    largest relative L2 error any process measured."""
    rows = []
    for key in runs[0]["pairs"]:
        row = dict(pair=key, bitwise_equal=equal.get(key))
        for tag in ("old", "new"):
            us = [t for r in runs if r["tag"] == tag for t in r["pairs"][key]["us"]]
            errs = [r["pairs"][key]["rel_l2_err"] for r in runs if r["tag"] == tag]
            row[tag] = dict(us=us, median_us=statistics.median(us), min_us=min(us), max_us=max(us),
                            rel_l2_err=max(errs))
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# A/B {meta['old']} -> {meta['new']}", "",
             f"{meta['device']}, {meta['date']}; {meta['alternations']} alternations of processes, "
             f"{meta['rounds']} rounds each; plan + run, CUDA-graph replays, L2 flushed (us).", "",
             "| pair | old | new | new / old | bitwise equal | rel. L2 error old / new |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        o, n = r["old"], r["new"]
        lines.append(f"| {r['pair']} | {o['min_us']:.2f}-{o['max_us']:.2f} | {n['min_us']:.2f}-{n['max_us']:.2f} | "
                     f"{n['median_us'] / o['median_us']:.3f} | {r['bitwise_equal']} | "
                     f"{o['rel_l2_err']:.2e} / {n['rel_l2_err']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", required=True, help="scenario:route,... (attention scenarios)")
    old = ap.add_mutually_exclusive_group()
    old.add_argument("--old-rev", help="commit whose src/ is the old version (git archive)")
    old.add_argument("--old-src", help="directory holding the old version's qsa package")
    ap.add_argument("--new-src", default=os.path.join(ROOT, "src"))
    ap.add_argument("--alternations", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    pairs = parse_pairs(args.pairs)
    if args.worker:
        print("AB " + json.dumps(worker(args.worker, pairs, args.rounds, args.save)), flush=True)
        return 0
    if not (args.old_rev or args.old_src):
        ap.error("give --old-rev or --old-src")
    if args.alternations < 1 or args.rounds < 1:
        ap.error("--alternations and --rounds must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        old_src = args.old_src or extract(args.old_rev, tmp)
        runs = []
        for i in range(args.alternations):
            for tag, src in (("old", old_src), ("new", args.new_src)):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), ROOT]))
                save = os.path.join(tmp, tag) if i == args.alternations - 1 else None
                cmd = [sys.executable, "-m", "benchmarks.ab", "--worker", tag, "--pairs", args.pairs,
                       "--rounds", str(args.rounds)] + (["--save", save] if save else [])
                res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                line = [ln for ln in res.stdout.splitlines() if ln.startswith("AB ")]
                if res.returncode != 0 or not line:
                    sys.stderr.write(res.stdout[-4000:] + res.stderr[-4000:])
                    raise SystemExit(f"the {tag} process failed (exit {res.returncode})")
                run = json.loads(line[-1][3:])
                if os.path.abspath(run["qsa"]) != os.path.abspath(os.path.join(src, "qsa")):
                    raise SystemExit(f"the {tag} process imported qsa from {run['qsa']}, not from {src}")
                runs.append(run)
                print(f"{tag} {i + 1}: " + ", ".join(f"{k} {min(v['us']):.2f} us" for k, v in run["pairs"].items()),
                      flush=True)
        equal = bitwise_equal(os.path.join(tmp, "old"), os.path.join(tmp, "new"), pairs)
    import torch

    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), old=args.old_rev or args.old_src,
                new=args.new_src, alternations=args.alternations, rounds=args.rounds, pairs=args.pairs)
    rows = summarize(runs, equal)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(dict(**meta, rows=rows, runs=runs), f, indent=1)
    text = markdown(rows, meta)
    with open(os.path.join(args.out, "ab.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
