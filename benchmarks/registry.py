"""Named benchmark scenarios.

A :class:`Scenario` fixes one workload (shape, dtypes, rows, context, how selections are made) and the
routes and baselines measured on it. ``SCENARIOS`` lists them in run order: the quick set first, so a
run cut short still holds the key targets. Defaults are the TP4 per-rank shape 6/1/256, fp16, page 16,
one KV layer.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

K = 1024
ATTENTION_ROUTES = ("grouped", "xqa", "splitk", "invariant")
"""Kernel routes of ``qsa`` (each checked against the fp32 reference before it is timed). ``invariant`` (the
batch-invariant route) is measured for its cost; no target takes it."""
BASELINES = ("naive",)
"""Plain PyTorch: gather per row, matmul, softmax, matmul, in row chunks."""
COMPONENTS = ("planner",)
"""Timed parts of a route (no output of their own): the grouped planner alone."""
SELECTION_ROUTES = ("select", "torch-select")
"""``qsa.select_tokens`` and its PyTorch baseline ``benchmarks.baselines.torch_select_baseline``."""


@dataclass(frozen=True)
class Scenario:
    """One benchmark workload.

    Attributes:
        name: unique name (``--scenario`` globs match it).
        kind: ``"attention"`` or ``"selection"``.
        rows: query rows.
        context: tokens of every request (its ``seq_len``).
        num_reqs: requests; rows are spread evenly and sit at the end of their request's context
            (one request: positions ``context - rows .. context - 1``; decode: one row per request).
        num_q_heads, num_kv_heads, head_dim: attention shape (Hq / Hkv / D).
        dtype: activations, ``"fp16"`` or ``"bf16"``.
        kv_cache_dtype: ``"auto"`` (cache in ``dtype``) or ``"fp8_e4m3"``.
        block_size: tokens per KV page.
        topk: selected 4-token blocks per row (index width ``4 * topk + 3``).
        selection: ``"walk"`` (generator with a controllable adjacent-row overlap) or ``"indexer"``
            (``qsa.select_tokens`` on synthetic keys whose queries drift slowly from row to row).
        overlap: requested adjacent-row overlap of the walk generator.
        drift: per-row step of the index queries (``selection="indexer"``), relative to their norm.
        routes: routes, baselines and components measured, in order (see the module constants).
        quick_routes: the subset measured with ``--quick`` (default: ``routes``).
        quick: part of the ``--quick`` set.
        test_only: tiny CPU scenarios for the test-suite; run only when a ``--scenario`` glob names them.
        seed: base seed of every random draw of the scenario.
    """

    name: str
    kind: str = "attention"
    rows: int = 8192
    context: int = 64 * K
    num_reqs: int = 1
    num_q_heads: int = 6
    num_kv_heads: int = 1
    head_dim: int = 256
    dtype: str = "fp16"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    topk: int = 512
    selection: str = "walk"
    overlap: float | None = 0.8
    drift: float = 0.0
    routes: tuple = ("grouped", "splitk", "naive", "planner")
    quick_routes: tuple | None = None
    quick: bool = False
    test_only: bool = False
    seed: int = 0
    description: str = ""
    tags: tuple = field(default_factory=tuple)

    @property
    def width(self) -> int:
        """Columns of ``indices``: 4 tokens per selected block plus the 3-token causal tail."""
        return 4 * self.topk + 3

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def routes_for(self, quick: bool) -> tuple:
        return tuple(self.quick_routes) if quick and self.quick_routes is not None else tuple(self.routes)

    def describe(self) -> str:
        if self.description:
            return self.description
        if self.kind == "selection":
            return f"select_tokens: {self.rows} rows over {self.context // 4} blocks, k={self.topk}"
        shape = f"{self.num_q_heads}/{self.num_kv_heads}/{self.head_dim}"
        cache = "fp8" if self.kv_cache_dtype == "fp8_e4m3" else self.dtype
        return f"{self.rows} rows x {self.num_reqs} req @ {self.context // K}K, {shape}, {cache}"


def _prefill(name, context, overlap, *, quick=False, invariant=False, **kw):
    routes = ("grouped", "xqa", "splitk") + (("invariant",) if invariant else ()) + ("naive", "planner")
    return Scenario(name=name, rows=8192, context=context, overlap=overlap, routes=routes,
                    quick_routes=("grouped", "splitk", "naive", "planner"), quick=quick,
                    description=kw.pop("description", ""), **kw)


def _mtp(rows, *, quick=False):
    return Scenario(name=f"mtp-{rows}", rows=rows, context=64 * K, overlap=0.8,
                    routes=("grouped", "xqa", "splitk", "invariant", "naive"), quick=quick,
                    description=f"{rows} MTP rows of one request @ 64K")


def _decode(rows, *, suffix="", quick=False, invariant=False, **kw):
    # grouped too from 16 rows: one row per request, so a group's 8 rows share no microblock
    routes = (("grouped",) if rows >= 16 else ()) + ("xqa", "splitk") + (("invariant",) if invariant else ()) \
        + ("naive",)
    return Scenario(name=f"decode-{rows}{suffix}", rows=rows, context=64 * K, num_reqs=rows, overlap=None,
                    routes=routes, quick=quick, **kw)


def _selection(rows, context, *, quick=False):
    return Scenario(name=f"selection-{rows}x{context // 4}", kind="selection", rows=rows, context=context,
                    overlap=None, routes=SELECTION_ROUTES, quick=quick,
                    description=f"select_tokens: {rows} rows over {context // 4} blocks ({context // K}K), k=512")


SCENARIOS: tuple[Scenario, ...] = (
    # --- the quick set (key targets) ---
    _prefill("prefill-64k-o80", 64 * K, 0.8, quick=True, invariant=True),
    _prefill("prefill-64k-o98", 64 * K, 0.98, quick=True),
    _decode(64, quick=True, invariant=True),
    _mtp(8, quick=True),
    _selection(8192, 64 * K, quick=True),
    # --- prefill ---
    _prefill("prefill-128k-o80", 128 * K, 0.8),
    _prefill("prefill-128k-o98", 128 * K, 0.98),
    _prefill("prefill-8k-o80", 8 * K, 0.8),
    _prefill("prefill-8k-o98", 8 * K, 0.98),
    _prefill("prefill-64k-indexer", 64 * K, None, selection="indexer", drift=0.2, invariant=True,
             description="8192 rows @ 64K, selections from qsa.select_tokens on synthetic drifting keys"),
    # --- mtp / decode ---
    _mtp(5),
    _mtp(16),
    _decode(1, invariant=True),
    _decode(16, invariant=True),
    _decode(256, invariant=True),
    Scenario(name="mixed-185", rows=185, context=64 * K, overlap=0.8, routes=("grouped", "xqa", "splitk", "naive"),
             description="185 rows of one request @ 64K (auto: 23 whole groups and a partial one)"),
    Scenario(name="chunk-2048", rows=2048, context=64 * K, overlap=0.8, routes=("grouped", "xqa", "splitk", "naive"),
             description="a 2048-row prefill chunk of one request @ 64K"),
    # --- shape and dtype variants ---
    _prefill("prefill-64k-o80-12x1", 64 * K, 0.8, num_q_heads=12, num_kv_heads=1),
    _prefill("prefill-64k-o80-24x2", 64 * K, 0.8, num_q_heads=24, num_kv_heads=2),
    _prefill("prefill-64k-o80-fp8", 64 * K, 0.8, kv_cache_dtype="fp8_e4m3"),
    _prefill("prefill-64k-o80-bf16", 64 * K, 0.8, dtype="bf16"),
    _decode(64, suffix="-12x1", num_q_heads=12, num_kv_heads=1),
    _decode(64, suffix="-24x2", num_q_heads=24, num_kv_heads=2),
    _decode(64, suffix="-fp8", kv_cache_dtype="fp8_e4m3"),
    _decode(64, suffix="-bf16", dtype="bf16"),
    # --- selection: 1 to 8192 rows, 8K to 256K tokens ---
    *(_selection(r, c) for c in (8 * K, 64 * K, 256 * K) for r in (1, 64, 1024, 8192)
      if (r, c) != (8192, 64 * K)),
    # --- tiny CPU scenarios for the test-suite (Triton interpreter) ---
    Scenario(name="tiny-prefill", rows=20, context=256, num_q_heads=2, num_kv_heads=1, head_dim=16, topk=8,
             overlap=0.8, routes=("grouped", "xqa", "splitk", "naive", "planner"), test_only=True),
    Scenario(name="tiny-decode", rows=3, context=200, num_reqs=3, num_q_heads=2, num_kv_heads=1, head_dim=16,
             topk=8, overlap=None, kv_cache_dtype="fp8_e4m3", routes=("xqa", "splitk", "invariant", "naive"),
             test_only=True),
    Scenario(name="tiny-selection", kind="selection", rows=6, context=256, topk=8, overlap=None,
             routes=SELECTION_ROUTES, test_only=True),
)

BY_NAME = {s.name: s for s in SCENARIOS}
assert len(BY_NAME) == len(SCENARIOS), "scenario names must be unique"


def select(patterns=None, *, quick: bool = False) -> list[Scenario]:
    """Scenarios matching any of the glob ``patterns`` (all non-test ones when none), in run order.

    ``quick`` keeps only the quick set unless a pattern names scenarios explicitly. Test-only
    scenarios are returned only when a pattern matches them.
    """
    if not patterns:
        return [s for s in SCENARIOS if not s.test_only and (s.quick or not quick)]
    out = []
    for s in SCENARIOS:
        if any(fnmatch.fnmatchcase(s.name, p) for p in patterns):
            out.append(s)
    return out
