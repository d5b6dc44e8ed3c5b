"""Paged KV cache: allocation, the Triton write kernel (fp16/bf16/FP8), bookkeeping, relocation."""

import random

import numpy as np
import pytest
import torch

import qsa
import qsa.cache.paged
from qsa.cache.paged import (allocate_kv_cache, BlockAllocator, COLLISION_OFFSET, collision_prone_num_blocks, COLLISION_STRIDE, dequantize_e4m3, E4M3_NAN_BYTE, E4M3_SATURATES, OutOfBlocksError, PagedKVCache, quantize_e4m3, random_mapping, relocate, write_kv)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of ``t`` (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(torch.uint8)


def _cache_bytes(cache: PagedKVCache) -> list:
    return [_bytes(cache.storage)] if cache.storage is not None else [_bytes(cache.k), _bytes(cache.v)]


def _e4m3_model(x: torch.Tensor, saturate: bool) -> torch.Tensor:
    """torch's fp32 -> E4M3FN cast restated in numpy; ``saturate`` picks newer (+-448) or older
    (NaN) overflow handling. Checked against the installed torch in the mode it uses."""
    f = x.float().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        bits = f.view(np.uint32).astype(np.int64)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        sub = (np.abs(f) + np.float32(16384.0)).view(np.uint32).astype(np.int64) - (141 << 23)
        norm = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    if saturate:
        norm = np.where(norm == 0x7F, 0x7E, norm)
        big = np.where(mag > 0x7F800000, 0x7F, 0x7E)
    else:
        big = np.full_like(mag, 0x7F)
    out = np.where(mag >= 0x43F00000, big, np.where(mag < (121 << 23), sub, norm))
    return torch.from_numpy(((out & 0x7F) | sign).astype(np.uint8))


def _assert_same_e4m3(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    """Bytes equal, except that a NaN input only needs some E4M3 NaN: the sign of a NaN after
    ``x / scale`` is the platform's (a GPU's fp32 division returns a positive canonical NaN)."""
    got, want, nan = got.cpu().flatten(), want.cpu().flatten(), x.cpu().flatten().isnan()
    assert torch.equal(got[~nan], want[~nan])
    assert ((got[nan] & 0x7F) == 0x7F).all()


def _e4m3_probe_values() -> torch.Tensor:
    """fp32 values that exercise every rounding case of fp32 -> E4M3FN."""
    every_fp16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[:-1] + grid[1:]) / 2  # exact in fp32: round-half-even cases, subnormal ones included
    up = torch.nextafter(ties, torch.full_like(ties, float("inf")))
    down = torch.nextafter(ties, torch.full_like(ties, -float("inf")))
    special = torch.tensor([448.0, 449.0, 463.99, 464.0, 479.99, 480.0, 481.0, 1e6, 3e38, float("inf"),
                            -float("inf"), float("nan"), -float("nan"), 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10,
                            2.0 ** -11, 1e-45, 2.0 ** -126, 0.0, -0.0, 2.0 ** -6, 2.0 ** -6 - 2.0 ** -10])
    return torch.cat([every_fp16, ties, up, down, -ties, -up, -down, special, -special])


class TestAllocate:
    @pytest.mark.parametrize("layout", ["interleaved", "separate"])
    @pytest.mark.parametrize("kv_cache_dtype,dtype", [("auto", torch.float16), ("auto", torch.bfloat16),
                                                      ("fp8_e4m3", torch.float16)])
    def test_shapes_views_and_nan_fill(self, layout, kv_cache_dtype, dtype):
        c = allocate_kv_cache(5, 12, 2, 8, dtype=dtype, kv_cache_dtype=kv_cache_dtype, layout=layout,
                              fill="nan", k_scale=0.5, v_scale=2.0)
        want = torch.uint8 if kv_cache_dtype == "fp8_e4m3" else dtype
        assert c.k.shape == c.v.shape == (5, 12, 2, 8)
        assert c.k.dtype == c.v.dtype == c.dtype == want
        assert (c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim) == (5, 12, 2, 8)
        assert (c.k_scale, c.v_scale, c.layout) == (0.5, 2.0, layout)
        for t in (c.k, c.v):
            if want == torch.uint8:
                assert (t == E4M3_NAN_BYTE).all() and t.view(torch.float8_e4m3fn).float().isnan().all()
            else:
                assert t.isnan().all()
        if layout == "interleaved":
            assert c.storage.shape == (5, 2, 12, 2, 8)
            assert c.k.data_ptr() == c.storage.data_ptr()
            c.storage[3, 1, 4] = 0
            assert (c.v[3, 4] == 0).all() and not (c.k[3, 4] == 0).any()
        else:
            assert c.storage is None and c.k.is_contiguous() and c.v.is_contiguous()

    @pytest.mark.parametrize("block_size", [4, 16, 32, 400, 784])
    def test_any_multiple_of_four(self, block_size):
        assert allocate_kv_cache(2, block_size, 1, 4, fill="zeros").k.abs().sum() == 0

    @pytest.mark.parametrize("kwargs,exc,match", [
        (dict(block_size=6), ValueError, "block_size must be a multiple of 4"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(num_blocks=-1), ValueError, "num_blocks"),
        (dict(kv_cache_dtype="fp8"), ValueError, "kv_cache_dtype"),
        (dict(layout="blocked"), ValueError, "layout"),
        (dict(fill=0.0), ValueError, "fill"),
        (dict(dtype=torch.int8), TypeError, "dtype"),
        (dict(kv_cache_dtype="fp8_e4m3", k_scale=0.0), ValueError, "k_scale"),
        (dict(kv_cache_dtype="fp8_e4m3", v_scale=torch.tensor(1.0)), TypeError, "v_scale"),
    ])
    def test_bad_arguments(self, kwargs, exc, match):
        args = dict(num_blocks=4, block_size=16, num_kv_heads=1, head_dim=8)
        args.update(kwargs)
        with pytest.raises(exc, match=match):
            allocate_kv_cache(args.pop("num_blocks"), args.pop("block_size"), args.pop("num_kv_heads"),
                              args.pop("head_dim"), **args)


class TestE4M3:
    def test_quantize_is_torch_cast_bit_exact(self):
        x = _e4m3_probe_values()
        for scale in (1.0, 0.37, 3.0, 1 / 3):
            want = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(quantize_e4m3(x, scale), want)

    def test_torch_cast_overflow_and_nan(self):
        """The behaviour the kernel reproduces: torch's E4M3FN cast in the installed version."""
        got = quantize_e4m3(torch.tensor([464.0, 470.0, 1e9, float("inf"), -float("inf"), float("nan")]), 1.0)
        if E4M3_SATURATES:
            assert got.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F]
        else:
            assert got.tolist() == [0x7E, 0x7F, 0x7F, 0x7F, 0xFF, 0x7F]

    def test_numpy_model_is_torch(self):
        x = _e4m3_probe_values()
        assert torch.equal(_e4m3_model(x, E4M3_SATURATES), x.to(torch.float8_e4m3fn).view(torch.uint8))
        # The two overflow modes differ exactly on values that round past 448.
        differ = _e4m3_model(x, True) != _e4m3_model(x, False)
        assert torch.equal(differ, (x.abs() > 464) & ~x.isnan())

    def test_dequantize_roundtrip(self):
        u8 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        x = dequantize_e4m3(u8, 0.25)
        assert x.dtype == torch.float32
        finite = torch.isfinite(x)
        assert finite.sum() == 254  # 0x7F and 0xFF are NaN, everything else finite
        assert torch.equal(quantize_e4m3(x[finite], 0.25), u8[finite])


