"""Ahead-of-time compilation of the kernels for the H200 (sm_90) on a machine without a GPU.

The interpreter does not catch what only the GPU compiler rejects (dot shapes, layouts, shared
memory); compiling for sm_90 here does, and reports registers, spills and shared memory.

    python tests/sm90.py                      # compile every kernel at its production settings
    python tests/sm90.py grouped single-row   # some sections only (SECTIONS; --list names them)
"""

import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

import qsa
import qsa.attention.grouped.launch
import qsa.attention.invariant.launch
import qsa.attention.launch
import qsa.attention.splitk.launch
import qsa.attention.xqa.launch
import qsa.settings
from qsa.settings import MAP_LIST_WORDS, PLANNER, PLANNER_FEW, PLANNER_MAP, PLANNER_SHORT, SHARED_MAP_MICROBLOCKS
from qsa.attention.kernels import merge_splits_kernel
from qsa.attention.merge import merge_attention_states_kernel, merge_states_config
from qsa.attention.grouped.kernel import grouped_attention_kernel
from qsa.attention.invariant.kernel import invariant_attention_kernel, invariant_merge_kernel
from qsa.attention.planning.kernels import (grouped_plan_kernel, grouped_plan_map_kernel, LIST_WORDS, SHARED_MAP_MICROBLOCKS as KERNEL_MAP_MICROBLOCKS, single_row_plan_kernel, single_row_sort_plan_kernel)
from qsa.attention.splitk.kernel import splitk_attention_kernel
from qsa.attention.xqa.kernel import xqa_attention_kernel, xqa_direct_kernel, xqa_direct_merge_kernel
from qsa.cache.kernels import cache_write_kernel
from qsa.selection.kernels import block_scores_kernel, clear_invalid_pages_kernel, store_compressed_kernel
from qsa.selection.topk import topk_kernel


def compile_sm90(kernel, pointers: dict, constexprs: dict, floats=(), num_warps=4, num_stages=2,
                 divisible=None, maxnreg=None):
    """Compile ``kernel`` for sm_90; ``pointers`` maps pointer args to Triton dtypes ("*fp16").

    As a real launch would, pointers and the args named in ``divisible`` (default: every
    ``stride_*`` argument) are marked divisible by 16.
    """
    jit = kernel
    signature = {}
    attrs = {}
    for i, p in enumerate(jit.params):
        if p.name in pointers or (p.name.startswith("stride_") if divisible is None else p.name in divisible):
            attrs[(i,)] = [["tt.divisibility", 16]]
    for p in jit.params:
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    defaults = {p.name: p.default for p in jit.params if p.is_constexpr and p.has_default}
    src = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs={**defaults, **constexprs}, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, resource_usage(compiled)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


