"""Decode steps over a batch of sequences (conduit_step_*): the graph-capturable decode path.

Several steps over sequences of different lengths, one forked (its new tokens land in blocks shared
copy-on-write), one compacted between steps (its block table changes under the step's mirror):
the written K (rotated) and V, and the attention output and log-sum-exp, are checked against
float64 torch references over what the sequences hold. Bad arguments raise typed errors and change
nothing.
"""
from __future__ import annotations

import pytest
import torch

from conduit_rt.arena import KVArena
from conduit_rt.errors import ArenaFullError, InvalidArgumentError

from . import reference
from .conftest import DEVICES

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
N_LAYERS, N_KV, GROUP, HEAD_DIM, BLOCK = 2, 2, 3, 64, 8
N_HEADS = N_KV * GROUP
SECTIONS = (8, 12, 12)
SCALE = HEAD_DIM**-0.5


def make_arena(device: str, dtype: torch.dtype, kind: str = "neox", kv_bytes: int = 4 << 20) -> KVArena:
    arena = KVArena(n_layers=N_LAYERS, n_kv_heads=N_KV, head_dim=HEAD_DIM, dtype=dtype, device=device,
                    block_size=BLOCK, kv_bytes=kv_bytes)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    arena.set_rope(inv_freq, kind, sections=SECTIONS if kind == "mrope" else (0, 0, 0))
    arena.inv_freq = inv_freq  # kept for the reference
    return arena


