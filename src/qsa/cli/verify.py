"""``qsa verify``: replay one step of a QSA layer under the determinism contract (docs/spec.md section 7).

A step's inputs are captured from the tiny model served by :class:`qsa.model.serving.Engine` (a mixed step:
one request's prefill chunk next to another's first chunk, so both the grouped and the single-row
route run), or loaded from a file written by ``--save``. The selection and the attention are then
replayed and compared bit for bit:

* repeat -- the same inputs again;
* relocation -- N random moves of the physical pages (same-size permutations, a cache twice as
  large, collision-prone ids), the K/V cache and the compressed-key cache moved together;
* permuted index order -- the entries of every row of ``indices`` shuffled;
* CUDA-graph replay (GPU only) -- selection + plan + attention captured once, replayed on the original
  and on relocated data;
* batch invariance (``--route invariant`` only) -- the attention of sub-batches of the step (rows alone, the
  first half, the rows in reverse order) against the same rows of the whole step;
* and, for scale, the output against the fp64 reference (within twice PyTorch's own error).

The attention replays use the step's own selection; the selection itself is replayed (and rows'
indices shuffled) on all rows on the GPU and on a spread of ``--sample`` rows on the CPU, where the
kernels run under the Triton interpreter (turned on here) with small sizes. Exit status 1 when any
replay differs by a single bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import MISSING, asdict, dataclass, fields

import torch

from ..attention.routing import ROUTES
from ..utils import (SEED_MAX, SEED_MIN, as_finite_float, check_int, check_tensor, cli_device, int_at_least,
                    int_in_range)

CPU_STEP = dict(prompts=(200, 136), chunk=76, step=2, block_size=16)
GPU_STEP = dict(prompts=(6000, 3000), chunk=2052, step=2, block_size=64)
CPU_SAMPLE = 12
"""Rows of the CPU step whose selection is replayed and whose indices are shuffled."""
SAMPLE_ROWS = 96
"""Rows compared with the (slow, loop-based) fp64 reference."""


@dataclass
class StepInputs:
    """One layer's step: what the selection and the attention read.

    Attributes:
        q, gate: ``[rows, Hq, D]``; iq: ``[rows, index_heads, index_head_dim]``.
        kv: ``[num_blocks, 2, block_size, Hkv, D]`` cache after the step's write.
        kc: ``[num_blocks, block_size // 4, index_head_dim]`` compressed keys after the step.
        block_table, token_to_req, positions, seq_lens: the step's metadata.
        indices: ``[rows, 4 * index_topk + 3]`` int32 the layer's selection in that step.
        index_topk, kv_cache_dtype, k_scale, v_scale: the layer's settings.
    """

    q: torch.Tensor
    gate: torch.Tensor
    iq: torch.Tensor
    kv: torch.Tensor
    kc: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    indices: torch.Tensor
    index_topk: int
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    @classmethod
    def from_capture(cls, cap: dict) -> "StepInputs":
        cfg = cap["config"]
        return cls(cap["q"].contiguous(), cap["gate"].contiguous(), cap["iq"].contiguous(), cap["kv"], cap["kc"],
                   cap["block_table"], cap["token_to_req"], cap["positions"], cap["seq_lens"],
                   cap["indices"], cfg.index_topk, cfg.kv_cache_dtype, cfg.k_scale, cfg.v_scale)

    def to(self, device) -> "StepInputs":
        d = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in asdict(self).items()}
        return StepInputs(**d)

    def save(self, path: str) -> None:
        torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in asdict(self).items()}, path)

    @classmethod
    def load(cls, path: str) -> "StepInputs":
        """The step saved at ``path`` by :meth:`save`.

        Raises:
            ValueError, TypeError: ``path`` does not hold such a step (naming what is missing or wrong).
        """
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a file torch.load cannot read fails in many ways (pickle, zip, EOF, ...)
            detail = (str(e).strip().splitlines() or [""])[0][:200]
            raise ValueError(f"not a step saved with --save: torch.load failed ({type(e).__name__}"
                             f"{': ' + detail if detail else ''})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data) -> "StepInputs":
        """A step from the mapping :meth:`save` writes, its fields checked (ValueError/TypeError naming
        the field)."""
        if not isinstance(data, dict):
            raise TypeError(f"a saved step must be a dict of the StepInputs fields, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        unknown = sorted(str(k) for k in data if k not in names)
        if missing or unknown:
            raise ValueError("a saved step must hold the StepInputs fields: "
                             + "; ".join(f"{w} {', '.join(ks)}" for w, ks in (("missing", missing),
                                                                               ("unknown", unknown)) if ks))
        for name, ndim, what in (("q", 3, "[rows, Hq, D]"), ("gate", 3, "[rows, Hq, D]"),
                                 ("iq", 3, "[rows, index_heads, index_head_dim]"),
                                 ("kv", 5, "[num_blocks, 2, block_size, Hkv, D]"),
                                 ("kc", 3, "[num_blocks, block_size // 4, index_head_dim]"),
                                 ("block_table", 2, "[num_reqs, max_blocks]"), ("token_to_req", 1, "[rows]"),
                                 ("positions", 1, "[rows]"), ("seq_lens", 1, "[num_reqs]"),
                                 ("indices", 2, "[rows, 4 * index_topk + 3]")):
            check_tensor(name, data[name], ndim=ndim, what=what)
        rows = data["q"].shape[0]
        for name in ("gate", "iq", "token_to_req", "positions", "indices"):
            if data[name].shape[0] != rows:
                raise ValueError(f"{name} must have {rows} rows (as q), got shape {tuple(data[name].shape)}")
        check_int("index_topk", data["index_topk"], 1)
        if not isinstance(data.get("kv_cache_dtype", "auto"), str):
            raise TypeError(f"kv_cache_dtype must be a str, got {type(data['kv_cache_dtype']).__name__}")
        for name in ("k_scale", "v_scale"):
            if name in data:
                as_finite_float(name, data[name])
        return cls(**data)

    @property
    def rows(self) -> int:
        return self.q.shape[0]


def capture_step(device, *, seed: int = 0, build_route: str | None = None) -> StepInputs:
    """Serve the tiny model (one layer) until a mixed prefill step and capture that step's inputs."""
    from ..model.serving import Engine, ServingConfig
    from ..model.tiny import TinyConfig, TinyQSAModel

    device = torch.device(device)
    spec = GPU_STEP if device.type == "cuda" else CPU_STEP
    base = TinyConfig.reference(vocab_size=4096) if device.type == "cuda" else TinyConfig.small()
    cfg = TinyConfig(base.vocab_size, 1, base.intermediate_size, base.attn, seed)
    model = TinyQSAModel(cfg, device=device)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in spec["prompts"]]
    bs = spec["block_size"]
    num_blocks = sum(-(-n // bs) for n in spec["prompts"]) + 8
    route = build_route or ("auto" if device.type == "cuda" else "reference")
    engine = Engine(model, ServingConfig(num_blocks=num_blocks, block_size=bs, max_reqs=len(prompts),
                                         max_blocks_per_req=-(-max(spec["prompts"]) // bs) + 1,
                                         chunk_size=spec["chunk"], route=route, allocator_seed=seed + 1))
    res = engine.generate(prompts, 1, capture_step=spec["step"])
    return StepInputs.from_capture(res.capture)


def _select(step: StepInputs, kc, table, backend: str, rows=None):
    """The selection of ``rows`` (default all; a row's selection depends on that row alone)."""
    from ..model import ops

    iq, t2r, pos = step.iq, step.token_to_req, step.positions
    if rows is not None:
        iq, t2r, pos = iq[rows], t2r[rows], pos[rows]
    return ops.select_tokens(iq, kc, table, t2r, pos, step.seq_lens, block_size=step.kv.shape[2], k=step.index_topk,
                             backend=backend)


def _attend(step: StepInputs, kv, table, indices, route: str, order: str = "logical",
            max_query_len: int | None = None):
    from ..attention.api import plan_attention, run_attention

    plan = plan_attention(indices, table, step.token_to_req, step.positions, step.seq_lens,
                          block_size=kv.shape[2], num_blocks=kv.shape[0], num_q_heads=step.q.shape[1],
                          num_kv_heads=kv.shape[3], head_dim=step.q.shape[2], route=route, order=order,
                          max_query_len=max_query_len, rows_sorted=True, kv_cache_dtype=step.kv_cache_dtype)
    return run_attention(plan, step.q, kv[:, 0], kv[:, 1], gate=step.gate, kv_cache_dtype=step.kv_cache_dtype,
                         k_scale=step.k_scale, v_scale=step.v_scale, return_lse=True)


def _attend_rows(step: StepInputs, rows: torch.Tensor, route: str):
    """The attention of rows ``rows`` of the step (in that order) as a batch of their own."""
    from ..attention.api import sparse_paged_attention

    return sparse_paged_attention(step.q[rows], step.kv[:, 0], step.kv[:, 1], step.indices[rows], step.block_table,
                                  step.token_to_req[rows], step.positions[rows], step.seq_lens, gate=step.gate[rows],
                                  kv_cache_dtype=step.kv_cache_dtype, k_scale=step.k_scale, v_scale=step.v_scale,
                                  return_lse=True, route=route)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)


@dataclass
class Check:
    name: str
    runs: int = 0
    failures: int = 0
    detail: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else "ok" if self.failures == 0 else "FAIL"


class Verifier:
    """Replays a :class:`StepInputs` and records :class:`Check` results.

    The attention replays use the step's captured selection; the selection is replayed on ``sample``
    rows (all rows on the GPU; a spread of rows on the CPU, where the interpreted top-k and the
    sorting planner of unordered rows are slow). Rows are independent in the selection and in the
    single-row plan, so a subset tests the same property; the row grouping is never changed.
    """

    def __init__(self, step: StepInputs, *, route: str = "auto", seed: int = 0, plan_order: str = "logical",
                 sample: int | None = None, log=print):
        from .. import backend
        from ..attention import routing

        self.step, self.route, self.order, self.log = step, route, plan_order, log
        self.device = step.q.device
        self.backend = backend.kernel_backend(route, self.device)
        hq, hkv = step.q.shape[1], step.kv.shape[3]
        # as the layer plans the step: a pure decode step (one row per request) takes xqa under auto
        self.max_query_len = routing.max_query_len_of(step.token_to_req)
        self.choice = routing.choose(route, rows=step.rows, G=hq // hkv, head_dim=step.q.shape[2], device=self.device,
                                    max_query_len=self.max_query_len)
        self.gen = torch.Generator().manual_seed(seed)
        self.checks: list[Check] = []
        if sample is None or sample >= step.rows:
            self.rows = torch.arange(step.rows, device=self.device)
        else:  # spread over the step, the last (single-row route) rows included
            self.rows = torch.linspace(0, step.rows - 1, sample).round().long().unique().to(self.device)
        self.base_idx = step.indices
        self.base_sel = _select(step, step.kc, step.block_table, self.backend, self.rows)
        self.base_out, self.base_lse = _attend(step, step.kv, step.block_table, self.base_idx, route, plan_order,
                                                 self.max_query_len)

    def _compare(self, check: Check, sel, out, lse, what: str) -> None:
        check.runs += 1
        bad = [n for n, a, b in (("indices", sel, self.base_sel), ("out", out, self.base_out),
                                 ("lse", lse, self.base_lse)) if a is not None and not _same(a, b)]
        if bad:
            check.failures += 1
            diff = float((out.float() - self.base_out.float()).abs().nan_to_num(float("inf")).max())
            check.detail = f"{what}: {', '.join(bad)} differ (max |out diff| {diff:.3g})"

    def _sel_note(self) -> str:
        n = len(self.rows)
        return "indices" if n == self.step.rows else f"indices ({n} rows)"

    def repeat(self) -> Check:
        c = Check("repeat")
        sel = _select(self.step, self.step.kc, self.step.block_table, self.backend, self.rows)
        out, lse = _attend(self.step, self.step.kv, self.step.block_table, self.base_idx, self.route, self.order,
                           self.max_query_len)
        self._compare(c, sel, out, lse, "second run")
        c.detail = c.detail or f"{self._sel_note()}, out and lse bitwise equal"
        return c

    def mapping(self, kind: str):
        """A random block mapping and the relocated cache size."""
        from ..cache.paged import collision_prone_num_blocks, random_mapping

        n = self.step.kv.shape[0]
        if kind == "permutation":
            return random_mapping(n, generator=self.gen), n
        if kind == "2x cache":
            return random_mapping(n, num_blocks_out=2 * n, generator=self.gen), 2 * n
        out = collision_prone_num_blocks(n, 16)
        return random_mapping(n, num_blocks_out=out, generator=self.gen, collision_prone=True), out

    def relocated(self, kind: str):
        """The step's K/V and compressed-key caches moved by one random mapping, the new table, and
        the new number of blocks."""
        from ..cache.paged import relocate

        mapping, n_out = self.mapping(kind)
        kv, table = relocate(self.step.kv, self.step.block_table, mapping, num_blocks_out=n_out, fill="nan")
        kc, _ = relocate(self.step.kc, self.step.block_table, mapping, num_blocks_out=n_out, fill="nan")
        return kv, kc, table, n_out

    def relocations(self, n: int) -> list[Check]:
        kinds = ("permutation", "2x cache", "collision-prone")
        checks = {k: Check(f"relocation ({k})") for k in kinds}
        sizes = {}
        for i in range(n):
            kind = kinds[i % len(kinds)]
            kv, kc, table, sizes[kind] = self.relocated(kind)
            sel = _select(self.step, kc, table, self.backend, self.rows)
            out, lse = _attend(self.step, kv, table, self.base_idx, self.route, self.order, self.max_query_len)
            self._compare(checks[kind], sel, out, lse, f"relocation {i}")
            self.log(f"  relocation {i + 1}/{n} ({kind}): {checks[kind].status}")
        for kind, c in checks.items():
            c.skipped = c.runs == 0
            if not c.skipped and not c.detail:
                c.detail = f"{self.step.kv.shape[0]} -> {sizes[kind]} blocks; {self._sel_note()}, out, lse bitwise equal"
        return list(checks.values())

    def permuted(self) -> Check:
        c = Check("permuted index order")
        perm = torch.argsort(torch.rand(self.base_idx.shape, generator=self.gen), dim=1).to(self.device)
        idx = self.base_idx.clone()
        idx[self.rows] = torch.gather(self.base_idx, 1, perm)[self.rows]
        out, lse = _attend(self.step, self.step.kv, self.step.block_table, idx, self.route, self.order,
                           self.max_query_len)
        self._compare(c, None, out, lse, "shuffled rows")
        n = len(self.rows)
        c.detail = c.detail or (f"{'every row' if n == self.step.rows else f'{n} rows'}: indices shuffled; "
                                "out and lse bitwise equal")
        return c

    def cuda_graph(self, n: int) -> Check:
        c = Check("cuda graph replay")
        if self.device.type != "cuda":
            c.skipped, c.detail = True, "no GPU"
            return c
        if self.route == "reference":
            c.skipped, c.detail = True, "the reference route reads values on the host: no graph captures it"
            return c
        from ..attention.api import plan_attention, run_attention

        s = self.step
        static = {k: getattr(s, k).clone() for k in ("kv", "kc", "block_table")}
        nb, bs = s.kv.shape[0], s.kv.shape[2]
        hq, hkv, d = s.q.shape[1], s.kv.shape[3], s.q.shape[2]
        holder = {}

        def body():
            idx = _select(s, static["kc"], static["block_table"], self.backend)
            holder["plan"] = plan_attention(idx, static["block_table"], s.token_to_req, s.positions, s.seq_lens,
                                            block_size=bs, num_blocks=nb, num_q_heads=hq, num_kv_heads=hkv,
                                            head_dim=d, route=self.route, order=self.order, out=holder.get("plan"),
                                            max_query_len=self.max_query_len,
                                            rows_sorted=True, kv_cache_dtype=s.kv_cache_dtype)
            out, lse = run_attention(holder["plan"], s.q, static["kv"][:, 0], static["kv"][:, 1], gate=s.gate,
                                     kv_cache_dtype=s.kv_cache_dtype, k_scale=s.k_scale, v_scale=s.v_scale,
                                     out=holder["out"], return_lse=True)
            return idx, out, lse

        holder["out"] = torch.empty_like(s.q)
        eager_idx, _, _ = body()  # warm-up: compile kernels, allocate the plan
        eager_out, eager_lse = _attend(s, s.kv, s.block_table, eager_idx, self.route, self.order, self.max_query_len)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_idx, g_out, g_lse = body()

        def compare(what):
            graph.replay()
            torch.cuda.synchronize()
            c.runs += 1
            bad = [n for n, a, b in (("indices", g_idx, eager_idx), ("out", g_out, eager_out),
                                     ("lse", g_lse, eager_lse)) if not _same(a, b)]
            if bad:
                c.failures += 1
                c.detail = f"{what}: {', '.join(bad)} differ from eager"

        compare("replay of the original step")
        for i in range(n):
            kv, kc, table, _ = self.relocated("permutation")
            static["kv"].copy_(kv)
            static["kc"].copy_(kc)
            static["block_table"].copy_(table)
            compare(f"replay on relocation {i}")
        c.detail = c.detail or (f"selection + plan + attention captured once, replayed on the original and "
                                f"{n} relocations: bitwise equal to eager")
        return c

    def batch_invariance(self) -> Check:
        """The step's rows in batches of other sizes and orders: the same bits per row (the invariant route
        promises it; the others promise bits for a fixed batch shape only, so the check is skipped)."""
        c = Check("batch invariance")
        if self.choice.route != "invariant":
            c.skipped = True
            c.detail = f"route {self.choice.route}: same bits for a fixed batch shape only (--route invariant)"
            return c
        n = self.step.rows
        every = torch.arange(n, device=self.device)
        batches = {"rows in reverse order": every.flip(0), "first half alone": every[: max(1, n // 2)]}
        for r in self.rows[torch.linspace(0, len(self.rows) - 1, 3).round().long().unique()].tolist():
            batches[f"row {r} alone"] = every[r:r + 1]
        for what, rows in batches.items():
            out, lse = _attend_rows(self.step, rows, self.route)
            c.runs += 1
            if not (_same(out, self.base_out[rows]) and _same(lse, self.base_lse[rows])):
                c.failures += 1
                c.detail = f"{what}: out or lse differ from the whole step's rows"
        c.detail = c.detail or f"{len(batches)} sub-batches (reversed, half, single rows): bitwise equal per row"
        return c

    def accuracy(self) -> Check:
        """The output against the fp64 reference on a sample of rows (not bitwise; for scale)."""
        from ..attention.reference import assert_close_like_torch, reference_attention

        c = Check("fp64 reference", runs=1)
        s = self.step
        rows = torch.arange(s.rows, device=self.device)
        if s.rows > SAMPLE_ROWS:
            rows = torch.cat([rows[: SAMPLE_ROWS // 2], rows[-SAMPLE_ROWS // 2:]])
        args = (s.q[rows], s.kv[:, 0], s.kv[:, 1], self.base_idx[rows], s.block_table, s.token_to_req[rows],
                s.positions[rows], s.seq_lens)
        kw = dict(gate=s.gate[rows], kv_cache_dtype=s.kv_cache_dtype, k_scale=s.k_scale, v_scale=s.v_scale)
        ref, ref_lse = reference_attention(*args, **kw, compute_dtype=torch.float64)
        low, low_lse = reference_attention(*args, **kw, compute_dtype=s.q.dtype)
        try:
            st = assert_close_like_torch(self.base_out[rows], ref, low, lse=self.base_lse[rows], ref_lse=ref_lse,
                                         torch_lse=low_lse)
            c.detail = f"{len(rows)} rows: max |err| {st['err']:.2e} <= {st['bound']:.2e} (2 x torch + floor)"
        except AssertionError as e:
            c.failures, c.detail = 1, str(e).splitlines()[0]
        return c


def report(checks: list[Check]) -> str:
    w = max(len(c.name) for c in checks)
    head = f"{'check':<{w}s}  {'runs':>4s}  {'result':<7s}  detail"
    lines = [head, "-" * len(head)]
    for c in checks:
        lines.append(f"{c.name:<{w}s}  {c.runs:>4d}  {c.status:<7s}  {c.detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="qsa verify", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--relocations", type=int_at_least(1), default=None,
                   help="random page relocations to replay (default 3 on the CPU, 12 on the GPU)")
    p.add_argument("--seed", type=int_in_range(SEED_MIN, SEED_MAX), default=0,
                   help="model, prompts and relocation seed")
    p.add_argument("--device", default="auto", help="auto (the GPU if there is one), cpu or cuda")
    p.add_argument("--route", default="auto", choices=ROUTES, help="auto, grouped, xqa, splitk, invariant or reference")
    p.add_argument("--sample", type=int_at_least(1), default=None,
                   help=f"rows whose selection is replayed and whose indices are shuffled (default all on the "
                        f"GPU, {CPU_SAMPLE} on the CPU)")
    p.add_argument("--plan-order", default="logical", choices=("logical", "physical"),
                   help="physical: replay with a physical-order grouped plan (a demonstration; expected to fail)")
    p.add_argument("--load", metavar="FILE", help="replay a step saved with --save instead of capturing one")
    p.add_argument("--save", metavar="FILE", help="save the captured step")
    args = p.parse_args(argv)
    if args.load and not os.path.isfile(args.load):
        p.error(f"--load {args.load}: no such file")
    args.step = None
    if args.load:
        try:
            args.step = StepInputs.load(args.load)
        except (ValueError, TypeError) as e:
            p.error(f"--load {args.load}: {e}")
    if args.save:
        folder = os.path.dirname(os.path.abspath(args.save))
        if os.path.isdir(args.save):
            p.error(f"--save {args.save}: is a folder, not a file name")
        if not os.path.isdir(folder):
            p.error(f"--save {args.save}: no such folder {folder}")

    device = cli_device(p, args.device)
    if device.type == "cpu" and args.route != "reference":
        from .demo import use_interpreter

        status = use_interpreter("qsa.cli.verify", argv)
        if status is not None:
            return status
    from .demo import one_thread_on_cpu

    with one_thread_on_cpu(device):
        return _verify(args, device)


def _verify(args, device: torch.device) -> int:
    n = args.relocations if args.relocations is not None else (12 if device.type == "cuda" else 3)

    from .. import backend
    from ..attention import routing

    no_triton = backend.triton_available(device)
    if no_triton is not None and args.route not in ("auto", "reference"):
        print(f"qsa verify: --route {args.route} cannot run: {no_triton}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.load:
        step = args.step.to(device)
        source = f"loaded from {args.load}"
    else:
        step = capture_step(device, seed=args.seed)
        source = "captured from the tiny model (layer 0 of a mixed prefill step)"
    if args.save:
        step.save(args.save)
    hq, hkv, d = step.q.shape[1], step.kv.shape[3], step.q.shape[2]
    choice = routing.choose(args.route, rows=step.rows, G=hq // hkv, head_dim=d, device=device,
                           max_query_len=routing.max_query_len_of(step.token_to_req))
    split = (f"{choice.grouped_rows} rows grouped + {step.rows - choice.grouped_rows} single-row"
             if choice.route in ("grouped", "xqa") else f"all rows {choice.route}")
    print(f"qsa verify on {device}: step {source}")
    print(f"{step.rows} rows, {hq}/{hkv} heads x {d}, {step.kv.shape[0]} blocks of {step.kv.shape[2]}, "
          f"top-{step.index_topk} selection; route {args.route} -> {split}")
    if args.plan_order == "physical":
        print("plan order physical: a demonstration of the defect the logical order fixes")
        if not choice.grouped_rows:
            print(f"  the physical order only reorders grouped plans; the {choice.route} route of this step has "
                  "none, so the replays below run as in the logical order")
    sample = args.sample if args.sample is not None else (None if device.type == "cuda" else CPU_SAMPLE)
    v = Verifier(step, route=args.route, seed=args.seed, plan_order=args.plan_order, sample=sample)
    checks = [v.repeat(), *v.relocations(n), v.permuted(), v.cuda_graph(min(n, 4)), v.batch_invariance(),
              v.accuracy()]
    print(report(checks))
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"{'FAIL' if failed else 'OK'}: {sum(c.runs for c in checks)} replays, "
          f"{sum(c.failures for c in checks)} with a difference ({time.perf_counter() - t0:.1f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
