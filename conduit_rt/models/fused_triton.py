"""Triton kernels of ``fused`` (imported only on CUDA, where Triton ships with torch).

Every kernel works on rows of contiguous tensors, one program per row (a token), and rounds each
intermediate to the output dtype where the torch chain it replaces does, so that the results match
torch's bit for bit up to the float32 reduction order. Transcendentals come from libdevice, the
library CUDA's own cosf/sinf/expf are: RoPE angles reach tens of thousands of radians, where the
approximate hardware sine is far off.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice  # accurate cos/sin/exp (tl.cos may use approximations)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the dtype as torch's add
        delta = tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = libdevice.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta or x, its RMSNorm): x, delta [..., hidden], weight [hidden], one dtype."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    out = torch.empty_like(x)
    total = torch.empty_like(x) if delta is not None else x
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, total, out, hidden, eps,
                                  HAS_DELTA=delta is not None, BLOCK=block, num_warps=_warps(block))
    return total, out


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + libdevice.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block = 2048
        _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block, num_warps=8)
    return out


@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, inv_freq_ptr, n_tokens, n_heads, head_dim, n_freq, scaling,
                 section0, section1, MROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    f_mask = f < n_freq
    if MROPE:  # frequency f takes the t, h or w position by its section
        row = tl.where(f < section0, 0, tl.where(f < section0 + section1, 1, 2))
        pos = tl.load(pos_ptr + row * n_tokens + token, mask=f_mask, other=0).to(tl.float32)
    else:
        pos = tl.load(pos_ptr + token).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + f, mask=f_mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    cos = (libdevice.cos(angle) * scaling).to(dtype).to(tl.float32)[None, :]
    sin = (libdevice.sin(angle) * scaling).to(dtype).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < n_heads) & f_mask[None, :]
    base = token * n_heads * head_dim + h * head_dim
    x1 = tl.load(x_ptr + base + f[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + n_freq + f[None, :], mask=mask, other=0.0).to(tl.float32)
    # x cos + rotate_half(x) sin, each product rounded to the dtype, then the sum
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(out_ptr + base + f[None, :], out1.to(dtype), mask=mask)
    tl.store(out_ptr + base + n_freq + f[None, :], out2.to(dtype), mask=mask)
    if BLOCK_R > 0:  # elements past the rotary part pass through
        r = 2 * n_freq + tl.arange(0, BLOCK_R)[None, :]
        r_mask = (h < n_heads) & (r < head_dim)
        tl.store(out_ptr + base + r, tl.load(x_ptr + base + r, mask=r_mask, other=0.0), mask=r_mask)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
         sections: tuple[int, ...]) -> torch.Tensor:
    """x [n, heads, head_dim] rotated at positions int32 [n] or [3, n] (with M-RoPE sections)."""
    n, heads, head_dim = x.shape
    n_freq = inv_freq.numel()
    out = torch.empty_like(x)
    if n:
        rest = head_dim - 2 * n_freq
        s0, s1 = (sections[0], sections[1]) if sections else (0, 0)
        block_h, block_f = triton.next_power_of_2(heads), triton.next_power_of_2(n_freq)
        _rope_kernel[(n,)](x, out, positions, inv_freq, n, heads, head_dim, n_freq, float(scaling), s0, s1,
                           MROPE=bool(sections), BLOCK_H=block_h, BLOCK_F=block_f,
                           BLOCK_R=triton.next_power_of_2(rest) if rest > 0 else 0,
                           num_warps=_warps(block_h * block_f))
    return out
