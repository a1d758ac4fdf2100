"""The decoder's elementwise chains as single kernels: RMSNorm (with the residual add before it),
SiLU-gated product (of the stacked gate/up projection), and rotate-half RoPE of the queries; and the
one-token matrix-vector product.

In torch each of these is a chain of small kernels (an RMSNorm in float32 is seven). A decode step
of a 7B decoder runs about 37 kernels a layer, two thirds of them elementwise ops on one row that
each cost a couple of microseconds of launch and ramp on the GPU even when replayed from a CUDA
graph: more than a millisecond per token. On CUDA tensors each chain here is one Triton kernel; on
the CPU (and where Triton is missing) it is the torch chain, which is also the numerical
definition: the Triton kernels round every intermediate to the model dtype where torch does
(transformers' LlamaRMSNorm, ``silu(gate) * up``, ``x cos + rotate_half(x) sin`` with cos and sin
cast to the dtype), so they agree with it to the last bit or one unit in the last place.

``linear`` of a single row (a decode step) is a Triton GEMV that streams a 7B decoder's weights at
0.57-0.94 of the copy bandwidth on an H200, where cuBLAS's M = 1 kernels reach 0.43-0.82; several
rows, or the CPU, go to ``F.linear``. Its float32 sum runs in another order than cuBLAS's.
Two of a decode step's elementwise kernels ride on the GEMV before them: ``linear_silu_gate`` (the
gate/up product, then the SiLU gate) and ``linear_rotate_q`` (the q/k/v product, then the queries'
RoPE) give the same bits as the GEMV followed by ``silu_mul`` or ``rotate``, one launch fewer each.

Shapes: x, delta [..., hidden] (contiguous); gate_up [..., 2 intermediate]; q [n, heads, head_dim]
with cos, sin tables [n, n_freq] (``rope.rope_tables``: computed once per forward pass, in torch,
so that they are torch's values to the bit).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..config import env


@functools.cache
def _triton():
    """The Triton kernels module, or None when Triton is unavailable or disabled (CONDUIT_NO_TRITON=1)."""
    if not env().triton:
        return None
    try:
        from . import fused_triton
    except ImportError:
        return None
    return fused_triton


def _on_gpu(*tensors: torch.Tensor) -> bool:
    return tensors[0].is_cuda and all(t.is_contiguous() for t in tensors) and _triton() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the reduction in float32 and the product in x's dtype (LlamaRMSNorm)."""
    if _on_gpu(x, weight) and x.dtype == weight.dtype:
        return _triton().rms_norm(x, None, weight, eps)[1]
    return _rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the norm that follows it."""
    if _on_gpu(x, delta, weight) and x.dtype == delta.dtype == weight.dtype:
        return _triton().rms_norm(x, delta, weight, eps)
    total = x + delta
    return total, _rms_norm_torch(total, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from their stack gate_up [..., 2 width] (gate first): [..., width], each
    rounded to the dtype as in torch."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul needs gate and up stacked on the last dimension, got {gate_up.shape[-1]} columns")
    if _on_gpu(gate_up):
        return _triton().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [n, heads, head_dim] with cos, sin [n, n_freq] in x's dtype: the first
    2 n_freq elements of each head rotate (``x cos + rotate_half(x) sin``), the rest pass."""
    from .rope import rotate as rotate_torch

    if _on_gpu(x, cos, sin) and x.dim() == 3 and x.dtype == cos.dtype == sin.dtype:
        return _triton().rotate(x, cos, sin)
    return rotate_torch(x, cos, sin)


_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight [out, in]^T + bias [out] -> [n, out], as ``F.linear``."""
    if _gemv_applies(x, weight, bias):  # anything else (and every error message) is F.linear's
        return _triton().gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear(x, weight, bias)`` runs as the Triton GEMV (one row, on CUDA, same dtypes)."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and x.shape[1] == weight.shape[1] > 0
            and x.dtype in _GEMV_DTYPES and x.dtype == weight.dtype and weight.is_cuda
            and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype and bias.is_contiguous()))
            and _on_gpu(x, weight))


def linear_silu_gate(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(linear(x, gate_up)): x [n, in], gate_up [2 width, in] (gate rows, then up rows) ->
    [n, width]; a decode step's row in one kernel."""
    if _gemv_applies(x, gate_up, None) and gate_up.shape[0] % 2 == 0:
        return _triton().gemv_silu_gate(x, gate_up)
    return silu_mul(linear(x, gate_up))


def linear_rotate_q(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int, head_dim: int,
                    cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query projection rotated, and the rest of the stack: x [n, in] @ weight [q_rows + rest,
    in]^T + bias, q_rows = n_heads * head_dim -> (q [n, n_heads, head_dim] rotated with cos, sin [n,
    n_freq] as ``rotate``, the rest [n, rest]). A decode step's row with full-width RoPE in one kernel."""
    n, q_rows = x.shape[0], n_heads * head_dim
    if (_gemv_applies(x, weight, bias) and 2 * cos.shape[-1] == head_dim and q_rows <= weight.shape[0]
            and cos.dtype == sin.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous()):
        out = _triton().gemv_rotate_q(x, weight, bias, n_heads, head_dim, cos, sin)
        return out[:, :q_rows].view(n, n_heads, head_dim), out[:, q_rows:]
    out = linear(x, weight, bias)
    q = rotate(out[:, :q_rows].reshape(n, n_heads, head_dim), cos, sin).contiguous()
    return q, out[:, q_rows:]


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
