"""Paged KV cache write: scatter new K/V rows into their slots, optionally quantised to FP8 E4M3."""

import triton
import triton.language as tl


@triton.jit
def fp32_to_e4m3_bits(x, SATURATE: tl.constexpr):
    """Round fp32 ``x`` to FP8 E4M3FN and return the byte (as int32), bit-exact with torch's cast.

    Round to nearest even; NaN gives 0x7F with the NaN's sign bit. Values that round past 448
    (|x| > 464, inf included) give +-448 (0x7E / 0xFE) with SATURATE (newer torch, e.g. 2.13) and
    NaN (0x7F / 0xFF) without (older torch, e.g. 2.11). Done with integer ops because ``x.to(tl.float8e4nv)``
    differs from torch under the interpreter (subnormals, overflow).
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = tl.where(bits < 0, 0x80, 0)
    mag = bits & 0x7FFFFFFF
    # |x| < 2**-6 (E4M3 subnormal range): adding 2**14 leaves the rounded subnormal mantissa in the
    # low bits of the fp32 result (the fp32 add does the round-to-nearest-even).
    b_sub = (tl.abs(x) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # Normal range: rebias the exponent (127 -> 7) and round the mantissa to 3 bits, ties to even.
    odd = (mag >> 20) & 1
    b_norm = (mag - (120 << 23) + 0x7FFFF + odd) >> 20
    # 0x43F00000 is 480.0, the first value that does not round to a finite E4M3 number.
    if SATURATE:
        b_norm = tl.where(b_norm == 0x7F, 0x7E, b_norm)
        b_big = tl.where(mag > 0x7F800000, 0x7F, 0x7E)
    else:
        b_big = tl.full(mag.shape, 0x7F, tl.int32)
    b_mag = tl.where(mag >= 0x43F00000, b_big, tl.where(mag < (121 << 23), b_sub, b_norm))
    return (b_mag & 0x7F) | sign


@triton.jit
def cache_write_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    slot_ptr,  # [T] int32/int64: physical_block * block_size + offset; < 0 or >= num_slots skipped
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] fp16/bf16/fp32, or uint8 holding E4M3
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    k_scale,  # fp32, used when IS_FP8
    v_scale,  # fp32, used when IS_FP8
    num_slots,  # num_blocks * block_size
    block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    SATURATE: tl.constexpr,  # FP8 overflow -> +-448 (else NaN), as the installed torch casts
):
    # One program per (token, KV head).
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)

    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    i_b = slot // block_size
    i_s = slot % block_size

    o_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_d = (o_d < HEAD_DIM) & valid

    b_k = tl.load(k_ptr + i_t * stride_kt + i_h * stride_kh + o_d * stride_kd, mask=m_d, other=0.0)
    b_v = tl.load(v_ptr + i_t * stride_vt + i_h * stride_vh + o_d * stride_vd, mask=m_d, other=0.0)
    if IS_FP8:
        # (x.float() / scale) with a correctly rounded division, as torch computes it.
        b_k = fp32_to_e4m3_bits(tl.div_rn(b_k.to(tl.float32), k_scale), SATURATE).to(tl.uint8)
        b_v = fp32_to_e4m3_bits(tl.div_rn(b_v.to(tl.float32), v_scale), SATURATE).to(tl.uint8)
    else:
        b_k = b_k.to(k_cache_ptr.dtype.element_ty)
        b_v = b_v.to(v_cache_ptr.dtype.element_ty)

    p_kc = k_cache_ptr + i_b * stride_kcb + i_s * stride_kcs + i_h * stride_kch + o_d * stride_kcd
    p_vc = v_cache_ptr + i_b * stride_vcb + i_s * stride_vcs + i_h * stride_vch + o_d * stride_vcd
    tl.store(p_kc, b_k, mask=m_d)
    tl.store(p_vc, b_v, mask=m_d)
