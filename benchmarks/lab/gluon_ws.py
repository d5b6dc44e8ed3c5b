"""Prototype, not a route: the grouped attention kernel warp-specialized, two CTAs per SM, in Gluon.

Each CTA attends one 8-row group with two warpgroups: a consumer (both products and the softmax, Q in
shared memory, the next tile's Q K^T issued before this tile's softmax as in ``gluon_grouped``) and a
producer (every K/V copy, cp.async, handed over through mbarriers). K has 2 buffers, V 3: 115 KB of
shared memory, so two CTAs fit an SM.

Registers. Two CTAs of 256 threads leave 128 registers per thread at entry; the consumer needs about
220. ``setmaxnreg`` moves registers from the producer (``pregs``) to the consumer (``256 - pregs``), and
ptxas allocates each region within its own count, provided that

- the kernel's entry count is pinned by ``.minnctapersm 2`` (Triton emits ``.maxnreg``, under which the
  regions get nothing more),
- no single instruction needs more registers than the entry count: a 64 x 256 fp32 wgmma needs 154,
  so P V runs as two N=128 halves, and
- the producer lowers its count as soon as it branches off and the consumer raises its own once, at its
  start: Triton's partition loop raises every warp back to the entry count around each partition, which
  under two CTAs per SM waits forever for registers that the other warpgroup holds.

``rewrite_ptx`` makes these changes to the PTX, through Triton's stage hook. Triton's compile cache
does not see the hook: the rewritten kernel is cached under the plain kernel's key (the register split
follows from ``PREGS``, a constexpr, so it is part of that key; a change to ``rewrite_ptx`` needs a
fresh cache).

Measured on the H200 (2026-11-30), bitwise equal to ``grouped_attention_kernel``: level with it, not
faster. Over three runs, prefill-64k-o80 956-978 us against 952-962 and o98 487-491 against 489-495 (V in
3 buffers; with 2, 1189-1197 and 612-618).

Scope: 6/1/256, fp16 activations and cache, K and V of one layout, 8-row groups, one split, no gate or
LSE; a GPU only (the interpreter does not run Gluon). ``tests/sm90.py`` compiles it on any machine.

    python -m benchmarks.lab.gluon_ws prefill-64k-o80 prefill-64k-o98 --out DIR
"""

from __future__ import annotations
import qsa.attention.grouped.launch
import qsa.attention.planning.plan

import re
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .gluon_grouped import group_tile

CTAS_PER_SM = 2


