"""The fused decoder ops (models.fused) on CUDA, where they run as Triton kernels, against
transformers' modules and the torch chains they replace. RMSNorm may differ by the float32
reduction order and SiLU by its exp (at most one unit in the last place of the dtype); the rotation
takes torch's cos/sin tables and matches bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conduit_rt.models import fused
from conduit_rt.models.rope import RopeConfig, RotaryEmbedding, apply_rope, rope_tables

from .conftest import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2.4e-7, torch.float16: 2**-10, torch.bfloat16: 2**-7}  # relative: one unit in the last place


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ULP[want.dtype], atol=ULP[want.dtype] * 1e-3)


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (7, 100), (2, 3, 640)])
def test_rms_norm_and_residual_add_match_transformers(dtype, shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    reference = LlamaRMSNorm(shape[-1], eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        reference.weight.copy_(randn(shape[-1], dtype=dtype) + 1)
    x, delta = randn(*shape, dtype=dtype, scale=3.0), randn(*shape, dtype=dtype)
    with torch.no_grad():
        close(fused.rms_norm(x, reference.weight, 1e-5), reference(x))
        total, normed = fused.add_rms_norm(x, delta, reference.weight, 1e-5)
        assert torch.equal(total, x + delta)
        close(normed, reference(x + delta))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(3, 11008), (1, 5), (2, 4100)])
def test_silu_mul_matches_torch(dtype, rows, width):
    gate, up = randn(rows, width, dtype=dtype, scale=4.0), randn(rows, width, dtype=dtype)
    close(fused.silu_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,n_freq", [(128, 64), (80, 16)])  # full rotary; partial (rest passes through)
def test_rotate_matches_transformers(dtype, head_dim, n_freq):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n, heads = 5, 32
    x = randn(n, heads, head_dim, dtype=dtype, scale=2.0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(n_freq, dtype=torch.float32, device="cuda") / n_freq))
    positions = torch.tensor([0, 1, 4095, 32767, 131071], dtype=torch.int32, device="cuda")
    cos, sin = rope_tables(positions, inv_freq, 1.0, (), dtype)
    got = fused.rotate(x, cos, sin)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # transformers' tables, its layout
    emb = torch.cat([freqs, freqs], dim=-1)
    rotary = x[..., : 2 * n_freq].transpose(0, 1)[None]  # [1, heads, n, 2 n_freq]
    want, _ = apply_rotary_pos_emb(rotary, rotary, emb.cos().to(dtype)[None], emb.sin().to(dtype)[None])
    want = torch.cat([want[0].transpose(0, 1), x[..., 2 * n_freq:]], dim=-1)
    assert torch.equal(got, want)  # the same tables and roundings: bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_rotation_matches_the_torch_chain(dtype):
    n, heads, head_dim, sections = 6, 4, 128, (16, 24, 24)
    x = randn(n, heads, head_dim, dtype=dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(64, dtype=torch.float32, device="cuda") / 64))
    gen = torch.Generator(device="cuda").manual_seed(1)
    positions = torch.randint(0, 30000, (3, n), generator=gen, device="cuda", dtype=torch.int32)
    assert torch.equal(fused.rotate(x, *rope_tables(positions, inv_freq, 0.9, sections, dtype)),
                       apply_rope(x, positions, inv_freq, 0.9, sections))


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_tables_follow_in_place_position_writes(device):
    """RotaryEmbedding.apply follows the positions tensor when it is written in place (a CUDA
    graph's static inputs are): the same rotation twice, then the one at the new positions."""
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=64), device)
    x = torch.randn(1, 4, 64, device=device)
    positions = torch.tensor([7], dtype=torch.int32, device=device)
    first = rotary.apply(x, positions)
    assert torch.equal(rotary.apply(x, positions), first)
    positions.fill_(1000)
    moved = rotary.apply(x, positions)
    torch.testing.assert_close(moved, apply_rope(x, positions, rotary.inv_freq))
    assert not torch.equal(moved, first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_out,n_in", [(4096, 4096), (12288, 4096), (4096, 11008), (37, 100), (5, 8192)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_single_row_linear_matches_a_float64_product(dtype, n_out, n_in, with_bias):
    """The Triton GEMV (one row) against the float64 product: within the dtype's rounding of the
    result plus a float32 sum's error, like F.linear's own; odd sizes take the masked tails."""
    x, weight = randn(1, n_in, dtype=dtype), randn(n_out, n_in, dtype=dtype, scale=n_in**-0.5)
    bias = randn(n_out, dtype=dtype) if with_bias else None
    got = fused.linear(x, weight, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (1, n_out)
    torch.testing.assert_close(got.double(), want, rtol=ULP[dtype], atol=ULP[dtype] * 0.05)
    cublas = F.linear(x, weight, bias)  # no further from the truth than cuBLAS, beyond one rounding
    assert (got.double() - want).abs().max() <= (cublas.double() - want).abs().max() + ULP[dtype] * want.abs().max()


@pytest.mark.gpu
def test_several_rows_and_non_contiguous_inputs_take_torch():
    weight = randn(64, 32, dtype=torch.bfloat16)
    rows = randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(fused.linear(rows, weight), F.linear(rows, weight))
    column = randn(32, 2, dtype=torch.bfloat16)[:, :1].t()  # [1, 32] with a stride of 2
    assert torch.equal(fused.linear(column, weight), F.linear(column, weight))


def _rope_tables(n_freq: int, position: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(n_freq, dtype=torch.float32, device=device) / n_freq))
    return rope_tables(torch.tensor([position], dtype=torch.int32, device=device), inv_freq, 1.0, (), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width,n_in", [(11008, 4096), (18944, 3584), (37, 100), (3, 8192)])
def test_gemv_with_the_silu_gate_equals_the_gemv_then_silu_mul(dtype, width, n_in):
    """One kernel for a decode step's gate/up product and SiLU gate: the bits of the two kernels it
    replaces (the same sums, then silu_mul's roundings), and within silu_mul's tolerance of torch."""
    x, gate_up = randn(1, n_in, dtype=dtype), randn(2 * width, n_in, dtype=dtype, scale=n_in**-0.5 * 3)
    got = fused.linear_silu_gate(x, gate_up)
    assert got.shape == (1, width) and got.dtype == dtype
    assert torch.equal(got, fused.silu_mul(fused.linear(x, gate_up)))
    gate, up = F.linear(x.double(), gate_up.double()).chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=4 * ULP[dtype], atol=ULP[dtype] * 0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,with_bias", [(32, 32, 128, False), (28, 4, 128, True),
                                                               (8, 2, 64, True), (3, 1, 16, False)])
