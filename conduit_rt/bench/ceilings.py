"""The device's two ceilings, measured once per run (measured, not taken from datasheets).

- copy bandwidth: one large device-to-device copy, counting the bytes read plus the bytes written;
  every memory-bound target (decode attention, decode tokens/s) is a fraction of it.
- matmul rate: a square bf16 (float32 on the CPU) product, 2 n^3 FLOPs over its time.
Inputs are random: a product of zeros runs about 13% faster on an H200 than one of random values.
"""
from __future__ import annotations

import logging

import torch

from .timing import Timer

logger = logging.getLogger(__name__)


def copy_bandwidth(timer: Timer, nbytes: int) -> dict:
    """Bytes per second of ``dst.copy_(src)`` over ``nbytes`` (read + write counted)."""
    n = nbytes // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=timer.device)
    dst = torch.empty_like(src)
    timing = timer.device_time(lambda: dst.copy_(src))
    if not torch.equal(dst, src):
        raise RuntimeError("the copy-bandwidth probe copied wrong bytes")
    moved = 2 * n * 4
    return {"bytes_per_s": moved / timing.median_s, "bytes_moved": moved, "time": timing.as_dict()}


def matmul_rate(timer: Timer, n: int, dtype: torch.dtype) -> dict:
    """FLOP/s of an n x n x n product in ``dtype`` (bf16 on CUDA) into a preallocated output."""
    generator = torch.Generator(device=timer.device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=timer.device, generator=generator)
    b = torch.randn(n, n, dtype=dtype, device=timer.device, generator=generator)
    out = torch.empty(n, n, dtype=dtype, device=timer.device)
    timing = timer.device_time(lambda: torch.matmul(a, b, out=out))
    return {"flop_per_s": 2.0 * n**3 / timing.median_s, "n": n, "dtype": str(dtype).replace("torch.", ""),
            "time": timing.as_dict()}


def measure(timer: Timer, copy_bytes: int, matmul_n: int, dtype: torch.dtype) -> dict:
    copy = copy_bandwidth(timer, copy_bytes)
    matmul = matmul_rate(timer, matmul_n, dtype)
    logger.info("ceilings: copy %.0f GB/s, matmul %.0f TFLOP/s", copy["bytes_per_s"] / 1e9,
                matmul["flop_per_s"] / 1e12)
    return {"copy": copy, "matmul": matmul}
