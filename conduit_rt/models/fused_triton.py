"""Triton kernels of ``fused`` (imported only on CUDA, where Triton ships with torch).

Every kernel works on rows of contiguous tensors, one program per row (a token), and rounds each
intermediate to the output dtype where the torch chain it replaces does, so that the results match
torch's bit for bit up to the float32 reduction order and the exp of SiLU (libdevice's, as CUDA's
expf); divisions are IEEE-rounded (div_rn), as CUDA's own. They compile without fused multiply-adds,
which torch's separate kernels cannot form. RoPE takes its cos/sin tables from torch
(``rope.rope_tables``) rather than evaluating them.

Programmatic dependent launch (PDL): on Hopper and later (compute capability >= 9.0, with a Triton
that has grid dependency control) every kernel here is launched with ``launch_pdl=True`` and
compiled with ``PDL=True``, so that it may start while the kernel before it on the stream drains.
Before its ``gdc_wait()`` a kernel reads only what no kernel writes during a forward pass (the
GEMV's first weight tile, the norm weight) and writes nothing; after it, everything the stream's
earlier kernels wrote is visible. Each kernel waits in every program, so the kernel after it, whose
own wait returns only once this one completed, also sees everything before: chains stay ordered.
``gdc_launch_dependents()`` right after the wait lets the next kernel be scheduled (its programs
then take their weight tiles while this one runs). Env ``CONDUIT_PDL=0`` turns it off (read once,
at the first launch on a device); with ``PDL=False`` the kernels compile exactly as without it.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice  # the accurate exp (tl.exp may use the approximate ex2)

from ..config import env

try:  # grid dependency control (not in older Tritons: there PDL stays off)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _triton_has_pdl() -> bool:
    """Whether this Triton has ``gdc_wait`` and its CUDA launcher takes ``launch_pdl``."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return gdc_wait is not None and "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


@functools.cache
def pdl_enabled(device_index: int) -> bool:
    """Whether kernels on CUDA device ``device_index`` launch with PDL: capability >= 9.0, a Triton
    that supports it, not the Triton interpreter, and ``CONDUIT_PDL`` not "0". Decided once a device."""
    if not env().pdl:
        return False
    return _triton_has_pdl() and torch.cuda.get_device_capability(device_index) >= (9, 0)


