"""Bad arguments give typed exceptions with the native message, and the arena stays usable."""
from __future__ import annotations

import pytest
import torch

from conduit_rt import native
from conduit_rt.arena import KernelTuning, KVArena
from conduit_rt.errors import (
    AlreadyExistsError,
    ArenaFullError,
    InUseError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)


@pytest.fixture
def arena():
    with KVArena(n_layers=2, n_kv_heads=2, head_dim=16, block_size=4, kv_bytes=16 * 2 * 2 * 4 * 16 * 4,
                 image_cache_bytes=8 * 2 * 2 * 4 * 16 * 4) as a:
        yield a


def assert_still_usable(arena: KVArena) -> None:
    seq = arena.new_sequence()
    seq.append([0, 1])
    k = torch.randn(2, 2, 16)
    seq.write_kv(0, k, k)
    assert torch.equal(seq.read_kv(0)[0], k)
    seq.free()


def test_null_handles_are_invalid_arguments_not_crashes():
    ffi, lib = native.load()
    for status in (
        lib.conduit_seq_append(ffi.NULL, ffi.NULL, 3),
        lib.conduit_seq_attention(ffi.NULL, 0, 1, 1, ffi.NULL, ffi.NULL, 1.0, ffi.NULL, ffi.NULL, ffi.NULL),
        lib.conduit_arena_get_stats(ffi.NULL, ffi.NULL),
        lib.conduit_image_commit(ffi.NULL),
    ):
        assert status == lib.CONDUIT_ERR_INVALID_ARGUMENT
        assert "NULL" in native.last_error()
    assert lib.conduit_seq_n_tokens(ffi.NULL, 0) == -1
    assert lib.conduit_seq_max_tokens(ffi.NULL) == -1
    lib.conduit_seq_free(ffi.NULL)
    lib.conduit_arena_free(ffi.NULL)


@pytest.mark.parametrize("field,value,match", [
    ("head_dim", 12, "head_dim"),
    ("block_size", 3, "block_size"),
    ("n_layers", 0, "n_layers"),
    ("kv_bytes", 10, "kv_bytes"),
])
def test_bad_arena_params_are_rejected(field, value, match):
    kw = dict(n_layers=1, n_kv_heads=1, head_dim=16, block_size=4, kv_bytes=1 << 16)
    kw[field] = value
    with pytest.raises(InvalidArgumentError, match=match):
        KVArena(**kw)


@pytest.mark.parametrize("fields,match", [
    (dict(mma_warps=6), "mma_warps"),
    (dict(mma_warps=-4), "mma_warps"),
    (dict(mma_split_waves=9), "mma_split_waves"),
    (dict(mma_split_waves=-1), "mma_split_waves"),
])
def test_bad_kernel_tuning_is_rejected(fields, match):
    with pytest.raises(InvalidArgumentError, match=match):
        KVArena(n_layers=1, n_kv_heads=1, head_dim=16, tuning=KernelTuning(**fields))


def test_kernel_tuning_takes_int32_values_only():
    for value in (2**31, 1.5, "8", True):
        with pytest.raises(InvalidArgumentError, match="mma_warps"):
            KernelTuning(mma_warps=value)


def test_unknown_dtype_and_missing_backend_are_typed():
    with pytest.raises(InvalidArgumentError, match="dtype"):
        KVArena(n_layers=1, n_kv_heads=1, head_dim=16, dtype=torch.int8)
    ffi, lib = native.load()
    params = lib.conduit_arena_default_params()
    params.dtype = 7
    out = ffi.new("conduit_arena **")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        native.check(lib.conduit_arena_create(ffi.new("conduit_arena_params *", params), out))
    assert out[0] == ffi.NULL
    if not native.backends()["cuda"]["available"]:
        params = lib.conduit_arena_default_params()
        params.backend = lib.CONDUIT_BACKEND_CUDA
        with pytest.raises(UnsupportedError):
            native.check(lib.conduit_arena_create(ffi.new("conduit_arena_params *", params), out))


