"""vLLM's QSA attention op and qsa's drop-in for it, side by side on the same inputs in vLLM's layout.

For each scenario (Hq/Hkv 6/1, 12/1 and 24/2; bf16; D 256; page 16; 64K-token requests; steps: an
8192-row prefill of one request and a 2048-row chunk of one request, both with walk selections of
adjacent-row overlap 0.8 (``benchmarks.generators.walk_blocks``), a decode step of 64 rows of 64 requests
and an MTP step of 8 rows of one request), in one process:

* the inputs, as vLLM's model passes them: one server tensor ``[num_blocks, Hkv, page, 2*D]`` (pages in a
  shuffled order, physical block 0 unused and NaN) and its K/V views ``kv.transpose(1, 2).split(D, -1)``;
  ``logical_indices [rows, 2052]`` int32, each row's tokens first (selected 4-token blocks ascending, then
  the causal tail), -1 after them, the count in the last column; ``block_table``, ``token_to_req``; a
  contiguous ``output_gate``; ``use_prefill_config`` as vLLM's model sets it
  (``max_query_len > 1 + num_speculative_tokens``, 7 speculative tokens: the prefill and the chunk True,
  decode and MTP False);
* ``vllm``: vLLM 0.33.0's op, ``vllm.models.qwen4_exp.nvidia.ops.qsa.qsa_sparse_paged_attention``, imported
  from the checkout's ignored ``.vllm/`` folder (``--setup-vllm`` puts the op's file there from the
  wheel, with a small stand-in for the few vLLM modules it imports) or from an installed vLLM; when it
  cannot be imported, the record says why and qsa is still measured;
* ``qsa``: ``qsa.integrations.vllm.qsa_sparse_paged_attention`` (the drop-in), called with the same
  arguments; the record names the route qsa's ``auto`` takes for the call;
* checks: each op's output on a sample of rows against the fp32 reference
  (``benchmarks.baselines.reference_attention_fp32`` over each row's count, times ``sigmoid(gate)``),
  flash-attention style: max abs error <= 2 x the naive bf16 computation's + eps x max|ref|, relative L2
  <= 2 x naive's + eps (``benchmarks.run.gate_bounds``); and the two ops against each other over all rows
  (max abs difference, whether bitwise equal);
* times (an op that fails its check gets none): the median of CUDA-graph replays with the L2 flushed
  before each (``Timer.time``), one eager call with the L2 flushed and the device idle
  (``Timer.time_eager``), and the host time to enqueue one call (``Timer.host_us``). After each, the
  output must still equal the checked one bitwise.

The JSON report (``--out``) is rewritten after every scenario, so a run cut short keeps what it measured:
``{schema, tool, device, date, complete, quick, argv, versions, vllm_op: {available, module, file, sha256,
shim, vllm_version, error}, num_speculative_tokens, scenarios: [{name, step, shapes and sizes,
use_prefill_config, overlap_requested, overlap, tokens_total, avg_set_size, avg_union_per_group, qsa_route,
ref_rows, naive_max_abs_err, bound_abs, bound_rel, ops: {vllm, qsa: {available, passed, error, max_abs_err,
rel_l2_err, graph_ms (min, max, reps), replay_equal, eager_ms (min, max, reps), host_us, host_calls,
eager_equal}}, vllm_vs_qsa: {max_abs_diff, bitwise_equal}, x_graph, x_eager, x_host (vLLM / qsa), setup_s,
elapsed_s, error}], fatal_error}``. The Markdown table goes to ``--md`` and stdout. Exit status 1 when an
available op failed its check or a scenario errored.

Run from the checkout root on the GPU machine (meant to take about 5 minutes on an H100 for the 12
scenarios, most of it Triton compiles; ``--max-minutes M`` starts no scenario after M minutes)::

    PYTHONPATH=src:.vllm python -m benchmarks.vllm_side_by_side --out side.json --md side.md
    PYTHONPATH=src:.vllm python -m benchmarks.vllm_side_by_side --quick --out smoke.json   # tiny shapes

Put vLLM's op in place once (the wheel from ``pip download --no-deps vllm==0.33.0``)::

    python -m benchmarks.vllm_side_by_side --setup-vllm vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

On a CPU (``--device cpu``) qsa's kernels run under the Triton interpreter, on the tiny ``--quick``
scenarios only (their times mean nothing); vLLM's op is not run there: it takes bf16 only, and the Triton
3.6 interpreter computes ``tl.dot`` on bf16 operands from their raw bits (and fails in its split merge).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import hashlib
import math
import os
import sys
import time
import traceback
import zipfile
from pathlib import Path

from .registry import K, Scenario

ROOT = Path(__file__).resolve().parent.parent
VLLM_DIR = ROOT / ".vllm"
"""Where ``--setup-vllm`` puts vLLM's op (ignored by git: add ``/.vllm/`` to ``.git/info/exclude``)."""
VLLM_VERSION = "0.33.0"
VLLM_OP_MODULE = "vllm.models.qwen4_exp.nvidia.ops.qsa"
VLLM_OP_FILE = "vllm/models/qwen4_exp/nvidia/ops/qsa.py"
VLLM_OP_NAME = "qsa_sparse_paged_attention"
NUM_SPECULATIVE_TOKENS = 7
"""vLLM's model passes ``use_prefill_config = max_query_len > 1 + num_speculative_tokens``; with MTP of
7 speculative tokens, a decode step (1 row per request) and an MTP step (8 rows) are not prefill."""
OPS = ("vllm", "qsa")
SCHEMA_VERSION = 1
INTERPRETER_NOTE = ("not run on the CPU: vLLM's op asserts bf16, and the Triton 3.6 interpreter multiplies the "
                    "raw bits of bf16 operands in tl.dot (qsa's kernels take fp32 operands there); its split "
                    "merge kernel also fails under the interpreter")

