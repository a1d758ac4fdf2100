"""Timing and memory readings for the benchmarks.

Two clocks, chosen per measurement:

- ``Timer.device_time(fn)``: the device time of the work ``fn`` enqueues (kernels). On CUDA, each
  repeat reads a 256 MiB buffer (so no input stays in L2 from the repeat before, and what L2 holds
  is clean: a flush by writing would leave ~L2-size of dirty lines whose write-back the timed
  kernels pay, +9 us on a 32K-key decode on an H200, cuDNN's alike), then holds the
  GPU in a spin kernel long enough for the host to enqueue all of ``fn``'s launches, and times
  ``fn`` between two CUDA events: launch gaps and host overhead stay out, as in
  ``triton.testing.do_bench``. ``fn`` must not synchronize.
- ``Timer.wall_time(fn)``: host wall clock around ``fn`` with the device synchronized before and
  after (requests, and anything that syncs inside): what a caller waits.

Both warm up first and return the median of the repeats (with min and max beside it). On the
CPU both are the host clock.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLUSH_BYTES = 256 << 20
SPIN_CLOCK_HZ = 2.0e9  # cycles per second assumed for torch.cuda._sleep (H200 boost ~1.98 GHz)


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds: the median of ``n`` repeats, and the fastest and slowest."""

    median_s: float
    min_s: float
    max_s: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> "Timing":
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def as_dict(self) -> dict[str, float]:
        return {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s, "n": self.n}


class Timer:
    """Times callables on one device with ``warmup`` untimed calls and ``repeat`` timed ones."""

    def __init__(self, device: torch.device, warmup: int = 3, repeat: int = 20) -> None:
        self.device, self.warmup, self.repeat = torch.device(device), warmup, repeat
        self._flush: torch.Tensor | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def wall_time(self, fn: Callable[[], object], repeat: int | None = None, warmup: int | None = None,
                  before: Callable[[], object] | None = None) -> Timing:
        """Median host time of synchronized calls; ``before`` runs untimed ahead of each call."""
        for _ in range(self.warmup if warmup is None else warmup):
            if before is not None:
                before()
            fn()
        samples = []
        for _ in range(self.repeat if repeat is None else repeat):
            if before is not None:
                before()
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - start)
        return Timing.of(samples)

    def device_time(self, fn: Callable[[], object], repeat: int | None = None) -> Timing:
        """Median device time of ``fn``'s enqueued work (see the module docstring)."""
        if not self.is_cuda:
            return self.wall_time(fn, repeat)
        for _ in range(self.warmup):
            fn()
        self.sync()
        start = time.perf_counter()
        fn()
        host_s = time.perf_counter() - start  # how long the host takes to enqueue fn
        self.sync()
        spin_cycles = int(max(3 * host_s, 50e-6) * SPIN_CLOCK_HZ)
        n = self.repeat if repeat is None else repeat
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for begin, end in events:
            self._flush_l2()
            _spin(spin_cycles)
            begin.record()
            fn()
            end.record()
        self.sync()
        return Timing.of([begin.elapsed_time(end) / 1e3 for begin, end in events])

    def host_time(self, fn: Callable[[], object], repeat: int = 10) -> float:
        """Median host seconds to run ``fn`` without waiting for the device (launch overhead)."""
        self.sync()
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
            self.sync()
        return statistics.median(samples)

    def _flush_l2(self) -> None:
        """Replaces L2's contents with clean lines of a buffer larger than it (see the module docstring)."""
        if self._flush is None:
            self._flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=self.device)
        self._flush.sum()


def _spin(cycles: int) -> None:
    """Holds the current CUDA stream for about ``cycles`` GPU clocks (no-op without the helper)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


class PeakMemory:
    """Peak device memory of a block: torch's allocator peak plus bytes allocated outside torch
    (the native KV arena's pool), in bytes. On the CPU only the outside bytes are known."""

    def __init__(self, device: torch.device, outside_bytes: int = 0) -> None:
        self.device, self.outside_bytes = torch.device(device), outside_bytes
        self.torch_bytes = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.torch_bytes = int(torch.cuda.max_memory_allocated(self.device))

    def as_dict(self) -> dict[str, int]:
        return {"torch_peak_bytes": self.torch_bytes, "arena_bytes": self.outside_bytes,
                "total_bytes": self.torch_bytes + self.outside_bytes}
