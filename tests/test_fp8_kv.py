"""The fp8 KV format (``kv_format="fp8"``): e4m3 K and V with a power-of-two scale per token and KV
head, against torch's own e4m3 rounding (``reference.quantize_fp8``) and the float64 references of
the kernels, on the CPU backend and, under the ``gpu`` marker, on CUDA."""
from __future__ import annotations

import math

import pytest
import torch

from conduit_rt.arena import KVArena
from conduit_rt.errors import InvalidArgumentError

from . import reference
from .conftest import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# What a row loses to e4m3: 3 mantissa bits, half an ulp relative (plus the dtype's own rounding).
FP8_RTOL = 2.0 ** -4


def fp8_arena(device: str, dtype: torch.dtype, n_kv_heads: int = 2, head_dim: int = 64, block_size: int = 8,
              **kw) -> KVArena:
    return KVArena(n_layers=2, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                   block_size=block_size, kv_bytes=4 << 20, kv_format="fp8", **kw)


def rows(shape, dtype, device, gen, spread: float = 3.0) -> torch.Tensor:
    """Random rows whose magnitudes differ by orders (2^-spread .. 2^spread per row): one scale per
    row must serve each."""
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.empty(shape[:-1] + (1,)).uniform_(-spread, spread, generator=gen))
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_written_kv_reads_back_as_torch_rounds_it_to_e4m3(device, dtype):
    gen = torch.Generator().manual_seed(1)
    arena = fp8_arena(device, dtype)
    seq = arena.new_sequence()
    n = 45  # a partial last block
    seq.append(range(n))
    k, v = rows((n, 2, 64), dtype, device, gen), rows((n, 2, 64), dtype, device, gen)
    seq.write_kv(1, k, v)
    k_out, v_out = seq.read_kv(1)
    assert k_out.dtype == dtype and k_out.shape == k.shape
    assert torch.equal(k_out.cpu().float(), reference.quantize_fp8(k.cpu()))
    assert torch.equal(v_out.cpu().float(), reference.quantize_fp8(v.cpu()))
    assert not torch.equal(k_out.cpu(), k.cpu())  # it was rounded: the test sees the format


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_rows_keep_their_relative_precision_and_nan_stays_nan(device):
    arena = fp8_arena(device, torch.float32)
    seq = arena.new_sequence()
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(5, 2, 64, generator=gen)
    k = base * torch.tensor([1e30, 1e-30, 1.0, 0.0, 1.0])[:, None, None]
    k[4, 1, 3] = float("nan")
    seq.append(range(5))
    seq.write_kv(0, k.to(device), base.to(device))
    k_out = seq.read_kv(0)[0].cpu()
    finite = k_out[:3]
    torch.testing.assert_close(finite, k[:3], rtol=FP8_RTOL, atol=0)
    assert torch.equal(k_out[3], torch.zeros(2, 64))
    assert torch.isnan(k_out[4, 1]).all()  # the whole row: its scale is NaN
    assert torch.equal(k_out[4, 0], reference.quantize_fp8(k[4, 0]))  # the other head is untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_blocks_hold_twice_the_tokens_of_bf16_in_the_same_bytes(device, dtype):
    dense = KVArena(n_layers=1, n_kv_heads=4, head_dim=128, dtype=torch.bfloat16, device=device, block_size=16,
                    kv_bytes=8 << 20)
    fp8 = KVArena(n_layers=1, n_kv_heads=4, head_dim=128, dtype=dtype, device=device, block_size=16,
                  kv_bytes=8 << 20, kv_format="fp8")
    assert fp8.stats().block_bytes == 2 * 4 * 16 * (128 + 4)  # bytes, then a float32 scale per row
    assert fp8.stats().n_blocks_total / dense.stats().n_blocks_total == pytest.approx(2 * 128 / 132, rel=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# One query (the decode kernels: GQA, multi-head, an odd group, a context of many tiles) and many.
@pytest.mark.parametrize("n_kv_heads,group,n_tokens,n_q", [
    (2, 4, 37, 1), (4, 1, 300, 1), (1, 7, 200, 1), (2, 4, 5000, 1), (2, 2, 100, 13), (1, 8, 70, 70)])
def test_attention_and_its_statistics_read_the_dequantized_kv(device, dtype, n_kv_heads, group, n_tokens, n_q):
    gen = torch.Generator().manual_seed(n_tokens + n_q)
    arena = fp8_arena(device, dtype, n_kv_heads=n_kv_heads)
    seq = arena.new_sequence()
    k_pos = torch.randint(0, n_tokens, (n_tokens,), generator=gen, dtype=torch.int32)
    seq.append(k_pos)
    k, v = rows((n_tokens, n_kv_heads, 64), dtype, device, gen, 1.0), rows((n_tokens, n_kv_heads, 64), dtype, device, gen, 1.0)
    seq.write_kv(1, k, v)
    q = torch.randn(n_q, n_kv_heads * group, 64, generator=gen).to(dtype).to(device)
    q_pos = torch.randint(0, n_tokens + 1, (n_q,), generator=gen, dtype=torch.int32)
    scale = 1.0 / math.sqrt(64)
    kq, vq = reference.quantize_fp8(k.cpu()), reference.quantize_fp8(v.cpu())

    out, lse = seq.attention(1, q, q_pos.to(device), scale, return_lse=True)
    want_out, want_lse = reference.attention(q.cpu(), kq, vq, q_pos, k_pos, scale)
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}[dtype]
    torch.testing.assert_close(out.cpu().double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-4, rtol=1e-4)

    mass, n_below, _ = seq.attention_stats(1, q, q_pos.to(device), scale, 0.01)
    want_mass, want_below = reference.attention_stats(q.cpu(), kq, q_pos, k_pos, scale, 0.01)
    torch.testing.assert_close(mass.cpu().double(), want_mass, atol=1e-3, rtol=1e-3)
    assert (n_below.cpu().double() - want_below).abs().max() <= 2  # scores at the cut may round either way


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_restore_with_rope_and_compaction_on_fp8(device, dtype):
    """An image entry restored with RoPE holds the rotated, re-quantized pre-RoPE KV; compaction keeps
    the chosen tokens' values exactly."""
    gen = torch.Generator().manual_seed(3)
    arena = fp8_arena(device, dtype, image_cache_bytes=1 << 20)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    arena.set_rope(inv_freq, "neox")
    n_img = 21
    k, v = rows((n_img, 2, 64), dtype, device, gen), rows((n_img, 2, 64), dtype, device, gen)
    entry = arena.create_image(bytes(range(32)), n_img)
    for layer in range(arena.n_layers):
        entry.write(layer, k, v)
    entry.commit()
    assert torch.equal(entry.read(1)[0].cpu().float(), reference.quantize_fp8(k.cpu()))
    rope_pos = torch.randint(0, 1000, (n_img,), generator=gen, dtype=torch.int32)
    seq = arena.new_sequence()
    seq.append(range(n_img))
    seq.restore_image(1, entry, rope_pos=rope_pos.to(device))
    k_r, v_r = (x.cpu() for x in seq.read_kv(1))
    rotated = reference.rope(reference.quantize_fp8(k.cpu()), rope_pos, inv_freq)
    torch.testing.assert_close(k_r.double(), reference.quantize_fp8(rotated).double(), rtol=FP8_RTOL, atol=1e-6)
    torch.testing.assert_close(k_r.double(), rotated, rtol=FP8_RTOL, atol=1e-6)
    assert torch.equal(v_r.float(), reference.quantize_fp8(v.cpu()))  # V moves without rounding again

    keep = [s for s in range(n_img) if s % 3 != 1]
    seq.compact(1, keep)
    k_c, v_c = (x.cpu() for x in seq.read_kv(1))
    assert torch.equal(k_c, k_r[keep]) and torch.equal(v_c, v_r[keep])
    entry.release()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_steps_write_and_attend_fp8(device, dtype):
    gen = torch.Generator().manual_seed(4)
    arena = fp8_arena(device, dtype, n_kv_heads=2)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    arena.set_rope(inv_freq, "neox")
    seqs = []
    for n in (5, 16, 30):
        seq = arena.new_sequence()
        seq.append(range(n))
        for layer in range(2):
            seq.write_kv(layer, rows((n, 2, 64), dtype, device, gen, 1.0), rows((n, 2, 64), dtype, device, gen, 1.0))
        seqs.append(seq)
    step = arena.new_step(max_seqs=4, max_tokens=64, n_heads=8)
    scale = 1.0 / math.sqrt(64)
    for t in range(5):
        positions = [100 + t] * len(seqs)
        step.prepare(seqs, positions)
        rope_pos = torch.randint(0, 3000, (len(seqs),), generator=gen, dtype=torch.int32)
        for layer in range(2):
            k, v = (torch.randn(len(seqs), 2, 64, generator=gen).to(dtype) for _ in range(2))
            q = torch.randn(len(seqs), 8, 64, generator=gen).to(dtype)
            step.write_kv(layer, k.to(device), v.to(device), rope_pos=rope_pos.to(device))
            out, lse = step.attention(layer, q.to(device), None, scale, return_lse=True)
            for i, seq in enumerate(seqs):
                stored_k, stored_v = (x.cpu() for x in seq.read_kv(layer))
                want_k = reference.quantize_fp8(reference.rope(k[i:i + 1], rope_pos[i:i + 1], inv_freq))
                torch.testing.assert_close(stored_k[-1:].double(), want_k.double(), rtol=FP8_RTOL, atol=1e-6)
                assert torch.equal(stored_v[-1].float(), reference.quantize_fp8(v[i]))
                want_out, want_lse = reference.attention(q[i:i + 1], stored_k, stored_v,
                                                         torch.tensor([positions[i]]), seq.positions(layer), scale)
                tol = 2e-5 if dtype == torch.float32 else 2.5e-2
                torch.testing.assert_close(out[i:i + 1].cpu().double(), want_out, atol=tol, rtol=tol)
                torch.testing.assert_close(lse[i:i + 1].cpu().double(), want_lse, atol=1e-4, rtol=1e-4)


def test_an_unknown_kv_format_is_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="kv_format"):
        KVArena(n_layers=1, n_kv_heads=1, head_dim=64, kv_format="int4")