# (step, rows, requests, overlap): one request's prefill rows sit at the end of its context
STEPS = (("prefill-8192", 8192, 1, 0.8), ("chunk-2048", 2048, 1, 0.8), ("decode-64", 64, 64, None),
         ("mtp-8", 8, 1, 0.8))
SHAPES = ((6, 1), (12, 1), (24, 2))
CONTEXT = 64 * K
REF_ROWS = 16
"""Rows per scenario checked against the fp32 reference (spread over the batch, first and last included)."""


def _scenarios() -> tuple[Scenario, ...]:
    out = []
    for hq, hkv in SHAPES:  # the 6/1 steps first: a run cut short keeps the TP4 shape whole
        for step, rows, reqs, overlap in STEPS:
            out.append(Scenario(name=f"{step}-{hq}x{hkv}", rows=rows, context=CONTEXT, num_reqs=reqs,
                                num_q_heads=hq, num_kv_heads=hkv, head_dim=256, dtype="bf16", block_size=16,
                                topk=512, overlap=overlap, routes=OPS, tags=(step,)))
    # --quick: tiny shapes (seconds on a GPU; a CPU runs them under the Triton interpreter)
    tiny = dict(context=512, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="bf16", block_size=16, topk=16,
                routes=OPS, quick=True, test_only=True)
    out.append(Scenario(name="tiny-prefill-64", rows=64, num_reqs=1, overlap=0.8, tags=("prefill",), **tiny))
    out.append(Scenario(name="tiny-decode-4", rows=4, num_reqs=4, overlap=None, tags=("decode",), **tiny))
    out.append(Scenario(name="tiny-mtp-8", rows=8, num_reqs=1, overlap=0.8, tags=("mtp",), **tiny))
    return tuple(out)


SCENARIOS = _scenarios()