@gluon.jit
def _producer(bufs, k_ptr, v_ptr, ids_ptr, masks_ptr, counts_ptr, stride_k_block, stride_k_tok, stride_k_head,
              stride_plan, MB: gl.constexpr, MB_PER_BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, PW: gl.constexpr):
    """Tile by tile, K then V into the next free buffers (cp.async; each thread arrives when its copies land)."""
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty = bufs
    NK: gl.constexpr = k_bufs.type.shape[0]
    NV: gl.constexpr = v_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = 4 * MB
    # Each thread holds 4 token rows (one microblock) x 8 columns: one plan entry per microblock.
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 8], threads_per_warp=[1, 32], warps_per_cta=[PW, 1],
                                        order=[1, 0])
    i_g = gl.program_id(0)
    i_kvh = gl.program_id(1).to(gl.int64)
    count = gl.load(counts_ptr + i_g)
    n_tiles = gl.maximum(gl.cdiv(count, MB), 1)
    p_ids = ids_ptr + i_g.to(gl.int64) * stride_plan
    p_masks = masks_ptr + i_g.to(gl.int64) * stride_plan
    o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    k_base = k_ptr + i_kvh * stride_k_head
    v_base = v_ptr + i_kvh * stride_k_head
    for j in range(n_tiles):
        o_e = j * MB + o_n // 4
        b_id = gl.load(p_ids + o_e, mask=o_e < count, other=0)
        b_gm = gl.load(p_masks + o_e, mask=o_e < count, other=0)
        off = ((b_id // MB_PER_BLOCK).to(gl.int64) * stride_k_block
               + ((b_id % MB_PER_BLOCK) * 4 + o_n % 4) * stride_k_tok)
        used = ((b_gm >> (o_n % 4)) & 0x11111111) != 0  # entries past the count read as 0: nothing used
        off2 = off[:, None] + o_d[None, :]
        sk = j % NK
        mbarrier.wait(k_empty.index(sk), ((j // NK) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(k_bufs.index(sk), k_base + off2, mask=used[:, None])
        async_copy.mbarrier_arrive(k_ready.index(sk), increment_count=False)
        sv = j % NV
        mbarrier.wait(v_empty.index(sv), ((j // NV) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(v_bufs.index(sv), v_base + off2, mask=used[:, None])
        async_copy.mbarrier_arrive(v_ready.index(sv), increment_count=False)


@gluon.jit
def _consumer(q_ptr, out_ptr, masks_ptr, counts_ptr, q_smem, bufs, num_rows, qk_scale,
              stride_q_row, stride_q_head, stride_plan, stride_o_row, stride_o_head,
              G: gl.constexpr, GROUP_ROWS: gl.constexpr, MB: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The group's online softmax over the producer's tiles; P V in two halves of the head dimension."""
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty = bufs
    NK: gl.constexpr = k_bufs.type.shape[0]
    NV: gl.constexpr = v_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 4 * MB
    HALF: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 8], threads_per_warp=[1, 32], warps_per_cta=[4, 1],
                                        order=[1, 0])
    i_g = gl.program_id(0)
    i_kvh = gl.program_id(1).to(gl.int64)

    p_q, m_q = group_tile(q_ptr, i_g, i_kvh, num_rows, stride_q_row, stride_q_head, G, GROUP_ROWS, BLOCK_M, HEAD_DIM,
                          ld)
    q_smem.store(gl.load(p_q, mask=m_q, other=0.0))
    fence_async_shared()
    gl.thread_barrier()

    o_ms = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    o_ns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    o_shift = 4 * gl.minimum(o_ms // G, GROUP_ROWS - 1)[:, None] + (o_ns % 4)[None, :]
    count = gl.load(counts_ptr + i_g)
    p_masks = masks_ptr + i_g.to(gl.int64) * stride_plan
    n_tiles = gl.maximum(gl.cdiv(count, MB), 1)

    b_gm = gl.load(p_masks + o_ns // 4, mask=o_ns // 4 < count, other=0)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(k_ready.index(0), 0)
    fence_async_shared()
    b_s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s, ))
    mbarrier.arrive(k_empty.index(0), count=1)

    b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    b_l = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    b_acc0 = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout))
    b_acc1 = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout))
    for i_t in range(0, n_tiles):
        # The next tile's scores run on the tensor cores under this tile's softmax.
        has_next = i_t + 1 < n_tiles
        o_e = (i_t + 1) * MB + o_ns // 4
        b_gm_next = gl.load(p_masks + o_e, mask=o_e < count, other=0)
        sk = (i_t + 1) % NK
        mbarrier.wait(k_ready.index(sk), ((i_t + 1) // NK) & 1, pred=has_next)
        fence_async_shared()
        b_s_next = warpgroup_mma(q_smem, k_bufs.index(sk).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # This tile's softmax, as grouped_attention_kernel's attend_tile computes it.
        m_attend = ((b_gm[None, :] >> o_shift) & 1) != 0
        b_sm = gl.where(m_attend, b_s, float("-inf"))
        b_m_new = gl.maximum(b_m, gl.max(b_sm, 1) * qk_scale)
        b_shift = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = gl.exp2(b_sm * qk_scale - b_shift[:, None])
        b_alpha = gl.exp2(b_m - b_shift)
        b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new
        # The previous tile's P V is done once only the scores are in flight: its V buffer is free.
        b_acc0, b_acc1 = warpgroup_mma_wait(num_outstanding=1, deps=(b_acc0, b_acc1))
        mbarrier.arrive(v_empty.index((i_t + NV - 1) % NV), count=1, pred=i_t > 0)
        b_alpha_o = gl.convert_layout(b_alpha, gl.SliceLayout(1, o_layout))
        b_acc0 = b_acc0 * b_alpha_o[:, None]
        b_acc1 = b_acc1 * b_alpha_o[:, None]
        b_pf = gl.convert_layout(b_p.to(gl.float16), p_op)
        sv = i_t % NV
        mbarrier.wait(v_ready.index(sv), (i_t // NV) & 1)
        fence_async_shared()
        b_acc0 = warpgroup_mma(b_pf, v_bufs.index(sv).slice(0, HALF, dim=1), b_acc0, is_async=True)
        b_acc1 = warpgroup_mma(b_pf, v_bufs.index(sv).slice(HALF, HALF, dim=1), b_acc1, is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=2, deps=(b_s_next, ))
        mbarrier.arrive(k_empty.index(sk), count=1, pred=has_next)
        b_gm = b_gm_next
    b_acc0, b_acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc0, b_acc1))

    b_l = gl.convert_layout(b_l, gl.SliceLayout(1, o_layout))
    b_den = gl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o, m_o = group_tile(out_ptr, i_g, i_kvh, num_rows, stride_o_row, stride_o_head, G, GROUP_ROWS, BLOCK_M, HALF,
                          o_layout)
    gl.store(p_o, (b_acc0 / b_den).to(gl.float16), mask=m_o)
    gl.store(p_o + HALF, (b_acc1 / b_den).to(gl.float16), mask=m_o)


@gluon.jit
def gluon_ws_kernel(
    q_ptr, k_ptr, v_ptr,  # [rows, Hq, D] fp16; [num_blocks, block_size, Hkv, D] fp16, K and V of one layout
    ids_ptr, masks_ptr, counts_ptr,  # the grouped plan (qsa.attention.planning.plan.GroupedPlan)
    out_ptr,  # [rows, Hq, D] fp16
    num_rows, qk_scale,
    stride_q_row, stride_q_head, stride_k_block, stride_k_tok, stride_k_head, stride_plan,
    stride_o_row, stride_o_head,
    G: gl.constexpr, GROUP_ROWS: gl.constexpr, MB: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    NK: gl.constexpr = 2, NV: gl.constexpr = 3, PREGS: gl.constexpr = 32,
):
    PW: gl.constexpr = 4  # setmaxnreg acts on whole warpgroups
    kv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    BLOCK_N: gl.constexpr = 4 * MB
    q_s = gl.allocate_shared_memory(gl.float16, [64, HEAD_DIM], kv_layout)
    k_bufs = gl.allocate_shared_memory(gl.float16, [NK, BLOCK_N, HEAD_DIM], kv_layout)
    v_bufs = gl.allocate_shared_memory(gl.float16, [NV, BLOCK_N, HEAD_DIM], kv_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NK, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NK, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NV, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NV, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NK):
        mbarrier.init(k_ready.index(i), count=PW * 32)
        mbarrier.init(k_empty.index(i), count=1)
    for i in gl.static_range(NV):
        mbarrier.init(v_ready.index(i), count=PW * 32)
        mbarrier.init(v_empty.index(i), count=1)
    bufs = (k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty)
    gl.warp_specialize([
        (_consumer, (q_ptr, out_ptr, masks_ptr, counts_ptr, q_s, bufs, num_rows, qk_scale, stride_q_row,
                     stride_q_head, stride_plan, stride_o_row, stride_o_head, G, GROUP_ROWS, MB, HEAD_DIM)),
        (_producer, (bufs, k_ptr, v_ptr, ids_ptr, masks_ptr, counts_ptr, stride_k_block, stride_k_tok,
                     stride_k_head, stride_plan, MB, BLOCK_SIZE // 4, HEAD_DIM, PW)),
    ], [PW], [PREGS])


_DEC = re.compile(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);")


def rewrite_ptx(ptx: str, ctas_per_sm: int = CTAS_PER_SM) -> str:
    """The register split of the module docstring. The producer's count is the one Triton emits for the
    worker partition (``PREGS``); the consumer gets the rest of its CTA's share, ``256 - PREGS`` rounded
    down to 8 for two CTAs per SM."""
    pregs = int(_DEC.search(ptx).group(1))
    entry = 65536 // (256 * ctas_per_sm)  # registers per thread of two 4-warp warpgroups
    cregs = (2 * entry - pregs) // 8 * 8
    out, n = re.subn(r"^\.maxnreg \d+$", f".minnctapersm {ctas_per_sm}", ptx, flags=re.M)
    if n != 1:
        raise ValueError("expected one .maxnreg directive")
    # Triton branches the warps into partitions first: `@p bra <default>; bra.uni <workers>;`.
    worker = re.search(r"^\s*bra\.uni\s+(\$L__BB\d+_\d+);", out, flags=re.M).group(1)
    lines, raised = [], False
    for line in out.split("\n"):
        if "setmaxnreg." in line:
            if "setmaxnreg.inc" in line and not raised:
                lines.append(f"\tsetmaxnreg.inc.sync.aligned.u32 \t{cregs};")
                raised = True
            continue
        lines.append(line)
        if line.startswith(worker + ":"):
            lines.append(f"\tsetmaxnreg.dec.sync.aligned.u32 \t{pregs};")
    if not raised:
        raise ValueError("no setmaxnreg.inc in the default partition")
    return "\n".join(lines)


def install_ptx_hook() -> None:
    """Route ``gluon_ws_kernel``'s PTX through ``rewrite_ptx`` (Triton's stage hook; other kernels pass)."""
    knobs = triton.knobs.runtime
    previous = knobs.add_stages_inspection_hook
    if getattr(previous, "_gluon_ws", False):
        return

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_ptx = stages["ptx"]

        def ptx(src, metadata):
            text = make_ptx(src, metadata)
            return rewrite_ptx(text) if metadata["name"] == "gluon_ws_kernel" else text

        stages["ptx"] = ptx

    hook._gluon_ws = True
    knobs.add_stages_inspection_hook = hook


def gluon_ws(q, k, v, plan, out, softmax_scale: float, *, nv: int = 3, pregs: int = 32) -> None:
    """Rows ``[0, plan.num_rows)`` of ``out`` from the grouped plan (scope in the module docstring)."""
    from .harness import kernel_args

    args = kernel_args(q, k, v, plan, out, softmax_scale)
    install_ptx_hook()
    gluon_ws_kernel[(plan.num_groups, k.shape[2])](
        *args, G=q.shape[1] // k.shape[2], GROUP_ROWS=plan.group_rows, MB=8, HEAD_DIM=q.shape[2],
        BLOCK_SIZE=k.shape[1], NV=nv, PREGS=pregs, num_warps=4)


def compare(names, timer, rounds: int = 2, only=None) -> list[dict]:
    """Each scenario's grouped attention (plan made once): the Triton kernel and this one with V in 3 and 2
    buffers, each checked against the fp32 reference and bitwise against the Triton kernel, then timed in
    interleaved rounds."""
    import qsa

    from .harness import compare_kernels

    def make_runs(pb):
        q, c, plan = pb.q, pb.cache, pb.plan

        def ws(nv):
            return lambda out: gluon_ws(q, c.k, c.v, plan, out, pb.scale, nv=nv)

        return {"triton": lambda out: qsa.attention.grouped.launch.grouped_attention(q, c.k, c.v, plan, out=out, config=None,
                                                                  **pb.attention_kwargs),
                "ws-v3": ws(3), "ws-v2": ws(2)}

    return compare_kernels(names, timer, make_runs, {"ws-v3": "triton", "ws-v2": "triton"}, rounds, only)


def main(argv=None) -> int:
    from .harness import main as run

    return run("python -m benchmarks.lab.gluon_ws", __doc__, "gluon-ws", compare, argv)


if __name__ == "__main__":
    sys.exit(main())
