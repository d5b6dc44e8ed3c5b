"""Route admission and tuned launch settings: the one place that decides which kernel runs.

Routes:

* ``grouped`` -- page4 grouped plan, K/V tiles shared by ``GROUP_ROWS`` adjacent rows x all heads.
* ``xqa`` -- page4 single-row plan, all G heads of a KV head per program, split + ordered merge.
* ``splitk`` -- token lists through the block table; any G; the baseline and fallback.
* ``invariant`` -- batch-invariant: every row on its own, cut into splits of a fixed size at fixed
  positions of its list and folded in list order, with settings fixed by the shape alone, so a row's
  output bits depend only on its own inputs, never on the batch (:func:`invariant_config`). Only on request.
* ``reference`` -- the pure PyTorch reference (CPU without the Triton interpreter, or on request).

``auto`` sends ``rows // GROUP_ROWS * GROUP_ROWS`` rows to ``grouped`` when there are at least
``GROUPED_MIN_ROWS`` rows, the shape is supported and the batch is not known to be pure decode (one row
per request), the remaining rows to ``xqa``, and falls back to ``splitk`` for shapes the page4 routes
do not take (to ``reference`` for head dims no Triton kernel takes, and where no Triton kernel can run:
a CPU without the interpreter, or an interpreter that cannot run them, :func:`interpreter_problem`).
Each such fallback is logged once per process, with its reason, as a WARNING on the ``qsa`` logger
(printed to stderr when logging is not configured); a forced route that cannot run raises ValueError.

xqa rows run one of two kernels: with a single-row plan built by its own launch, or, when the caller
says the rows are sorted (``rows_sorted``: ascending kept tokens, dropped entries last, as
``select_tokens`` emits them) and there are at most ``DIRECT_MAX_ROWS`` of them, "direct": each
program reads its row's list straight from ``indices`` (one launch fewer). A row that is not sorted after
all is sorted inside the direct kernel, correctly but slowly. A row of whole 4-token blocks and a tail (the
indexer's selections), all of whose tokens are kept, gets the same bits with or without the hint: the
planned kernel cuts the rows the direct kernel could take as it would (:func:`xqa_cut`). Other rows agree
within rounding.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch

from .utils import check_bool, check_int, device_facts, interpreter_enabled, next_pow2

logger = logging.getLogger("qsa")

ROUTES = ("auto", "grouped", "xqa", "splitk", "invariant", "reference")
GROUP_ROWS = 8
GROUPED_MIN_ROWS = 64
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_TILE_ROWS = 128
"""Largest matrix-row tile (rows x heads, or heads) a page4 program holds."""
DIRECT_MAX_ROWS = 64
"""Most xqa rows the direct kernel takes (at 256 decode rows the planned kernel measured faster)."""
DIRECT_MAX_WIDTH = 4096
"""Widest ``indices`` row the direct kernel holds in registers."""
DIRECT_RESOLVE_MAX = 512
"""Most entries of a split (rounded up to a power of two) that the direct kernel resolves before its loop
in any launch."""
DIRECT_RESOLVE_WAVE_MAX = 2048
"""... and in a launch that fits one wave (at most ``programs_per_sm`` programs per SM)."""
DIRECT_MAX_REGISTERS = 168
"""Register cap of the direct kernel where it is capped (:func:`xqa_direct_config`): three 128-thread
programs per SM."""
DIRECT_CAP_LISTS = 16
"""Most lists (rows x KV heads) for which the direct kernel is capped whatever its cache dtype."""
DIRECT_WAVE_SLACK = 8
"""The direct kernel's split count may put up to 1/8 of a wave into a second one; past that it takes
the most splits that fit one wave (see :func:`direct_split_count`)."""
DIRECT_ALONE_LISTS = 8
"""Up to this many lists the direct kernel's splits aim at one program per SM, not two
(:func:`direct_split_count`)."""

_logged: set[str] = set()


def log_once(message: str) -> None:
    """Log ``message`` once per process at WARNING on the ``qsa`` logger: with no logging configured,
    Python's last-resort handler prints it to stderr, so a fallback of ``route="auto"`` is never silent."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


@dataclass(frozen=True)
class GroupedConfig:
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
    """xqa and splitk settings."""

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
    qk_halves: bool = False  # xqa (planned and direct) and splitk: K/V tiles and scores over the head's two
    # column halves (``attend_tile_halves``)


@dataclass(frozen=True)
class InvariantConfig:
    """Settings of the batch-invariant route. ``tile_tokens``, ``split_tiles``, ``num_warps`` and ``qk_halves``
    decide how a row's sums round, so they come from the shape alone (:func:`invariant_config`);
    ``num_stages`` and ``max_registers`` only schedule the work (which programs share an SM, how far ahead
    the loads run), so they may follow the launch's size."""

    tile_tokens: int  # tokens per K/V tile
    split_tiles: int  # tiles per split (split s holds list tiles [s * split_tiles, (s + 1) * split_tiles))
    num_warps: int
    num_stages: int
    qk_halves: bool = False  # scores over the head's column halves (``attend_tile_halves``)
    max_registers: int | None = None  # register cap per thread (``maxnreg``) on the GPU; None: the compiler's


