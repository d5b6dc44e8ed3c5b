"""Timing: medians of CUDA-graph replays with the L2 flushed before each one, a ``do_bench`` fallback
for code that cannot be captured, wall-clock on the CPU; and the ceilings every run measures.

Ceiling conventions:

* copy bandwidth: a device-to-device ``copy_`` of a 2 GiB buffer; GB/s counts the bytes read plus the
  bytes written (``2 * size / time``), the usual convention for copy benchmarks. A kernel that only
  reads is compared against this number, so "80% of the copy bandwidth" means reading at 0.8 x that
  rate.
* matmul rate: ``torch.matmul`` of two 8192 x 8192 fp16 matrices of N(0, 1) data (fp32 accumulation in
  cuBLAS), ``2 * 8192**3`` FLOPs per product.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

FLUSH_BYTES = 256 << 20
"""Bytes written before each timed replay to evict the previous replay's data from L2 (H200: 60 MB)."""


@dataclass
class TimingConfig:
    budget_s: float = 0.25  # timed replays per measurement: about this much device time
    min_reps: int = 5
    max_reps: int = 100
    bench_warmup_ms: float = 25.0  # do_bench fallback
    bench_rep_ms: float = 100.0
    flush: str = "write"  # L2 flush before each replay: "write" (every recorded run) or "read" (see Timer)


QUICK_TIMING = TimingConfig(budget_s=0.1, min_reps=5, max_reps=40, bench_warmup_ms=10.0, bench_rep_ms=40.0)


@dataclass
class Timing:
    median_ms: float
    reps: int
    method: str  # "graph", "eager", "do_bench" or "wall"
    min_ms: float | None = None
    max_ms: float | None = None


class Timer:
    """Times callables on one device. ``fn`` must already have run once (compilation, allocation).

    The L2 flush before each timed replay: ``"write"`` (the default, as ``triton.testing.do_bench``
    flushes) sets ``FLUSH_BYTES`` to zero, which leaves the L2 full of dirty lines that the timed step
    writes back as it reads; ``"read"`` reads ``FLUSH_BYTES`` of another buffer, which leaves it clean.
    Every recorded run used ``"write"``; ``benchmarks.floors --flush read`` measures the difference."""

    FLUSHES = ("write", "read")

    def __init__(self, device, config: TimingConfig | None = None):
        self.device = torch.device(device)
        self.config = config or TimingConfig()
        if self.config.flush not in self.FLUSHES:
            raise ValueError(f"flush must be one of {self.FLUSHES}, got {self.config.flush!r}")
        self._flush = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def flush_l2(self):
        if self._flush is None:
            if self.config.flush == "write":
                self._flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=self.device)
            else:
                self._flush = (torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=self.device),
                               torch.empty((), dtype=torch.float32, device=self.device))
        if self.config.flush == "write":
            self._flush.zero_()
        else:
            torch.sum(self._flush[0], dim=0, out=self._flush[1])

    def time(self, fn, *, graph: bool = True) -> Timing:
        """Median time of ``fn()`` in ms: CUDA-graph replays when ``graph`` and capture works, else
        ``triton.testing.do_bench`` (median, L2 flushed); on the CPU a wall-clock median."""
        if not self.is_cuda:
            return self._time_wall(fn)
        if graph:
            try:
                g = self.capture(fn)
            except Exception:  # not capturable (host sync, ...): fall back to eager timing
                torch.cuda.synchronize(self.device)
                g = None
            if g is not None:
                try:
                    return self._time_replays(g)
                finally:
                    del g
        return self._time_do_bench(fn)

    def capture(self, fn) -> torch.cuda.CUDAGraph:
        """A CUDA graph of one call of ``fn`` (warmed up on a side stream first, as PyTorch asks)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize(self.device)
        return g

    def _time_replays(self, g) -> Timing:
        cfg = self.config
        g.replay()
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush_l2()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        est_ms = max(start.elapsed_time(end), 1e-3)
        reps = int(min(cfg.max_reps, max(cfg.min_reps, cfg.budget_s * 1e3 / est_ms)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for s, e in events:
            self.flush_l2()
            s.record()
            g.replay()
            e.record()
        torch.cuda.synchronize(self.device)
        times = [s.elapsed_time(e) for s, e in events]
        return Timing(statistics.median(times), reps, "graph", min(times), max(times))

    def time_eager(self, fn, reps: int = 50) -> Timing:
        """Median latency of one eager call of ``fn`` in ms: the L2 flushed and the device idle before
        each call, so the time runs from the call's first enqueued work to its last and includes the
        host's enqueueing wherever the device waits on it (a CUDA graph replay hides exactly that)."""
        if not self.is_cuda:
            return self._time_wall(fn)
        times = self.eager_samples(fn, reps)
        return Timing(statistics.median(times), reps, "eager", min(times), max(times))

    def eager_samples(self, fn, reps: int) -> list:
        """The ms of ``reps`` eager calls of ``fn`` (after one untimed call), timed as :meth:`time_eager`
        times them (CUDA only)."""
        fn()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            self.flush_l2()
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    def host_us(self, fn, calls: int = 200, drain_every: int = 20) -> float:
        """Median host time of one call of ``fn`` in microseconds: the time to enqueue it, not to run
        it. The device is drained every ``drain_every`` calls (outside the timed calls), so a call
        never waits on a full launch queue."""
        return statistics.median(self.host_samples(fn, calls, drain_every))

    def host_samples(self, fn, calls: int, drain_every: int = 20) -> list:
        """The host microseconds of ``calls`` calls of ``fn`` (after one untimed call), counted as
        :meth:`host_us` counts them."""
        fn()
        times = []
        for i in range(calls):
            if i % drain_every == 0 and self.is_cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        return times

    def _time_do_bench(self, fn) -> Timing:
        from triton.testing import do_bench

        cfg = self.config
        ms = do_bench(fn, warmup=cfg.bench_warmup_ms, rep=cfg.bench_rep_ms, return_mode="median")
        return Timing(float(ms), 0, "do_bench")

    def _time_wall(self, fn, reps: int = 3) -> Timing:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return Timing(statistics.median(times), reps, "wall", min(times), max(times))