def _pdl_options(t: torch.Tensor) -> dict:
    """The launch keywords of a kernel whose operands are on t's device: the ``PDL`` constexpr and,
    when on, ``launch_pdl`` (never for CPU tensors, which only the Triton interpreter runs)."""
    if t.is_cuda and pdl_enabled(t.device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """With PDL: wait for the kernels before on the stream (their writes are visible after it),
    then let the next kernel be scheduled. Nothing without."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:  # the norm weight is no kernel's output: read it while the previous kernel drains
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    _pdl_wait(PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the dtype as torch's add
        delta = tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = libdevice.rsqrt(libdevice.div_rn(tl.sum(h * h, axis=0), n_cols.to(tl.float32)) + eps)
    normed = (h * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    if not PDL:
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
                                  HAS_DELTA=delta is not None, BLOCK=block, num_warps=_warps(block),
                                  enable_fp_fusion=False, **_pdl_options(x))
    return total, out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row r of out [rows, width] from row r of gate_up [rows, 2 width] (gate, then up)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    _pdl_wait(PDL)
    g = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 width] (contiguous) -> silu(gate) * up [..., width]."""
    width = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // (2 * width) if width else 0
    if rows:
        block = 2048
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block, num_warps=8,
                                                             enable_fp_fusion=False, **_pdl_options(gate_up))
    return out


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, head_dim, n_freq,
                   BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    f_mask = f < n_freq
    _pdl_wait(PDL)  # the tables are a forward pass's: computed by the kernels before
    cos = tl.load(cos_ptr + token * n_freq + f, mask=f_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * n_freq + f, mask=f_mask, other=0.0).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < n_heads) & f_mask[None, :]
    base = token * n_heads * head_dim + h * head_dim
    x1 = tl.load(x_ptr + base + f[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + n_freq + f[None, :], mask=mask, other=0.0).to(tl.float32)
    # x cos + rotate_half(x) sin, each product rounded to the dtype, then the sum (no fused multiply-add:
    # the kernel is compiled with enable_fp_fusion=False)
    dtype = out_ptr.dtype.element_ty
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(out_ptr + base + f[None, :], out1.to(dtype), mask=mask)
    tl.store(out_ptr + base + n_freq + f[None, :], out2.to(dtype), mask=mask)
    if BLOCK_R > 0:  # elements past the rotary part pass through
        r = 2 * n_freq + tl.arange(0, BLOCK_R)[None, :]
        r_mask = (h < n_heads) & (r < head_dim)
        tl.store(out_ptr + base + r, tl.load(x_ptr + base + r, mask=r_mask, other=0.0), mask=r_mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated with cos, sin [n, n_freq] (x's dtype, contiguous)."""
    n, heads, head_dim = x.shape
    n_freq = cos.shape[-1]
    out = torch.empty_like(x)
    if n:
        rest = head_dim - 2 * n_freq
        block_h, block_f = triton.next_power_of_2(heads), triton.next_power_of_2(n_freq)
        _rotate_kernel[(n,)](x, cos, sin, out, heads, head_dim, n_freq, BLOCK_H=block_h, BLOCK_F=block_f,
                             BLOCK_R=triton.next_power_of_2(rest) if rest > 0 else 0,
                             num_warps=_warps(block_h * block_f), enable_fp_fusion=False, **_pdl_options(x))
    return out


# What a GEMV program does with its rows' sums (EPILOGUE): store them; gate and up rows -> silu(gate) * up;
# pairs of query rows rotated with RoPE.
STORE, SILU_GATE, ROTATE_Q = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _gemv_rows(program, n_rotating, n_freq, head_dim, gate_width, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr):
    """The BLOCK_N weight rows of ``program``. STORE: consecutive rows. SILU_GATE (BLOCK_N 2): row
    ``program`` of gate and of up (rows program and program + gate_width). ROTATE_Q (BLOCK_N 2):
    programs below ``n_rotating`` take the rows (f, f + n_freq) of query head program // n_freq, f =
    program % n_freq, which RoPE mixes; the programs after take the rows past the queries two by two."""
    offsets = tl.arange(0, BLOCK_N)
    if EPILOGUE == SILU_GATE:
        return program + offsets * gate_width
    if EPILOGUE == ROTATE_Q:
        rotating = program < n_rotating
        first = tl.where(rotating, program // n_freq * head_dim + program % n_freq,
                         2 * n_rotating + (program - n_rotating) * BLOCK_N)
        return first + offsets * tl.where(rotating, n_freq, 1)
    return program * BLOCK_N + offsets


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, cos_ptr, sin_ptr, n_out, n_in, n_rotating, n_freq, head_dim,
                 HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """out[r] = w[r] . x (+ bias[r]) for the BLOCK_N rows r of a program (``_gemv_rows``), the sum in
    float32, then the EPILOGUE.

    A program holds a [BLOCK_N, BLOCK_K] tile of products; with BLOCK_K = 4096 a row of a 7B
    model's projection is one round of loads, all in flight at once. The weight is read once and
    never again in the step: evict_first keeps it from pushing the activations out of L2. With PDL
    the first K-block of the weight is loaded before the wait for x (the same products, in the same
    order: the results are those without PDL, bit for bit). The products are accumulated with an
    explicit fused multiply-add: the kernel compiles without fusion (``enable_fp_fusion=False``, for
    the epilogues' arithmetic, which must round as the separate kernels do), and the sums stay the
    same whatever Triton's default.
    """
    program = tl.program_id(0)
    rows = _gemv_rows(program, n_rotating, n_freq, head_dim, n_out // 2, BLOCK_N, EPILOGUE)
    row_mask = rows < n_out
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * n_in
    if PDL:  # the first K-block: its weight before the wait (no kernel writes it), x after
        cols = tl.arange(0, BLOCK_K)
        col_mask = cols < n_in
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        _pdl_wait(PDL)
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc = tl.fma(w.to(tl.float32), x, acc)
    for start in range(BLOCK_K if PDL else 0, n_in, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < n_in
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = tl.fma(w.to(tl.float32), x, acc)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:  # added before rounding, as cuBLAS's bias epilogue
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if EPILOGUE == SILU_GATE:  # as _silu_mul_kernel on the rounded gate and up
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (1, 2)))
        silu = libdevice.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(dtype).to(tl.float32)
        tl.store(out_ptr + program + tl.arange(0, 1), (silu * up).to(dtype))
    elif EPILOGUE == ROTATE_Q:  # as _rotate_kernel on the rounded query pair, for the rotating programs
        x1, x2 = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (1, 2)))
        rotating = program < n_rotating
        f = tl.where(rotating, program % n_freq, 0) + tl.arange(0, 1)
        cos = tl.load(cos_ptr + f).to(tl.float32)
        sin = tl.load(sin_ptr + f).to(tl.float32)
        out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
        out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
        y = tl.where(rotating, tl.reshape(tl.join(out1, out2), (2,)), y)
        tl.store(out_ptr + rows, y.to(dtype), mask=row_mask)
    else:
        tl.store(out_ptr + rows, y.to(dtype), mask=row_mask)


# Tile of the GEMV, the fastest of a sweep on an H200: two rows of up to 4096 columns a program, 4 warps.
# A 7B row is one round of loads, all in flight at once (Triton pipelines only loads that feed a tl.dot,
# so smaller K tiles are 5-15% slower), and 2 rows x 4 warps keep enough programs on each SM.
GEMV_BLOCK_N, GEMV_MAX_BLOCK_K, GEMV_WARPS = 2, 4096, 4


def _launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, programs: int,
                 epilogue: int, block_n: int, block_k: int | None, num_warps: int,
                 rope: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None) -> torch.Tensor:
    n_out, n_in = weight.shape
    cos, sin, n_rotating, n_freq, head_dim = rope if rope is not None else (weight, weight, 0, 1, 1)
    _gemv_kernel[(programs,)](x, weight, bias if bias is not None else weight, out, cos, sin, n_out, n_in,
                              n_rotating, n_freq, head_dim, HAS_BIAS=bias is not None, EPILOGUE=epilogue,
                              BLOCK_N=block_n, BLOCK_K=block_k or min(GEMV_MAX_BLOCK_K, triton.next_power_of_2(n_in)),
                              num_warps=num_warps, enable_fp_fusion=False, **_pdl_options(x))
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = GEMV_BLOCK_N,
         block_k: int | None = None, num_warps: int = GEMV_WARPS) -> torch.Tensor:
    """x [1, in] @ weight [out, in]^T (+ bias [out]) -> [1, out]; contiguous, one dtype."""
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch_gemv(x, weight, bias, out, triton.cdiv(weight.shape[0], block_n), STORE, block_n, block_k,
                        num_warps)


def gemv_silu_gate(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(gemv(x, gate_up)) in one kernel, the same bits: x [1, in], gate_up [2 width, in] (gate
    rows, then up rows) -> [1, width]."""
    width = gate_up.shape[0] // 2
    out = torch.empty((1, width), dtype=x.dtype, device=x.device)
    return _launch_gemv(x, gate_up, None, out, width, SILU_GATE, 2, None, GEMV_WARPS)


def gemv_rotate_q(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_heads: int, head_dim: int,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """gemv(x, weight, bias) -> [1, out] with its first n_heads * head_dim outputs (the queries, head
    by head) rotated as ``rotate`` with cos, sin [1, head_dim / 2], the same bits, in one kernel.
    Full-width RoPE only (2 n_freq = head_dim)."""
    n_out = weight.shape[0]
    n_rotating = n_heads * head_dim // 2  # one program per rotated pair
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    programs = n_rotating + triton.cdiv(n_out - 2 * n_rotating, 2)
    return _launch_gemv(x, weight, bias, out, programs, ROTATE_Q, 2, None, GEMV_WARPS,
                        rope=(cos, sin, n_rotating, head_dim // 2, head_dim))