@dataclass(frozen=True)
class RoutePlan:
    """Which rows go where. ``grouped_rows`` rows from row 0 take the grouped route, the rest xqa,
    unless ``route`` is ``splitk`` or ``reference`` (then all rows take it)."""

    route: str
    grouped_rows: int
    group_rows: int = GROUP_ROWS
    direct: bool = False  # xqa rows read their lists straight from ``indices`` (no single-row plan)


def grouped_config(G: int, head_dim: int, kv_fp8: bool = False) -> GroupedConfig:
    """Tuned defaults per shape (see docs/perf-notes.md).

    head_dim 256: up to 8 heads per KV head, 8 rows fill a 64-row tile (4 warps, two programs per SM,
    num_stages 3). On the H200 the attention kernel of prefill-64k took 0.510-0.512 ms at overlap 0.98
    (0.561 ms with num_stages 2, the default until the v4.1 kernel changed its loads) and 1.000 ms at
    overlap 0.8 (1.081-1.083); bf16 the same; prefill-128k-o80 1.028-1.031 ms (1.118-1.119). An FP8
    cache loads a quarter of the bytes per tile into registers: there num_stages 3 alone was slower
    (1.312-1.322 vs 1.272 ms at o80) and with the plan-entry prefetch faster (1.245 ms)
    (benchmarks/results/experiments/2026-11-30-0246-grouped-stages-nvidia-h200.json). More heads (12/1,
    24/2) take 128-row tiles on 8 warps with the plan-entry prefetch, which keeps all 8 rows per program
    (both have G = 12; fewer rows only for G > 16): 0.46 ms (12/1) and 0.86 ms (24/2) for 2048 rows at 8K, overlap 0.8
    (tune-2026-11-29-2027); 12/1 at 64K, overlap 0.8: 1.66-1.67 ms with 3 stages, 1.82 ms with 4,
    2.16 ms with 2.

    The lazy rescale (per row, multiplies skipped by warps whose rows keep their reference) pays where
    the plan entries are prefetched: at prefill-64k-o80, plan + run, FP8 1.274-1.275 -> 1.162 ms, 12/1
    1.703-1.715 -> 1.546-1.554 ms, 24/2 3.390-3.414 -> 3.072 ms (every tile rescaled). On 6/1 fp16
    tiles without the prefetch it costs: o80 0.966-0.970 -> 0.982-0.985 ms, o98 0.504 -> 0.510 ms
    (benchmarks/results/experiments/2026-11-30-0545-lazy-rescale-order-nvidia-h200.json, section E, and
    2026-11-30-0525-row-rescale-sort-in-row-nvidia-h200.json).
    """
    wide = head_dim == 256 and GROUP_ROWS * G > 64  # 12/1, 24/2: 128-row tiles, 8 warps, prefetch
    tile_rows = 64 if head_dim == 256 and not wide else MAX_TILE_ROWS
    rows = GROUP_ROWS
    while rows > 1 and rows * G > tile_rows:
        rows //= 2
    block_m = max(16, next_pow2(rows * G))
    return GroupedConfig(rows_per_prog=rows, block_m=block_m, mb=8,
                         num_warps=8 if wide else 4, num_stages=3, prefetch=wide or kv_fp8,
                         lazy_rescale=wide or (kv_fp8 and block_m == 64))


def xqa_config(G: int, head_dim: int) -> SplitConfig:
    # 32-token tiles, four K/V buffers fed by the plan-entry prefetch, one program per SM: on the H200
    # the xqa kernel took 0.144 ms for decode-256 (0.160 ms with one buffer of 64 tokens), 0.056 ms for
    # decode-64 (0.060) and 0.020 ms for mtp-8 (0.021), benchmarks/results/tune-2026-11-29-2027.
    # The scores over column halves as in the direct kernel (xqa_direct_config), whose rows must come out
    # with the same bits whichever of the two kernels computes them.
    return SplitConfig(tile_tokens=32, num_warps=4, num_stages=4, programs_per_sm=1, prefetch=True,
                       qk_halves=head_dim >= 256)