def _matmul_time(timer: Timer, n: int) -> Timing:
    """One [n, n] @ [n, n] fp16 product, after a warm-up that raises an idle GPU's clock."""
    dev = timer.device
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=torch.float16, generator=gen)
    b = torch.randn(n, n, device=dev, dtype=torch.float16, generator=gen)
    c = torch.empty(n, n, device=dev, dtype=torch.float16)
    if timer.is_cuda:
        # An idle GPU sits at a low clock: run about half a second of products before measuring.
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            for _ in range(20):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize(dev)
    torch.matmul(a, b, out=c)
    return timer.time(lambda: torch.matmul(a, b, out=c))


def _copy_times(timer: Timer, copy_bytes: int) -> dict:
    """A device-to-device copy of ``copy_bytes``, captured in a graph and (on the GPU) launched eagerly."""
    dev = timer.device
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    # copy_ is a memcpy node in a CUDA graph but a copy kernel when launched eagerly, which can
    # differ; the ceiling is the best of both (each recorded).
    copies = {"graph": timer.time(lambda: dst.copy_(src), graph=True)}
    if timer.is_cuda:
        copies["eager"] = timer.time(lambda: dst.copy_(src), graph=False)
    return copies


def measure_ceilings(timer: Timer) -> dict:
    """Copy bandwidth (GB/s, read + write bytes) and fp16 matmul rate (TFLOP/s) of the device."""
    if timer.is_cuda:
        copy_bytes, n = 2 << 30, 8192
    else:
        copy_bytes, n = 64 << 20, 256
    t_mm = _matmul_time(timer, n)  # its operands are freed before the copy's buffers are allocated
    copies = _copy_times(timer, copy_bytes)
    if timer.is_cuda:
        torch.cuda.empty_cache()
    copy_gbps = {k: 2 * copy_bytes / (t.median_ms * 1e-3) / 1e9 for k, t in copies.items()}
    return dict(
        copy_gbps=max(copy_gbps.values()),
        copy_gbps_by_method=copy_gbps,
        copy_bytes=copy_bytes,
        copy_convention="device-to-device copy_; GB/s = (bytes read + bytes written) / time",
        matmul_tflops=2 * n**3 / (t_mm.median_ms * 1e-3) / 1e12,
        matmul_shape=[n, n, n],
        matmul_dtype="fp16",
    )