def use_prefill_config(scn: Scenario) -> bool:
    """As vLLM's model sets it: the batch's max query length over ``1 + num_speculative_tokens``."""
    return -(-scn.rows // scn.num_reqs) > 1 + NUM_SPECULATIVE_TOKENS


def select(patterns=None, *, quick: bool = False) -> list[Scenario]:
    """Scenarios matching the globs (default: the full set, or the tiny set with ``quick``)."""
    if patterns:
        return [s for s in SCENARIOS if any(fnmatch.fnmatchcase(s.name, p) for p in patterns)]
    return [s for s in SCENARIOS if s.test_only == quick]


# ------------------------------------------------------------------------------------------------
# vLLM's op: the file from the wheel, and a stand-in for the vLLM modules it imports

SHIM_MARKER = "QSA_SIDE_BY_SIDE_SHIM"

SHIM_FILES = {
    "vllm/__init__.py": f'''"""Not vLLM: a stand-in package written for qsa's benchmarks/vllm_side_by_side.py.

Only {VLLM_OP_FILE} comes from the vLLM {VLLM_VERSION} wheel (Apache-2.0); every other module here
provides just the names that file imports, with torch and Triton doing the work."""

{SHIM_MARKER} = True
__version__ = "{VLLM_VERSION}+qsa-side-by-side-shim"
''',
    "vllm/platforms/__init__.py": '''"""Stand-in for vllm.platforms: ``current_platform``, the device capability queries only."""

import torch


class _CudaPlatform:
    """What the op asks of vLLM's platform object: the compute capability of the current device."""

    def get_device_capability(self, device_id: int = 0):
        if not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        cap = self.get_device_capability(device_id)
        if cap is None:
            return False
        if isinstance(capability, tuple):
            return cap >= tuple(capability)
        return cap[0] * 10 + cap[1] >= int(capability)

    def is_cuda(self) -> bool:
        return torch.cuda.is_available()

    def is_rocm(self) -> bool:
        return False


current_platform = _CudaPlatform()
''',
    "vllm/triton_utils/__init__.py": '''"""Stand-in for vllm.triton_utils: the real Triton."""

import triton
import triton.language as tl

HAS_TRITON = True
''',
    "vllm/model_executor/__init__.py": '"""Stand-in package (see vllm/__init__.py)."""\n',
    "vllm/model_executor/warmup/__init__.py": '"""Stand-in package (see vllm/__init__.py)."""\n',
    "vllm/model_executor/warmup/jit_warmup_triton_helper.py": '''"""Stand-in for vLLM's ahead-of-time Triton warm-up helpers: the op's module imports two names, which only
its warm-up function uses; the benchmark compiles kernels by calling the op, so these refuse to be used."""


class TritonWarmupTensor:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the side-by-side shim has no ahead-of-time warm-up: call the op instead")


def triton_scalar_specialization_rep(value):
    raise NotImplementedError("the side-by-side shim has no ahead-of-time warm-up: call the op instead")
''',
    "vllm/models/__init__.py": '"""Stand-in package (see vllm/__init__.py)."""\n',
    "vllm/models/qwen4_exp/__init__.py": '"""Stand-in package: the model itself is not here (see vllm/__init__.py)."""\n',
    "vllm/models/qwen4_exp/nvidia/__init__.py": '"""Stand-in package (see vllm/__init__.py)."""\n',
    "vllm/models/qwen4_exp/nvidia/ops/__init__.py": '"""Stand-in package (see vllm/__init__.py)."""\n',
}
"""The stand-in modules, by path under the ``.vllm`` folder: the op's file imports
``vllm.model_executor.warmup.jit_warmup_triton_helper`` (``TritonWarmupTensor``,
``triton_scalar_specialization_rep``: its warm-up function only), ``vllm.platforms`` (``current_platform``:
the device capability, which picks its tuning table) and ``vllm.triton_utils`` (``HAS_TRITON``, ``tl``,
``triton``); the packages on the way are empty."""


def setup_vllm(wheel: Path, dest: Path = VLLM_DIR) -> Path:
    """Extract vLLM's op file from ``wheel`` into ``dest`` (keeping its ``vllm/...`` path) and write the
    stand-in modules beside it. Returns the op file's path."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        if VLLM_OP_FILE not in names:
            near = sorted(n for n in names if n.endswith("/qsa.py") and "/ops/" in n)
            raise SystemExit(f"{wheel} has no {VLLM_OP_FILE}; QSA op files in it: {near or 'none'}")
        data = z.read(VLLM_OP_FILE)
    for rel, text in SHIM_FILES.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    op = dest / VLLM_OP_FILE
    op.write_bytes(data)
    (dest / "SOURCE.txt").write_text(
        f"{VLLM_OP_FILE}: from {wheel.name}, sha256 {hashlib.sha256(data).hexdigest()}\n"
        "Everything else under vllm/ is a stand-in written for benchmarks/vllm_side_by_side.py.\n")
    return op


def load_vllm_op(vllm_dir: Path | None = VLLM_DIR):
    """``(op, info)``: vLLM's op from an importable ``vllm`` (``.vllm`` on PYTHONPATH, or an installed
    vLLM), else from ``vllm_dir`` put on ``sys.path``; ``(None, info)`` with the reason when neither works."""
    import importlib

    info: dict = dict(module=VLLM_OP_MODULE, available=False)
    errors = []
    for attempt in ("path", "dir"):
        if attempt == "dir":
            if vllm_dir is None or not (vllm_dir / VLLM_OP_FILE).is_file() or str(vllm_dir) in sys.path:
                break
            sys.path.insert(0, str(vllm_dir))
            for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
                del sys.modules[name]
        try:
            mod = importlib.import_module(VLLM_OP_MODULE)
            op = getattr(mod, VLLM_OP_NAME)
        except Exception as e:  # noqa: BLE001 - any import failure is recorded, qsa is still measured
            errors.append(f"{type(e).__name__}: {e}")
            continue
        pkg = sys.modules["vllm"]
        path = Path(mod.__file__)
        info.update(available=True, file=_rel(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                    shim=bool(getattr(pkg, SHIM_MARKER, False)), vllm_version=getattr(pkg, "__version__", None))
        return op, info
    info["error"] = "; ".join(errors) or "not importable"
    return None, info


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


# ------------------------------------------------------------------------------------------------
# inputs in vLLM's layout


_WALKS: dict = {}


class Inputs:
    """One scenario's arguments of the op, in vLLM's layout, and what the checks need."""

    def __init__(self, scn: Scenario, device):
        import numpy as np
        import torch

        from .generators import expand_blocks, row_layout, selection_stats, shuffled_block_table, walk_blocks

        dev = torch.device(device)
        gen = torch.Generator().manual_seed(scn.seed)
        hq, hkv, d, page = scn.num_q_heads, scn.num_kv_heads, scn.head_dim, scn.block_size
        req_np, pos_np = row_layout(scn.rows, scn.num_reqs, scn.context)
        seq_np = np.full(scn.num_reqs, scn.context, dtype=np.int64)
        table, num_blocks = shuffled_block_table(scn.num_reqs, scn.context, page, gen)
        # vLLM's server tensor: [num_blocks, Hkv, page, 2*D], K in the first D columns, V in the last
        server = torch.empty(num_blocks, hkv, page, 2 * d, dtype=torch.bfloat16, device=dev)
        dgen = torch.Generator(device=dev).manual_seed(scn.seed + 1)
        step = max(1, (1 << 26) // server[0].numel())
        for b0 in range(1, num_blocks, step):
            server[b0:b0 + step].normal_(generator=dgen)
        server[0].fill_(float("nan"))  # never in the table: any read of it shows
        self.server = server
        self.block_table = table.to(dev)
        self.token_to_req = torch.from_numpy(req_np).to(torch.int32).to(dev)
        self.positions = torch.from_numpy(pos_np).to(dev)
        self.seq_lens = torch.from_numpy(seq_np).to(torch.int32).to(dev)
        key = (scn.rows, scn.num_reqs, scn.context, scn.topk, scn.overlap, scn.seed)
        if key not in _WALKS:  # the shapes share their steps' selections (a numpy loop over the rows)
            _WALKS.clear()
            _WALKS[key] = walk_blocks(req_np, pos_np, seq_np, topk=scn.topk, overlap=scn.overlap or 0.0,
                                      seed=scn.seed + 2)
        blocks = _WALKS[key]
        indices = expand_blocks(torch.from_numpy(blocks).to(dev), self.positions,
                                self.seq_lens.long()[self.token_to_req.long()])
        valid = indices >= 0
        counts = valid.sum(1)
        width = indices.shape[1]
        prefix = torch.arange(width, device=dev)[None, :] < counts[:, None]
        if not bool((valid == prefix).all()):
            raise AssertionError("expanded selections must hold their valid tokens first")
        self.indices = indices                                                   # [rows, W]
        logical = torch.full((scn.rows, width + 1), -1, dtype=torch.int32, device=dev)
        logical[:, :width] = indices
        logical[:, width] = counts.to(torch.int32)
        self.logical_indices = logical                                           # [rows, W + 1]
        self.q = torch.randn(scn.rows, hq, d, generator=gen).to(torch.bfloat16).to(dev)
        self.gate = torch.randn(scn.rows, hq, d, generator=gen).to(torch.bfloat16).to(dev)
        self.use_prefill_config = use_prefill_config(scn)
        self.stats = selection_stats(indices, self.block_table, self.token_to_req, self.positions, self.seq_lens,
                                     block_size=page, num_blocks=num_blocks)
        self.num_blocks = num_blocks

    @property
    def kv(self):
        """vLLM's views: ``kv.transpose(1, 2).split(D, dim=-1)``, each ``[num_blocks, page, Hkv, D]``."""
        return self.server.transpose(1, 2).split(self.server.shape[-1] // 2, dim=-1)

    def call(self, op, out):
        """One call of ``op`` with vLLM's arguments (as its model passes them), writing ``out``."""
        k, v = self.kv
        return op(self.q, k, v, self.logical_indices, self.block_table, self.token_to_req, self.use_prefill_config,
                  out, k_scale=None, v_scale=None, output_gate=self.gate)

    def reference_rows(self, n: int = REF_ROWS):
        """Rows checked against the reference: ``n`` spread over the batch, the first and the last among them."""
        import torch

        rows = self.q.shape[0]
        return torch.unique(torch.linspace(0, rows - 1, min(n, rows)).round().long()).to(self.q.device)

    def references(self, sel):
        """``(fp32 reference, naive bf16 yardstick)`` of rows ``sel``, both gated as the ops gate:
        ``attention * sigmoid(gate)`` (the yardstick rounds the attention and the product to bf16)."""
        import torch

        from .baselines import chunked_attention, reference_attention_fp32

        k, v = self.kv
        args = (k, v, self.indices[sel], self.block_table, self.token_to_req[sel], self.positions[sel], self.seq_lens)
        sig = torch.sigmoid(self.gate[sel].float())
        ref = reference_attention_fp32(self.q[sel], *args) * sig
        naive = chunked_attention(self.q[sel], *args, compute_dtype=torch.bfloat16)
        naive = (naive.float() * sig).to(torch.bfloat16)
        return ref, naive


# ------------------------------------------------------------------------------------------------
# one scenario


def qsa_route(scn: Scenario, inp: Inputs) -> str:
    """The route qsa's ``auto`` takes for the drop-in's call (the hints the adapter passes)."""
    import torch

    from qsa.attention.routing import choose

    rp = choose("auto", rows=scn.rows, G=scn.group, head_dim=scn.head_dim, device=torch.device(inp.q.device),
                max_query_len=None if inp.use_prefill_config else 1, rows_sorted=True,
                index_width=inp.logical_indices.shape[1] - 1)
    direct = " direct" if rp.direct else ""
    if rp.route == "grouped" and 0 < rp.grouped_rows < scn.rows:
        return f"grouped {rp.grouped_rows} + xqa {scn.rows - rp.grouped_rows}{direct}"
    if rp.route == "grouped":
        return "grouped"
    return rp.route + (direct if rp.route == "xqa" else "")


def _err_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) < 600 else text[:600] + " ..."


FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
              "illegal instruction")


def _is_fatal(exc: BaseException) -> bool:
    return any(s in str(exc) for s in FATAL_CUDA)


def run_scenario(scn: Scenario, ops: dict, timer, *, eager_reps: int, host_calls: int) -> dict:
    """Build the inputs, check each op, time the ones that pass; one record (see ``main``'s JSON)."""
    import torch

    from .run import gate, gate_bounds, output_errors

    t0 = time.time()
    rec = dict(name=scn.name, step=scn.tags[0] if scn.tags else None, num_q_heads=scn.num_q_heads,
               num_kv_heads=scn.num_kv_heads, head_dim=scn.head_dim, dtype=scn.dtype, block_size=scn.block_size,
               rows=scn.rows, num_reqs=scn.num_reqs, context=scn.context, topk=scn.topk,
               width=scn.width + 1, use_prefill_config=use_prefill_config(scn), overlap_requested=scn.overlap,
               description=f"{scn.rows} rows x {scn.num_reqs} req @ {scn.context} tokens, "
                           f"{scn.num_q_heads}/{scn.num_kv_heads}/{scn.head_dim}, bf16, page {scn.block_size}",
               error=None, ops={})
    sync = (lambda: torch.cuda.synchronize(timer.device)) if timer.is_cuda else (lambda: None)
    inp = Inputs(scn, timer.device)
    st = inp.stats
    rec.update(overlap=st["overlap"], tokens_total=st["tokens_total"], avg_set_size=st["tokens_total"] / scn.rows,
               avg_union_per_group=st["avg_union_per_group"], qsa_route=qsa_route(scn, inp))
    sel = inp.reference_rows()
    ref, naive = inp.references(sel)
    sync()
    yard = output_errors(naive, ref)
    if not gate(yard, gate_bounds(ref, torch.bfloat16, None)):
        yard = None  # a yardstick that fails its own fixed bound sets no bounds
    bounds = gate_bounds(ref, torch.bfloat16, yard)
    rec.update(ref_rows=len(sel), naive_max_abs_err=None if yard is None else yard["max_abs_err"],
               bound_abs=bounds["bound_abs"], bound_rel=bounds["bound_rel"], yardstick=bounds["yardstick"],
               setup_s=round(time.time() - t0, 2))
    del naive

    outs = {}
    for name in OPS:
        r = rec["ops"][name] = dict(available=ops.get(name) is not None, passed=False, error=None)
        op = ops.get(name)
        if op is None:
            r["error"] = ops.get(f"{name}_error") or "not available"
            continue
        out = torch.empty_like(inp.q)
        try:
            out.fill_(float("nan"))
            got = inp.call(op, out)
            sync()
            if got is not None and got.data_ptr() != out.data_ptr():
                raise AssertionError("the op did not return its out buffer")
            err = output_errors(out[sel], ref)
            r.update(max_abs_err=err["max_abs_err"], rel_l2_err=err["rel_l2_err"], finite=err["finite"],
                     passed=gate(err, bounds))
            outs[name] = out
            if not r["passed"]:
                r["error"] = (f"correctness gate failed: max abs {err['max_abs_err']:.3g} (bound "
                              f"{bounds['bound_abs']:.3g}), rel L2 {err['rel_l2_err']:.3g} (bound "
                              f"{bounds['bound_rel']:.3g}); not timed")
                continue
            checked = out.clone()

            def fn(op=op, out=out):
                inp.call(op, out)

            t = timer.time(fn, graph=True)
            sync()
            r.update(graph_ms=t.median_ms, graph_min_ms=t.min_ms, graph_max_ms=t.max_ms, graph_reps=t.reps,
                     timing=t.method, replay_equal=bool(torch.equal(out, checked)))
            te = timer.time_eager(fn, reps=eager_reps) if timer.is_cuda else t
            sync()
            eager_equal = bool(torch.equal(out, checked))
            host = timer.host_us(fn, calls=host_calls)
            sync()
            eager_equal &= bool(torch.equal(out, checked))
            r.update(eager_ms=te.median_ms, eager_min_ms=te.min_ms, eager_max_ms=te.max_ms, eager_reps=te.reps,
                     host_us=host, host_calls=host_calls, eager_equal=eager_equal)
            if not (r["replay_equal"] and eager_equal):
                r.update(passed=False, error="the output of the timed calls differs from the checked output")
        except Exception as e:  # noqa: BLE001 - recorded; the other op still runs
            r.update(passed=False, error=_err_text(e))
            if _is_fatal(e):
                raise
    if len(outs) == 2:
        a, b = outs["vllm"].float(), outs["qsa"].float()
        both = torch.isfinite(a) & torch.isfinite(b)
        rec["vllm_vs_qsa"] = dict(max_abs_diff=float((a - b).abs().max()) if bool(both.all()) else math.inf,
                                  bitwise_equal=bool(torch.equal(outs["vllm"], outs["qsa"])),
                                  rows=scn.rows)
    rec.update(x_graph=speedup(rec, "graph_ms"), x_eager=speedup(rec, "eager_ms"), x_host=speedup(rec, "host_us"),
               elapsed_s=round(time.time() - t0, 2))
    return rec


