"""Each native kernel against a plain-torch reference, on random inputs, over a grid of shapes."""
from __future__ import annotations

import math

import pytest
import torch

from conduit_rt.arena import KernelTuning, KVArena
from conduit_rt.errors import InvalidArgumentError

from . import reference

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_arena(device: str, dtype: torch.dtype, n_kv_heads: int, head_dim: int, block_size: int, n_layers: int = 2,
               **kw) -> KVArena:
    return KVArena(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                   block_size=block_size, kv_bytes=8 << 20, **kw)


def rand(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen).to(dtype).to(device)


ATTENTION_GRID = [
    # n_kv_heads, group, head_dim, block_size, n_tokens, n_q
    (1, 1, 64, 16, 1, 1),
    (2, 4, 64, 16, 37, 1),
    (2, 2, 128, 8, 100, 13),
    (4, 1, 128, 32, 65, 65),
    (1, 8, 64, 1, 19, 7),
    (8, 4, 128, 16, 300, 3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_kv_heads,group,head_dim,block_size,n_tokens,n_q", ATTENTION_GRID)
def test_attention_matches_sdpa_reference(device, dtype, n_kv_heads, group, head_dim, block_size, n_tokens, n_q):
    gen = torch.Generator().manual_seed(n_tokens * 31 + n_q)
    arena = make_arena(device, dtype, n_kv_heads, head_dim, block_size)
    seq = arena.new_sequence()
    # Scattered, repeated and unsorted positions: causality is by stored position, not by slot.
    k_pos = torch.randint(0, n_tokens, (n_tokens,), generator=gen, dtype=torch.int32)
    seq.append(k_pos)
    k = rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen)
    v = rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen)
    seq.write_kv(1, k, v)
    q = rand((n_q, n_kv_heads * group, head_dim), dtype, device, gen)
    q_pos = torch.randint(-1, n_tokens + 1, (n_q,), generator=gen, dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)

    out, lse = seq.attention(1, q, q_pos.to(device), scale, return_lse=True)

    ref_out, ref_lse = reference.attention(q.cpu(), k.cpu(), v.cpu(), q_pos, k_pos, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=1e-4)


# CONDUIT's text pass (LLaVA-7B: 104 text queries after ~4700 cached keys, 32 heads of 128, MHA; and a
# GQA model's 28 heads over 4 KV heads) and recomputes of as few queries scattered over the keys (one
# of them seeing nothing). So few (query, head) rows per KV head leave the tensor-core attention's CTAs
# short of filling the GPU: it splits the keys and merges the splits by their log-sum-exp.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_kv_heads,group,layout", [(32, 1, "text"), (4, 7, "text"), (32, 1, "recompute"),
                                                     (8, 4, "recompute")])
def test_attention_of_few_queries_over_many_keys_matches_the_reference(dtype, n_kv_heads, group, layout):
    check_few_queries(dtype, n_kv_heads, group, layout)


def check_few_queries(dtype: torch.dtype, n_kv_heads: int, group: int, layout: str,
                      tuning: KernelTuning | None = None) -> None:
    """104 queries over 4700 keys on the GPU (see the test above), against the float64 reference."""
    n_tokens, n_q, head_dim, device = 4700, 104, 128, "cuda"
    gen = torch.Generator().manual_seed(n_kv_heads * 10 + group)
    arena = KVArena(n_layers=1, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, device=device, block_size=16,
                    kv_bytes=128 << 20, tuning=tuning)
    seq = arena.new_sequence()
    k_pos = torch.arange(n_tokens, dtype=torch.int32)
    seq.append(k_pos)
    k = rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen)
    v = rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen)
    seq.write_kv(0, k, v)
    q = rand((n_q, n_kv_heads * group, head_dim), dtype, device, gen)
    if layout == "text":  # the last n_q positions, as a prefill chunk
        q_pos = torch.arange(n_tokens - n_q, n_tokens, dtype=torch.int32)
    else:  # scattered and in order: early queries see none of the later keys
        q_pos = torch.randperm(n_tokens, generator=gen)[:n_q].sort().values.to(torch.int32)
        q_pos[1] = -1
    scale = 1.0 / math.sqrt(head_dim)

    out, lse = seq.attention(0, q, q_pos.to(device), scale, return_lse=True)

    ref_out, ref_lse = reference.attention(q.cpu(), k.cpu(), v.cpu(), q_pos, k_pos, scale)
    # Averages over thousands of keys are small (|out| ~ 0.02), which the grid's absolute tolerance would
    # pass as zeros; a tenth of it still leaves room for the rounding of the weights and the output.
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=TOL[dtype] / 10, rtol=TOL[dtype])
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=1e-4)


