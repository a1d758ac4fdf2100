"""Batched image restore (conduit_seq_restore_images): several entries, several layers, one call.

Checked against per-image, per-layer restores (bit for bit) and against a torch RoPE reference, with
typed errors for bad arguments that leave the sequence unchanged and the arena usable.
"""
from __future__ import annotations

import pytest
import torch

from conduit_rt.arena import KVArena
from conduit_rt.errors import InvalidArgumentError

from . import reference

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
N_LAYERS, N_KV, HEAD_DIM, BLOCK = 3, 2, 64, 8
IMAGE_TOKENS = (21, 8, 13)  # one entry ends mid-block, one fills a block exactly
SECTIONS = (8, 12, 12)
TEXT = 5  # tokens before the images


class Setup:
    """An arena with RoPE, entries holding different random K, V per layer, and their prompt slots."""

    def __init__(self, device: str, dtype: torch.dtype, kind: str, seed: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype, self.kind = device, dtype, kind
        self.arena = KVArena(n_layers=N_LAYERS, n_kv_heads=N_KV, head_dim=HEAD_DIM, dtype=dtype, device=device,
                             block_size=BLOCK, kv_bytes=4 << 20, image_cache_bytes=1 << 20)
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.arena.set_rope(self.inv_freq, kind, sections=SECTIONS if kind == "mrope" else (0, 0, 0))
        self.kv = []  # per entry: per layer (k, v) [n, N_KV, HEAD_DIM]
        self.entries = []
        for m, n in enumerate(IMAGE_TOKENS):
            entry = self.arena.create_image(bytes([m]) * 32, n)
            layers = []
            for layer in range(N_LAYERS):
                k = torch.randn((n, N_KV, HEAD_DIM), generator=gen).to(dtype).to(device)
                v = torch.randn((n, N_KV, HEAD_DIM), generator=gen).to(dtype).to(device)
                entry.write(layer, k, v)
                layers.append((k, v))
            entry.commit()
            self.kv.append(layers)
            self.entries.append(entry)
        self.n = sum(IMAGE_TOKENS)
        # the images in reverse prompt order, at scattered slots after the text
        self.slots = torch.randperm(self.n, generator=gen) + TEXT
        shape = (self.n,) if kind == "neox" else (3, self.n)
        self.rope_pos = torch.randint(0, 2000, shape, generator=gen, dtype=torch.int32)

    def sequence(self):
        """A sequence of TEXT + n tokens, every slot written (so that comparisons never meet stale memory)."""
        seq = self.arena.new_sequence()
        seq.append(range(TEXT + self.n))
        filler = torch.linspace(-1, 1, (TEXT + self.n) * N_KV * HEAD_DIM).reshape(TEXT + self.n, N_KV, HEAD_DIM)
        filler = filler.to(self.dtype).to(self.device)
        for layer in range(N_LAYERS):
            seq.write_kv(layer, filler, filler)
        return seq

    def spans(self):
        """(entry index, slice of the concatenated tokens) per entry."""
        lo = 0
        for m, n in enumerate(IMAGE_TOKENS):
            yield m, slice(lo, lo + n)
            lo += n

    def restore_one_by_one(self, seq, layers) -> None:
        for m, span in self.spans():
            rope = self.rope_pos[..., span].contiguous().to(self.device)
            for layer in layers:
                seq.restore_image(layer, self.entries[m], slots=self.slots[span], rope_pos=rope)

    def expected_k(self, layer: int) -> torch.Tensor:
        """Reference: float64 K of the concatenated entries at ``layer``, rotated at rope_pos."""
        k = torch.cat([self.kv[m][layer][0].cpu() for m, _ in self.spans()])
        return reference.rope(k, self.rope_pos, self.inv_freq, SECTIONS if self.kind == "mrope" else None)

    def release(self) -> None:
        for entry in self.entries:
            entry.release()


def read_all(seq) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.cpu() for t in seq.read_kv(layer)) for layer in range(N_LAYERS)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["neox", "mrope"])
def test_batched_restore_equals_per_image_restores_and_reference(device, dtype, kind):
    s = Setup(device, dtype, kind)
    batched, single = s.sequence(), s.sequence()
    s.restore_one_by_one(single, range(N_LAYERS))
    batched.restore_images(s.entries, slots=s.slots, rope_pos=s.rope_pos.to(device))
    for layer, ((k_b, v_b), (k_s, v_s)) in enumerate(zip(read_all(batched), read_all(single))):
        assert torch.equal(k_b[TEXT:], k_s[TEXT:]) and torch.equal(v_b[TEXT:], v_s[TEXT:]), f"layer {layer}"
        torch.testing.assert_close(k_b[s.slots].double(), s.expected_k(layer), atol=TOL[dtype] * 4, rtol=TOL[dtype])
        v = torch.cat([s.kv[m][layer][1].cpu() for m, _ in s.spans()])
        assert torch.equal(v_b[s.slots], v)
    s.release()


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_batched_restore_of_a_layer_range_with_default_slots_and_no_rope(device, dtype):
    """layers=range(1, 3) leaves layer 0 alone; slots=None takes the last n; no rope_pos: K as stored."""
    s = Setup(device, dtype, "neox")
    seq = s.sequence()
    gen = torch.Generator().manual_seed(5)
    before = torch.randn((TEXT + s.n, N_KV, HEAD_DIM), generator=gen).to(dtype).to(device)
    for layer in range(N_LAYERS):
        seq.write_kv(layer, before, before)
    seq.restore_images(s.entries, layers=range(1, N_LAYERS))
    after = read_all(seq)
    assert torch.equal(after[0][0], before.cpu()) and torch.equal(after[0][1], before.cpu())
    for layer in (1, 2):
        k = torch.cat([s.kv[m][layer][0].cpu() for m, _ in s.spans()])
        assert torch.equal(after[layer][0][TEXT:], k)
        assert torch.equal(after[layer][0][:TEXT], before[:TEXT].cpu())
    s.release()