# ------------------------------------------------------------------------------------------------
# reports


def speedup(rec: dict, key: str):
    """vLLM's time / qsa's (> 1: qsa faster) for ``key`` (``graph_ms``, ``eager_ms``, ``host_us``), or None."""
    v, q = (rec.get("ops", {}).get(n, {}) for n in OPS)
    a, b = v.get(key), q.get(key)
    if not (v.get("passed") and q.get("passed")) or not a or not b:
        return None
    return a / b


def _f(x, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):  # sanitized inf / nan
        return x
    return format(x, spec)


def _check(r: dict) -> str:
    if not r.get("available"):
        return "n/a"
    return "ok" if r.get("passed") else "FAIL"


def _graph(r: dict) -> str:
    """The graph column; a time taken otherwise (capture failed: ``do_bench``) says so."""
    text = _f(r.get("graph_ms"), ".4f")
    return text if r.get("timing") in (None, "graph") or text == "-" else f"{text} ({r['timing']})"


COLUMNS = ("scenario", "Hq/Hkv", "rows x reqs", "overlap", "qsa route", "vLLM graph ms", "qsa graph ms", "x graph",
           "vLLM eager ms", "qsa eager ms", "x eager", "vLLM host us", "qsa host us", "max abs vLLM-qsa",
           "max abs vs fp32 vLLM / qsa (bound)", "check vLLM / qsa")