def check_long_chunk(device: str, dtype: torch.dtype, head_dim: int, layout: str,
                     tuning: KernelTuning | None = None) -> None:
    """A prefill chunk of 1200 queries over its own 1200 keys, GQA 32 / 8: 304 CTAs of 128 rows, enough
    for the tensor-core attention's 8-warp CTAs (two wgmma warpgroups each on Hopper) on a GPU of up
    to 152 SMs. ``causal``: keys at positions 0..n-1 in slot order (most tiles open, the CTAs' key
    ranges cut after their last query); ``shuffled``: the same positions in random slots (every tile
    masked per element, visible slots anywhere in the range)."""
    n, n_kv_heads, group = 1200, 8, 4
    gen = torch.Generator().manual_seed(head_dim + (layout == "shuffled"))
    arena = KVArena(n_layers=1, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, device=device, block_size=16,
                    kv_bytes=64 << 20, tuning=tuning)
    seq = arena.new_sequence()
    k_pos = torch.arange(n, dtype=torch.int32) if layout == "causal" else torch.randperm(n, generator=gen).to(torch.int32)
    seq.append(k_pos)
    k = rand((n, n_kv_heads, head_dim), dtype, device, gen)
    v = rand((n, n_kv_heads, head_dim), dtype, device, gen)
    seq.write_kv(0, k, v)
    q = rand((n, n_kv_heads * group, head_dim), dtype, device, gen)
    q_pos = torch.arange(n, dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)

    out, lse = seq.attention(0, q, q_pos.to(device), scale, return_lse=True)

    ref_out, ref_lse = reference.attention(q, k, v, q_pos, k_pos, scale)  # float64, on the device
    torch.testing.assert_close(out.double(), ref_out, atol=TOL[dtype] / 10, rtol=TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["causal", "shuffled"])
def test_attention_of_a_long_prefill_chunk_matches_the_reference(dtype, head_dim, layout):
    check_long_chunk("cuda", dtype, head_dim, layout)


# conduit_tuning moves the tensor-core attention's CTA shape and key splits, not its result: 4- and
# 8-warp CTAs forced and three waves of splits, on a text pass (few rows per KV head: split keys) and
# a long chunk (enough rows for 8-warp CTAs by default).
@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [KernelTuning(mma_warps=4), KernelTuning(mma_warps=8),
                                    KernelTuning(mma_split_waves=3)], ids=str)
def test_attention_under_kernel_tuning_matches_the_reference(tuning):
    check_few_queries(torch.bfloat16, 32, 1, "text", tuning)
    check_few_queries(torch.bfloat16, 8, 4, "recompute", tuning)
    check_long_chunk("cuda", torch.bfloat16, 128, "causal", tuning)