def test_gemv_with_the_query_rotation_equals_the_gemv_then_rotate(dtype, heads, kv_heads, head_dim, with_bias):
    """One kernel for a decode step's q/k/v product and the queries' RoPE: the bits of the GEMV then
    ``rotate`` of its query part (the keys and values as the GEMV left them), at a far position."""
    n_in, q_rows = 512, heads * head_dim
    n_out = q_rows + 2 * kv_heads * head_dim
    x, weight = randn(1, n_in, dtype=dtype), randn(n_out, n_in, dtype=dtype, scale=n_in**-0.5)
    bias = randn(n_out, dtype=dtype) if with_bias else None
    cos, sin = _rope_tables(head_dim // 2, 70001, dtype, "cuda")
    q, rest = fused.linear_rotate_q(x, weight, bias, heads, head_dim, cos, sin)
    plain = fused.linear(x, weight, bias)
    assert q.shape == (1, heads, head_dim) and q.is_contiguous() and rest.shape == (1, n_out - q_rows)
    assert torch.equal(q, fused.rotate(plain[:, :q_rows].reshape(1, heads, head_dim), cos, sin))
    assert torch.equal(rest, plain[:, q_rows:])


@pytest.mark.parametrize("device", DEVICES)
def test_projections_with_their_epilogues_match_transformers(device):
    """``linear_rotate_q`` and ``linear_silu_gate`` against transformers' chains on one row, in
    float32: rotate_half RoPE of q_proj's output, and act_fn(gate_proj(x)) * up_proj(x). Float32 takes
    the paths that define the results (the fused GEMV takes bf16/f16 rows and is checked bit for bit
    against them above)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator(device=device).manual_seed(3)
    heads, kv_heads, head_dim, n_in, width = 4, 2, 32, 64, 48
    n_out = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(1, n_in, generator=gen, device=device)
    weight, bias = torch.randn(n_out, n_in, generator=gen, device=device), torch.randn(n_out, generator=gen, device=device)
    cos, sin = _rope_tables(head_dim // 2, 1234, torch.float32, device)
    q, rest = fused.linear_rotate_q(x, weight, bias, heads, head_dim, cos, sin)
    plain = F.linear(x, weight, bias)
    q_plain = plain[:, :heads * head_dim].view(1, heads, head_dim).transpose(0, 1)[None]  # [1, heads, 1, d]
    emb_cos, emb_sin = torch.cat([cos, cos], dim=-1)[None], torch.cat([sin, sin], dim=-1)[None]
    want, _ = apply_rotary_pos_emb(q_plain, q_plain, emb_cos, emb_sin)
    torch.testing.assert_close(q, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, plain[:, heads * head_dim:], rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(2 * width, n_in, generator=gen, device=device)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(fused.linear_silu_gate(x, gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
