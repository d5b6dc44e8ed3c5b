"""Every tuning knob of qsa in one place: launch settings, thresholds and planner presets.

Each knob is read where it is used as ``settings.NAME`` at call time, so a test or a tuning run can
override one with ``monkeypatch.setattr(qsa.settings, "NAME", value)``; the exceptions are
``SHARED_MAP_MICROBLOCKS`` and ``MAP_LIST_WORDS``, which also size the planner kernel's static
shared-memory map when :mod:`qsa.attention.planning.kernels` is imported (a test may lower
``MAP_LIST_WORDS``, never raise either). Which functions turn shapes into
settings is in each route's ``launch.py`` (for example :func:`qsa.attention.xqa.launch.xqa_config`); how
the shipped values were chosen and how to re-tune them is in ``docs/tuning.md``, the measurements that
decided them in ``docs/performance.md``.

Settings change which programs run and how a row's sums are cut; several of them change output bits
(``docs/spec.md`` section 7 says which promises hold for a fixed device and shape). The shipped values
are fixed per shape: nothing is autotuned on first call.

Environment variables read by qsa: ``TRITON_INTERPRET=1`` (run the Triton kernels under the CPU
interpreter; read when the kernels are defined, so set it before importing qsa) and ``QSA_PDL=0``
(launch no kernel as a programmatic dependent launch of the one before it; :func:`qsa.utils.launch_options`).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

# --- Launch settings records --------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedConfig:
    """Settings of the grouped attention kernel (``qsa.attention.grouped``)."""

    rows_per_prog: int  # group rows one program computes (divides GROUP_ROWS)
    block_m: int  # power of two >= rows_per_prog * G
    mb: int  # microblocks per K/V tile
    num_warps: int
    num_stages: int
    programs_per_sm: int = 2  # split each group's list when there are fewer programs than this
    prefetch: bool = False  # load each tile's plan entries one iteration ahead (deeper K/V pipeline)
    lazy_rescale: bool = False  # rescale the accumulator only when a row's max grows past a slack


@dataclass(frozen=True)
class SplitConfig:
    """Settings of the xqa (planned and direct) and splitk kernels."""

    tile_tokens: int  # tokens per K/V tile (xqa: 4 per microblock)
    num_warps: int
    num_stages: int
    programs_per_sm: int = 3  # split each row's list until the launch has about this many programs
    prefetch: bool = False  # xqa: load each tile's plan entries one iteration ahead
    resolve_split: bool = False  # direct xqa: a split's tokens and pages all read before its loop, where
    # ``direct_resolves`` allows (else ``prefetch`` applies)
    max_registers: int | None = None  # register cap per thread (``maxnreg``) on the GPU; None: the compiler's
    defer_check: bool = False  # direct xqa, resolved splits: each split checks its own positions and the merge
    # recomputes a row found out of order (``xqa_direct_kernel``'s ``DEFER_CHECK``)
    qk_halves: bool = False  # scores over the head's two column halves (``attend_tile_halves``)


@dataclass(frozen=True)
class InvariantConfig:
    """Settings of the batch-invariant route. ``tile_tokens``, ``split_tiles``, ``num_warps`` and ``qk_halves``
    decide how a row's sums round, so they come from the shape alone; ``num_stages`` and ``max_registers``
    only schedule the work, so they may follow the launch's size."""

    tile_tokens: int  # tokens per K/V tile
    split_tiles: int  # tiles per split (split s holds list tiles [s * split_tiles, (s + 1) * split_tiles))
    num_warps: int
    num_stages: int
    qk_halves: bool = False  # scores over the head's column halves (``attend_tile_halves``)
    max_registers: int | None = None  # register cap per thread (``maxnreg``) on the GPU; None: the compiler's


@dataclass(frozen=True)
class PlannerConfig:
    """Launch settings of the grouped planner (``grouped_plan_kernel`` / ``grouped_plan_map_kernel``).

    Attributes:
        quads: index quads (4 columns) per row per step of the bitmap pass.
        scan: logical microblocks per step of the emission scan (a multiple of 8).
        num_warps: warps per program.
        programs_per_sm: persistent programs per SM (each owns one scratch bitmap).
        summary: the bitmap pass also marks each 8-word sector it sets a bit in, and the scan reads the
            marked sectors only (else every word of the touched range).
        late_table: the bitmap pass sets the bits of every token the table-free checks keep, and the scan
            drops microblocks whose block-table entry is invalid (else the bitmap pass looks each one up).
        shared_map: gather the rows' bits in a byte per microblock in shared memory
            (``grouped_plan_map_kernel``; tables of at most ``SHARED_MAP_MICROBLOCKS`` logical
            microblocks, else the settings above apply); ``scan`` is then the step that lists live map
            words (at most 4096 microblocks), ``quads`` its pass's step.
        emit: ``shared_map`` only: live map words (4 microblocks each) per emission step, a power of two.
        max_registers: ``shared_map`` only: register cap per thread (``maxnreg``) on the GPU; None: the
            compiler's choice.
    """

    quads: int = 32
    scan: int = 2048
    num_warps: int = 4
    programs_per_sm: int = 5
    summary: bool = True
    late_table: bool = True
    shared_map: bool = False
    emit: int = 128
    max_registers: int | None = None