def test_an_arena_reports_its_kernel_tuning_which_the_cpu_backend_ignores():
    gen = torch.Generator().manual_seed(3)
    tuned = make_arena("cpu", torch.float32, 2, 64, 16, tuning=KernelTuning(mma_warps=8, mma_split_waves=2))
    plain = make_arena("cpu", torch.float32, 2, 64, 16)
    assert tuned.tuning == KernelTuning(8, 2) and plain.tuning == KernelTuning()
    k, v, q = (rand((40, 2, 64), torch.float32, "cpu", gen) for _ in range(3))
    q_pos = torch.arange(40, dtype=torch.int32)
    outs = []
    for arena in (tuned, plain):
        seq = arena.new_sequence()
        seq.append(range(40))
        seq.write_kv(0, k, v)
        outs.append(seq.attention(0, q, q_pos, 0.125))
    assert torch.equal(outs[0], outs[1])
    ref_out, _ = reference.attention(q.double(), k.double(), v.double(), q_pos, q_pos, 0.125)
    torch.testing.assert_close(outs[0].double(), ref_out, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_of_a_query_that_sees_nothing_is_zero_with_lse_minus_inf(device, dtype):
    arena = make_arena(device, dtype, 2, 64, 16)
    seq = arena.new_sequence()
    seq.append(range(10, 20))
    gen = torch.Generator().manual_seed(1)
    seq.write_kv(0, rand((10, 2, 64), dtype, device, gen), rand((10, 2, 64), dtype, device, gen))
    out, lse = seq.attention(0, rand((2, 4, 64), dtype, device, gen), torch.tensor([3, 9], dtype=torch.int32, device=device),
                             0.125, return_lse=True)
    assert torch.all(out.cpu() == 0)
    assert torch.all(torch.isneginf(lse.cpu()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,n_freq,block_size", [(64, 32, 16), (128, 64, 8), (128, 32, 4)])
def test_write_kv_applies_rotate_half_rope(device, dtype, head_dim, n_freq, block_size):
    gen = torch.Generator().manual_seed(head_dim + n_freq)
    arena = make_arena(device, dtype, 2, head_dim, block_size)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * n_freq, 2, dtype=torch.float32) / (2 * n_freq)))
    arena.set_rope(inv_freq, "neox", attention_scaling=0.9)
    seq = arena.new_sequence()
    n = 23
    seq.append(range(n))
    k, v = rand((n, 2, head_dim), dtype, device, gen), rand((n, 2, head_dim), dtype, device, gen)
    rope_pos = torch.randint(0, 5000, (n,), generator=gen, dtype=torch.int32)
    seq.write_kv(0, k, v, rope_pos=rope_pos.to(device))
    k_out, v_out = seq.read_kv(0)
    expected = reference.rope(k, rope_pos, inv_freq, scaling=0.9)
    torch.testing.assert_close(k_out.cpu().double(), expected, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    assert torch.equal(v_out.cpu(), v.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mrope_matches_transformers_qwen2vl_rotary_embedding(device, dtype):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    head_dim, n_kv, n = 128, 2, 29
    sections = [16, 24, 24]
    config = Qwen2VLTextConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=n_kv,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections})
    rotary = Qwen2VLRotaryEmbedding(config)
    gen = torch.Generator().manual_seed(7)
    rope_pos = torch.randint(0, 300, (3, n), generator=gen, dtype=torch.int32)
    k = rand((n, n_kv, head_dim), dtype, device, gen)
    cos, sin = rotary(k.cpu().float(), rope_pos.long()[:, None, :])  # [1, n, d] each
    expected, _ = apply_rotary_pos_emb(k.cpu().double().transpose(0, 1)[None], k.cpu().double().transpose(0, 1)[None],
                                       cos.double(), sin.double())
    expected = expected[0].transpose(0, 1)

    arena = make_arena(device, dtype, n_kv, head_dim, 16)
    arena.set_rope(rotary.inv_freq, "mrope", sections=sections)
    seq = arena.new_sequence()
    seq.append(range(n))
    seq.write_kv(0, k, k.clone(), rope_pos=rope_pos.to(device))
    k_out, _ = seq.read_kv(0)
    torch.testing.assert_close(k_out.cpu().double(), expected, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["neox", "mrope"])