def filled(arena: KVArena, n: int, gen: torch.Generator):
    """A sequence of n tokens at positions 0..n-1, every layer written with random K, V."""
    seq = arena.new_sequence()
    seq.append(range(n))
    for layer in range(N_LAYERS):
        k, v = (torch.randn(n, N_KV, HEAD_DIM, generator=gen).to(arena.dtype).to(arena.device) for _ in range(2))
        seq.write_kv(layer, k, v)
    return seq


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["neox", "mrope"])
def test_steps_match_reference(device: str, dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    arena = make_arena(device, dtype, kind)
    parent = filled(arena, 21, gen)
    seqs = [filled(arena, 5, gen), parent.fork(), filled(arena, 16, gen)]  # mid-block, shared blocks, full block
    step = arena.new_step(max_seqs=4, max_tokens=64, n_heads=N_HEADS)
    n = len(seqs)
    for t in range(11):
        if t == 4:  # compaction between steps: the step must notice the new block table
            seqs[2].compact(0, [s for s in range(seqs[2].n_tokens(0)) if s % 3 != 1])
        positions = [100 + 10 * t + i for i in range(n)]
        step.prepare(seqs, positions)
        rope_shape = (n,) if kind == "neox" else (3, n)
        rope_pos = torch.randint(0, 3000, rope_shape, generator=gen, dtype=torch.int32)
        for layer in range(N_LAYERS):
            k, v = (torch.randn(n, N_KV, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
            q = torch.randn(n, N_HEADS, HEAD_DIM, generator=gen).to(dtype)
            step.write_kv(layer, k.to(device), v.to(device), rope_pos=rope_pos.to(device))
            out, lse = step.attention(layer, q.to(device), None, SCALE, return_lse=True)
            for i, seq in enumerate(seqs):
                stored_k, stored_v = (x.cpu() for x in seq.read_kv(layer))
                want_k = reference.rope(k[i:i + 1], rope_pos[..., i:i + 1], arena.inv_freq,
                                        SECTIONS if kind == "mrope" else None)
                torch.testing.assert_close(stored_k[-1:].double(), want_k, atol=TOL[dtype], rtol=TOL[dtype])
                assert torch.equal(stored_v[-1], v[i])
                k_pos = seq.positions(layer)
                want_out, want_lse = reference.attention(q[i:i + 1], stored_k, stored_v,
                                                         torch.tensor([positions[i]]), k_pos, SCALE)
                torch.testing.assert_close(out[i:i + 1].cpu().double(), want_out, atol=TOL[dtype], rtol=TOL[dtype])
                torch.testing.assert_close(lse[i:i + 1].cpu().double(), want_lse, atol=1e-4, rtol=1e-4)
    assert parent.n_tokens(0) == 21  # the fork's appends never reached the parent
    for layer in range(N_LAYERS):
        assert seqs[1].n_tokens(layer) == 21 + 11
    arena.close()


@pytest.mark.parametrize("device", DEVICES)
def test_long_sequence_uses_every_split(device: str) -> None:
    """One sequence far longer than a split, in a step of large capacity, next to a short one."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    arena = make_arena(device, dtype, kv_bytes=64 << 20)
    seqs = [filled(arena, 3000, gen), filled(arena, 2, gen)]
    step = arena.new_step(max_seqs=2, max_tokens=8192, n_heads=N_HEADS)
    step.prepare(seqs, [5000, 5000])
    layer = 1
    k, v = (torch.randn(2, N_KV, HEAD_DIM, generator=gen).to(dtype).to(device) for _ in range(2))
    step.write_kv(layer, k, v)  # no RoPE
    q = torch.randn(2, N_HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = step.attention(layer, q.to(device), None, SCALE)
    for i, seq in enumerate(seqs):
        stored_k, stored_v = (x.cpu() for x in seq.read_kv(layer))
        assert torch.equal(stored_k[-1], k[i].cpu())
        want, _ = reference.attention(q[i:i + 1], stored_k, stored_v, torch.tensor([5000]), seq.positions(layer), SCALE)
        torch.testing.assert_close(out[i:i + 1].cpu().double(), want, atol=TOL[dtype], rtol=TOL[dtype])


# A VL-Cache-compressed decode (~3.3K keys) with LLaVA-7B's 32 heads of 128 (MHA: the CUDA-core
# kernel) and a GQA model's 28 heads over 4 KV heads (the tensor-core decode): the keys split and the
# last CTA of each head group merges the splits, on arrival counters in the step's workspace that
# every launch leaves at zero. Eager calls, calls with the batch size changed in between, CUDA graph
# replays and the single-sequence path all give the reference's values, and the same q the same bits.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_kv_heads,group", [(32, 1), (4, 7)])
def test_split_decode_is_the_same_across_calls_and_graph_replays(dtype: torch.dtype, n_kv_heads: int,
                                                                 group: int) -> None:
    device, head_dim, n_heads, scale = "cuda", 128, n_kv_heads * group, 128**-0.5
    gen = torch.Generator().manual_seed(n_kv_heads + group)
    arena = KVArena(n_layers=1, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                    block_size=16, kv_bytes=256 << 20)
    seqs = []
    for n in (3300, 700):
        seq = arena.new_sequence()
        seq.append(range(n))
        seq.write_kv(0, *(torch.randn(n, n_kv_heads, head_dim, generator=gen).to(dtype).to(device) for _ in range(2)))
        seqs.append(seq)
    step = arena.new_step(max_seqs=2, max_tokens=4096, n_heads=n_heads)

    def decode(batch: list, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends a token to each sequence of `batch`; returns a q for them and its reference output."""
        step.prepare(batch, [position] * len(batch))
        step.write_kv(0, *(torch.randn(len(batch), n_kv_heads, head_dim, generator=gen).to(dtype).to(device)
                           for _ in range(2)))
        q = torch.randn(len(batch), n_heads, head_dim, generator=gen).to(dtype)
        want = []
        for i, seq in enumerate(batch):
            k, v = (x.cpu() for x in seq.read_kv(0))
            want.append(reference.attention(q[i:i + 1], k, v, torch.tensor([position]), seq.positions(0), scale)[0])
        return q.to(device), torch.cat(want)

    def check(out: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(out.cpu().double(), want, atol=TOL[dtype], rtol=TOL[dtype])

    q, want = decode(seqs, 5000)  # two sequences: fewer splits
    two = step.attention(0, q, None, scale)
    check(two, want)
    q, want = decode(seqs[:1], 5001)  # one: more splits, on the same workspace
    eager = step.attention(0, q, None, scale)
    check(eager, want)
    assert torch.equal(step.attention(0, q, None, scale), eager)
    static_q, static_out = q.clone(), torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.attention(0, static_q, None, scale, out=static_out)
    for _ in range(3):
        static_out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static_out, eager)
    other = torch.randn(1, n_heads, head_dim, generator=gen).to(dtype).to(device)
    static_q.copy_(other)
    graph.replay()
    assert torch.equal(static_out, step.attention(0, other, None, scale))
    single = seqs[0].attention(0, q, torch.tensor([5001], dtype=torch.int32, device=device), scale)
    check(single, want)
    assert torch.equal(seqs[0].attention(0, q, torch.tensor([5001], dtype=torch.int32, device=device), scale), single)
    arena.close()


# write_kv_attention is write_kv then attention in one call (on CUDA the attention kernel writes the
# rows it reads): two arenas filled alike step on, one with the two calls, one with the fused call,
# and hold the same bits after every step: the arena's K (rotated, NEOX and M-RoPE) and V, and the
# output. Lengths put the new slot at the start, inside and at the end of a split's tiles, with
# several splits (a 4096-token step) on the CUDA-core kernel (MHA) and the tensor-core decode (GQA).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["neox", "mrope"])
@pytest.mark.parametrize("n_kv_heads,group,head_dim", [(8, 1, 128), (2, 4, 64)])
def test_write_kv_attention_equals_write_kv_then_attention(device: str, kind: str, n_kv_heads: int, group: int,
                                                           head_dim: int) -> None:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n_heads, scale, lengths = n_kv_heads * group, head_dim**-0.5, (1, 127, 300, 1023)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    arenas, steps, batches = [], [], []
    for _ in range(2):
        gen = torch.Generator().manual_seed(11)
        arena = KVArena(n_layers=1, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                        block_size=16, kv_bytes=64 << 20)
        sections = (head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16)  # sums to head_dim / 2
        arena.set_rope(inv_freq, kind, sections=sections if kind == "mrope" else (0, 0, 0))
        seqs = []
        for n in lengths:
            seq = arena.new_sequence()
            seq.append(range(n))
            seq.write_kv(0, *(torch.randn(n, n_kv_heads, head_dim, generator=gen).to(dtype).to(device)
                              for _ in range(2)))
            seqs.append(seq)
        arenas.append(arena)
        steps.append(arena.new_step(max_seqs=len(lengths), max_tokens=4096, n_heads=n_heads))
        batches.append(seqs)
    gen = torch.Generator().manual_seed(12)
    for t in range(3):
        n = len(lengths)
        k, v = (torch.randn(n, n_kv_heads, head_dim, generator=gen).to(dtype).to(device) for _ in range(2))
        q = torch.randn(n, n_heads, head_dim, generator=gen).to(dtype).to(device)
        rope_pos = torch.randint(0, 3000, (n,) if kind == "neox" else (3, n), generator=gen,
                                 dtype=torch.int32).to(device)
        for step, seqs in zip(steps, batches):
            step.prepare(seqs, [5000 + t] * n)
        two_calls = steps[0]
        two_calls.write_kv(0, k, v, rope_pos=rope_pos)
        want = two_calls.attention(0, q, None, scale)
        got = steps[1].write_kv_attention(0, k, v, None, rope_pos, q, None, scale)
        assert torch.equal(got, want)
        for a, b in zip(*batches):
            for x, y in zip(a.read_kv(0), b.read_kv(0)):
                assert torch.equal(x, y)
    for arena in arenas:
        arena.close()


def test_bad_arguments_change_nothing() -> None:
    gen = torch.Generator().manual_seed(1)
    arena = make_arena("cpu", torch.float32)
    a, b = filled(arena, 9, gen), filled(arena, 4, gen)
    step = arena.new_step(max_seqs=2, max_tokens=12, n_heads=N_HEADS)
    k = torch.randn(1, N_KV, HEAD_DIM)
    with pytest.raises(InvalidArgumentError, match="not prepared"):
        step.write_kv(0, k, k)
    cases = [
        (([a], [8]), "not after every stored token"),  # position 8 is stored already
        (([a, a], [20, 21]), "given twice"),
        (([a, b, b], [20, 21, 22]), "out of range"),  # more than max_seqs
        (([a], [20, 21]), "2 positions given for 1 sequences"),
    ]
    for (seqs, positions), message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            step.prepare(seqs, positions)
    other = make_arena("cpu", torch.float32)
    with pytest.raises(InvalidArgumentError, match="another arena"):
        step.prepare([filled(other, 2, gen)], [5])
    for _ in range(3):
        step.prepare([a], [a.n_tokens(0) + 100])
    with pytest.raises(InvalidArgumentError, match="capacity"):  # a would hold 13 > 12 tokens
        step.prepare([a, b], [500, 500])
    assert (a.n_tokens(0), b.n_tokens(0)) == (12, 4)  # nothing changed, b included
    with pytest.raises(InvalidArgumentError, match="slots must be None"):
        step.write_kv(0, k, k, slots=[0])
    with pytest.raises(InvalidArgumentError, match="shape"):
        step.attention(0, torch.randn(2, N_HEADS, HEAD_DIM), None, SCALE)
    with pytest.raises(InvalidArgumentError, match="multiple of n_kv_heads"):
        arena.new_step(max_seqs=1, max_tokens=8, n_heads=N_KV + 1)
    step.prepare([b], [50])  # still usable
    step.write_kv(1, k, k)
    assert b.n_tokens(1) == 5
    step.free()
    step.free()  # twice is a no-op
    arena.close()  # frees any step left; must not crash


def test_arena_full_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(2)
    block_bytes = 2 * N_KV * BLOCK * HEAD_DIM * 4
    arena = make_arena("cpu", torch.float32, kv_bytes=block_bytes * N_LAYERS * 3)
    a, b = filled(arena, BLOCK, gen), filled(arena, BLOCK, gen)  # 2 of the 3 blocks per layer, both full
    step = arena.new_step(max_seqs=2, max_tokens=64, n_heads=N_HEADS)
    with pytest.raises(ArenaFullError):
        step.prepare([a, b], [100, 100])  # each needs a new block in each layer: 4 blocks, 2 free
    assert (a.n_tokens(0), b.n_tokens(0), arena.stats().n_blocks_free) == (BLOCK, BLOCK, N_LAYERS)
    step.prepare([a], [100])
    assert a.n_tokens(1) == BLOCK + 1
    arena.close()


@pytest.mark.parametrize("device", DEVICES)
def test_regrowth_after_compaction_reaches_the_device(device: str) -> None:
    """A layer compacted to a prefix (block table shrunk) and grown again must point its kernels at
    the new blocks, not at the freed ones that another sequence then takes."""
    gen = torch.Generator().manual_seed(5)
    arena = make_arena(device, torch.float32)
    a = filled(arena, 5 * BLOCK, gen)
    a.compact(0, range(BLOCK))  # a prefix: blocks 1..4 of layer 0 are freed, no data moves
    a.append(range(100, 100 + 2 * BLOCK))
    k, v = (torch.randn(2 * BLOCK, N_KV, HEAD_DIM, generator=gen).to(device) for _ in range(2))
    a.write_kv(0, k, v)
    b = filled(arena, 6 * BLOCK, gen)  # takes the freed blocks and writes them
    stored_k, stored_v = a.read_kv(0)
    assert torch.equal(stored_k[BLOCK:].cpu(), k.cpu()) and torch.equal(stored_v[BLOCK:].cpu(), v.cpu())
    assert b.n_tokens(0) == 6 * BLOCK


def test_cyclic_garbage_frees_each_native_object_once() -> None:
    """An arena and its children in one reference cycle: the garbage collector runs their finalizers
    in any order after clearing weak references; a child finalized after its arena must not free
    itself again (it was freed with the arena)."""
    import gc

    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        arena = make_arena("cpu", torch.float32)
        seq = filled(arena, 3, gen)
        step = arena.new_step(max_seqs=1, max_tokens=16, n_heads=N_HEADS)
        step.prepare([seq], [10])
        holder = {"arena": arena, "children": [seq, step]}
        holder["self"] = holder
        arena.holder = holder
        del arena, seq, step, holder
        gc.collect()


def test_a_block_shared_by_two_sequences_of_one_step_is_copied_once_and_nothing_leaks() -> None:
    """A fork and its parent truncated into the same shared partial block, stepped together: the first
    copy leaves the other its sole owner, and the block counted for the second goes back to the pool."""
    gen = torch.Generator().manual_seed(6)
    arena = make_arena("cpu", torch.float32)
    total = arena.stats().n_blocks_free
    parent = filled(arena, 2 * BLOCK, gen)
    child = parent.fork()
    for seq in (parent, child):
        seq.truncate(BLOCK + 4)  # both now end in the same shared, partial second block
    step = arena.new_step(max_seqs=2, max_tokens=64, n_heads=N_HEADS)
    step.prepare([parent, child], [100, 100])
    k = torch.randn(2, N_KV, HEAD_DIM, generator=gen)
    step.write_kv(0, k, k)
    assert torch.equal(parent.read_kv(0)[0][-1], k[0]) and torch.equal(child.read_kv(0)[0][-1], k[1])
    parent.free()
    child.free()
    step.free()
    assert arena.stats().n_blocks_free == total


def test_int_lists_of_any_integer_kind_and_out_of_range_values() -> None:
    import numpy as np

    arena = make_arena("cpu", torch.float32)
    seq = arena.new_sequence()
    seq.append([np.int64(0), torch.tensor(1), 2])
    seq.append(np.array([3, 4], dtype=np.uint16))
    assert seq.positions().tolist() == [0, 1, 2, 3, 4]
    for bad in ([2**31], np.array([2**63], dtype=np.uint64), [-(2**31) - 1]):
        with pytest.raises(InvalidArgumentError, match="outside int32"):
            seq.append(bad)
    assert seq.n_tokens() == 5


def test_rotary_tables_under_inference_mode() -> None:
    from conduit_rt.models.rope import RopeConfig, RotaryEmbedding, apply_rope

    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=64), "cpu")
    with torch.inference_mode():
        x = torch.randn(2, 4, 64)
        positions = torch.tensor([3, 9], dtype=torch.int32)
        torch.testing.assert_close(rotary.apply(x, positions), apply_rope(x, positions, rotary.inv_freq))