class TestWriteKV:
    def _expected(self, cache, k, v, slots):
        """Loop reference of write_kv on a copy of ``cache``."""
        if cache.storage is not None:
            want = PagedKVCache.from_storage(cache.storage.cpu().clone(), kv_cache_dtype=cache.kv_cache_dtype,
                                             k_scale=cache.k_scale, v_scale=cache.v_scale)
        else:
            want = PagedKVCache(cache.k.cpu().clone(), cache.v.cpu().clone(), None, cache.kv_cache_dtype,
                                cache.k_scale, cache.v_scale)
        fp8 = cache.kv_cache_dtype == "fp8_e4m3"
        for i, s in enumerate(slots.tolist()):
            if not 0 <= s < cache.num_blocks * cache.block_size:
                continue
            b, o = divmod(s, cache.block_size)
            want.k[b, o] = quantize_e4m3(k[i], cache.k_scale) if fp8 else k[i]
            want.v[b, o] = quantize_e4m3(v[i], cache.v_scale) if fp8 else v[i]
        return want

    @pytest.mark.parametrize("block_size", [4, 16, 32])
    @pytest.mark.parametrize("layout", ["interleaved", "separate"])
    @pytest.mark.parametrize("kv_cache_dtype,dtype", [("auto", torch.float16), ("auto", torch.bfloat16),
                                                      ("fp8_e4m3", torch.bfloat16),
                                                      ("fp8_e4m3", torch.float16)])
    def test_matches_loop_and_skips_bad_slots(self, block_size, layout, kv_cache_dtype, dtype, device):
        g = torch.Generator().manual_seed(block_size)
        num_blocks, hkv, d = 5, 2, 24
        cache = allocate_kv_cache(num_blocks, block_size, hkv, d, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                  layout=layout, fill="nan", device=device, k_scale=0.37, v_scale=3.0)
        num_slots = num_blocks * block_size
        good = torch.randperm(num_slots, generator=g)[:7]
        slots = torch.cat([good, torch.tensor([-1, num_slots, num_slots + 3 * block_size, -num_slots - 1,
                                               2**40])])
        slots = slots[torch.randperm(len(slots), generator=g)]
        # Strided inputs: k and v are halves of a packed [T, Hkv, 2D] projection.
        packed = (torch.randn(len(slots), hkv, 2 * d, generator=g) * 40).to(dtype)
        k, v = packed[..., :d], packed[..., d:]
        want = self._expected(cache, k, v, slots)
        cache.write(k.to(device), v.to(device), slots.to(device))
        for got_b, want_b in zip(_cache_bytes(cache), _cache_bytes(want)):
            assert torch.equal(got_b.cpu(), want_b)
        # Every slot not in `good` is still poisoned.
        flat_k = cache.k.reshape(num_slots, hkv, d).cpu()
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[good] = False
        nan = (flat_k == E4M3_NAN_BYTE) if kv_cache_dtype == "fp8_e4m3" else flat_k.isnan()
        assert nan[untouched].all() and not nan[~untouched].any()

    def test_fp8_conversion_bit_exact(self, device):
        """Every fp16 value, every E4M3 tie (+-1 ulp), subnormals, overflow, inf, NaN, through the kernel."""
        x = _e4m3_probe_values()
        d = 256
        t = -(-x.numel() // d)
        x = torch.cat([x, torch.ones(t * d - x.numel())]).view(t, 1, d)
        cache = allocate_kv_cache(-(-t // 4), 4, 1, d, kv_cache_dtype="fp8_e4m3", layout="separate",
                                  fill="nan", device=device)
        write_kv(cache.k, cache.v, x.to(device), (-x).to(device), torch.arange(t, device=device),
                 kv_cache_dtype="fp8_e4m3")
        got_k = cache.k.reshape(-1, 1, d)[:t]
        got_v = cache.v.reshape(-1, 1, d)[:t]
        # Bit-exact with torch's cast on the same device, NaN signs included ...
        assert torch.equal(got_k, quantize_e4m3(x.to(device), 1.0))
        assert torch.equal(got_v, quantize_e4m3(-x.to(device), 1.0))
        # ... and with the CPU cast up to the sign of NaNs.
        _assert_same_e4m3(got_k, x.to(torch.float8_e4m3fn).view(torch.uint8), x)
        _assert_same_e4m3(got_v, (-x).to(torch.float8_e4m3fn).view(torch.uint8), x)

    def test_fp8_other_overflow_mode(self, device, monkeypatch):
        """The overflow mode the installed torch does not use, against the numpy model."""
        other = not E4M3_SATURATES
        monkeypatch.setattr(qsa.cache.paged, "E4M3_SATURATES", other)
        x = _e4m3_probe_values()
        x = x[(x.abs() > 400) | x.isnan()]
        x = torch.cat([x, torch.ones(-x.numel() % 64)]).view(-1, 1, 64)
        t = x.shape[0]
        cache = allocate_kv_cache(-(-t // 4), 4, 1, 64, kv_cache_dtype="fp8_e4m3", fill="nan", device=device)
        cache.write(x.to(device), x.to(device), torch.arange(t, device=device))
        _assert_same_e4m3(cache.k.reshape(-1, 1, 64)[:t], _e4m3_model(x, other), x)

    @pytest.mark.parametrize("scale", [0.37, 1 / 3, 3.0, 1e-3])
    def test_fp8_scaled_bit_exact(self, scale, device):
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(16, 2, 64, generator=g) * 300 * scale).to(torch.bfloat16)
        cache = allocate_kv_cache(4, 4, 2, 64, kv_cache_dtype="fp8_e4m3", fill="nan", device=device,
                                  k_scale=scale, v_scale=scale / 2)
        cache.write(x.to(device), x.to(device), torch.arange(16, device=device))
        assert torch.equal(cache.k.reshape(16, 2, 64).cpu(), (x.float() / scale).to(torch.float8_e4m3fn)
                           .view(torch.uint8))
        assert torch.equal(cache.v.reshape(16, 2, 64).cpu(), quantize_e4m3(x, scale / 2))

    @pytest.mark.parametrize("scale", [0.37, 1 / 3, 3.0, 0.1])
    def test_fp8_division_is_correctly_rounded(self, scale, device):
        """fp32 inputs within a few ulps of ``tie * scale``: only a correctly rounded ``x / scale``
        (not ``x * (1 / scale)``) lands on the same side of every E4M3 tie as torch."""
        grid = torch.arange(128, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[torch.isfinite(grid)]
        ties = (grid[:-1] + grid[1:]) / 2
        bits = (ties * scale).float().view(torch.int32)
        x = torch.cat([(bits + ulps).view(torch.float32) for ulps in range(-3, 4)])
        x = torch.cat([x, -x])
        x = torch.cat([x, torch.ones(-x.numel() % 64)]).view(-1, 1, 64)
        t = x.shape[0]
        cache = allocate_kv_cache(-(-t // 4), 4, 1, 64, kv_cache_dtype="fp8_e4m3", fill="nan", device=device,
                                  k_scale=scale, v_scale=scale)
        cache.write(x.to(device), x.to(device), torch.arange(t, device=device))
        assert torch.equal(cache.k.reshape(-1, 1, 64)[:t].cpu(),
                           (x / scale).to(torch.float8_e4m3fn).view(torch.uint8))

    def test_checker_catches_a_shifted_write(self, device):
        cache = allocate_kv_cache(2, 4, 1, 4, fill="nan", device=device)
        k = torch.ones(1, 1, 4, dtype=torch.float16)
        want = self._expected(cache, k, k, torch.tensor([3]))
        cache.write(k.to(device), k.to(device), torch.tensor([2], device=device))
        assert not torch.equal(_bytes(cache.storage).cpu(), _bytes(want.storage))

    def test_empty_batch_is_a_no_op(self):
        cache = allocate_kv_cache(2, 4, 1, 4, fill="nan")
        e = torch.empty(0, 1, 4, dtype=torch.float16)
        cache.write(e, e, torch.empty(0, dtype=torch.int64))
        assert cache.storage.isnan().all()

    @pytest.mark.parametrize("change,exc,match", [
        (dict(k=torch.zeros(3, 2, 8, dtype=torch.float16)), ValueError, r"k must have shape \[\*, 1, 8\]"),
        (dict(k=torch.zeros(3, 8, dtype=torch.float16)), ValueError, "k must be 3-D"),
        (dict(v=torch.zeros(2, 1, 8, dtype=torch.float16)), ValueError, r"v must have shape \[3, 1, 8\]"),
        (dict(k=torch.zeros(3, 1, 8, dtype=torch.bfloat16)), TypeError, "k must have dtype float16"),
        (dict(v=torch.zeros(3, 1, 8, dtype=torch.float32)), TypeError, "v must have dtype float16"),
        (dict(slots=torch.zeros(3)), TypeError, "slot_mapping must have dtype int64, int32"),
        (dict(slots=torch.zeros(4, dtype=torch.int64)), ValueError, r"slot_mapping must have shape \[3\]"),
        (dict(k_cache=torch.zeros(4, 4, 1, 8, dtype=torch.uint8)), TypeError, "k_cache must have dtype"),
        (dict(v_cache=torch.zeros(4, 8, 1, 8, dtype=torch.float16)), ValueError, "v_cache must have shape"),
        (dict(k_cache=torch.zeros(4, 4, 8, dtype=torch.float16)), ValueError, "k_cache must be 4-D"),
        (dict(k_cache=torch.zeros(4, 6, 1, 8, dtype=torch.float16),
              v_cache=torch.zeros(4, 6, 1, 8, dtype=torch.float16)), ValueError, "multiple of 4"),
        (dict(kv_cache_dtype="fp8_e4m3"), TypeError, "k_cache must have dtype uint8"),
        (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype"),
        (dict(k_scale=-1.0), ValueError, "k_scale"),
        (dict(v_scale=torch.tensor(2.0)), TypeError, "v_scale"),
        (dict(k=[[0.0]]), TypeError, "k must be a torch.Tensor"),
        # the kernel reads slot i at offset i: a strided or broadcast mapping is refused
        (dict(slots=torch.tensor([0, 100, 5, 100, 9, 100])[::2]), ValueError, "slot_mapping must be contiguous"),
        (dict(slots=torch.tensor([5])[:1].expand(3)), ValueError, "slot_mapping must be contiguous"),
    ])
    def test_bad_arguments(self, change, exc, match):
        args = dict(k_cache=torch.zeros(4, 4, 1, 8, dtype=torch.float16),
                    v_cache=torch.zeros(4, 4, 1, 8, dtype=torch.float16),
                    k=torch.zeros(3, 1, 8, dtype=torch.float16), v=torch.zeros(3, 1, 8, dtype=torch.float16),
                    slots=torch.zeros(3, dtype=torch.int64), kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
        args.update(change)
        with pytest.raises(exc, match=match):
            write_kv(args["k_cache"], args["v_cache"], args["k"], args["v"], args["slots"],
                     kv_cache_dtype=args["kv_cache_dtype"], k_scale=args["k_scale"], v_scale=args["v_scale"])

    @pytest.mark.gpu
    def test_cuda_graph_capture(self):
        cache = allocate_kv_cache(8, 16, 1, 64, kv_cache_dtype="fp8_e4m3", fill="nan", device="cuda",
                                  k_scale=0.5, v_scale=0.5)
        k = torch.randn(5, 1, 64, device="cuda", dtype=torch.float16)
        slots = torch.tensor([3, 17, -1, 200, 127], device="cuda")
        cache.write(k, k, slots)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.write(k, k, slots)
        k.copy_(torch.randn_like(k))
        slots.copy_(torch.tensor([4, 5, 6, 7, 8], device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache.k.reshape(-1, 1, 64)[4:9], quantize_e4m3(k, 0.5))

    @pytest.mark.gpu
    def test_offsets_past_int32(self):
        """A slot whose byte offset exceeds 2**31 (uint8 cache of more than 2 GiB)."""
        block_size, d = 16, 512
        num_blocks = (2**31) // (2 * block_size * d) + 8
        cache = allocate_kv_cache(num_blocks, block_size, 1, d, kv_cache_dtype="fp8_e4m3", device="cuda",
                                  fill="zeros")
        x = torch.randn(2, 1, d, device="cuda")
        last = num_blocks * block_size - 1
        cache.write(x, x, torch.tensor([last, 5], device="cuda"))
        assert torch.equal(cache.v[-1, -1], quantize_e4m3(x[0], 1.0))
        assert torch.equal(cache.k[0, 5], quantize_e4m3(x[1], 1.0))


    def test_k_and_v_must_not_share_memory(self):
        """V written over K: the same tensor twice, or two views whose elements overlap, are refused."""
        cache = allocate_kv_cache(4, 4, 1, 16, dtype=torch.float16, layout="separate", fill="zeros")
        x = torch.ones(1, 1, 16, dtype=torch.float16)
        slots = torch.tensor([0])
        with pytest.raises(ValueError, match="k_cache and v_cache must not share memory"):
            PagedKVCache(cache.k, cache.k)
        with pytest.raises(ValueError, match="k_cache and v_cache must not share memory"):
            write_kv(cache.k, cache.k, x, -x, slots, backend="torch")
        buf = torch.zeros(6, 4, 1, 16, dtype=torch.float16)
        with pytest.raises(ValueError, match="k_cache and v_cache must not share memory"):
            write_kv(buf[:4], buf[2:], x, -x, slots, backend="torch")
        # FP8 bytes, V one element past K
        raw = torch.zeros(4 * 4 * 16 + 1, dtype=torch.uint8)
        with pytest.raises(ValueError, match="k_cache and v_cache must not share memory"):
            PagedKVCache(raw[:-1].view(4, 4, 1, 16), raw[1:].view(4, 4, 1, 16), kv_cache_dtype="fp8_e4m3")

    @pytest.mark.parametrize("dim", [1, 2, 3])
    def test_disjoint_views_of_one_storage_are_accepted(self, dim):
        """K and V interleaved along any dimension of one tensor share no element: accepted, and each
        write lands in its own half."""
        shape = [4, 4, 1, 16]
        shape.insert(dim, 2)
        storage = torch.zeros(shape, dtype=torch.float16)
        k_cache, v_cache = storage.select(dim, 0), storage.select(dim, 1)
        PagedKVCache(k_cache, v_cache)
        x = torch.arange(16, dtype=torch.float16).reshape(1, 1, 16)
        write_kv(k_cache, v_cache, x, -x, torch.tensor([5]), backend="torch")
        assert torch.equal(k_cache[1, 1], x[0]) and torch.equal(v_cache[1, 1], -x[0])

    def test_storage_views_must_have_its_dtype(self):
        cache = allocate_kv_cache(4, 4, 1, 16, dtype=torch.float16, fill="zeros")
        k, v = cache.k.view(torch.bfloat16), cache.v.view(torch.bfloat16)
        with pytest.raises(ValueError, match=r"k must be the view storage\[:, 0\].*float16.*bfloat16"):
            PagedKVCache(k, v, cache.storage)


class TestBlockAllocator:
    def test_grow_free_and_reuse(self):
        a = BlockAllocator(6, 4)
        assert a.num_free_blocks == 5  # block 0 reserved
        assert a.allocate("x", 5) == [1, 2]
        assert a.allocate("x", 8) == [1, 2]  # still fits
        assert a.allocate("x", 9) == [1, 2, 3]
        assert a.num_tokens("x") == 9
        a.allocate("y", 4)
        a.free("x")
        assert a.num_free_blocks == 4
        assert 0 not in a.allocate("z", 16)

    def test_out_of_blocks_is_clear_and_atomic(self):
        a = BlockAllocator(4, 16, reserve_block0=False)
        a.allocate(0, 40)
        with pytest.raises(OutOfBlocksError, match="needs 2 more blocks"):
            a.allocate(1, 17)
        assert a.num_free_blocks == 1 and a.blocks(1) == []
        assert a.allocate(1, 16) == [3]

    @pytest.mark.parametrize("gen", [7, random.Random(7), torch.Generator().manual_seed(7)])
    def test_shuffled_free_list(self, gen):
        a = BlockAllocator(64, 16, generator=gen)
        blocks = a.allocate(0, 63 * 16)
        assert sorted(blocks) == list(range(1, 64)) and blocks != sorted(blocks)

    def test_shuffle_is_seeded(self):
        assert BlockAllocator(32, 4, generator=3).allocate(0, 40) == \
            BlockAllocator(32, 4, generator=3).allocate(0, 40)

    def test_share_prefix_refcounts(self):
        a = BlockAllocator(8, 4, generator=1)
        src = a.allocate("a", 10)
        shared = a.share_prefix("a", "b", 2)
        assert shared == src[:2] and a.num_tokens("b") == 8
        b = a.allocate("b", 13)
        assert b[:2] == src[:2] and b[2] not in src
        assert [a.refcount(x) for x in src] == [2, 2, 1]
        free_before = a.num_free_blocks
        a.free("a")
        assert a.num_free_blocks == free_before + 1  # only a's unshared block
        assert [a.refcount(x) for x in src[:2]] == [1, 1]
        assert a.blocks("b")[:2] == src[:2]
        a.free("b")
        assert a.num_free_blocks == 7

    def test_share_prefix_errors(self):
        a = BlockAllocator(8, 4)
        a.allocate("a", 8)
        a.allocate("b", 1)
        with pytest.raises(ValueError, match="already holds blocks"):
            a.share_prefix("a", "b", 1)
        with pytest.raises(ValueError, match="num_blocks must be in"):
            a.share_prefix("a", "c", 3)
        with pytest.raises(KeyError, match="unknown request"):
            a.share_prefix("nope", "c", 1)

    def test_slot_mapping_and_table(self):
        a = BlockAllocator(10, 4, generator=5)
        ba = a.allocate("a", 7)
        bb = a.allocate("b", 2)
        slots = a.slot_mapping("a", 2, 7)
        assert slots.dtype == torch.int64
        assert slots.tolist() == [ba[0] * 4 + 2, ba[0] * 4 + 3, ba[1] * 4, ba[1] * 4 + 1, ba[1] * 4 + 2]
        with pytest.raises(ValueError, match="outside"):
            a.slot_mapping("a", 0, 9)
        table = a.block_table(["b", "a"], max_blocks=3)
        assert table.dtype == torch.int32
        assert table.tolist() == [[bb[0], -1, -1], [ba[0], ba[1], -1]]
        assert a.block_table(["a", "b"]).shape == (2, 2)
        with pytest.raises(ValueError, match="more than max_blocks"):
            a.block_table(["a"], max_blocks=1)

    @pytest.mark.parametrize("block_size", [6, 2, 0, -4])
    def test_block_size_must_be_a_positive_multiple_of_4(self, block_size):
        with pytest.raises(ValueError, match="block_size must be a positive multiple of 4"):
            BlockAllocator(8, block_size)

    def test_table_of_no_column(self):
        """``max_blocks=0`` gives the promised ``[n, 0]`` table (as does the default with no block)."""
        a = BlockAllocator(8, 4)
        a.allocate("a", 0)
        assert a.block_table(["a"], max_blocks=0).shape == (1, 0)
        assert a.block_table(["a"]).shape == (1, 0)
        assert a.block_table([], max_blocks=0).shape == (0, 0)
        with pytest.raises(ValueError, match="max_blocks must be an int >= 0"):
            a.block_table(["a"], max_blocks=-1)


class TestRelocate:
    def _logical(self, tensor, table):
        """Content per (request, logical block); None for invalid entries."""
        n = tensor.shape[0]
        return [[tensor[e].clone() if 0 <= e < n else None for e in row] for row in table.tolist()]

    def _same(self, a, b):
        return all((x is None and y is None) or (x is not None and y is not None
                   and torch.equal(_bytes(x), _bytes(y))) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

    @pytest.mark.parametrize("collision_prone", [False, True])
    @pytest.mark.parametrize("kind", ["storage", "k_fp8", "compressed"])
    def test_content_follows_the_table(self, kind, collision_prone):
        g = torch.Generator().manual_seed(3)
        if kind == "storage":
            tensor = torch.randn(9, 2, 4, 1, 8).half()
        elif kind == "k_fp8":
            tensor = torch.randint(0, 256, (9, 16, 2, 4), generator=g).to(torch.uint8)
        else:
            tensor = torch.randn(9, 4, 32)  # a compressed-key cache: one row per 4-block
        table = torch.tensor([[3, 1, -1], [3, 7, 2], [20, -5, 8]], dtype=torch.int32)
        n_out = collision_prone_num_blocks(9, 32) if collision_prone else None
        mapping = random_mapping(9, generator=g, collision_prone=collision_prone, num_blocks_out=n_out)
        new, new_table = relocate(tensor, table, mapping, num_blocks_out=n_out, fill="nan")
        assert new.shape == ((n_out or 9), *tensor.shape[1:]) and new.dtype == tensor.dtype
        assert self._same(self._logical(tensor, table), self._logical(new, new_table))
        assert new_table.tolist() == [[mapping[3], mapping[1], -1], [mapping[3], mapping[7], mapping[2]],
                                      [-1, -1, mapping[8]]]
        if collision_prone:
            assert ((mapping - COLLISION_OFFSET) % 32 == 0).all()
            # 20 would be a valid block of the larger cache: it must stay invalid.
            assert new_table[2, 0] == -1
        unused = torch.ones(new.shape[0], dtype=torch.bool)
        unused[mapping] = False
        filler = new[unused]
        assert (filler == E4M3_NAN_BYTE).all() if tensor.dtype == torch.uint8 else filler.isnan().all()

    def test_checker_sees_a_wrong_move(self):
        tensor = torch.arange(4.0).view(4, 1)
        table = torch.tensor([[1, 2]], dtype=torch.int32)
        new, new_table = relocate(tensor, table, torch.tensor([0, 1, 2, 3]))
        assert self._same(self._logical(tensor, table), self._logical(new, new_table))
        assert not self._same(self._logical(tensor, table), self._logical(new, new_table.flip(1)))

    def test_cache_relocated(self):
        cache = allocate_kv_cache(6, 4, 1, 8, layout="separate", fill="zeros")
        cache.k.normal_()
        cache.v.normal_()
        table = torch.tensor([[2, 4]], dtype=torch.int32)
        mapping = random_mapping(6, num_blocks_out=11)
        moved, new_table = cache.relocated(table, mapping, num_blocks_out=11)
        assert moved.num_blocks == 11 and moved.layout == "separate"
        for old, new in zip(table[0].tolist(), new_table[0].tolist()):
            assert torch.equal(moved.k[new], cache.k[old]) and torch.equal(moved.v[new], cache.v[old])

    def test_a_cache_of_no_block(self):
        new, table = relocate(torch.zeros(0, 2, 4), torch.tensor([[-1, 3]], dtype=torch.int32),
                              torch.zeros(0, dtype=torch.int64), num_blocks_out=4)
        assert new.shape == (4, 2, 4) and table.tolist() == [[-1, -1]]

    def test_storage_must_hold_the_views(self):
        """``relocated`` moves ``storage``: a cache whose k and v are not its views would lose them."""
        cache = allocate_kv_cache(4, 4, 1, 16, dtype=torch.float16, fill="zeros")
        with pytest.raises(ValueError, match=r"k must be the view storage\[:, 0\]"):
            PagedKVCache(cache.k, cache.v, torch.zeros_like(cache.storage))
        with pytest.raises(ValueError, match=r"v must be the view storage\[:, 1\]"):
            PagedKVCache(cache.k, cache.k, cache.storage)

    @pytest.mark.parametrize("bad", [-2, -(2**40)])
    def test_mapping_below_minus_one_is_refused(self, bad):
        """Only -1 drops a block: other negative ids are refused, not dropped."""
        with pytest.raises(ValueError, match=r"mapping must hold ids >= -1 \(-1: drop\)"):
            relocate(torch.ones(3, 2), torch.tensor([[0]], dtype=torch.int32), torch.tensor([1, bad, -1]))

    def test_zero_fill_default(self):
        new, _ = relocate(torch.ones(3, 2), torch.tensor([[0]], dtype=torch.int32), torch.tensor([1, -1, -1]))
        assert new.tolist() == [[0, 0], [1, 1], [0, 0]]

    @pytest.mark.parametrize("mapping,match", [
        (torch.tensor([1, 1, 2]), "injective"),
        (torch.tensor([0, -1, 2]), "drops"),
        (torch.tensor([0, 1, 3]), "num_blocks_out"),
        (torch.tensor([0, 1, 2], dtype=torch.int32), "mapping must have dtype int64"),
        (torch.tensor([0, 1]), r"mapping must have shape \[3\]"),
    ])
    def test_bad_mappings(self, mapping, match):
        with pytest.raises((ValueError, TypeError), match=match):
            relocate(torch.zeros(3, 4), torch.tensor([[1, 0]], dtype=torch.int32), mapping)

    def test_random_mapping(self):
        m = random_mapping(50, generator=torch.Generator().manual_seed(0))
        assert sorted(m.tolist()) == list(range(50)) and m.tolist() != list(range(50))
        m = random_mapping(50, num_blocks_out=80)
        assert m.unique().numel() == 50 and m.max() < 80
        m = random_mapping(50, collision_prone=True)
        assert ((m - COLLISION_OFFSET) % COLLISION_STRIDE == 0).all() and m.unique().numel() == 50
        assert m.max() < collision_prone_num_blocks(50)
        m = random_mapping(5, collision_prone=True, num_blocks_out=200)
        assert m.max() < 200 and ((m - COLLISION_OFFSET) % 32 == 0).all()
        with pytest.raises(ValueError, match="too small"):
            random_mapping(50, collision_prone=True, num_blocks_out=100)
        with pytest.raises(ValueError, match="num_blocks_out"):
            random_mapping(50, num_blocks_out=10)