# --- Route admission -----------------------------------------------------------------------------

GROUP_ROWS = 8
"""Adjacent rows per group of the grouped route (their K/V microblocks are loaded once for all)."""
GROUPED_MIN_ROWS = 64
"""Fewest rows for which ``auto`` takes the grouped route (below, xqa)."""
GROUPED_LONG_CONTEXT = 16384
"""Block tables spanning at least this many tokens (``max_blocks * block_size``) are long contexts, where
``auto`` groups only from ``GROUPED_MIN_ROWS_LONG`` rows."""
GROUPED_MIN_ROWS_LONG = 256
"""Fewest rows for which ``auto`` takes the grouped route over a long context (below, xqa): a few groups
over a long table pay the grouped planner and a wider union per group; ``docs/tuning.md`` says what set it."""

# --- Split counts --------------------------------------------------------------------------------

MAX_SPLITS = 32
"""Most splits per list of the planned xqa, grouped and splitk launches."""
DIRECT_MAX_SPLITS = 64
"""Most splits per list of the direct xqa kernel, whose lists are exactly the index width long."""
DIRECT_WAVE_SLACK = 8
"""The direct kernel's splits may put up to 1/8 of a wave into a second one; past that, one wave."""
DIRECT_ALONE_LISTS = 8
"""Up to this many lists the direct kernel's splits aim at one program per SM, not two."""

# --- xqa -----------------------------------------------------------------------------------------

DIRECT_MAX_ROWS = 64
"""Most xqa rows the direct kernel takes (beyond, the planned kernel is faster)."""
DIRECT_MAX_WIDTH = 4096
"""Widest ``indices`` row the direct and invariant kernels hold in registers."""
DIRECT_RESOLVE_MAX = 512
"""Most entries of a split the direct kernel reads before its loop in any launch."""
DIRECT_RESOLVE_WAVE_MAX = 2048
"""... and in a launch that fits one wave."""
DIRECT_MAX_REGISTERS = 168
"""Register cap of the direct kernel where capped: three 128-thread programs per SM."""
DIRECT_CAP_LISTS = 16
"""Most lists (rows x KV heads) for which the direct kernel is capped whatever its cache dtype."""
XQA_MERGE_FEW_LISTS = 8
"""Up to this many lists of an xqa launch, its split merge cuts each head into column programs."""
XQA_MERGE_FEW_COLUMNS = 128
"""Columns per program of that merge."""
MERGE_STATES_TILE_ELEMENTS = 2048
"""Elements (heads x padded D) per program of ``merge_attention_states``: sized, not measured; changes no bit."""

# --- splitk --------------------------------------------------------------------------------------

SPLITK_FEW_LISTS = 256
"""Most lists of a splitk launch that take its short tiles."""
SPLITK_SHORT_PER_SM = 4
"""Programs of splitk's short-tile kernel that fit an SM at once (the long tiles: 3)."""
SPLITK_FP8_FEW_LISTS = 8
"""Most lists of a splitk launch over an FP8 cache that take the short tiles."""

# --- batch-invariant -----------------------------------------------------------------------------

INVARIANT_FOLD_LISTS = 256
"""From this many lists the invariant route folds each row's splits in one program (else a merge)."""
INVARIANT_MERGE_ELEMENTS = 16384
"""Partial elements (all splits) one program of the invariant merge folds."""
INVARIANT_CAP_LISTS = 1024
"""From this many lists a folding invariant launch at head_dim 256 caps its registers (three per SM)."""

# --- Grouped planner -----------------------------------------------------------------------------

