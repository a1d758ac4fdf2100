"""The fused decoder ops (models.fused) on CUDA, where they run as Triton kernels, against
transformers' modules and the torch chains they replace. Each output may differ from the reference
by the float32 reduction order only: at most one unit in the last place of the dtype."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conduit_rt.models import fused
from conduit_rt.models.rope import apply_rope

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}  # relative: one unit in the last place


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[want.dtype], atol=ULP[want.dtype] * 1e-3)


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate, up = randn(3, 11008, dtype=dtype, scale=4.0), randn(3, 11008, dtype=dtype)
    close(fused.silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,n_freq", [(128, 64), (80, 16)])  # full rotary; partial (rest passes through)
def test_rope_matches_transformers(dtype, head_dim, n_freq):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n, heads = 5, 32
    x = randn(n, heads, head_dim, dtype=dtype, scale=2.0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(n_freq, dtype=torch.float32, device="cuda") / n_freq))
    positions = torch.tensor([0, 1, 4095, 32767, 131071], dtype=torch.int32, device="cuda")  # far angles too
    got = fused.rope(x, positions, inv_freq, 1.0, ())
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    rotary = x[..., : 2 * n_freq].transpose(0, 1)[None]  # [1, heads, n, 2 n_freq], transformers' layout
    want, _ = apply_rotary_pos_emb(rotary, rotary, emb.cos().to(dtype)[None], emb.sin().to(dtype)[None])
    want = torch.cat([want[0].transpose(0, 1), x[..., 2 * n_freq:]], dim=-1)
    close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_matches_the_torch_chain(dtype):
    n, heads, head_dim, sections = 6, 4, 128, (16, 24, 24)
    x = randn(n, heads, head_dim, dtype=dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(64, dtype=torch.float32, device="cuda") / 64))
    gen = torch.Generator(device="cuda").manual_seed(1)
    positions = torch.randint(0, 30000, (3, n), generator=gen, device="cuda", dtype=torch.int32)
    close(fused.rope(x, positions, inv_freq, 0.9, sections), apply_rope(x, positions, inv_freq, 0.9, sections))