def test_wrong_shapes_slots_and_layers_leave_the_sequence_unchanged(arena):
    seq = arena.new_sequence()
    seq.append(range(6))
    k = torch.randn(6, 2, 16)
    seq.write_kv(0, k, k)
    with pytest.raises(InvalidArgumentError, match="shape"):
        seq.write_kv(0, torch.randn(6, 2, 8), torch.randn(6, 2, 8))
    with pytest.raises(InvalidArgumentError, match="out of range"):
        seq.write_kv(0, torch.randn(2, 2, 16), torch.randn(2, 2, 16), slots=[1, 6])
    with pytest.raises(InvalidArgumentError, match="twice"):
        seq.write_kv(0, torch.randn(2, 2, 16), torch.randn(2, 2, 16), slots=[2, 2])
    with pytest.raises(InvalidArgumentError, match="layer"):
        seq.write_kv(5, k, k)
    with pytest.raises(InvalidArgumentError, match="cannot write"):
        seq.write_kv(1, torch.randn(7, 2, 16), torch.randn(7, 2, 16))
    with pytest.raises(InvalidArgumentError, match="increasing"):
        seq.compact(0, [3, 1])
    with pytest.raises(InvalidArgumentError, match="multiple"):
        seq.attention(0, torch.randn(1, 3, 16), torch.tensor([9], dtype=torch.int32), 1.0)
    with pytest.raises(InvalidArgumentError, match="RoPE"):
        seq.write_kv(0, k, k, rope_pos=torch.arange(6, dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        seq.write_kv(0, k.double(), k.double())
    assert torch.equal(seq.read_kv(0)[0], k)
    assert seq.positions(0).tolist() == list(range(6))
    assert_still_usable(arena)


def test_attention_into_a_given_output(arena):
    """``out=`` receives the attention (the prefill graphs' static buffer); a wrong one is refused
    before anything runs."""
    seq = arena.new_sequence()
    seq.append(range(5))
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    seq.write_kv(0, k, v)
    q, q_pos = torch.randn(3, 4, 16), torch.tensor([1, 3, 4], dtype=torch.int32)
    want = seq.attention(0, q, q_pos, 0.25)
    out = torch.full((3, 4, 16), float("nan"))
    assert seq.attention(0, q, q_pos, 0.25, out=out) is out
    assert torch.equal(out, want)
    for bad, match in ((torch.empty(3, 4, 8), "shape"), (torch.empty(3, 4, 16, dtype=torch.float64), "dtype"),
                       (torch.empty(16, 4, 3).transpose(0, 2), "contiguous")):
        with pytest.raises(InvalidArgumentError, match=match):
            seq.attention(0, q, q_pos, 0.25, out=bad)
    assert_still_usable(arena)


def test_arena_full_is_recoverable_and_changes_nothing(arena):
    total = arena.stats().n_blocks_total  # 16 blocks of 4 tokens, 2 layers: 32 tokens fit
    seq = arena.new_sequence()
    seq.append(range(30))
    with pytest.raises(ArenaFullError, match="full"):
        seq.append(range(30, 40))
    assert seq.n_tokens(0) == 30 and seq.n_tokens(1) == 30
    assert arena.stats().n_blocks_used == total
    with pytest.raises(ArenaFullError):
        seq.fork()  # the partial block of each layer needs copying
    assert arena.stats().n_seqs == 1
    seq.free()
    assert arena.stats().n_blocks_used == 0
    assert_still_usable(arena)


def test_image_store_errors(arena):
    key = bytes(range(32))
    assert arena.acquire_image(key) is None
    entry = arena.create_image(key, 5)
    with pytest.raises(AlreadyExistsError):
        arena.create_image(key, 5)
    assert arena.acquire_image(key) is None  # pending entries are invisible
    k = torch.randn(5, 2, 16)
    entry.write(0, k, k)
    entry.write(1, k, k)
    entry.commit()
    with pytest.raises(InUseError):
        arena.evict_image(key)
    entry.release()
    arena.evict_image(key)
    with pytest.raises(NotFoundError):
        arena.evict_image(key)
    with pytest.raises(ArenaFullError, match="image_cache_bytes"):
        arena.create_image(bytes(32), 40)
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        arena.create_image(b"short", 4)
    assert arena.stats().n_blocks_used == 0
    assert_still_usable(arena)


def test_image_entries_in_use_are_never_evicted_and_lru_goes_first(arena):
    # budget: 8 blocks = 4 entries of 4 tokens (1 block x 2 layers each)
    keys = [bytes([i]) * 32 for i in range(5)]
    held = arena.create_image(keys[0], 4)
    for layer in range(2):
        held.write(layer, torch.randn(4, 2, 16), torch.randn(4, 2, 16))
    held.commit()
    for key in keys[1:4]:
        e = arena.create_image(key, 4)
        e.commit()
        e.release()
    arena.acquire_image(keys[1]).release()  # keys[1] is now more recent than keys[2]
    e = arena.create_image(keys[4], 4)  # over budget: evicts the LRU unreferenced entry, keys[2]
    e.commit()
    e.release()
    assert arena.acquire_image(keys[2]) is None
    for key in (keys[0], keys[1], keys[3], keys[4]):
        entry = arena.acquire_image(key)
        assert entry is not None
        entry.release()
    assert arena.stats().n_image_evictions == 1
    held.release()


def test_closed_arena_objects_raise_instead_of_crashing():
    a = KVArena(n_layers=1, n_kv_heads=1, head_dim=16)
    seq = a.new_sequence()
    a.close()
    with pytest.raises(InvalidArgumentError, match="freed"):
        seq.append([0])
    with pytest.raises(InvalidArgumentError, match="closed"):
        a.new_sequence()