def xqa_direct_config(G: int, head_dim: int, lists: int = 1, kv_fp8: bool = False) -> SplitConfig:
    """Settings of the direct kernel for ``lists`` = rows x KV heads.

    32-token tiles, 3 stages, about two programs per SM. Each split's tokens and pages are all read
    while its row is checked, and each tile takes its own from registers, so the pipeline issues the
    K/V loads two tiles ahead (sm_90 TTGIR: ``async_wait`` with 2 copies in flight; with tile-by-tile
    list and table loads and no prefetch, as at 64 rows, it waited for every copy at the top of each
    iteration). On the H200, plan + run (interleaved, us): mtp-8 17.5-18.0 -> 16.4-16.9,
    mtp-16 20.7-21.0 -> 19.8-20.1, decode-1 14.7-14.9 -> 13.7-13.9, decode-16 26.9-27.0 -> 24.6-24.7,
    decode-64 57.1-57.8 -> 55.8-56.4, decode-64 FP8 81.7-82.1 -> 57.7-57.9; but decode-64 24/2 (three
    splits of 22 tiles, 1024 entries, two waves) 90.0 -> 101.2, hence :func:`direct_resolves`
    (benchmarks/results/experiments/2026-11-30-0636-direct-resolved-splits-nvidia-h200.json). Without it, up
    to 16 lists read each split's first tile while the row is checked and every next one a tile ahead
    (mtp-8 17.5 vs 18.0 us, 2026-11-30-0017-direct-width-splits); at 64 rows that prefetch costs more
    than it hides (decode-64: 73.4 vs 57.6 us).

    Registers: the kernel takes 227-234 per thread, mostly for its row check and its in-kernel sort of
    an unsorted row (4096 entries held across 128 threads), not for the tile loop. Capped at
    ``DIRECT_MAX_REGISTERS`` (168), ptxas spills 48-56 bytes, all of them before the loop (sm_90 SASS),
    and three programs fit an SM (3 x 75 KB of shared memory). On the H200, plan + run (us, two rounds,
    benchmarks/results/experiments/2026-11-30-0858-direct-register-cap-nvidia-h200.json), the cap with
    the same splits: mtp-8 15.5 -> 14.9-15.0, mtp-5 15.1 -> 14.8, decode-1 13.3 -> 13.2, decode-16 23.5-23.6
    -> 23.3-23.4, mtp-16 18.8 -> 18.7; but decode-64 52.8-52.9 -> 53.1 and 12/1 54.2-54.3 -> 54.6-54.7. With
    an FP8 cache, whose tiles are converted in registers, three programs per SM (decode-64: 6 splits
    instead of 4) took 41.0-41.1 against 47.0-47.3 (the cap with 4 splits: 48.4). Hence the cap for at most
    16 lists, and with three programs per SM for an FP8 cache past that. The shipped rule against the old
    one (2026-11-30-0905-direct-register-cap-defaults): mtp-8 14.7 -> 14.3, mtp-8 with an FP8 cache 15.2 ->
    14.8, decode-64 FP8 46.9 -> 40.7; decode-16 FP8 (16 lists) 20.5 either way.

    The row check deferred (``defer_check``, at most ``DIRECT_CAP_LISTS`` lists): each program checks
    only its split's positions, after its loop, and ``xqa_direct_merge_kernel`` recomputes a row found
    out of order; the kernel then holds no sort (164-166 registers under the cap, no spill). On the
    H200, plan + run (us, two alternations of processes, outputs bitwise equal;
    benchmarks/results/experiments/2026-11-30-1639-direct-deferred-check-nvidia-h200.json): mtp-16
    17.7-17.8 -> 17.1-17.3, decode-16 23.0 -> 22.7-22.8, mtp-8, mtp-5 and decode-1 0.1 us faster. At 64
    lists (4 splits of 1024 entries, uncapped) it was slower (decode-64 52.1-52.2 -> 54.9-56.0 in three builds), so
    there the whole row is still checked before the loop.

    At head_dim 256 the scores are taken over the head's two column halves (``qk_halves``,
    ``attend_tile_halves``): two chains of 8 mma steps per warp instead of one of 16, 348 instead of 465
    instructions per tile in the loop. On the H200, plan + run (us, two alternations;
    benchmarks/results/experiments/2026-11-30-2010-direct-score-halves-nvidia-h200.json): mtp-16
    16.96-17.06 -> 16.50-16.70, mtp-8 14.22-14.30 -> 13.95-14.11, mtp-5 13.60-13.66 -> 13.34-13.41, decode-16
    22.46-22.53 -> 22.21-22.35, decode-1 and decode-64 level. ``xqa_config`` takes the same form, so that a
    row gets the same bits from the planned kernel as from this one.
    """
    capped = lists <= DIRECT_CAP_LISTS or kv_fp8
    return SplitConfig(tile_tokens=32, num_warps=4, num_stages=3,
                       programs_per_sm=3 if kv_fp8 and lists > DIRECT_CAP_LISTS else 2,
                       prefetch=lists <= 16, resolve_split=True, defer_check=lists <= DIRECT_CAP_LISTS,
                       max_registers=DIRECT_MAX_REGISTERS if capped else None, qk_halves=head_dim >= 256)


XQA_MERGE_FEW_LISTS = 8
"""Up to this many lists (rows x KV heads) of an xqa launch, planned or direct, its split merge cuts each
head's columns over programs of ``XQA_MERGE_FEW_COLUMNS`` (:func:`merge_config`)."""
XQA_MERGE_FEW_COLUMNS = 128