def table_rows(report: dict) -> list:
    rows = []
    for rec in report["scenarios"]:
        if rec.get("error") and not rec.get("ops"):
            rows.append([rec["name"], f"{rec['num_q_heads']}/{rec['num_kv_heads']}", f"{rec['rows']} x {rec['num_reqs']}",
                         "-", "-", *(["-"] * 10), f"error: {str(rec['error'])[:60]}"])
            continue
        v, q = rec["ops"].get("vllm", {}), rec["ops"].get("qsa", {})
        cmp_ = rec.get("vllm_vs_qsa") or {}
        diff = "-" if not cmp_ else ("0 (bitwise)" if cmp_.get("bitwise_equal") else _f(cmp_.get("max_abs_diff"), ".2e"))
        errs = f"{_f(v.get('max_abs_err'), '.2e')} / {_f(q.get('max_abs_err'), '.2e')} ({_f(rec.get('bound_abs'), '.2e')})"
        rows.append([rec["name"], f"{rec['num_q_heads']}/{rec['num_kv_heads']}", f"{rec['rows']} x {rec['num_reqs']}",
                     _f(rec.get("overlap"), ".2f"), rec.get("qsa_route") or "-",
                     _graph(v), _graph(q), _f(speedup(rec, "graph_ms"), ".2f"),
                     _f(v.get("eager_ms"), ".4f"), _f(q.get("eager_ms"), ".4f"), _f(speedup(rec, "eager_ms"), ".2f"),
                     _f(v.get("host_us"), ".1f"), _f(q.get("host_us"), ".1f"), diff, errs,
                     f"{_check(v)} / {_check(q)}"])
    return rows