def test_batched_restore_copies_shared_blocks_and_accepts_an_entry_twice(device):
    s = Setup(device, torch.float32, "neox")
    parent = s.sequence()
    parent.restore_images(s.entries, slots=s.slots, rope_pos=s.rope_pos.to(device))
    parent_kv = read_all(parent)
    child = parent.fork()
    twice = [s.entries[1], s.entries[1]]
    slots = list(range(TEXT, TEXT + 2 * IMAGE_TOKENS[1]))
    rope = torch.arange(2 * IMAGE_TOKENS[1], dtype=torch.int32) + 100
    child.restore_images(twice, slots=slots, rope_pos=rope.to(device))
    for (k_p, v_p), (k_now, v_now) in zip(parent_kv, read_all(parent)):
        assert torch.equal(k_p, k_now) and torch.equal(v_p, v_now)  # copy-on-write kept the parent
    for layer, (k_c, _) in enumerate(read_all(child)):
        k = s.kv[1][layer][0].cpu()
        expected = reference.rope(torch.cat([k, k]), rope, s.inv_freq)
        torch.testing.assert_close(k_c[TEXT:TEXT + len(slots)].double(), expected, atol=1e-4, rtol=1e-5)
    s.release()


def test_bad_batched_restores_raise_typed_errors_and_change_nothing(device):
    s = Setup(device, torch.float32, "neox")
    seq = s.sequence()
    seq.restore_images(s.entries, slots=s.slots, rope_pos=s.rope_pos.to(device))
    state = read_all(seq)
    rope = s.rope_pos.to(device)
    repeated = s.slots.clone()
    repeated[1] = repeated[0]
    other = KVArena(n_layers=N_LAYERS, n_kv_heads=N_KV, head_dim=HEAD_DIM, device=device, block_size=BLOCK,
                    kv_bytes=1 << 20, image_cache_bytes=1 << 18)
    foreign = other.create_image(bytes(32), IMAGE_TOKENS[0])
    no_rope = KVArena(n_layers=N_LAYERS, n_kv_heads=N_KV, head_dim=HEAD_DIM, device=device, block_size=BLOCK,
                      kv_bytes=1 << 20, image_cache_bytes=1 << 18)
    bad = [
        dict(slots=repeated, rope_pos=rope),                                   # a slot twice
        dict(slots=s.slots + 100, rope_pos=rope),                              # out of range
        dict(slots=s.slots[:-1], rope_pos=rope),                               # too few slots
        dict(slots=s.slots, rope_pos=rope, layers=range(1, N_LAYERS + 1)),     # layer out of range
        dict(slots=s.slots, rope_pos=rope, layers=range(0, N_LAYERS, 2)),      # not contiguous
        dict(slots=s.slots, rope_pos=rope[:-1]),                               # rope_pos of the wrong length
    ]
    for kwargs in bad:
        with pytest.raises(InvalidArgumentError):
            seq.restore_images(s.entries, **kwargs)
    with pytest.raises(InvalidArgumentError):  # an entry of another arena
        seq.restore_images([s.entries[0], foreign], slots=list(range(TEXT, TEXT + 2 * IMAGE_TOKENS[0])))
    with pytest.raises(InvalidArgumentError):  # more tokens than the layers hold
        seq.restore_images(s.entries * 2)
    seq.compact(2, list(range(TEXT + s.n - 1)))
    with pytest.raises(InvalidArgumentError):  # default slots, but the layers differ in length
        seq.restore_images(s.entries[:1])
    for (k0, v0), (k1, v1) in zip(state[:2], read_all(seq)[:2]):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    no_rope_entry = no_rope.create_image(bytes(32), 4)
    no_rope_seq = no_rope.new_sequence()
    no_rope_seq.append(range(4))
    with pytest.raises(InvalidArgumentError):  # rope_pos given but the arena has no RoPE
        no_rope_seq.restore_images([no_rope_entry], rope_pos=torch.arange(4, dtype=torch.int32).to(device))
    # still usable: a good restore afterwards matches the reference
    seq.restore_images(s.entries[:1], slots=s.slots[:IMAGE_TOKENS[0]], rope_pos=rope[:IMAGE_TOKENS[0]].contiguous(),
                       layers=range(0, 2))
    k0 = seq.read_kv(0)[0].cpu()
    torch.testing.assert_close(k0[s.slots[:IMAGE_TOKENS[0]]].double(), s.expected_k(0)[:IMAGE_TOKENS[0]],
                               atol=1e-4, rtol=1e-5)
    for handle in (foreign, no_rope_entry):
        handle.release()
    s.release()