def merge_config(num_splits: int, head_dim: int, xqa_lists: int | None = None) -> tuple[int, int]:
    """(columns per program, warps) of the split merges (``merge_splits_kernel``, and
    ``xqa_direct_merge_kernel``): one program per row and head, all of its columns, 4 warps; after an xqa
    launch (``xqa_lists`` given) of at most ``XQA_MERGE_FEW_LISTS`` lists, programs of
    ``XQA_MERGE_FEW_COLUMNS`` columns. The planned and the direct xqa step take the same columns, so that
    a row gets the same bits from either (the column count changes how the splits' sum rounds).

    On the H200 (plan + run, us): at first no column split or warp count was faster (two rounds: mtp-8
    xqa 14.6-15.3 with 256 columns on 4 warps, 15.0-15.7 with 256 on 8, 128 or 64 on 4, 64 or 32 on 2;
    mtp-16, decode-1 and decode-64 likewise within noise or slower;
    benchmarks/results/experiments/2026-11-30-0810-merge-columns-nvidia-h200.json). On the deferred
    merge of the direct kernel as of v23, 128 columns on 4 warps: decode-1 11.52-11.68 -> 11.04-11.20, mtp-8
    13.57-13.95 -> 13.60-13.79, mtp-5 level (three alternations,
    benchmarks/results/experiments/2026-12-01-0651-direct-merge-columns-nvidia-h200.json); from 16
    lists slower (mtp-16 +0.7-0.85, decode-16 +0.55; 2026-12-01-0442-direct-tiles-and-split-rule). The
    planned kernel's merge at so few lists was not timed (the benchmark's few-row xqa steps are direct);
    splitk's merge keeps whole heads (not measured either way)."""
    if xqa_lists is not None and xqa_lists <= XQA_MERGE_FEW_LISTS:
        return min(head_dim, XQA_MERGE_FEW_COLUMNS), 4
    return head_dim, 4


def direct_merge_registers(programs: int, programs_per_sm: int, device: torch.device) -> int | None:
    """Register cap of ``xqa_direct_merge_kernel`` after a direct launch of ``programs`` programs, or None.

    The deferred merge is launched as the direct kernel starts (programmatic dependent launch) and
    waits for it; its programs can wait beside the direct kernel's only where registers are left. It
    takes 255 per thread uncapped (its recompute path), 168 capped, which fits beside two direct programs
    of at most 168. Capped, ptxas spills in the recompute and saves 13 register pairs to local memory on
    the common path before its branch to it (one pair uncapped; sm_90 SASS). Capped where the direct
    launch fills its programs per SM, on the H200 (plan + run, us, two alternations;
    benchmarks/results/experiments/2026-11-30-1838-direct-merge-register-cap-nvidia-h200.json): mtp-16
    16.77-16.86 -> 16.64-16.74, mtp-8 14.05-14.38 -> 13.98-14.05, decode-16 level; where programs are
    left free it was slower (mtp-5, 165 programs, 13.31-13.41 -> 13.63-13.79; decode-1 11.30-11.36 ->
    11.55-12.05), so there it is not."""
    facts = device_facts(str(device))
    if facts["kind"] != "cuda" or programs < programs_per_sm * facts["sm_count"]:
        return None
    return DIRECT_MAX_REGISTERS


SPLITK_FEW_LISTS = 256
"""Most lists (rows x KV heads) of a splitk launch that take its short tiles (``splitk_config``)."""
SPLITK_SHORT_PER_SM = 4
"""Programs of splitk's short-tile kernel that fit an SM at once (sm_90, 6/1/256 fp16: 124 registers and 42 KB
of shared memory per 128-thread program; the long tiles' 158 and 75 KB fit 3)."""
SPLITK_FP8_FEW_LISTS = 8
"""Most lists of a splitk launch over an FP8 cache that take the short tiles."""


