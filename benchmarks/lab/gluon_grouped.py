"""Prototype, not a route: the grouped attention kernel written in Gluon (Triton's lower-level language),
where the wgmma waits are explicit, so the next tile's Q K^T can run under this tile's softmax, as
FlashAttention 3 does. Triton 3.6's own pipeliner places that wait right after the wgmma
(docs/performance.md, "Grouped route (prefill)").

Scope: 6/1/256, fp16 activations and cache, K and V of one layout, 8-row groups, one split, no gate or
LSE. The Triton interpreter does not run Gluon, so this kernel is checked on a GPU only (``main``);
``tests/sm90.py`` compiles it for sm_90 on any machine. Its output is bitwise equal to
``grouped_attention_kernel``'s at the same settings (with ``lazy``, to the lazy-rescale setting's). On
the H200 it took 929-935 us at prefill-64k-o80 against 953 us, 468-469 against 488-490 at o98
(2026-11-30): 2-4%, where the o80
target needs about 10%. A warp-specialized version (a producer warpgroup for the copies, two CTAs per SM)
is ``gluon_ws.py``: level with the Triton kernel, not faster.

    python -m benchmarks.lab.gluon_grouped prefill-64k-o80 prefill-64k-o98 --out DIR
"""

from __future__ import annotations
import qsa.attention.grouped.launch
import qsa.attention.kernels
import qsa.attention.planning.plan
import qsa.settings

import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from qsa.attention.kernels import RESCALE_SLACK, SCALE_ASM, SCALE_CONSTRAINTS, SCALE_PACK, WARP_ANY_ASM


@gluon.jit
def _issue_entries(ids_ring, masks_ring, p_ids, p_masks, count, i_t, R: gl.constexpr, MB: gl.constexpr,
                   LAYOUT: gl.constexpr):
    """Tile i_t's plan entries, one per token row (each microblock's id and mask 4 times), into ring slot
    i_t % R (asynchronous copies; entries past the count read as 0)."""
    BLOCK_N: gl.constexpr = 4 * MB
    o_n = gl.arange(0, BLOCK_N, layout=LAYOUT)
    o_e = i_t * MB + o_n // 4
    m_e = o_e < count
    async_copy.async_copy_global_to_shared(ids_ring.index(i_t % R), p_ids + o_e, mask=m_e)
    async_copy.async_copy_global_to_shared(masks_ring.index(i_t % R), p_masks + o_e, mask=m_e)