def markdown(report: dict) -> str:
    """The side-by-side table, with a header saying what was measured where."""
    vl = report.get("vllm_op") or {}
    if vl.get("available"):
        src = (f"vLLM's op `{VLLM_OP_MODULE}.{VLLM_OP_NAME}` from `{vl.get('file')}` (sha256 "
               f"{str(vl.get('sha256'))[:12]}{', with the side-by-side stand-in for the vLLM modules it imports' if vl.get('shim') else ''})")
    else:
        src = f"vLLM's op not available ({vl.get('error', 'not importable')}): qsa alone"
    v = report.get("versions", {})
    lines = [
        f"vLLM {VLLM_VERSION}'s QSA op vs qsa's drop-in (`qsa.integrations.vllm.qsa_sparse_paged_attention`), "
        f"{report['device']['name']}, {report['date']}; torch {v.get('torch')}, triton {v.get('triton')}, qsa "
        f"{v.get('qsa')}; {src}.",
        "",
        "Same inputs in vLLM's layout (server tensor `[num_blocks, Hkv, page, 2*D]`, `logical_indices [rows, W + 1]` "
        "with counts, gate), bf16, "
        + ("the tiny `--quick` shapes" if report.get("quick") else "D 256, page 16, 2051 selected tokens per row, "
           "64K-token requests")
        + ("; on the CPU (Triton interpreter) the times mean nothing" if report["device"]["name"] == "cpu" else "")
        + ". `graph`: median of CUDA-graph replays, L2 "
        "flushed before each; `eager`: one eager call, L2 flushed and the device idle before it (median); "
        "`host`: host time to enqueue one call (median); `x`: vLLM / qsa (> 1: qsa faster). Errors: max abs "
        "against the fp32 reference on sampled rows, bound = 2 x the naive bf16 computation's + eps x max|ref|.",
        "",
    ]
    if not report.get("complete", True):
        lines += ["**Incomplete run**: the scenarios below are those measured before it stopped.", ""]
    cols = COLUMNS
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("| " + " | ".join("---" for _ in cols) + " |")
    for row in table_rows(report):
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    errs = [(rec["name"], n, r.get("error")) for rec in report["scenarios"] for n, r in rec.get("ops", {}).items()
            if r.get("error") and r.get("available")]
    errs += [(rec["name"], "-", rec["error"]) for rec in report["scenarios"] if rec.get("error")]
    if errs:
        lines += ["", "Errors:", ""] + [f"* {s} {n}: {e}" for s, n, e in errs]
    return "\n".join(lines) + "\n"


def failures(report: dict) -> list[str]:
    """Ops that were available and failed or errored, and scenarios that errored (skips are not failures)."""
    bad = [f"{rec['name']}:{n}" for rec in report["scenarios"] for n, r in rec.get("ops", {}).items()
           if r.get("available") and not r.get("passed")]
    bad += [f"{rec['name']} ({rec['error']})" for rec in report["scenarios"]
            if rec.get("error") and not str(rec["error"]).startswith("skipped")]
    return bad


