"""``qsa demo``: the tiny QSA model served twice on different page placements, logits compared bitwise.

On the GPU (the default device when there is one) the layers have the reference shape (hidden 2560,
24/2 heads of 256, index 4 x 128, top-512 blocks), prompts are long enough that the selection is
sparse, and decode steps replay a CUDA graph. On the CPU the demo reruns itself with the Triton
interpreter on (``TRITON_INTERPRET=1``; not for ``--route reference``), so the same Triton kernels run
(attention, selection and cache writes), at small sizes (``CPU_DEFAULTS``: about 50 s on two cores):
two requests of 100 and 152 tokens (sparse: each row keeps 16 blocks of 4 tokens and a tail), prefill
chunks of 128 rows (the grouped route), decode steps on xqa. The demo prints
the routes that ran, counted from each step's record (:meth:`qsa.model.serving.GenerationResult.route_steps`).

``--plan-order physical`` adds a demonstration: the same two placements with grouped plans sorted by
physical microblock id instead of logical order, which lets the page placement into the kernel's
accumulation order. On the CPU it takes smaller sizes still, with the selection and cache writes in
PyTorch.

Exit status: 0 when the logical-order logits are bitwise equal across placements, 1 when they differ or
when the two runs came out on the same physical blocks (then the comparison shows nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from ..attention.routing import ROUTES
from ..backend import BACKENDS
from ..selection.api import MAX_K
from ..utils import SEED_MAX, SEED_MIN, cli_device, int_at_least, int_in_range

CPU_DEFAULTS = dict(layers=2, requests=2, prompt_len=100, new_tokens=8, chunk=128, block_size=16, topk=16,
                    dtype="bf16")
CPU_PHYSICAL_DEFAULTS = dict(layers=1, requests=2, prompt_len=96, new_tokens=3, chunk=64, block_size=16,
                             topk=16, dtype="fp16")
GPU_DEFAULTS = dict(layers=4, requests=4, prompt_len=4096, new_tokens=32, chunk=2048, block_size=64, topk=512,
                    dtype="bf16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ProgressBar:
    """A one-line text progress bar (redrawn in place on a terminal, printed once otherwise)."""

    def __init__(self, label: str, width: int = 32, stream=None):
        self.label, self.width = label, width
        self.stream = stream or sys.stdout
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0 = time.perf_counter()

    def line(self, done: int, total: int, note: str = "") -> str:
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        return (f"{self.label:<16s} [{bar}] {done:>3d}/{total:<3d} steps "
                f"{time.perf_counter() - self.t0:6.1f}s {note}").rstrip()

    def update(self, done: int, total: int, note: str = "") -> None:
        if self.tty:
            self.stream.write("\r" + self.line(done, total, note))
            if done == total:
                self.stream.write("\n")
            self.stream.flush()
        elif done == total:
            print(self.line(done, total, note), file=self.stream, flush=True)


def use_interpreter(module: str, argv: list[str]) -> int | None:
    """Make sure the Triton kernels run under the interpreter on a CPU.

    The flag is read when a kernel is defined, and importing ``qsa`` defines some (the cache write, the
    selection), so unless ``TRITON_INTERPRET=1`` was set before, ``python -m module argv`` is rerun with
    it and its exit status returned. Returns None when this process can go on.
    """
    from ..utils import interpreter_enabled

    if interpreter_enabled():
        return None
    return subprocess.call([sys.executable, "-m", module, *argv], env=dict(os.environ, TRITON_INTERPRET="1"))


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device):
    """Run with one intra-op thread on a CPU: the small per-row matmuls of the CPU sizes are faster,
    and far steadier on shared machines, without thread synchronisation."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class RunResult:
    label: str
    seed: int
    order: str
    result: object  # qsa.model.serving.GenerationResult
    blocks: list  # physical blocks of each request, in logical order