@gluon.jit
def _tile_rows(ids_ring, masks_ring, i_t, stride_block, stride_tok, R: gl.constexpr, MB: gl.constexpr,
               MB_PER_BLOCK: gl.constexpr, ROW_LAYOUT: gl.constexpr):
    """Per token row of tile i_t (entries from the ring): element offset of its K/V head row, and whether
    some row of the group keeps it."""
    BLOCK_N: gl.constexpr = 4 * MB
    o_n = gl.arange(0, BLOCK_N, layout=ROW_LAYOUT)
    b_id = ids_ring.index(i_t % R).load(ROW_LAYOUT)
    b_gm = masks_ring.index(i_t % R).load(ROW_LAYOUT)
    off = (b_id // MB_PER_BLOCK).to(gl.int64) * stride_block + ((b_id % MB_PER_BLOCK) * 4 + o_n % 4) * stride_tok
    used = ((b_gm >> (o_n % 4)) & 0x11111111) != 0  # entries past the count read as 0: nothing used
    return off, used


@gluon.jit
def _issue(buf, base_ptr, off, used, o_d):
    async_copy.async_copy_global_to_shared(buf, base_ptr + off[:, None] + o_d[None, :], mask=used[:, None])


@gluon.jit
def group_tile(base_ptr, i_g, i_kvh, num_rows, stride_row, stride_head, G: gl.constexpr, GROUP_ROWS: gl.constexpr,
               BLOCK_M: gl.constexpr, COLS: gl.constexpr, LAYOUT: gl.constexpr):
    """Pointers [BLOCK_M, COLS] in LAYOUT to the group's matrix rows (matrix row m is group row m // G, head
    m % G of KV head i_kvh), and the mask of the real ones."""
    o_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    o_c = gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    o_row = (i_g * GROUP_ROWS + o_m // G).to(gl.int64)
    m_row = (o_m < GROUP_ROWS * G) & (o_row < num_rows)
    ptrs = base_ptr + o_row[:, None] * stride_row + (i_kvh * G + o_m % G)[:, None] * stride_head + o_c[None, :]
    return ptrs, m_row[:, None]


@gluon.jit
def gluon_grouped_kernel(
    q_ptr, k_ptr, v_ptr,  # [rows, Hq, D] fp16; [num_blocks, block_size, Hkv, D] fp16, K and V of one layout
    ids_ptr, masks_ptr, counts_ptr,  # the grouped plan (qsa.attention.planning.plan.GroupedPlan)
    out_ptr,  # [rows, Hq, D] fp16
    num_rows, qk_scale,
    stride_q_row, stride_q_head, stride_k_block, stride_k_tok, stride_k_head, stride_plan,
    stride_o_row, stride_o_head,
    G: gl.constexpr, GROUP_ROWS: gl.constexpr, MB: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    LAZY: gl.constexpr = False,  # lazy rescale, multiplies skipped by warps (as qsa.attention.kernels.attend_tile)
):
    """One program per (group, KV head), as ``grouped_attention_kernel`` at 6/1/256 (64 matrix rows, tiles
    of 8 microblocks, 4 warps, one split). Per tile i the program issues the copies of tile i + 2 (K, V
    and, two tiles further, the plan entries the copies after those need), then the scores of tile i + 1
    (wgmma, asynchronous), and only then the softmax of tile i, so the next tile's Q K^T runs under it;
    P V of tile i is waited for one tile later."""
    BLOCK_M: gl.constexpr = 64
    BLOCK_N: gl.constexpr = 4 * MB
    MB_PER_BLOCK: gl.constexpr = BLOCK_SIZE // 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 8], threads_per_warp=[1, 32], warps_per_cta=[4, 1],
                                        order=[1, 0])
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    i_g = gl.program_id(0)
    i_kvh = gl.program_id(1).to(gl.int64)

    p_q, m_q = group_tile(q_ptr, i_g, i_kvh, num_rows, stride_q_row, stride_q_head, G, GROUP_ROWS, BLOCK_M, HEAD_DIM,
                          ld)
    b_q = gl.load(p_q, mask=m_q, other=0.0)
    b_q = gl.convert_layout(b_q, q_op)

    # Per matrix row: the nibble of its group row (rows past the group's read row 7's; never stored).
    o_ms = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    o_ns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    o_shift = 4 * gl.minimum(o_ms // G, GROUP_ROWS - 1)[:, None] + (o_ns % 4)[None, :]

    count = gl.load(counts_ptr + i_g)
    p_ids = ids_ptr + i_g.to(gl.int64) * stride_plan
    p_masks = masks_ptr + i_g.to(gl.int64) * stride_plan
    n_tiles = gl.maximum(gl.cdiv(count, MB), 1)

    # K of tiles i + 1 and i + 2 (the Q K^T of tile i is done when iteration i starts); V of tiles i - 1 to i + 2.
    k_bufs = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, HEAD_DIM], kv_smem_layout)
    v_bufs = gl.allocate_shared_memory(gl.float16, [4, BLOCK_N, HEAD_DIM], kv_smem_layout)
    R: gl.constexpr = 8
    ring_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    ids_ring = gl.allocate_shared_memory(gl.int32, [R, BLOCK_N], ring_layout)
    masks_ring = gl.allocate_shared_memory(gl.int32, [R, BLOCK_N], ring_layout)
    ENT: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    ROWS: gl.constexpr = gl.SliceLayout(1, ld)
    COLS: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_base = k_ptr + i_kvh * stride_k_head
    v_base = v_ptr + i_kvh * stride_k_head

    # Prologue: the entries of tiles 0-3 (one group), then K and V of tiles 0 and 1 (a group each).
    for j in gl.static_range(4):
        _issue_entries(ids_ring, masks_ring, p_ids, p_masks, count, j, R, MB, ENT)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()
    for j in gl.static_range(2):
        offj, usedj = _tile_rows(ids_ring, masks_ring, j, stride_k_block, stride_k_tok, R, MB,
                                 MB_PER_BLOCK, ROWS)
        _issue(k_bufs.index(j), k_base, offj, usedj, o_d)
        _issue(v_bufs.index(j), v_base, offj, usedj, o_d)
        async_copy.commit_group()
    async_copy.wait_group(1)  # tile 0 landed
    gl.thread_barrier()
    fence_async_shared()
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    b_s = warpgroup_mma(b_q, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s, ))

    b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    b_l = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    b_acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout))
    for i_t in range(0, n_tiles):
        # Tile i + 2 (its entries landed two iterations ago): K into the buffer of tile i (its Q K^T is
        # done), V into the one of tile i - 2 (its P V is done; the P V of tile i - 1 may still be
        # reading); and the entries of tile i + 4, in the same group.
        off2, used2 = _tile_rows(ids_ring, masks_ring, i_t + 2, stride_k_block, stride_k_tok, R, MB,
                                 MB_PER_BLOCK, ROWS)
        b_gm = masks_ring.index(i_t % R).load(COLS)  # this tile's masks, for its softmax
        gl.thread_barrier()
        _issue(k_bufs.index((i_t + 2) % 2), k_base, off2, used2, o_d)
        _issue(v_bufs.index((i_t + 2) % 4), v_base, off2, used2, o_d)
        _issue_entries(ids_ring, masks_ring, p_ids, p_masks, count, i_t + 4, R, MB, ENT)
        async_copy.commit_group()
        async_copy.wait_group(1)  # tile i + 1 landed (and everything issued before it)
        gl.thread_barrier()
        fence_async_shared()
        # The next tile's scores, issued before this tile's softmax.
        b_s_next = warpgroup_mma(b_q, k_bufs.index((i_t + 1) % 2).permute((1, 0)), s_zero, use_acc=False,
                                 is_async=True)
        # This tile's softmax.
        m_attend = ((b_gm[None, :] >> o_shift) & 1) != 0
        b_sm = gl.where(m_attend, b_s, float("-inf"))
        b_max = gl.max(b_sm, 1) * qk_scale
        if LAZY:
            b_move = b_max - gl.maximum(b_m, -3.0e38) > RESCALE_SLACK
            b_m_new = gl.where(b_move, gl.maximum(b_m, b_max), b_m)
        else:
            b_m_new = gl.maximum(b_m, b_max)
        b_shift = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = gl.exp2(b_m - b_shift)
        if LAZY:
            b_l = b_l * b_alpha
        b_p = gl.exp2(b_sm * qk_scale - b_shift[:, None])
        if LAZY:
            b_l = b_l + gl.sum(b_p, 1)
        else:
            b_l = b_l * b_alpha + gl.sum(b_p, 1)
        b_m = b_m_new
        # P V of the previous tile is done once only the scores' group is in flight.
        b_acc = warpgroup_mma_wait(num_outstanding=1, deps=(b_acc, ))
        b_alpha_o = gl.convert_layout(b_alpha, gl.SliceLayout(1, o_layout))
        if LAZY:
            # Warps none of whose rows moves their reference skip the multiplies (one vote per tile).
            b_warp = gl.inline_asm_elementwise(WARP_ANY_ASM, "=r,=r,r,r",
                                               [gl.convert_layout(b_move, gl.SliceLayout(1, o_layout)).to(gl.int32)],
                                               dtype=gl.int32, is_pure=False, pack=2)
            b_acc = gl.inline_asm_elementwise(
                SCALE_ASM, SCALE_CONSTRAINTS,
                [b_acc, gl.broadcast(b_alpha_o[:, None], b_acc)[0], gl.broadcast(b_warp[:, None], b_acc)[0]],
                dtype=gl.float32, is_pure=True, pack=SCALE_PACK)
        else:
            b_acc = b_acc * b_alpha_o[:, None]
        b_pf = gl.convert_layout(b_p.to(gl.float16), p_op)
        b_acc = warpgroup_mma(b_pf, v_bufs.index(i_t % 4), b_acc, is_async=True)
        # The next tile's scores: done once only this P V is in flight.
        b_s = warpgroup_mma_wait(num_outstanding=1, deps=(b_s_next, ))
    b_acc = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc, ))
    async_copy.wait_group(0)

    # Epilogue: out = acc / l for the program's real rows.
    b_l = gl.convert_layout(b_l, gl.SliceLayout(1, o_layout))
    b_out = b_acc / gl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o, m_o = group_tile(out_ptr, i_g, i_kvh, num_rows, stride_o_row, stride_o_head, G, GROUP_ROWS, BLOCK_M,
                          HEAD_DIM, o_layout)
    gl.store(p_o, b_out.to(gl.float16), mask=m_o)