def test_restore_image_equals_writing_k_at_the_new_positions(device, dtype, kind):
    """Restoring pre-RoPE image KV with RoPE at new positions equals computing K there directly."""
    gen = torch.Generator().manual_seed(11)
    head_dim, n_img = 64, 21
    arena = make_arena(device, dtype, 2, head_dim, 8, image_cache_bytes=1 << 20)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    sections = (8, 12, 12)
    arena.set_rope(inv_freq, kind, sections=sections if kind == "mrope" else (0, 0, 0))
    k, v = rand((n_img, 2, head_dim), dtype, device, gen), rand((n_img, 2, head_dim), dtype, device, gen)
    entry = arena.create_image(bytes(range(32)), n_img)
    for layer in range(arena.n_layers):
        entry.write(layer, k, v)
    entry.commit()
    shape = (n_img,) if kind == "neox" else (3, n_img)
    rope_pos = torch.randint(0, 1000, shape, generator=gen, dtype=torch.int32).to(device)

    restored, direct = arena.new_sequence(), arena.new_sequence()
    for seq in (restored, direct):
        seq.append(range(5))
        seq.append(range(5, 5 + n_img))
    slots = torch.randperm(n_img, generator=gen) + 5  # scattered destination slots
    restored.restore_image(1, entry, slots=slots, rope_pos=rope_pos)
    inverse = torch.argsort(slots)
    direct.write_kv(1, k[inverse.to(device)].contiguous(), v[inverse.to(device)].contiguous(),
                    slots=slots[inverse], rope_pos=rope_pos[..., inverse.to(device)].contiguous())
    k_r, v_r = restored.read_kv(1)
    k_d, v_d = direct.read_kv(1)
    assert torch.equal(k_r[5:].cpu(), k_d[5:].cpu())
    assert torch.equal(v_r[5:].cpu(), v_d[5:].cpu())
    # and both equal the reference rotation
    expected = reference.rope(k, rope_pos, inv_freq, sections if kind == "mrope" else None)
    torch.testing.assert_close(k_r[slots].cpu().double(), expected, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    assert torch.equal(entry.read(1)[0].cpu(), k.cpu())  # the entry keeps pre-RoPE K
    entry.release()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_compact_keeps_the_chosen_tokens_and_frees_blocks(device, dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    arena = make_arena(device, dtype, 2, 64, block_size)
    seq = arena.new_sequence()
    n = 53
    positions = torch.arange(100, 100 + n, dtype=torch.int32)
    seq.append(positions)
    k, v = rand((n, 2, 64), dtype, device, gen), rand((n, 2, 64), dtype, device, gen)
    seq.write_kv(0, k, v)
    used_before = arena.stats().n_blocks_used
    keep = torch.sort(torch.randperm(n, generator=gen)[:11]).values
    seq.compact(0, keep)
    k_c, v_c = seq.read_kv(0)
    assert torch.equal(k_c.cpu(), k.cpu()[keep]) and torch.equal(v_c.cpu(), v.cpu()[keep])
    assert torch.equal(seq.positions(0), positions[keep])
    assert seq.n_tokens(1) == n  # other layers untouched
    assert seq.max_tokens() == n  # the longest layer
    freed = -(-n // block_size) - (-(-11 // block_size))
    assert arena.stats().n_blocks_used == used_before - freed
    # attention over the compacted layer equals attention over the kept subset
    q = rand((3, 4, 64), dtype, device, gen)
    q_pos = torch.tensor([120, 130, 160], dtype=torch.int32)
    out = seq.attention(0, q, q_pos.to(device), 0.125)
    ref, _ = reference.attention(q.cpu(), k.cpu()[keep], v.cpu()[keep], q_pos, positions[keep], 0.125)
    torch.testing.assert_close(out.cpu().double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    seq.compact(1, torch.arange(20))
    assert (seq.n_tokens(0), seq.n_tokens(1), seq.max_tokens()) == (11, 20, 20)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_kv_heads,group,head_dim,n_tokens,n_q", [(2, 2, 64, 45, 5), (1, 4, 128, 130, 17), (4, 1, 64, 9, 1)])
def test_attention_stats_match_the_materialised_probabilities(device, dtype, n_kv_heads, group, head_dim, n_tokens, n_q):
    gen = torch.Generator().manual_seed(n_tokens + n_q)
    arena = make_arena(device, dtype, n_kv_heads, head_dim, 16)
    seq = arena.new_sequence()
    k_pos = torch.randint(0, n_tokens, (n_tokens,), generator=gen, dtype=torch.int32)
    seq.append(k_pos)
    k = rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen) * 2
    seq.write_kv(0, k, rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen))
    q = rand((n_q, n_kv_heads * group, head_dim), dtype, device, gen)
    q_pos = torch.randint(n_tokens // 2, n_tokens + 1, (n_q,), generator=gen, dtype=torch.int32)
    mass, n_below, lse = seq.attention_stats(0, q, q_pos.to(device), 1 / math.sqrt(head_dim), threshold=0.01)
    ref_mass, ref_below = reference.attention_stats(q.cpu(), k.cpu(), q_pos, k_pos, 1 / math.sqrt(head_dim), 0.01)
    _, ref_lse = reference.attention(q.cpu(), k.cpu(), k.cpu(), q_pos, k_pos, 1 / math.sqrt(head_dim))
    torch.testing.assert_close(mass.cpu().double(), ref_mass, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=1e-4)
    # a probability within rounding of the cut may land on either side
    assert (n_below.cpu().double() - ref_below).abs().max() <= max(2, 0.002 * float(ref_below.max()))
    # each (query, head) row that sees a key spreads a probability mass of exactly 1
    assert float(mass.sum()) == pytest.approx(float(torch.isfinite(ref_lse).sum()), rel=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_kv_heads,group,head_dim,n_tokens,n_q", [(2, 2, 64, 45, 5), (1, 4, 128, 130, 17), (4, 1, 128, 300, 9)])
def test_attention_mass_with_the_lse_given_matches_the_probabilities(device, dtype, n_kv_heads, group, head_dim,
                                                                      n_tokens, n_q):
    """CONDUIT's scoring call: several layers, each row's log-sum-exp taken from the attention of the
    same queries (as the text pass returns it), one native call."""
    gen = torch.Generator().manual_seed(3 * n_tokens + n_q)
    arena = make_arena(device, dtype, n_kv_heads, head_dim, 16, n_layers=3)
    seq = arena.new_sequence()
    k_pos = torch.randint(0, n_tokens, (n_tokens,), generator=gen, dtype=torch.int32)
    seq.append(k_pos)
    keys = [rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen) * 2 for _ in range(3)]
    for layer, k in enumerate(keys):
        seq.write_kv(layer, k, rand((n_tokens, n_kv_heads, head_dim), dtype, device, gen))
    layers = [2, 0]  # any order: row i of the table is layer layers[i]
    q = rand((len(layers), n_q, n_kv_heads * group, head_dim), dtype, device, gen)
    q_pos = torch.randint(n_tokens // 2, n_tokens + 1, (n_q,), generator=gen, dtype=torch.int32)
    q_pos[0] = -1  # sees no key: lse -inf, no mass
    scale = 1 / math.sqrt(head_dim)
    lse = torch.stack([seq.attention(layer, q[i], q_pos.to(device), scale, return_lse=True)[1]
                       for i, layer in enumerate(layers)])
    mass = seq.attention_mass(layers, q, q_pos.to(device), lse, scale)
    assert mass.shape == (len(layers), n_tokens) and mass.dtype == torch.float32
    for i, layer in enumerate(layers):
        ref_mass, _ = reference.attention_stats(q[i].cpu(), keys[layer].cpu(), q_pos, k_pos, scale, 0.01)
        torch.testing.assert_close(mass[i].cpu().double(), ref_mass, atol=1e-3, rtol=1e-3)
        stats_mass, _, _ = seq.attention_stats(layer, q[i], q_pos.to(device), scale)
        torch.testing.assert_close(mass[i], stats_mass, atol=1e-3, rtol=1e-3)
    # bad input: a typed error, nothing written, the sequence still usable
    with pytest.raises(InvalidArgumentError):
        seq.attention_mass(layers, q, q_pos.to(device), lse[:, 1:], scale)
    with pytest.raises(InvalidArgumentError):
        seq.attention_mass([0, 3], q, q_pos.to(device), lse, scale)
    seq.compact(1, torch.arange(n_tokens - 1))
    with pytest.raises(InvalidArgumentError, match="equal lengths"):
        seq.attention_mass([0, 1], q, q_pos.to(device), lse, scale)
    assert torch.equal(seq.attention_mass(layers, q, q_pos.to(device), lse, scale), mass)


def _load_tool(name: str):
    """A script of tools/ as a module."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def _sass(*instructions: str) -> str:
    """cuobjdump -sass text of one function with these instructions, 16 bytes apart."""
    lines = [f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(instructions)]
    return "\n\tFunction : kernel\n" + "\n".join(lines) + "\n"


def test_the_sass_check_finds_a_register_of_a_running_product_touched_on_some_path():
    """The checker's rule on hand-written SASS: a product's A fragment (R8..R11) and accumulators
    (R16..R47) are off limits until the DEPBAR that retires its group, on every path."""
    check = _load_tool("check_wgmma_sass")
    issue = ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R16, R8, gdesc[UR4], R16, gsb0"]
    clean = _sass(*issue, "FMUL R50, R51, R52", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "F2FP.BF16.F32.PACK_AB R8, R16, R17",
                  "EXIT")
    assert check.scan(clean) == ([], 1)
    # A write of the A fragment on the taken side of a branch only, and a read of an accumulator.
    branchy = _sass(*issue, "@P0 BRA 0x0050", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT", "F2FP.BF16.F32.PACK_AB R9, R50, R51",
                    "FADD R60, R17, R61", "EXIT")
    hazards, _ = check.scan(branchy)
    assert [(h.address, h.kind, h.registers) for h in hazards] == [("0050", "write", [9]), ("0060", "read", [17])]
    # DEPBAR.LE 1 retires the older group only: the newer one's accumulators stay off limits.
    two_groups = _sass(*issue, "HGMMA.64x64x16.F32.BF16 R48, R12, gdesc[UR4], R48, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
                       "FMUL R16, R16, R2", "FMUL R48, R48, R2", "EXIT")
    hazards, _ = check.scan(two_groups)
    assert [(h.address, h.registers) for h in hazards] == [("0050", [48])]
    # A path that traps ends there: its fall-through into the next instructions is no path at all
    # (a branch over the wait to a trap, as a guard of an impossible value compiles).
    trapped = _sass(*issue, "@!P0 BRA 0x0060", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "FADD R60, R17, R61", "EXIT",
                    "BPT.TRAP 0x1", "FADD R60, R17, R61", "EXIT")
    hazards, _ = check.scan(trapped)
    assert hazards == []
    not_trapped = trapped.replace("BPT.TRAP 0x1", "NOP")
    assert [h.address for h in check.scan(not_trapped)[0]] == ["0070"]


def test_the_sass_check_finds_a_warp_specialized_kernel_whose_register_trade_was_dropped():
    """A function with warpgroup MMAs that waits on an mbarrier must give registers back (producer)
    and take them (consumers); one that waits on none, or has no HGMMA, needs neither."""
    check = _load_tool("check_wgmma_sass")
    wait = "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R91+URZ], R90"
    hgmma = "HGMMA.64x64x16.F32.BF16 R16, R8, gdesc[UR4], R16, gsb0"
    take, give = "@!P2 USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", "USETMAXREG.DEALLOC.CTAPOOL 0x38"
    traded = _sass("@P0 BRA 0x0040", take, wait, hgmma, give, "EXIT")
    assert check.missing_register_trades(traded) == []
    assert check.missing_register_trades(traded.replace(give, "NOP")) == ["kernel"]
    assert check.missing_register_trades(traded.replace(take, "NOP")) == ["kernel"]
    assert check.missing_register_trades(_sass(wait, hgmma, "EXIT")) == ["kernel"]
    assert check.missing_register_trades(_sass(wait, "EXIT")) == []  # an mbarrier user without wgmma
    assert check.missing_register_trades(_sass(hgmma, "EXIT")) == []


@pytest.mark.gpu  # (no GPU needed, but the GPU machine is where cuobjdump and an sm_90a build meet: `-m gpu` runs it)
def test_the_wgmma_attention_leaves_the_registers_of_a_running_product_alone():
    """The library's sm_90a code (when it has some) touches no A fragment or accumulator of an
    in-flight HGMMA before the wait that retires it: ptxas does not enforce it (tools/check_wgmma_sass.py)."""
    from conduit_rt import native

    check = _load_tool("check_wgmma_sass")
    tool = check.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to read the library's SASS")
    sass = check.dump_sass(tool, str(native.find_library()))
    if sass is None:
        pytest.skip("the library has no CUDA backend")
    hazards, n_hgmma = check.scan(sass)
    if n_hgmma == 0:
        pytest.skip("the library holds no warpgroup MMA (not built for sm_90a)")
    assert [f"{h.address}: {h.instruction}" for h in hazards] == []
    # The warp-specialized kernels keep the register budgets they ask for (ptxas may drop setmaxnreg).
    assert check.missing_register_trades(sass) == []