def _prompts(n: int, base_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [base_len + (base_len * 9 // 20) * i + 7 * i for i in range(n)]
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lens]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _compare(a, b) -> str:
    la, lb = a.result.logits, b.result.logits
    if _bitwise_equal(la, lb):
        return f"bitwise equal ({la.numel()} logits)"
    diff = (la != lb) & ~(la.isnan() & lb.isnan())
    tok = "same" if a.result.tokens == b.result.tokens else "different"
    return (f"NOT bitwise equal: {int(diff.sum())} of {la.numel()} logits differ, max |diff| "
            f"{float((la - lb).abs().nan_to_num(0).max()):.3g}; greedy tokens {tok}")


def _table(runs: list[RunResult]) -> str:
    head = f"{'run':<4s} {'plan order':<10s} {'alloc seed':>10s} {'first blocks':<18s} " \
           f"{'prefill tok/s':>13s} {'decode tok/s':>12s} {'tokens':>6s}"
    lines = [head, "-" * len(head)]
    for r in runs:
        res = r.result
        blocks = ",".join(str(b) for b in r.blocks[0][:3]) + ",.."
        lines.append(f"{r.label:<4s} {r.order:<10s} {r.seed:>10d} {blocks:<18s} "
                     f"{res.prefill_tokens / max(res.prefill_s, 1e-9):>13.0f} "
                     f"{res.decode_tokens / max(res.decode_s, 1e-9):>12.0f} "
                     f"{res.prefill_tokens + res.decode_tokens:>6d}")
    return "\n".join(lines)


ROUTE_ORDER = ("grouped", "xqa", "splitk", "invariant", "reference")


def routes_run(result) -> str:
    """What a :class:`~qsa.model.serving.GenerationResult`'s steps ran, e.g. ``grouped 4 prefill steps, xqa 2
    prefill steps + 3 decode steps``: for each attention route, the steps in which its kernel ran (from the
    steps' records; a step split between grouped and xqa rows counts for both)."""
    tally = result.route_steps()
    parts = []
    for route in sorted(tally, key=lambda r: (ROUTE_ORDER.index(r) if r in ROUTE_ORDER else len(ROUTE_ORDER), r)):
        counts = [f"{n} {kind} step{'s' * (n != 1)}" for kind, n in tally[route].items() if n]
        parts.append(f"{route} {' + '.join(counts)}")
    return ", ".join(parts) or "none"


def stages_run(result) -> str:
    """How the selection and cache writes ran in a result's steps."""
    names = {"triton": "Triton kernels", "torch": "PyTorch implementations"}
    return " and ".join(names.get(b, b) for b in sorted(result.backends())) or "none"


def _routes_report(runs: list[RunResult]) -> str:
    """The routes and stages that ran, for each run (once when the runs agree)."""
    seen = {(routes_run(r.result), stages_run(r.result)) for r in runs}
    labels = " and ".join(r.label for r in runs)
    if len(seen) == 1:
        (attn, stages), = seen
        return f"routes run (each of runs {labels}): {attn}; selection and cache writes: {stages}"
    return "\n".join(f"routes run (run {r.label}): {routes_run(r.result)}; selection and cache writes: "
                     f"{stages_run(r.result)}" for r in runs)


def _defaults(name: str) -> str:
    return (f" (default {CPU_DEFAULTS[name]} on the CPU, {CPU_PHYSICAL_DEFAULTS[name]} in the CPU physical-order "
            f"demonstration, {GPU_DEFAULTS[name]} on the GPU)")


def parser() -> argparse.ArgumentParser:
    """The command line of ``qsa demo``."""
    p = argparse.ArgumentParser(prog="qsa demo", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda")
    p.add_argument("--route", default="auto", choices=ROUTES,
                   help="attention route: auto, grouped, xqa, splitk, invariant, reference (on the CPU every route "
                   "but reference runs the Triton kernels under the interpreter)")
    p.add_argument("--plan-order", default="logical", choices=("logical", "physical"),
                   help="physical: also run a physical-order plan to show why the order is logical")
    p.add_argument("--layers", type=int_at_least(1), help="QSA layers of the tiny model" + _defaults("layers"))
    p.add_argument("--requests", type=int_at_least(1), help="requests served together" + _defaults("requests"))
    p.add_argument("--prompt-len", type=int_at_least(1),
                   help="length of the first prompt; the others are longer" + _defaults("prompt_len"))
    p.add_argument("--new-tokens", type=int_at_least(1), help="tokens generated per request, the first by the "
                   "prefill and the others by decode steps" + _defaults("new_tokens"))
    p.add_argument("--chunk", type=int_at_least(1), help="prefill tokens per step; from 64 rows a step takes the "
                   "grouped route" + _defaults("chunk"))
    p.add_argument("--backend", choices=BACKENDS, help="selection and cache writes: triton (the kernels) or torch "
                   "(their PyTorch implementations); default triton wherever the attention runs Triton kernels, "
                   "torch in the CPU physical-order demonstration")
    p.add_argument("--block-size", type=int_at_least(4), help="tokens per KV block, a multiple of 4"
                   + _defaults("block_size"))
    p.add_argument("--topk", type=int_in_range(1, MAX_K), help="blocks of 4 tokens each row selects"
                   + _defaults("topk"))
    p.add_argument("--dtype", choices=tuple(DTYPES), help="activations and caches (default bf16; fp16 for the "
                   "CPU physical-order demonstration, whose 10-bit mantissa shows rounding flips more often)")
    p.add_argument("--seed", type=int_in_range(SEED_MIN, SEED_MAX), default=0, help="weights and prompts")
    p.add_argument("--alloc-seeds", type=int, nargs=2, default=(1, 2), metavar=("A", "B"),
                   help="block allocator shuffles of the two runs")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on the GPU")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed first pass that compiles the kernels (skipped under the interpreter)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    if args.block_size is not None and args.block_size % 4:
        p.error(f"--block-size must be a multiple of 4, got {args.block_size}")
    if abs(args.alloc_seeds[0]) == abs(args.alloc_seeds[1]):
        p.error(f"--alloc-seeds must differ in absolute value: {args.alloc_seeds[0]} and {args.alloc_seeds[1]} "
                "shuffle the blocks alike (random.Random seeds with |seed|), and the demo compares two page "
                "placements")

    if args.route == "reference" and args.backend == "triton":
        p.error("--backend triton: the reference route runs no Triton kernel (its selection and cache writes "
                "are the PyTorch implementations)")

    device = cli_device(p, args.device)
    physical_cpu = args.plan_order == "physical" and device.type == "cpu"
    # On the CPU the Triton kernels run under the interpreter, turned on here (a rerun of this command).
    if device.type == "cpu" and args.route != "reference":
        status = use_interpreter("qsa.cli.demo", argv)
        if status is not None:
            return status
    with one_thread_on_cpu(device):
        return _demo(args, device, physical_cpu)


def _demo(args, device: torch.device, physical_cpu: bool) -> int:
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_PHYSICAL_DEFAULTS if physical_cpu else CPU_DEFAULTS
    for name, val in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, val)

    from ..backend import triton_available
    from ..model.serving import Engine, ServingConfig
    from ..model.tiny import TinyConfig, TinyQSAModel
    from ..utils import interpreter_enabled

    no_triton = triton_available(device)
    if no_triton is not None and (args.route not in ("auto", "reference") or args.backend == "triton"):
        what = f"--route {args.route}" if args.route != "auto" else "--backend triton"
        print(f"qsa demo: {what} cannot run: {no_triton}", file=sys.stderr)
        return 2

    base = TinyConfig.reference(vocab_size=4096) if device.type == "cuda" else TinyConfig.small()
    cfg = base.with_attn(index_topk=args.topk, dtype=DTYPES[args.dtype])
    cfg = TinyConfig(cfg.vocab_size, args.layers, cfg.intermediate_size, cfg.attn, args.seed)
    a = cfg.attn
    model = TinyQSAModel(cfg, device=device)
    prompts = _prompts(args.requests, args.prompt_len, cfg.vocab_size, args.seed)
    lens = [len(q) for q in prompts]
    max_len = max(lens) + args.new_tokens
    max_blocks = -(-max_len // args.block_size)
    num_blocks = sum(-(-(n + args.new_tokens) // args.block_size) for n in lens) + 16
    # The reference route reads values on the host: no graph captures it.
    graph = device.type == "cuda" and not args.no_cuda_graph and args.route != "reference"
    backend = args.backend if args.backend is not None else "torch" if physical_cpu else None
    print(f"qsa demo: tiny QSA model on {device}: {args.layers} layer{'s' * (args.layers != 1)}, hidden {a.hidden_size}, "
          f"{a.num_heads}/{a.num_kv_heads} heads x {a.head_dim}, index {a.index_heads} x {a.index_head_dim}, "
          f"top-{a.index_topk} blocks, {str(a.dtype).replace('torch.', '')}")
    print(f"{len(prompts)} requests of {', '.join(map(str, lens))} prompt tokens, {args.new_tokens} new tokens "
          f"each; prefill chunks of {args.chunk}, block size {args.block_size}, {num_blocks} blocks; "
          f"route {args.route}; decode {'in a CUDA graph' if graph else 'eager'}")
    if device.type == "cpu" and interpreter_enabled() and args.route != "reference" and no_triton is None:
        print("the Triton kernels run under the Triton interpreter (slow; hence the small sizes)")

    def run(label, seed, order):
        scfg = ServingConfig(num_blocks=num_blocks, block_size=args.block_size, max_reqs=len(prompts),
                             max_blocks_per_req=max_blocks, chunk_size=args.chunk, route=args.route,
                             plan_order=order, cuda_graph=graph, allocator_seed=seed,
                             backend=backend)
        engine = Engine(model, scfg)
        bar = ProgressBar(f"run {label} {order}")
        blocks = []

        def on_step(done, total, kind):
            if done == total:  # every request holds all of its blocks (they are freed after the last step)
                blocks.extend(engine.allocator.blocks(s) for s in range(len(prompts)))
            bar.update(done, total, kind)

        res = engine.generate(prompts, args.new_tokens, on_step=on_step)
        return RunResult(label, seed, order, res, blocks)

    sa, sb = args.alloc_seeds
    if not (args.no_warmup or interpreter_enabled()):
        run("warm", sa, "logical")
    runs = [run("A", sa, "logical"), run("B", sb, "logical")]
    if args.plan_order == "physical":
        runs += [run("C", sa, "physical"), run("D", sb, "physical")]
    print(_table(runs))
    print(_routes_report(runs[:2]))
    ok = _bitwise_equal(runs[0].result.logits, runs[1].result.logits)
    bad = runs[0].result.logits.isnan().any() or runs[1].result.logits.isnan().any()
    print(f"logical order, placements A vs B: {_compare(runs[0], runs[1])}" + ("  (NaN in logits!)" if bad else ""))
    if args.plan_order == "physical":
        c, d = runs[2], runs[3]
        print(f"physical order (demonstration), placements C vs D: {_compare(c, d)}")
        ran = sorted(set(c.result.route_steps()) | set(d.result.route_steps()))
        if "grouped" not in ran:
            names = " and ".join(ran) or "no"
            print(f"  the physical order only reorders grouped plans; the {names} route{'s' * (len(ran) > 1)} "
                  f"{'have' if len(ran) > 1 else 'has'} none")
        elif _bitwise_equal(c.result.logits, d.result.logits):
            print("  the physical order happened to give the same bits here: the grouped kernel's tile "
                  "sequence changed but no rounding flipped (try more requests or rows)")
        else:
            print("  the kernel accumulated the same pages in an order set by where they sit in memory")
    if runs[0].blocks == runs[1].blocks:
        print(f"INCONCLUSIVE: allocator seeds {sa} and {sb} placed every request on the same physical blocks, "
              "so the runs compared no two placements (try other --alloc-seeds, or more or longer requests)")
        return 1
    if ok and not bad:
        print("OK: logits are bitwise equal across page placements")
        return 0
    print("FAIL: logits differ across page placements with the logical plan order")
    return 1


if __name__ == "__main__":
    sys.exit(main())