def splitk_config(G: int, head_dim: int, lists: int | None = None, kv_fp8: bool = False,
                  sm_count: int | None = None) -> SplitConfig:
    """splitk settings for a launch of ``lists`` = rows x KV heads (None: many), over an FP8 cache or not, on
    a GPU of ``sm_count`` SMs (None: not known).

    At head_dim 256 the scores are taken over the head's column halves (``attend_tile_halves``): on the H200,
    plan + run against the whole-head form (benchmarks/results/experiments/2026-11-30-2322-splitk-score-halves-
    nvidia-h200.json, us): prefill-64k-o80 2933-2947 -> 2436-2439, mtp-16 24.8-24.9 -> 23.8-24.4, mtp-8
    22.3-22.4 -> 20.8-20.9, decode-64 65.2-65.5 -> 60.4-60.6, decode-256 208.4-209.0 -> 195.1-195.3.
    With the halves, the kernel alone (``benchmarks.tune --splitk-only``, 23:30) took 32-token tiles on 4
    stages best up to 256 lists (decode-256 0.147 ms against 0.189 with 64-token tiles on 2 stages,
    decode-64 0.053 against 0.057, mtp-16 0.017 against 0.019, mtp-8 0.016 against 0.018) and 64-token
    tiles on 2 stages at 8192 lists (prefill-64k-o80 2.35 ms against 2.58 with the short tiles). Both
    together, plan + run against the whole-head 64/4/2 kernel (2026-11-30-2342-splitk-shipped, us): decode-256
    208.8-209.1 -> 155.0-155.3, decode-64 64.7-64.9 -> 60.8-61.1, mtp-16 25.0-25.3 -> 23.0-23.1, mtp-8
    22.1 -> 20.2, decode-1 18.7-18.8 -> 16.6-16.8, prefill-64k-o80 2932-2944 -> 2440-2445.

    Past ``SPLITK_FEW_LISTS`` lists, on a GPU of known SM count, the launch is sized by waves. The split
    count aims at 3 programs per SM (``split_count``); 4 short programs fit an SM (``SPLITK_SHORT_PER_SM``),
    3 long ones. The short tiles win where the lists' splits fit one wave of short programs (on the H200, 132
    SMs: 257-264 lists in two splits, 396-528 in one); where they do not and the lists are fewer than the
    split target, two splits of the long tiles would spill past one wave of them, and one split each is
    faster. Plan + run, us (benchmarks/results/experiments/2026-12-01-0445-splitk-tiles-by-lists-nvidia-h200.json;
    rows at the end of a 64K request unless named), long tiles / short / long in one split:
    264 lists 148.7 / **111.6** / 136.6; 300 lists 151.4 / 158.9 / **136.2** (decode-300 at 16K 209.8 / 237.6 /
    210.2); 384 lists 156.6 / 175.4 / **137.0** (decode-384 at 16K 239.0 / 246.0 / **230.2**); 512 lists 237 /
    **189** (decode-512 at 16K 337 / 282; 256 rows of 24/2 236 / 185; bf16 alike). Past the window the long
    tiles stay faster: 640 lists 243 against 289, 768 lists 252 against 320, 1024 lists level (357 against
    359), 2048 and 4096 lists 685 / 1274 against 700 / 1360. At 200 and 256 lists the short tiles (105-106)
    beat both (121-131 and 127-144).

    Over an FP8 cache, whose tiles are converted in registers, the long tiles take a third stage: the 23:30
    sweep measured prefill-64k-o80 with an FP8 cache at 3.26 ms on 3 stages against 3.84 on 2 (32/4/4: 3.44).
    There the long tiles are faster from 16 lists on, the short ones up to ``SPLITK_FP8_FEW_LISTS`` (plan +
    run, us, long against short): mtp-16 24.1 / 26.7, decode-16 25.9 / 27.9, decode-64 57.1 / 60.5,
    decode-128 82.4 / 87.4, decode-256 142.5 / 152.2, 512 prefill rows 231 / 242; mtp-8 20.6 / 19.3-19.6,
    decode-1 17.3-17.8 / 16.6-17.3. Between 9 and 15 lists nothing was measured."""
    halves = head_dim >= 256
    short = SplitConfig(tile_tokens=32, num_warps=4, num_stages=4, qk_halves=halves)
    long = SplitConfig(tile_tokens=64, num_warps=4, num_stages=3 if kv_fp8 else 2, qk_halves=halves)
    if lists is None:
        return long
    if kv_fp8:
        return short if lists <= SPLITK_FP8_FEW_LISTS else long
    if lists <= SPLITK_FEW_LISTS:
        return short
    if sm_count is None:
        return long
    target = short.programs_per_sm * sm_count  # split_count's programs
    if lists * -(-target // lists) <= SPLITK_SHORT_PER_SM * sm_count:  # the splits fit one wave of short programs
        return short
    if lists < target:  # two splits would spill past one wave of long programs: one split each
        return replace(long, programs_per_sm=1)
    return long


INVARIANT_FOLD_LISTS = 256
"""From this many lists (rows x KV heads) the batch-invariant route folds each row's splits in one program;
below, a program per split and a merge launch (:func:`invariant_folds`)."""
INVARIANT_MERGE_ELEMENTS = 16384
"""Partial elements (all splits) of one program of the batch-invariant merge: 128 per thread on 4 warps, were
all of its unrolled loads in flight at once."""


INVARIANT_CAP_LISTS = 1024
"""From this many lists a folding batch-invariant launch at head_dim 256 (G <= 8, a cache in q's dtype) caps
its registers so that three programs share an SM (:func:`invariant_config`)."""


def invariant_config(G: int, head_dim: int, lists: int | None = None, kv_fp8: bool = False) -> InvariantConfig:
    """Settings of the batch-invariant route for a shape and a launch of ``lists`` lists (rows x KV heads;
    None: not known) over an FP8 cache or not. What decides a row's bits comes from the shape alone.

    The tile of the direct xqa kernel (32 tokens, 4 warps, the scores over column halves at head_dim 256)
    and splits of 4 tiles: a 2051-wide row is 17 splits of 128 list positions, as many as the direct
    kernel takes for one 16-row MTP step.

    From ``INVARIANT_CAP_LISTS`` lists (where the launch folds) at head_dim 256 the kernel is capped at 168
    registers on 2 stages: three programs per SM instead of two (244 registers uncapped), its spills all
    outside the tile loop (``tests/sm90.py``). Bits unchanged. On the H200, plan + run, us, uncapped on 3
    stages / capped on 3 / capped on 2 (benchmarks/results/experiments/2026-12-04-1850-invariant-register-
    cap-nvidia-h200.json): rows of one 64K request (overlap 0.8) 512: 244 / 291 / 280, 1024: 475 / 438 /
    416, 2048: 936 / 855 / 796, 4096: 1851 / 1573 / 1478, 8192: 3663 / 3005 / 2870; rows of distinct 16K
    requests 512: 298 / 361 / 360, 1024: 572 / 567 / 586, 2048: 1114 / 1129 / 1143; decode-256 (64K)
    172 / 170 / 192. Not measured: FP8 caches (a spill in the loop on 3 stages) and G > 8 (one in the loop
    on 2 stages), which keep the compiler's count."""
    cfg = InvariantConfig(tile_tokens=32, split_tiles=4, num_warps=4, num_stages=3, qk_halves=head_dim >= 256)
    if lists is not None and lists >= INVARIANT_CAP_LISTS and head_dim == 256 and G <= 8 and not kv_fp8:
        cfg = replace(cfg, num_stages=2, max_registers=DIRECT_MAX_REGISTERS)  # three 128-thread programs per SM
    return cfg


def invariant_folds(lists: int) -> bool:
    """Whether a batch-invariant launch of ``lists`` lists folds each row's splits in one program (from
    ``INVARIANT_FOLD_LISTS`` lists: a program per list then fills the GPU, and no partials are written)
    rather than running a program per split and a merge. Either gives the same bits."""
    return lists >= INVARIANT_FOLD_LISTS


def invariant_merge_columns(num_splits: int, head_dim: int, block_g: int = 16) -> int:
    """Columns per program of the batch-invariant merge, whose programs fold every split's partial tile of
    ``block_g`` matrix rows: the most (a power of two dividing ``head_dim``, at least 16 where the head has
    them) within ``INVARIANT_MERGE_ELEMENTS``. Changes no bit (the fold is column by column)."""
    cols = max(1, INVARIANT_MERGE_ELEMENTS // (block_g * max(num_splits, 1)))
    cols = 1 << (cols.bit_length() - 1)
    return max(min(16, head_dim), min(head_dim, cols))


def page4_refusal(G: int, head_dim: int) -> str | None:
    """Why the page4 routes (grouped, xqa) cannot take this shape, or None."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if next_pow2(max(G, 16)) > MAX_TILE_ROWS:
        return f"G = Hq / Hkv = {G} exceeds {MAX_TILE_ROWS} heads per tile"
    return None


NO_BACKEND_HINT = ("set TRITON_INTERPRET=1 before importing qsa to run the Triton kernels under the "
                   "interpreter, slowly, for testing")


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run qsa's kernels here, or None; found by running a probe kernel
    once per process (only called with the interpreter on: the kernel is defined then).

    The probe does what every page4 kernel does and what broke under NumPy 2.4 with the Triton 3.6
    interpreter: a loop whose bounds are loaded from memory (the interpreter holds loaded scalars in
    1-element arrays and turns them into loop bounds with ``int()``, which NumPy 2.4 refuses)."""
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(bounds_ptr, out_ptr):
        start = tl.load(bounds_ptr)
        end = tl.load(bounds_ptr + 1)
        acc = tl.zeros((4,), dtype=tl.int32)
        for i in range(start, end):
            acc += i
        tl.store(out_ptr + tl.arange(0, 4), acc)

    bounds = torch.tensor([2, 5], dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int32)
    versions = f"numpy {numpy.__version__} with triton {triton.__version__}"
    try:
        probe_kernel[(1,)](bounds, out)
    except Exception as e:  # the interpreter wraps what failed (InterpreterError, TypeError, ...)
        detail = (str(e).strip().splitlines() or [""])[0][:160]
        return (f"the Triton interpreter cannot run qsa's kernels with {versions} ({type(e).__name__}: "
                f"{detail}); NumPy 2.4 and newer break it: pip install 'numpy<2.4'")
    if out.tolist() != [9] * 4:
        return (f"the Triton interpreter computes a loop with bounds loaded from memory wrongly with {versions} "
                f"(got {out.tolist()}, want [9, 9, 9, 9]); NumPy 2.4 and newer break it: pip install 'numpy<2.4'")
    return None


def triton_available(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device``, or None. Under the interpreter (``TRITON_INTERPRET=1``)
    the interpreter must also run a probe kernel with the installed NumPy (:func:`interpreter_problem`)."""
    if interpreter_enabled():
        problem = interpreter_problem()
        if problem is not None:
            return problem
    if device.type == "cuda":
        cap = device_facts(str(device))["capability"]
        if cap < (8, 0):
            return f"compute capability {cap} is below 8.0"
        return None
    if interpreter_enabled():
        return None
    return f"no Triton backend for device {device.type}; {NO_BACKEND_HINT}"


BACKENDS = ("triton", "torch")
"""How the selection stage and cache writes run: Triton kernels, or their PyTorch implementations."""


def kernel_backend(route: str, device) -> str:
    """``"torch"`` for the reference route or where Triton cannot run on ``device``, else ``"triton"``."""
    if route == "reference" or triton_available(torch.device(device)) is not None:
        return "torch"
    return "triton"


def resolve_backend(backend: str | None, device) -> str:
    """``backend``, or the one :func:`kernel_backend` picks for ``device`` when it is None."""
    if backend is None:
        return kernel_backend("auto", device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton":
        why = triton_available(torch.device(device))
        if why is not None:
            raise ValueError(f"backend='triton' cannot run: {why}")
    return backend


def max_query_len_of(token_to_req) -> int | None:
    """The most rows any one request has among ``token_to_req`` (padding rows, request < 0, not
    counted; None when there are none). A device tensor is read back once (a host synchronisation), so
    compute it where the batch is built, not inside a captured region."""
    t = token_to_req.cpu() if isinstance(token_to_req, torch.Tensor) else torch.tensor(token_to_req)
    t = t[t >= 0].long()
    return int(torch.bincount(t).max()) if t.numel() else None


def choose(route: str, *, rows: int, G: int, head_dim: int, device: torch.device,
           max_query_len: int | None = None, rows_sorted: bool = False,
           index_width: int | None = None) -> RoutePlan:
    """Admission: map a requested route to the rows each kernel takes.

    ``max_query_len`` is the most rows any one request has in the batch, when the caller knows it (a
    host integer; serving engines track it). At 1, a pure decode batch, no two rows of a group share a
    request, so grouping shares no K/V load and ``auto`` takes xqa.

    ``rows_sorted`` (with ``index_width``, the columns of ``indices``) lets xqa rows take the direct
    kernel (see the module docstring); it changes which kernel runs, and no bit of a row of whole blocks.

    A forced route that cannot run raises ValueError; ``auto`` falls back and logs why once.
    """
    if max_query_len is not None:
        max_query_len = check_int("max_query_len", max_query_len, 1)
    rows_sorted = check_bool("rows_sorted", rows_sorted)
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if route == "reference":
        return RoutePlan("reference", 0)
    no_triton = triton_available(device)
    if no_triton is not None:
        if route != "auto":
            raise ValueError(f"route={route!r} cannot run: {no_triton}")
        log_once(f"qsa: route 'auto' falls back to the PyTorch reference attention: {no_triton}")
        return RoutePlan("reference", 0)
    if head_dim not in HEAD_DIMS:
        if route != "auto":
            raise ValueError(f"head_dim must be one of {HEAD_DIMS} for the Triton routes, got {head_dim}")
        log_once(f"qsa: route 'auto' falls back to the PyTorch reference attention: no Triton kernel takes "
                 f"head_dim {head_dim} (they take {HEAD_DIMS})")
        return RoutePlan("reference", 0)
    refusal = page4_refusal(G, head_dim)
    if route == "splitk":
        return RoutePlan("splitk", 0)
    if route == "invariant":
        if refusal is not None:
            raise ValueError(f"route='invariant' cannot run: {refusal}")
        if index_width is not None and next_pow2(max(index_width, 1)) > DIRECT_MAX_WIDTH:
            raise ValueError(f"route='invariant' takes indices at most {DIRECT_MAX_WIDTH} wide, got {index_width}")
        return RoutePlan("invariant", 0)
    if route in ("grouped", "xqa"):
        if refusal is not None:
            raise ValueError(f"route={route!r} cannot run: {refusal}")
        grouped_rows = rows if route == "grouped" else 0
    elif refusal is not None:
        log_once(f"qsa: route 'auto' takes splitk, not the page4 routes (grouped, xqa): {refusal}")
        return RoutePlan("splitk", 0)
    elif rows < GROUPED_MIN_ROWS or max_query_len == 1:
        route, grouped_rows = "xqa", 0
    else:
        route, grouped_rows = "grouped", rows // GROUP_ROWS * GROUP_ROWS
    direct = rows_sorted and index_width is not None and direct_admits(rows - grouped_rows, index_width)
    return RoutePlan(route, grouped_rows, direct=direct)


def direct_admits(rows: int, index_width: int) -> bool:
    """Whether the direct xqa kernel can take ``rows`` xqa rows of ``indices`` ``index_width`` wide (with
    the ``rows_sorted`` hint it then does; without it the planned kernel cuts them as it would:
    :func:`xqa_cut`)."""
    return 0 < rows <= DIRECT_MAX_ROWS and next_pow2(max(index_width, 1)) <= DIRECT_MAX_WIDTH


MAX_SPLITS = 32


def split_count(programs: int, max_tiles: int, programs_per_sm: int, device: torch.device,
                cap: int = MAX_SPLITS) -> int:
    """Splits per work list (row or group) so that a launch of ``programs`` lists has about
    ``programs_per_sm`` programs per SM (at most ``cap``); one when the lists alone fill the device.

    The count depends on the batch shape only, never on the data, so a fixed shape always cuts a
    list at the same positions (bitwise determinism for a fixed batch shape, docs/spec.md section 7).
    """
    facts = device_facts(str(device))
    target = programs_per_sm * facts["sm_count"]
    if facts["kind"] != "cuda" or programs >= target:  # the interpreter runs programs one by one
        return 1
    return max(1, min(cap, max_tiles, -(-target // max(programs, 1))))


DIRECT_MAX_SPLITS = 64
"""Split cap of the direct xqa kernel, whose lists are exactly ``W`` positions long."""


def direct_split_count(programs: int, tiles: int, programs_per_sm: int, device: torch.device) -> int:
    """Splits of the direct xqa kernel, whose rows are ``tiles`` tiles long whatever they keep.

    :func:`split_count` up to ``DIRECT_MAX_SPLITS``, unless that puts more than 1/``DIRECT_WAVE_SLACK``
    of a wave of programs into a second wave: then the most splits that fit one wave. Then as few
    splits as hold the same most tiles per split, so that no split is empty. On the H200, plan + run
    (us), decode-64 (64 lists of 65 tiles): 5 splits (320 programs on 264 slots) 54.5, 4 splits of 17
    tiles (one wave, resolved) 52.6; FP8 63.0 -> 47.0; bf16 54.6 -> 52.4; 12/1 55.6 -> 53.8; 24/2 (128
    lists) 3 splits 90.4, 2 splits resolved 85.3. Where few programs spill over, more splits stay
    better: mtp-16 (17 splits, 272 programs) 18.9 against 19.9 for 13 splits in one wave
    (benchmarks/results/experiments/2026-11-30-0736-direct-table-chain-waves-nvidia-h200.json).

    Up to ``DIRECT_ALONE_LISTS`` lists the count aims at one program per SM: a program then has its SM
    to itself (beside the waiting merge), and runs more tiles. On the H200 (the direct step alone, us,
    three rounds; benchmarks/results/experiments/2026-12-01-0340-direct-split-counts-nvidia-h200.json):
    mtp-8 33 splits of 2 tiles (264 programs) 14.05-14.14, 17 of 4 (136) 13.73-13.89, 22 of 3 (176)
    14.43-14.46; mtp-5 33 of 2 (165) 13.34-13.38, 22 of 3 (110) 12.74-12.83. At 16 lists two per SM
    stay faster: mtp-16 17 splits of 4 (272) 16.35-16.83, 13 of 5 (208) 18.05-18.08; decode-16 22.35-22.43
    against 22.58-22.62."""
    if programs <= DIRECT_ALONE_LISTS:
        programs_per_sm = 1
    want = split_count(programs, tiles, programs_per_sm, device, cap=DIRECT_MAX_SPLITS)
    facts = device_facts(str(device))
    slots = programs_per_sm * facts["sm_count"]
    if facts["kind"] == "cuda" and programs * want > slots + slots // DIRECT_WAVE_SLACK and programs <= slots:
        want = slots // programs
    return -(-tiles // -(-tiles // want))


def direct_tiles(index_width: int, tile_tokens: int) -> int:
    """Tiles of the direct xqa kernel's rows, which are ``index_width`` positions long whatever they keep."""
    return max(1, -(-index_width // tile_tokens))


def direct_cut(lists: int, index_width: int, cfg: SplitConfig, device: torch.device) -> tuple[int, int]:
    """(splits, tiles) of a direct xqa launch of ``lists`` lists with settings ``cfg``: its rows' tiles
    (:func:`direct_tiles`) cut by :func:`direct_split_count`."""
    tiles = direct_tiles(index_width, cfg.tile_tokens)
    return direct_split_count(lists, tiles, cfg.programs_per_sm, device), tiles


def xqa_cut(G: int, head_dim: int, rows: int, hkv: int, index_width: int | None, tile_tokens: int,
            kv_fp8: bool, device: torch.device) -> tuple[int, int] | None:
    """(splits, tiles cut) of a planned xqa launch of ``rows`` rows that the direct kernel could have
    taken (:func:`direct_admits`), or None for any other launch (then :func:`split_count` over the
    plan's capacity, and each row cut by its own tile count).

    Such rows are cut as the direct kernel cuts them: its split count, over its tile count of the index
    width, so that the ``rows_sorted`` hint, which picks between the two kernels, changes no bit of a row
    whose selection is whole 4-token blocks and a tail (the tiles then hold the same tokens in both).
    Only where the planned tiles are the direct kernel's size (``tile_tokens``). Before this rule the two
    kernels differed at most such launches on the H200 (planned 32 splits of 3 tiles against direct 33 of
    2 at one list of a 2051-wide row; bitwise equal only at 5 and 8 rows of 1-64 at 64K,
    benchmarks/results/experiments/2026-12-01-1037-hint-bitwise-nvidia-h200.json)."""
    if index_width is None or not direct_admits(rows, index_width):
        return None
    cfg = xqa_direct_config(G, head_dim, rows * hkv, kv_fp8=kv_fp8)
    if cfg.tile_tokens != tile_tokens:
        return None
    return direct_cut(rows * hkv, index_width, cfg, device)


def direct_resolves(programs: int, splits: int, split_entries: int, programs_per_sm: int,
                    device: torch.device) -> bool:
    """Whether the direct kernel reads all ``split_entries`` (a power of two) of each split before its
    loop: up to ``DIRECT_RESOLVE_MAX`` always, up to ``DIRECT_RESOLVE_WAVE_MAX`` where the launch fits
    one wave. On the H200, decode-64 24/2 with 3 splits of 22 tiles (384 programs, 1024 entries) took
    101.2 us resolved against 90.0 tile by tile; in one wave, 4 splits of 1024 entries (decode-64) and
    2 of 2048 (24/2) were the fastest settings measured (:func:`direct_split_count`)."""
    if split_entries <= DIRECT_RESOLVE_MAX:
        return True
    facts = device_facts(str(device))
    return split_entries <= DIRECT_RESOLVE_WAVE_MAX and programs * splits <= programs_per_sm * facts["sm_count"]