def gluon_grouped(q, k, v, plan, out, softmax_scale: float, *, lazy: bool = False) -> None:
    """Rows ``[0, plan.num_rows)`` of ``out`` from the grouped plan (scope in the module docstring)."""
    from .harness import kernel_args

    args = kernel_args(q, k, v, plan, out, softmax_scale)
    gluon_grouped_kernel[(plan.num_groups, k.shape[2])](
        *args, G=q.shape[1] // k.shape[2], GROUP_ROWS=plan.group_rows, MB=8, HEAD_DIM=q.shape[2],
        BLOCK_SIZE=k.shape[1], LAZY=lazy, num_warps=4)


def compare(names, timer, rounds: int = 2, only=None) -> list[dict]:
    """Each scenario's grouped attention (plan made once): the Triton kernel at its default and lazy-rescale
    settings and this kernel without and with the lazy rescale, each checked against the fp32 reference
    and bitwise against its Triton twin, then timed in interleaved rounds."""
    import qsa

    from .harness import compare_kernels

    lazy_cfg = qsa.settings.GroupedConfig(rows_per_prog=8, block_m=64, mb=8, num_warps=4, num_stages=3,
                                    programs_per_sm=2, prefetch=False, lazy_rescale=True)

    def make_runs(pb):
        q, c, plan = pb.q, pb.cache, pb.plan

        def triton(cfg):
            return lambda out: qsa.attention.grouped.launch.grouped_attention(q, c.k, c.v, plan, out=out, config=cfg,
                                                           **pb.attention_kwargs)

        def gluon(lazy):
            return lambda out: gluon_grouped(q, c.k, c.v, plan, out, pb.scale, lazy=lazy)

        return {"triton": triton(None), "triton-lazy": triton(lazy_cfg), "gluon": gluon(False),
                "gluon-lazy": gluon(True)}

    return compare_kernels(names, timer, make_runs, {"gluon": "triton", "gluon-lazy": "triton-lazy"}, rounds, only)


def main(argv=None) -> int:
    from .harness import main as run

    return run("python -m benchmarks.lab.gluon_grouped", __doc__, "gluon-grouped", compare, argv)


if __name__ == "__main__":
    sys.exit(main())