# ------------------------------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_side_by_side",
                                description="vLLM's QSA op vs qsa's drop-in on the same inputs (checked, then timed).")
    p.add_argument("--out", type=Path, help="the JSON report, rewritten after every scenario")
    p.add_argument("--md", type=Path, help="the Markdown table (also printed)")
    p.add_argument("--quick", action="store_true", help="the tiny scenarios only, few repetitions (a smoke run)")
    p.add_argument("--scenario", "-s", action="append", metavar="GLOB", help="scenarios matching GLOB (repeatable)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (cpu: the Triton interpreter, tiny scenarios)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new scenario after this many minutes (the rest is recorded as skipped)")
    p.add_argument("--vllm-dir", type=Path, default=VLLM_DIR,
                   help="where vLLM's op and the stand-in modules are (default: the checkout's .vllm)")
    p.add_argument("--setup-vllm", type=Path, metavar="WHEEL",
                   help="extract vLLM's op from this wheel into --vllm-dir, write the stand-in modules, and exit")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = p.parse_args(argv)
    if not (args.setup_vllm or args.list or args.out):
        p.error("--out is required")
    args.parser = p
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.setup_vllm:
        op = setup_vllm(args.setup_vllm, args.vllm_dir)
        print(f"wrote {op} and the stand-in modules under {args.vllm_dir}")
        return 0
    if args.list:
        for s in SCENARIOS:
            print(f"{s.name:22s} {'quick ' if s.quick else '      '}{s.rows} rows x {s.num_reqs} req @ "
                  f"{s.context} tokens, {s.num_q_heads}/{s.num_kv_heads}/{s.head_dim}, use_prefill_config="
                  f"{use_prefill_config(s)}")
        return 0

    import torch

    on_cpu = (not torch.cuda.is_available()) if args.device == "auto" else torch.device(args.device).type == "cpu"
    if on_cpu and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # Triton reads the flag when a kernel is defined: set it before qsa's and vLLM's kernels load
        if "qsa" in sys.modules or any(m == "vllm" or m.startswith("vllm.") for m in sys.modules):
            import subprocess

            return subprocess.call([sys.executable, "-m", "benchmarks.vllm_side_by_side", *argv],
                                   env=dict(os.environ, TRITON_INTERPRET="1"), cwd=str(ROOT))
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import qsa
    except ImportError:
        sys.path.insert(0, str(ROOT / "src"))
        import qsa
    import triton

    from .report import device_info, sanitize, write_json
    from .timing import QUICK_TIMING, Timer, TimingConfig

    device = torch.device("cpu" if on_cpu else ("cuda" if args.device == "auto" else args.device))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    scenarios = select(args.scenario, quick=args.quick or (on_cpu and not args.scenario))
    if not scenarios:
        args.parser.error(f"no scenario matches {args.scenario}; --list shows them")
    quick = args.quick or on_cpu
    timer = Timer(device, QUICK_TIMING if quick else TimingConfig())
    eager_reps, host_calls = (5, 10) if quick else (50, 200)
    if on_cpu:
        host_calls = 1

    from qsa.integrations.vllm import qsa_sparse_paged_attention as qsa_op

    vllm_op, vllm_info = load_vllm_op(args.vllm_dir)
    if on_cpu and vllm_op is not None:  # imported, but its results under the interpreter would be wrong
        vllm_op = None
        vllm_info.update(available=False, error=INTERPRETER_NOTE)
    ops = dict(vllm=vllm_op, qsa=qsa_op, vllm_error=vllm_info.get("error"))
    report = dict(schema=SCHEMA_VERSION, tool="benchmarks.vllm_side_by_side", device=device_info(device),
                  date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), complete=False, quick=quick,
                  argv=argv, versions=dict(python=sys.version.split()[0], torch=torch.__version__,
                                           triton=triton.__version__, qsa=qsa.__version__),
                  vllm_op=vllm_info, num_speculative_tokens=NUM_SPECULATIVE_TOKENS, scenarios=[], fatal_error=None)

    def save():
        if args.out:
            write_json(args.out, sanitize(report))

    print(f"vllm_side_by_side: {len(scenarios)} scenarios on {report['device']['name']}; vLLM op "
          f"{'from ' + str(vllm_info.get('file')) if vllm_op else 'not available: ' + str(vllm_info.get('error'))}",
          file=sys.stderr)
    save()
    t_start = time.time()
    fatal = None
    for scn in scenarios:
        if fatal or (args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes):
            why = f"skipped: {'an earlier CUDA error' if fatal else '--max-minutes reached'}"
            report["scenarios"].append(dict(name=scn.name, num_q_heads=scn.num_q_heads,
                                            num_kv_heads=scn.num_kv_heads, rows=scn.rows, num_reqs=scn.num_reqs,
                                            error=why, ops={}))
            save()
            continue
        print(f"  {scn.name} ...", file=sys.stderr, flush=True)
        try:
            rec = run_scenario(scn, ops, timer, eager_reps=eager_reps, host_calls=host_calls)
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on unless the context is lost
            traceback.print_exc()
            rec = dict(name=scn.name, num_q_heads=scn.num_q_heads, num_kv_heads=scn.num_kv_heads, rows=scn.rows,
                       num_reqs=scn.num_reqs, error=_err_text(e), ops={})
            if _is_fatal(e):
                fatal = report["fatal_error"] = _err_text(e)
        report["scenarios"].append(rec)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    report["complete"] = True
    save()
    text = markdown(sanitize(report))
    print(text)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text)
    bad = failures(report)
    if bad:
        print(f"vllm_side_by_side: {len(bad)} failed or errored: {', '.join(bad[:8])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
