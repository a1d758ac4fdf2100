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