@functools.lru_cache(maxsize=4)
def _sass(cubin: bytes) -> str:
    """The SASS of a cubin (cuobjdump), disassembled once for the checks that read it."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout


def resource_usage(compiled) -> dict:
    """Registers, stack, local memory (spills) and shared memory of a compiled kernel, and whether
    ptxas serialised its wgmma instructions (info C7515: each waits for the one before, so the
    tensor cores idle between the steps of a dot)."""
    ptx_text = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        info = ""
        if "wgmma" in ptx_text:  # C7515 is about wgmma only: without it there is nothing to serialise
            ptx = os.path.join(d, "k.ptx")
            with open(ptx, "w") as f:
                f.write(ptx_text)
            run = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "p.cubin")],
                                 capture_output=True, text=True)
            info = run.stdout + run.stderr
    sass = _sass(compiled.asm["cubin"])
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    usage = {k: int(v) for k, v in zip(("regs", "stack", "shared_static", "local"), m.groups())} if m else {}
    usage["shared"] = compiled.metadata.shared
    usage["wgmma_serialized"] = "C7515" in info
    usage["pdl"] = "griddepcontrol.wait" in ptx_text
    # Spill loads and stores (STL/LDL) between the first and the last tensor-core instruction: inside
    # the tile loop (and its pipelined prologue and epilogue), where they would cost every tile.
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    mma = [i for i, op in enumerate(ops) if op.startswith(("HMMA", "HGMMA"))]
    usage["loop_spills"] = sum(op.split(".")[0] in ("STL", "LDL") for op in ops[mma[0]:mma[-1] + 1]) if mma else 0
    usage["spills"] = sum(op.split(".")[0] in ("STL", "LDL") for op in ops)
    # The highest register the code names: above "regs" where setmaxnreg raised a region's count.
    usage["max_reg"] = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=0)
    usage["mma"] = "wgmma" if "wgmma" in ptx_text else ("mma" if "mma.sync" in ptx_text else "none")
    return usage


compile_sm90_ = compile_sm90
SMEM_LIMIT = 227 * 1024
SM_SHARED = 228 * 1024  # an H200 SM's shared memory, all of its programs together
ACT = {"fp16": tl.float16, "bf16": tl.bfloat16}


def _attention_pointers(act, cache):
    return {"q_ptr": f"*{act}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "gate_ptr": f"*{act}",
            "out_ptr": f"*{act}", "lse_ptr": "*fp32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}


FLAGS = dict(HEAD_DIM=256, BLOCK_SIZE=16, HAS_GATE=True, RETURN_LSE=True, PDL=True)
COUNTS = {"idx_count_ptr": "*i32"}  # the pointer a kernel with HAS_COUNTS takes (index_counts)


def counted_divisible(kernel, *others) -> set:
    """The arguments a launch on vLLM's ``[rows, W + 1]`` index buffer marks divisible by 16: every
    ``stride_*`` argument and ``others``, but the row strides of ``indices`` (``buf[:, :W]``) and of
    ``index_counts`` (``buf[:, W]``), both ``W + 1``."""
    return {p.name for p in kernel.params if (p.name.startswith("stride_") or p.name in others)
            and p.name not in ("stride_idx_row", "stride_idx_count")}


def assert_resident(programs_per_sm: int, num_warps: int, usage: dict, what) -> None:
    """``programs_per_sm`` programs of a kernel with this resource usage fit one SM at once: registers,
    and shared memory (each program also holds 1 KB of the SM's shared memory for the system, which
    cuobjdump counts in the static shared memory)."""
    assert programs_per_sm * 32 * num_warps * usage["regs"] <= 65536, (what, usage)
    static = max(usage.get("shared_static", 0), 1024)
    assert programs_per_sm * (usage["shared"] + static) <= SM_SHARED, (what, usage)


def check_grouped_kernel(act, cache, G):
    cfg = qsa.attention.grouped.launch.grouped_config(G, 256, kv_fp8=cache == "u8")
    ptrs = {**_attention_pointers(act, cache), "ids_ptr": "*i32", "masks_ptr": "*i32", "counts_ptr": "*i32"}
    compiled, usage = compile_sm90(
        grouped_attention_kernel, ptrs,
        dict(G=G, GROUP_ROWS=8, ROWS_PER_PROG=cfg.rows_per_prog, BLOCK_M=cfg.block_m, MB=cfg.mb, NUM_SPLITS=1,
             PREFETCH=cfg.prefetch, LAZY_RESCALE=cfg.lazy_rescale, SAME_KV_STRIDES=True,
             KV_FP8=cache == "u8", DOT_DTYPE=ACT[act], PTX=True, **FLAGS),
        floats=("qk_scale", "v_scale"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # The lazy rescale's warp flag ORs the two rows each thread holds: one vote per tile, not one per
    # pair of a thread's rows (which would leave rows out of a warp's decision).
    assert compiled.asm["ptx"].count("vote.sync.any") == (1 if cfg.lazy_rescale else 0), usage
    assert usage["mma"] == "wgmma", usage
    assert not usage["wgmma_serialized"], usage
    assert usage["shared"] <= SMEM_LIMIT, usage
    assert usage["pdl"], usage
    return usage


def check_single_row_kernel(route, cache):
    """The route's kernel at 6/1/256 as launched; an ``xqa-direct`` route with the suffix ``-counts`` is the
    direct kernel with ``HAS_COUNTS`` on vLLM's index buffer (``counted_divisible``)."""
    counts = route.endswith("-counts")
    route = route.removesuffix("-counts")
    assert not counts or route.startswith("xqa-direct"), route
    fp8 = cache == "u8"
    cfg = {"xqa": lambda G, d: qsa.attention.xqa.launch.xqa_config(G, d),
           "xqa-direct": lambda G, d: qsa.attention.xqa.launch.xqa_direct_config(G, d, 8, kv_fp8=fp8),
           "xqa-direct-64": lambda G, d: qsa.attention.xqa.launch.xqa_direct_config(G, d, 64, kv_fp8=fp8),
           "xqa-direct-128": lambda G, d: qsa.attention.xqa.launch.xqa_direct_config(G, d, 128, kv_fp8=fp8),
           "xqa-direct-unresolved": lambda G, d: dataclasses.replace(qsa.attention.xqa.launch.xqa_direct_config(G, d),
                                                                      resolve_split=False),
           "splitk": lambda G, d: qsa.attention.splitk.launch.splitk_config(G, d, kv_fp8=fp8),
           "splitk-few": lambda G, d: qsa.attention.splitk.launch.splitk_config(
               G, d, qsa.settings.SPLITK_FP8_FEW_LISTS if fp8 else qsa.settings.SPLITK_FEW_LISTS, kv_fp8=fp8)}[route](6, 256)
    ptrs = _attention_pointers("fp16", cache)
    if route.startswith("xqa-direct"):
        kernel = xqa_direct_kernel
        ptrs.update(idx_ptr="*i32", bt_ptr="*i32", req_ptr="*i32", pos_ptr="*i64", seq_lens_ptr="*i32",
                    scratch_ptr="*i32")
        # As launched: mtp-8's 33 splits of 64 entries, decode-64's 4 of 1024 (6 of 512 with an FP8 cache)
        # and decode-64 24/2's 2 of 2048 (resolved before the loop; one wave each).
        split_n = {"xqa-direct-64": 512 if fp8 else 1024, "xqa-direct-128": 2048}.get(route, 64)
        split_n = split_n if cfg.resolve_split else 0
        cx = dict(BLOCK_N=cfg.tile_tokens, BLOCK_W=qsa.settings.DIRECT_MAX_WIDTH, PREFETCH=cfg.prefetch and not split_n,
                  SPLIT_N=split_n, DEFER_CHECK=cfg.defer_check and split_n > 0, HALVES=cfg.qk_halves)
        if counts:
            ptrs.update(COUNTS)
            cx.update(HAS_COUNTS=True)
    elif route == "xqa":
        kernel = xqa_attention_kernel
        ptrs.update(ids_ptr="*i32", masks_ptr="*u8", counts_ptr="*i32")
        cx = dict(MB=cfg.tile_tokens // 4, PREFETCH=cfg.prefetch, HALVES=cfg.qk_halves)
    else:
        kernel = splitk_attention_kernel
        ptrs.update(tok_ptr="*i32", tok_counts_ptr="*i32", bt_ptr="*i32", req_ptr="*i32")
        cx = dict(BLOCK_N=cfg.tile_tokens, HALVES=cfg.qk_halves)
    compiled, usage = compile_sm90(kernel, ptrs, dict(G=6, BLOCK_G=16, NUM_SPLITS=4, KV_FP8=cache == "u8",
                                               SAME_KV_STRIDES=True,
                                               DOT_DTYPE=tl.float16, **cx, **FLAGS),
                            floats=("qk_scale", "v_scale"), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            maxnreg=getattr(cfg, "max_registers", None),
                            divisible=counted_divisible(kernel) if counts else None)
    assert usage["shared"] <= SMEM_LIMIT, usage
    assert usage["pdl"], usage
    assert usage["local"] == 0, usage  # no spills
    if route == "splitk-few" and not fp8:
        # The short tiles' one-wave window (qsa.attention.splitk.launch.splitk_config) counts this many programs per SM.
        assert_resident(qsa.settings.SPLITK_SHORT_PER_SM, cfg.num_warps, usage, (route, cache, cfg))
        assert (cfg.tile_tokens, cfg.num_stages) == (32, 4), cfg
    if route.startswith("xqa-direct"):
        # The programs per SM that the split count assumes fit.
        assert_resident(cfg.programs_per_sm, cfg.num_warps, usage, (route, cache, cfg))
        if cfg.max_registers is None or cx["DEFER_CHECK"]:  # deferred: no row check or sort in the kernel
            # Capped with an FP8 cache and the score halves, ptxas keeps one register pair on the stack (a
            # store and a load, outside the loop); nothing else spills.
            pair = cache == "u8" and cfg.qk_halves and cfg.max_registers is not None
            assert usage["stack"] <= (8 if pair else 0) and usage["spills"] <= (2 if pair else 0), usage
        assert usage["loop_spills"] == 0, (route, cache, usage)  # capped: spills only outside the loop
    # With the scores over column halves (routes: head_dim 256; xqa planned and direct alike, and splitk),
    # each warp's score tile is two independent chains of 8 mma steps, not one of 16 (the products are not
    # folded into one).
    assert qk_chain_depth(compiled) == (8 if cfg.qk_halves else 16), (route, cache, cfg)
    return usage


def check_invariant_kernels(cache, width=2051, counts=False):
    """The batch-invariant route's kernel as launched at 6/1/256 (folding, and a program per split) for
    ``indices`` ``width`` wide, and its merge; a folding launch of many lists under its register cap.
    With ``counts``: the kernel with ``HAS_COUNTS`` on vLLM's index buffer (``counted_divisible``), the
    merge (which reads no index) left out."""
    ptrs = {**_attention_pointers("fp16", cache), "idx_ptr": "*i32", "bt_ptr": "*i32", "req_ptr": "*i32",
            "pos_ptr": "*i64", "seq_lens_ptr": "*i32", "scratch_ptr": "*i32", **(COUNTS if counts else {})}
    kv_fp8 = cache == "u8"
    usage = {}
    launches = (("fold", True, qsa.settings.INVARIANT_FOLD_LISTS), ("split", False, 1),
                ("fold-many", True, qsa.settings.INVARIANT_CAP_LISTS))
    for name, fold, lists in launches:
        cfg = qsa.attention.invariant.launch.invariant_config(6, 256, lists, kv_fp8)
        splits = -(-qsa.attention.launch.direct_tiles(width, cfg.tile_tokens) // cfg.split_tiles)
        compiled, u = compile_sm90(
            invariant_attention_kernel, ptrs,
            dict(G=6, BLOCK_G=16, BLOCK_N=cfg.tile_tokens, BLOCK_W=max(16, triton.next_power_of_2(width)),
                 SPLIT_TILES=cfg.split_tiles, NUM_SPLITS=splits, SPLIT_N=cfg.split_tiles * cfg.tile_tokens,
                 FOLD=fold, KV_FP8=kv_fp8, SAME_KV_STRIDES=True, DOT_DTYPE=tl.float16, HALVES=cfg.qk_halves,
                 HAS_COUNTS=counts, **FLAGS),
            floats=("qk_scale", "v_scale"), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            maxnreg=cfg.max_registers, divisible=counted_divisible(invariant_attention_kernel) if counts else None)
        assert u["shared"] <= SMEM_LIMIT and u["pdl"], u
        assert u["loop_spills"] == 0, (name, cache, u)
        assert qk_chain_depth(compiled) == (8 if cfg.qk_halves else 16), u
        if cfg.max_registers:  # capped so that three programs share an SM: they fit
            assert u["regs"] <= cfg.max_registers, u
            assert_resident(3, cfg.num_warps, u, (name, cache))
        usage[name] = u
    if counts:
        return usage
    cfg = qsa.attention.invariant.launch.invariant_config(6, 256)
    splits = -(-qsa.attention.launch.direct_tiles(width, cfg.tile_tokens) // cfg.split_tiles)
    merge_ptrs = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "gate_ptr": "*fp16", "out_ptr": "*fp16",
                  "lse_ptr": "*fp32"}
    _, u = compile_sm90(invariant_merge_kernel, merge_ptrs,
                        dict(G=6, BLOCK_G=16, NUM_SPLITS=splits, HEAD_DIM=256,
                             BLOCK_D=qsa.attention.invariant.launch.invariant_merge_columns(splits, 256), HAS_GATE=True, RETURN_LSE=True,
                             PDL=True), floats=("v_scale",))
    assert u["local"] == 0 and u["pdl"], u  # every split's partial in registers at once, no spill
    usage["merge"] = u
    return usage


def qk_chain_depth(compiled) -> int:
    """The longest run of dependent ``HMMA`` steps (each accumulating the one before) in the sm_90 SASS:
    the score product's chain, the deepest of the kernel's."""
    sass = _sass(compiled.asm["cubin"])
    depth = {}  # register -> length of the chain of HMMA steps that last wrote it (0: another instruction)
    longest = 0
    for op, dst, rest in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+(R\d+)([^;]*);", sass):
        if op.startswith("HMMA"):
            acc = rest.split(",")[-1].strip()
            depth[dst] = depth.get(acc, 0) + 1
            longest = max(longest, depth[dst])
        else:
            depth[dst] = 0
    return longest


def check_merge_and_planner_kernels():
    def compile_sm90(kernel, pointers, constexprs, **kw):  # as launched on sm_90: with PDL
        _, usage = compile_sm90_(kernel, pointers, {**constexprs, "PDL": True}, **kw)
        assert usage["pdl"], (kernel, usage)
        assert usage["local"] == 0, (kernel, constexprs, usage)
        return usage

    partials = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*fp16", "gate_ptr": "*fp16",
                "lse_ptr": "*fp32"}
    for xqa_lists in (None, 1):  # whole heads, and after an xqa launch of few lists (qsa.attention.launch.merge_config)
        compile_sm90(merge_splits_kernel, partials,
                     dict(NUM_SPLITS=8, BLOCK_S=8, HEAD_DIM=256, HAS_GATE=True, RETURN_LSE=True,
                          BLOCK_D=qsa.attention.launch.merge_config(8, 256, xqa_lists=xqa_lists)[0]), floats=("v_scale",))
    direct = {**_attention_pointers("fp16", "fp16"), **partials, "redo_acc_ptr": "*fp32", "redo_ml_ptr": "*fp32",
              "idx_ptr": "*i32", "bt_ptr": "*i32",
              "req_ptr": "*i32", "pos_ptr": "*i64", "seq_lens_ptr": "*i32", "scratch_ptr": "*i32"}

    def direct_merge(lists, cap, counts=False):  # mtp-8 (8 lists) or mtp-16 (16 lists): 17 splits
        return compile_sm90(xqa_direct_merge_kernel, {**direct, **COUNTS} if counts else direct,
                            dict(G=6, BLOCK_G=16, BLOCK_N=32, BLOCK_W=qsa.settings.DIRECT_MAX_WIDTH, NUM_SPLITS=17,
                                 BLOCK_S=32, HEAD_DIM=256, BLOCK_SIZE=16, KV_FP8=False, SAME_KV_STRIDES=True,
                                 DOT_DTYPE=tl.float16, HAS_GATE=True, RETURN_LSE=True,
                                 BLOCK_D=qsa.attention.launch.merge_config(17, 256, xqa_lists=lists)[0],
                                 HALVES=qsa.attention.xqa.launch.xqa_direct_config(6, 256, lists).qk_halves,
                                 HAS_COUNTS=counts),
                            floats=("qk_scale", "v_scale"), num_warps=4, maxnreg=cap,
                            divisible=counted_divisible(xqa_direct_merge_kernel) if counts else None)

    def fits(direct_usage, merge_usage):
        return (2 * 128 * direct_usage["regs"] + 128 * merge_usage["regs"] <= 65536
                and 2 * (direct_usage["shared"] + 1024) + merge_usage["shared"] + 1024 <= SM_SHARED)

    merges = [direct_merge(16, cap) for cap in (qsa.settings.DIRECT_MAX_REGISTERS, None)]
    # qsa.attention.xqa.launch.direct_merge_registers: where the direct launch fills two programs per SM, the merge, launched
    # as the direct kernel starts, waits beside them only capped; uncapped (its recompute path) it does not fit.
    direct_usage = check_single_row_kernel("xqa-direct", "fp16")
    assert [fits(direct_usage, m) for m in merges] == [True, False], (direct_usage, merges)
    # The same with HAS_COUNTS (the merge is launched with the direct kernel's flag), on vLLM's index buffer.
    counted = (check_single_row_kernel("xqa-direct-counts", "fp16"),
               direct_merge(16, qsa.settings.DIRECT_MAX_REGISTERS, counts=True))
    assert fits(*counted), counted
    # After a direct launch of few lists (qsa.attention.launch.merge_config): programs of fewer columns, uncapped as launched.
    direct_merge(8, None)
    rows = {"idx_ptr": "*i32", "bt_ptr": "*i32", "req_ptr": "*i32", "pos_ptr": "*i64", "seq_lens_ptr": "*i32",
            "ids_ptr": "*i32", "masks_ptr": "*u8", "counts_ptr": "*i32", "unsorted_ptr": "*i32",
            "num_unsorted_ptr": "*i32", "keys_ptr": "*i32"}
    # Each planner without counts, then with HAS_COUNTS on vLLM's index buffer (counted_divisible).
    for counts in (False, True):
        for chunk, warps, tokens, steps in ((512, 4, False, False), (4096, 16, False, False), (4096, 16, True, False),
                                            (512, 4, False, True), (1024, 8, False, True)):
            compile_sm90(single_row_plan_kernel, {**rows, **COUNTS} if counts else rows,
                         dict(BLOCK_SIZE=16, CH=chunk, PAD=16, EMIT_TOKENS=tokens, ONE_CHUNK=chunk == 4096,
                              ASCENDING_STEPS=steps, SORT_W=4096 if steps else 0, HAS_COUNTS=counts),
                         num_warps=warps, divisible=counted_divisible(single_row_plan_kernel) if counts else None)
        compile_sm90(single_row_sort_plan_kernel, {**rows, **COUNTS} if counts else rows,
                     dict(BLOCK_SIZE=16, BLOCK_W=4096, CH=512, PAD=16, EMIT_TOKENS=True, HAS_COUNTS=counts),
                     num_warps=16, divisible=counted_divisible(single_row_sort_plan_kernel) if counts else None)
    groups = {"idx_ptr": "*i32", "bt_ptr": "*i32", "req_ptr": "*i32", "pos_ptr": "*i64", "seq_lens_ptr": "*i32",
              "g_ids_ptr": "*i32", "g_masks_ptr": "*i32", "g_counts_ptr": "*i32", "bits_ptr": "*i32"}
    for cfg in (PLANNER, PLANNER_FEW, PLANNER_SHORT):
        for summary, counts in ((cfg.summary, False), (not cfg.summary, False), (cfg.summary, True)):
            # XCAP (a multiple of 512) is specialised as divisible by 16 in real launches, like the strides.
            usage = compile_sm90(grouped_plan_kernel, {**groups, **COUNTS} if counts else groups,
                                 dict(GROUP_ROWS=8, BLOCK_Q=8, BLOCK_SIZE=16, QUADS=cfg.quads, SCAN=cfg.scan,
                                      PAD=16, SUMMARY=summary, PTX=True, LATE_TABLE=cfg.late_table, HAS_COUNTS=counts),
                                 num_warps=cfg.num_warps,
                                 divisible=counted_divisible(grouped_plan_kernel, "XCAP") if counts else
                                 {p.name for p in grouped_plan_kernel.params
                                  if p.name == "XCAP" or p.name.startswith("stride_")})
            if cfg is not PLANNER_FEW and summary == cfg.summary:
                # The persistent grid is resident at once: more programs than fit an SM would only wait for
                # a free slot (PLANNER_FEW launches fewer programs than SMs).
                assert_resident(cfg.programs_per_sm, cfg.num_warps, usage, (cfg, counts))
    # The planner over a map in shared memory: its static map, a program's whole grid resident at once.
    offsets = ("XCAP", "map_off", "flag_off", "list_off")
    for counts in (False, True):
        usage = compile_sm90(grouped_plan_map_kernel, {**groups, **COUNTS} if counts else groups,
                             dict(GROUP_ROWS=8, BLOCK_Q=8, BLOCK_SIZE=16, QUADS=PLANNER_MAP.quads, SCAN=PLANNER_MAP.scan,
                                  CH=PLANNER_MAP.emit, LIST=MAP_LIST_WORDS, PAD=16, SHARED=True, PTX=True,
                                  HAS_COUNTS=counts),
                             num_warps=PLANNER_MAP.num_warps, maxnreg=PLANNER_MAP.max_registers,
                             divisible=counted_divisible(grouped_plan_map_kernel, *offsets) if counts else
                             {p.name for p in grouped_plan_map_kernel.params
                              if p.name in offsets or p.name.startswith("stride_")})
        assert (KERNEL_MAP_MICROBLOCKS.value, LIST_WORDS.value) == (SHARED_MAP_MICROBLOCKS, MAP_LIST_WORDS)
        assert usage["shared_static"] == 4 * (SHARED_MAP_MICROBLOCKS * 9 // 32 + MAP_LIST_WORDS) + 1024, usage
        assert usage["spills"] == 0 and usage["regs"] <= PLANNER_MAP.max_registers, usage  # the cap costs no spills
        assert_resident(PLANNER_MAP.programs_per_sm, PLANNER_MAP.num_warps, usage, (PLANNER_MAP, counts))
    # qsa.merge_attention_states at 24 heads of 256 (merge_states_config), as launched (Triton's default 3
    # stages): up to 8 parts of one layout each its own pointer, or stacked (a loop over any count). The lse
    # parts are [rows, Hq] contiguous: their head stride 1 (a constant, as Triton specialises it), their row
    # and part strides multiples of Hq = 24, not divisible by 16.
    block_h, block_d, warps = merge_states_config(24, 256)
    for dtype, parts, stacked, lse in (("bf16", 2, False, True), ("bf16", 8, False, False), ("fp32", 16, True, True)):
        ptrs = {**{f"o_{i}": f"*{dtype}" for i in range(8)}, **{f"l_{i}": "*fp32" for i in range(8)},
                "out_ptr": f"*{dtype}", "lse_ptr": "*fp32"}
        compile_sm90(merge_attention_states_kernel, ptrs,
                     dict(NUM_PARTS=parts, STACKED=stacked, HEAD_DIM=256, BLOCK_D=block_d, BLOCK_H=block_h,
                          RETURN_LSE=lse, stride_lh=1),
                     num_warps=warps, num_stages=3,
                     divisible={"stride_op", "stride_or", "stride_oh", "stride_out_row", "stride_out_head"})


ONE_ARGS = {  # integer arguments a launch may pass as 1
    "xqa_direct_kernel": ("row_offset", "W", "num_reqs", "max_blocks", "num_blocks", "Hq"),
    "single_row_plan_kernel": ("row_start", "W", "num_reqs", "max_blocks", "num_blocks"),
    "single_row_sort_plan_kernel": ("num_programs", "W", "num_reqs", "max_blocks", "num_blocks"),
}


def check_arguments_of_one():
    """Triton compiles an integer argument equal to 1 as the constant 1 (``native_specialize_impl``), so
    a kernel must compile with any of them constant: a one-block table (``max_blocks`` 1), one request,
    one row. (``max_blocks.to(...)`` compiles with the argument but not with the constant 1.)"""
    direct = _attention_pointers("fp16", "fp16")
    direct.update(idx_ptr="*i32", bt_ptr="*i32", req_ptr="*i32", pos_ptr="*i64", seq_lens_ptr="*i32",
                  scratch_ptr="*i32")
    ones = {name: 1 for name in ONE_ARGS["xqa_direct_kernel"]}
    for split_n, prefetch, defer in ((64, False, False), (64, False, True), (0, True, False), (0, False, False)):
        compile_sm90(xqa_direct_kernel, direct,
                     dict(G=6, BLOCK_G=16, NUM_SPLITS=4, KV_FP8=False, SAME_KV_STRIDES=True, DOT_DTYPE=tl.float16,
                          BLOCK_N=32, BLOCK_W=4096, PREFETCH=prefetch, SPLIT_N=split_n, DEFER_CHECK=defer, **FLAGS,
                          **ones),
                     floats=("qk_scale", "v_scale"), num_warps=4, num_stages=3)
    rows = {"idx_ptr": "*i32", "bt_ptr": "*i32", "req_ptr": "*i32", "pos_ptr": "*i64", "seq_lens_ptr": "*i32",
            "ids_ptr": "*i32", "masks_ptr": "*u8", "counts_ptr": "*i32", "unsorted_ptr": "*i32",
            "num_unsorted_ptr": "*i32", "keys_ptr": "*i32"}
    ones = {name: 1 for name in ONE_ARGS["single_row_plan_kernel"]}
    for chunk, tokens, steps in ((4096, True, False), (4096, False, False), (1024, False, True), (512, True, False)):
        compile_sm90(single_row_plan_kernel, rows,
                     dict(BLOCK_SIZE=16, CH=chunk, PAD=16, EMIT_TOKENS=tokens, ONE_CHUNK=chunk == 4096,
                          ASCENDING_STEPS=steps, SORT_W=4096 if steps else 0, PDL=True, **ones))
    ones = {name: 1 for name in ONE_ARGS["single_row_sort_plan_kernel"]}
    compile_sm90(single_row_sort_plan_kernel, rows,
                 dict(BLOCK_SIZE=16, BLOCK_W=4096, CH=512, PAD=16, EMIT_TOKENS=True, PDL=True, **ones), num_warps=16)


def _compile_gluon_prototype(kernel, constexprs: dict):
    """A prototype's Gluon kernel (benchmarks/lab; the grouped kernel's arguments) for sm_90, its
    pointers and strides marked divisible by 16 as a launch would."""
    from triton.experimental.gluon._runtime import GluonASTSource

    ptrs = dict(q_ptr="*fp16", k_ptr="*fp16", v_ptr="*fp16", ids_ptr="*i32", masks_ptr="*i32", counts_ptr="*i32",
                out_ptr="*fp16")
    signature, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        else:
            signature[p.name] = ptrs.get(p.name, "fp32" if p.name == "qk_scale" else "i32")
            if p.name in ptrs or p.name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=kernel, signature=signature, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def _prototypes_importable() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


def check_gluon_prototype():
    """The Gluon prototype of the grouped kernel (benchmarks/lab), with and without the lazy
    rescale: two programs fit an SM, no spill inside its loop, its wgmma not serialised."""
    _prototypes_importable()
    from benchmarks.lab.gluon_grouped import gluon_grouped_kernel as kernel

    out = []
    for lazy in (False, True):
        usage = resource_usage(_compile_gluon_prototype(
            kernel, dict(G=6, GROUP_ROWS=8, MB=8, HEAD_DIM=256, BLOCK_SIZE=16, LAZY=lazy)))
        assert usage["mma"] == "wgmma" and not usage["wgmma_serialized"], usage
        assert usage["loop_spills"] <= (0 if lazy else 1), usage  # as measured on the H200 (13:53)
        assert_resident(2, 4, usage, ("gluon prototype", lazy))
        out.append(usage)
    return out


def check_gluon_ws_prototype():
    """The warp-specialized Gluon prototype (benchmarks/lab/gluon_ws.py), V in 3 and 2 buffers:
    with its PTX rewritten, two CTAs of 8 warps fit an SM at 128 registers per thread, the consumer's
    region takes more than 128 (up to 256 - PREGS), and the consumer keeps its loop in registers
    (one spill store with V in 3 buffers)."""
    _prototypes_importable()
    from benchmarks.lab.gluon_ws import gluon_ws_kernel as kernel, install_ptx_hook

    install_ptx_hook()
    out = []
    for nv in (3, 2):
        compiled = _compile_gluon_prototype(
            kernel, dict(G=6, GROUP_ROWS=8, MB=8, HEAD_DIM=256, BLOCK_SIZE=16, NK=2, NV=nv, PREGS=32))
        usage = resource_usage(compiled)
        ptx = compiled.asm["ptx"]
        assert ".minnctapersm 2" in ptx and ".maxnreg" not in ptx, "PTX not rewritten"
        assert re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx) == [("inc", "224"), ("dec", "32")]
        assert usage["regs"] == 128 and 128 < usage["max_reg"] < 224, usage
        assert usage["mma"] == "wgmma" and not usage["wgmma_serialized"], usage
        assert usage["loop_spills"] <= (1 if nv == 3 else 0), usage  # as measured on the H200 (15:51)
        assert_resident(2, 8, usage, ("gluon warp-specialized prototype", nv))
        out.append(usage)
    return out


def check_selection_and_cache_kernels() -> dict:
    """The selection stage (scores, invalid pages, top-k) at QSA's shapes (4 index heads of 128, bf16,
    page 16) as ``qsa.selection`` launches it, the compressed-key store and the KV cache write."""
    from qsa.selection.api import _score_config, _topk_config
    from qsa.settings import SELECT_MAX_REGISTER_TILE as MAX_REGISTER_TILE

    import torch

    usage = {}
    rows = {"req_ptr": "*i64", "pos_ptr": "*i64", "seq_ptr": "*i32", "bt_ptr": "*i32"}
    cfg = _score_config(16384, torch.bfloat16)
    for keys in (True, False):
        _, usage[f"scores keys={keys}"] = compile_sm90(
            block_scores_kernel, {**rows, "q_ptr": "*bf16", "kc_ptr": "*bf16", "out_ptr": "*i32" if keys else "*fp32"},
            dict(ROWS_PER_PAGE=4, H=4, H_PAD=4, D=128, BLOCK_R=cfg["BLOCK_R"], BLOCK_N=cfg["BLOCK_N"], WRITE_KEYS=keys,
                 DOT_FP32=False), floats=("scale",), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _, usage["clear invalid pages"] = compile_sm90(
        clear_invalid_pages_kernel, {"keys_ptr": "*i32", "req_ptr": "*i64", "bt_ptr": "*i32"},
        dict(ROWS_PER_PAGE=4, BLOCK_R=64, BLOCK_P=64))
    for n_cols in (MAX_REGISTER_TILE, 2 * MAX_REGISTER_TILE):  # one register tile (64K), chunked (128K)
        t = _topk_config(n_cols, 4 * 512 + 3)
        _, usage[f"top-k {n_cols}"] = compile_sm90(
            topk_kernel, {"src_ptr": "*i32", "vis_ptr": "*i32", "req_ptr": "*i64", "pos_ptr": "*i64",
                          "seq_ptr": "*i32", "out_ptr": "*i32"},
            dict(FROM_SCORES=False, EMIT_TOKENS=True, SINGLE_TILE=t["SINGLE_TILE"], BLOCK_N=t["BLOCK_N"],
                 RADIX_BITS=t["RADIX_BITS"], EMIT_BLOCK=t["EMIT_BLOCK"], OUT_BLOCK=t["OUT_BLOCK"]),
            num_warps=t["num_warps"])
    store_ptrs = {"kc_new_ptr": "*fp32", "grp_ptr": "*fp32", "req_ptr": "*i64", "pos_ptr": "*i64", "bt_ptr": "*i32",
                  "kc_ptr": "*bf16", "part_ptr": "*fp32", "perm_ptr": "*i64", "w_ptr": "*bf16", "cos_ptr": "*fp32",
                  "sin_ptr": "*fp32"}
    _, usage["store compressed"] = compile_sm90(  # sorted rows, a transform callable's keys
        store_compressed_kernel, store_ptrs, dict(D=128, NORM_ROPE=False, HALF=0, ORDERED=False), floats=("eps",))
    _, usage["store compressed fused"] = compile_sm90(  # the layer's: ordered rows, RMSNorm and RoPE of 64 dims
        store_compressed_kernel, store_ptrs, dict(D=128, NORM_ROPE=True, HALF=32, ORDERED=True), floats=("eps",))
    for cache in ("fp16", "u8"):
        _, usage[f"cache write {cache}"] = compile_sm90(
            cache_write_kernel, {"k_ptr": "*fp16", "v_ptr": "*fp16", "slot_ptr": "*i64", "k_cache_ptr": f"*{cache}",
                                 "v_cache_ptr": f"*{cache}"},
            dict(HEAD_DIM=256, BLOCK_D=256, IS_FP8=cache == "u8", SATURATE=True), floats=("k_scale", "v_scale"))
    for what, u in usage.items():
        assert u["local"] == 0, (what, u)
    return usage


def section_grouped():
    for act, cache in (("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "u8")):
        for G in (6, 12, 24):
            print(f"grouped {act}/{cache} G={G}: {check_grouped_kernel(act, cache, G)}")


def _single_row(*names):
    def section():
        for route in names:
            for cache in ("fp16", "u8"):
                print(f"{route} {cache}: {check_single_row_kernel(route, cache)}")
    return section


def _invariant(cache):
    def section():
        for width in (2051, 4096):
            print(f"invariant {cache} W={width}: {check_invariant_kernels(cache, width)}")
        print(f"invariant {cache} W=2051 counts: {check_invariant_kernels(cache, 2051, counts=True)}")
    return section


def section_merge_and_planner():
    check_merge_and_planner_kernels()
    print("merge and planner kernels: compiled")


def section_arguments_of_one():
    check_arguments_of_one()
    print("arguments of 1: compiled")


def section_selection_and_cache():
    for what, usage in check_selection_and_cache_kernels().items():
        print(f"{what}: {usage}")


def section_gluon():
    print(f"gluon prototype (plain, lazy): {check_gluon_prototype()}")
    print(f"gluon warp-specialized prototype (V in 3, 2 buffers): {check_gluon_ws_prototype()}")


SECTIONS = {  # each compiles on its own, in a process of its own if need be (tests/test_compile_sm90.py)
    "grouped": section_grouped,
    "single-row": _single_row("xqa", "xqa-direct", "splitk", "splitk-few"),
    "single-row-wide": _single_row("xqa-direct-64", "xqa-direct-128", "xqa-direct-unresolved", "xqa-direct-counts",
                                   "xqa-direct-64-counts"),
    "invariant-fp16": _invariant("fp16"),
    "invariant-u8": _invariant("u8"),
    "merge-planner": section_merge_and_planner,
    "arguments-of-one": section_arguments_of_one,
    "selection-cache": section_selection_and_cache,
    "gluon": section_gluon,
}


def main(argv=None) -> int:
    """Compile every kernel of the named sections (all without names) at its production settings; print
    resource usage and "section NAME: compiled" after each; non-zero on failure."""
    names = sys.argv[1:] if argv is None else list(argv)
    if names == ["--list"]:
        print("\n".join(SECTIONS))
        return 0
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        print(f"unknown sections {unknown}; the sections: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    for name in names or SECTIONS:
        SECTIONS[name]()
        print(f"section {name}: compiled", flush=True)
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: this compiles for the GPU")
    sys.exit(main())