PLANNER = PlannerConfig(programs_per_sm=3)
"""Grouped planner, many groups over tables wider than the shared map: flagged sectors, late table."""
PLANNER_FEW = PlannerConfig(quads=64, scan=4096, num_warps=8, programs_per_sm=4, summary=False, late_table=False)
"""Grouped planner, fewer groups than SMs (MTP, small batches): wide steps for one group's latency."""
PLANNER_SHORT = PlannerConfig(scan=1024, summary=False)
"""Grouped planner, many groups over tables of at most ``SHORT_MICROBLOCKS`` (contexts up to 32K)."""
PLANNER_MAP = PlannerConfig(quads=32, scan=4096, num_warps=4, programs_per_sm=4, summary=False, shared_map=True,
                            emit=128, max_registers=128)
"""Grouped planner, many groups over tables up to ``SHARED_MAP_MICROBLOCKS``: the shared-memory byte map."""
SHORT_MICROBLOCKS = 8192
"""Tables up to this many logical microblocks take ``PLANNER_SHORT``."""
SHARED_MAP_MICROBLOCKS = 36864
"""Tables up to this many logical microblocks (144K tokens) fit the shared-memory map."""
MAP_LIST_WORDS = 1536
"""Words of the map planner's list of live map words (fewer only to test the list's flushes)."""
PTX_SCAN = True
"""On a GPU, the grouped planner's scans load and store scattered entries with inline PTX."""
PLANNER_SCRATCH_BYTES = 256 << 20
"""The grouped planner's scratch stays under this size (fewer programs for very long contexts)."""

# --- Eager calls ---------------------------------------------------------------------------------

REPLAY_STEPS = True
"""Eager calls on a GPU replay the launches recorded by the first call of their shape
(:mod:`qsa.attention.replay`) instead of checking, deciding and binding again (``tests/test_replay.py``
checks the bits against the full path, on the GPU with the compiled handles). Off: every call takes the
full path."""
REPLAY_CACHE_SIZE = 32
"""Shapes whose recorded launches (and the buffers they own) are kept, per cache, least recently used
dropped first."""
REPLAY_CACHE_BYTES = 512 << 20
"""Device memory the recorded steps of one cache may hold in their plans' buffers (work lists, partials,
scratch), least recently used dropped first past it; the newest step is kept whatever its size (an
8192-row grouped plan at W = 2051 holds about 130 MB)."""
REPLAY_MAX_SCRATCH_BYTES = 64 << 20
"""Largest score-key scratch (``rows x max_blocks * block_size // 4`` int32) of a
:func:`qsa.selection.api.select_tokens` call that is recorded for replay: a replay holds its scratch for as
long as it is cached, so a prefill-sized call (whose binding is a small part of its time anyway) takes the
full path unrecorded instead of pinning its scratch. Read when a fingerprint is first seen."""

# --- Selection -----------------------------------------------------------------------------------

SELECT_MAX_REGISTER_TILE = 16384
"""Rows of at most this many candidate blocks are held in registers by one top-k program; longer rows are
streamed in chunks and selected by an 8-bit radix histogram (exact either way)."""
SELECT_SCORE_TILE = dict(BLOCK_R=32, BLOCK_N=64, n_per_prog=2048, num_warps=4, num_stages=2)
"""Score kernel on the GPU, fp16/bf16 index queries: rows x compressed keys per tile, keys per program."""
SELECT_SCORE_TILE_FP32 = dict(BLOCK_R=16, BLOCK_N=32, n_per_prog=1024, num_warps=4, num_stages=1)
"""Score kernel on the GPU, fp32 index queries (the exact FMA path, no tf32)."""
SELECT_TOPK_LONG_ROW = dict(BLOCK_N=4096, num_warps=8)
"""Top-k over rows longer than ``SELECT_MAX_REGISTER_TILE``: blocks per streamed chunk, warps."""
SELECT_TOPK_EMIT = 1024
"""Blocks per emission step of the top-k kernel."""
CLEAR_PAGES_TILE = (64, 64)
"""(compressed-key rows, pages) per program of the kernel that clears the keys of invalid pages."""

# --- Change counter ------------------------------------------------------------------------------


class _Settings(types.ModuleType):
    """This module's type: every assignment or deletion of a setting bumps :data:`CHANGES`, so code that
    caches a decision taken from the settings (the replayed steps of :mod:`qsa.attention.replay`) checks one
    integer instead of comparing every setting. Assign a new value to change a setting; a value changed in
    place (an item of a dict setting) is not counted."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name != "CHANGES":
            super().__setattr__("CHANGES", self.CHANGES + 1)

    def __delattr__(self, name):
        super().__delattr__(name)
        super().__setattr__("CHANGES", self.CHANGES + 1)


CHANGES = 0
"""How many times a setting was assigned or deleted since import (read-only: the module counts)."""
sys.modules[__name__].__class__ = _Settings
