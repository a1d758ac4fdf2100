"""Invalid calls on a KV arena, for the state machine of ``test_arena_properties.py``.

``expect_rejected`` runs one call that must fail and checks the contract of conduit.h: the call
raises its typed error and leaves the arena exactly as it was (the stats, and every live sequence's
positions, K and V read back, and which image entries are committed). ``RAW_CALLS`` are calls
straight into the C ABI with NULL pointers, negative counts or enum values past their enumerators,
which the Python layer would refuse before they reach the library, so that the native checks
themselves are exercised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import pytest
import torch

from conduit_rt import native
from conduit_rt.arena import ArenaStats, KVArena, Sequence


@dataclass
class ArenaSnapshot:
    """What an arena holds: stats; per sequence and layer (positions, K, V); committed image keys."""

    stats: ArenaStats
    layers: list[list[tuple[list[int], torch.Tensor, torch.Tensor]]]
    images: dict[bytes, bool]


def snapshot(arena: KVArena, seqs: Iterable[Sequence], image_keys: Iterable[bytes]) -> ArenaSnapshot:
    """Reads everything back (``has_image`` does not count as a use, so the LRU order is untouched)."""
    layers = [[(seq.positions(layer).tolist(), *seq.read_kv(layer)) for layer in range(arena.n_layers)]
              for seq in seqs]
    return ArenaSnapshot(arena.stats(), layers, {key: arena.has_image(key) for key in image_keys})


def assert_unchanged(before: ArenaSnapshot, after: ArenaSnapshot) -> None:
    assert after.stats == before.stats
    assert after.images == before.images
    assert len(after.layers) == len(before.layers)
    for seq_before, seq_after in zip(before.layers, after.layers):
        for (pos0, k0, v0), (pos1, k1, v1) in zip(seq_before, seq_after):
            assert pos1 == pos0
            assert torch.equal(k1, k0) and torch.equal(v1, v0)


def expect_rejected(arena: KVArena, seqs: Iterable[Sequence], image_keys: Iterable[bytes],
                    error: type[Exception], call: Callable[[], object]) -> None:
    """Runs ``call``, which must raise ``error`` (a typed conduit error) and change nothing in the arena
    or in the given sequences (freed ones aside: pass only live sequences)."""
    seqs, image_keys = list(seqs), list(image_keys)
    before = snapshot(arena, seqs, image_keys)
    with pytest.raises(error):
        call()
    assert_unchanged(before, snapshot(arena, seqs, image_keys))


class RawArgs:
    """Live handles and small buffers for the raw calls: a sequence ``seq`` of ``n`` tokens in layer
    0, a decode step, two int32 ``ints`` and a scratch tensor of n + 2 tokens (``data``, ``floats``)."""

    def __init__(self, arena: KVArena, seq: Sequence, step) -> None:
        self.ffi, self.lib = native.load()
        self.null = self.ffi.NULL
        self.arena, self.seq, self.step = arena.handle, seq.handle, step.handle
        self.n_layers, self.max_seqs = arena.n_layers, step.max_seqs
        self.n = seq.n_tokens(0)
        self.ints = self.ffi.new("int32_t[]", [0, 0])
        self.seqs = self.ffi.new("conduit_seq *[]", [self.seq])
        self._buffer = torch.zeros(self.n + 2, arena.n_kv_heads, arena.head_dim, dtype=arena.dtype)
        self.data = self.ffi.cast("void *", self._buffer.data_ptr())
        self.floats = self.ffi.cast("float *", self._buffer.data_ptr())
        self.unknown_rope = self.ffi.new("conduit_rope_params *", {"type": 9, "n_freq": 1})  # enums past their values
        params = self.lib.conduit_arena_default_params()
        params.backend = 5
        self.unknown_backend = self.ffi.new("conduit_arena_params *", params)


# Calls into the C ABI on live objects, each of which must return CONDUIT_ERR_INVALID_ARGUMENT: the
# bounds are checked before any pointer is read (a buffer that is too short would show under ASan).
RAW_CALLS: dict[str, Callable[[RawArgs], int]] = {
    "append NULL positions": lambda a: a.lib.conduit_seq_append(a.seq, a.null, 3),
    "append a negative count": lambda a: a.lib.conduit_seq_append(a.seq, a.ints, -1),
    "positions into a short buffer": lambda a: a.lib.conduit_seq_get_positions(a.seq, 0, a.ints, a.n - 1),
    "positions of layer -1": lambda a: a.lib.conduit_seq_get_positions(a.seq, -1, a.ints, 2),
    "truncate a reversed range": lambda a: a.lib.conduit_seq_truncate(a.seq, 5, 4, a.null),
    "compact with NULL slots": lambda a: a.lib.conduit_seq_compact(a.seq, 0, a.null, 1, a.null),
    "compact to a negative count": lambda a: a.lib.conduit_seq_compact(a.seq, 0, a.ints, -1, a.null),
    "compact to more slots than held": lambda a: a.lib.conduit_seq_compact(a.seq, 0, a.ints, a.n + 1, a.null),
    "write more tokens than held": lambda a: a.lib.conduit_seq_write_kv(a.seq, 0, a.n + 1, a.data, a.data, a.null,
                                                                         a.null, a.null),
    "write NULL K and V": lambda a: a.lib.conduit_seq_write_kv(a.seq, 0, 1, a.null, a.null, a.null, a.null, a.null),
    "write a negative count": lambda a: a.lib.conduit_seq_write_kv(a.seq, 0, -1, a.data, a.data, a.null, a.null,
                                                                    a.null),
    "restore a NULL entry": lambda a: a.lib.conduit_seq_restore_images(
        a.seq, 0, 1, 1, a.ffi.new("conduit_image *[]", [a.null]), a.null, a.null, a.null),
    "restore into layers past the last": lambda a: a.lib.conduit_seq_restore_images(
        a.seq, 0, a.n_layers + 1, 0, a.null, a.null, a.null, a.null),
    "restore a negative image count": lambda a: a.lib.conduit_seq_restore_images(a.seq, 0, 1, -1, a.null, a.null,
                                                                                  a.null, a.null),
    "attention of a negative query count": lambda a: a.lib.conduit_seq_attention(
        a.seq, 0, -1, 1, a.data, a.ints, 1.0, a.data, a.null, a.null),
    "attention with zero heads": lambda a: a.lib.conduit_seq_attention(a.seq, 0, 1, 0, a.data, a.ints, 1.0, a.data,
                                                                        a.null, a.null),
    "statistics with a threshold above 1": lambda a: a.lib.conduit_seq_attention_stats(
        a.seq, 0, 1, 1, a.data, a.ints, 1.0, 2.0, a.floats, a.null, a.null, a.null),
    "mass over a layer past the last": lambda a: a.lib.conduit_seq_attention_mass(
        a.seq, 1, a.ffi.new("int32_t[]", [a.n_layers]), 1, 1, a.data, a.ints, 1.0, a.floats, a.floats, a.null),
    "fork into NULL": lambda a: a.lib.conduit_seq_fork(a.seq, a.null, a.null),
    "step of zero sequences": lambda a: a.lib.conduit_step_prepare(a.step, 0, a.seqs, a.ints, a.null),
    "step of NULL sequences": lambda a: a.lib.conduit_step_prepare(a.step, 1, a.null, a.ints, a.null),
    "step of too many sequences": lambda a: a.lib.conduit_step_prepare(a.step, a.max_seqs + 1, a.seqs, a.ints,
                                                                        a.null),
    "image under a NULL key": lambda a: a.lib.conduit_image_create(a.arena, a.null, 1,
                                                                    a.ffi.new("conduit_image **")),
    "stats into NULL": lambda a: a.lib.conduit_arena_get_stats(a.arena, a.null),
    "RoPE of an unknown type": lambda a: a.lib.conduit_arena_set_rope(a.arena, a.unknown_rope),
    "arena of an unknown backend": lambda a: a.lib.conduit_arena_create(a.unknown_backend,
                                                                         a.ffi.new("conduit_arena **")),
}


def raw_call(args: RawArgs, name: str) -> Callable[[], None]:
    """The raw call ``name`` of RAW_CALLS, raising the typed error of its status."""
    return lambda: native.check(RAW_CALLS[name](args), name)
