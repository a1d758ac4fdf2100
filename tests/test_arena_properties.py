"""Long random sequences of arena operations (hypothesis), checked against a plain-Python model.

The model keeps, per live sequence and layer, the list of (position, K row, V row). After every step
each sequence's KV read back from the arena must equal the model (so a write to a fork never shows
in the sequence it was forked from), block counts must be exact, and at teardown every block must be
back in the pool. Decode steps over a few of the sequences at once run among the other operations,
so that the step's device tables must follow forks, truncations, compactions and frees; their
attention is checked against a float64 reference over the model.

Invalid calls run among the valid ones (bad layers, slots and slot lists, reversed or out-of-range
positions, wrong shapes and dtypes, freed sequences and released image entries, unknown and taken
keys, a step whose sequence changed after its prepare, an exhausted pool or image budget, and raw C
calls with NULL pointers or negative counts): each must raise its typed error and change nothing,
which ``arena_invalid_calls.expect_rejected`` checks by reading everything back before and after.
The file is longer than most: hypothesis draws the rules of one machine class, and the invalid calls
must interleave with the valid ones on the same arena.
"""
from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conduit_rt.arena import KVArena
from conduit_rt.errors import AlreadyExistsError, ArenaFullError, InUseError, InvalidArgumentError, NotFoundError

from . import arena_invalid_calls as invalid
from . import reference

N_LAYERS, N_KV, HEAD_DIM, BLOCK = 2, 1, 8, 4
N_BLOCKS = 48
IMAGE_BLOCKS = 16  # image_cache_bytes in blocks
STEP_SEQS, STEP_TOKENS, STEP_HEADS = 3, 40, 2


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena = KVArena(n_layers=N_LAYERS, n_kv_heads=N_KV, head_dim=HEAD_DIM, block_size=BLOCK,
                             kv_bytes=N_BLOCKS * 2 * N_KV * BLOCK * HEAD_DIM * 4, image_cache_bytes=IMAGE_BLOCKS * 2 * BLOCK * HEAD_DIM * 4)
        self.seqs: list = []    # arena sequences
        self.model: list = []   # per sequence: per layer: list of (pos, k [N_KV, D], v [N_KV, D])
        self.images: dict[bytes, torch.Tensor] = {}  # committed image key -> K (pre-RoPE) of layer 0
        self.counter = 0
        self.step = self.arena.new_step(STEP_SEQS, STEP_TOKENS, STEP_HEADS)

    def fresh(self, n: int) -> torch.Tensor:
        self.counter += 1
        return torch.randn(n, N_KV, HEAD_DIM, generator=torch.Generator().manual_seed(self.counter))

    @rule()
    def new_sequence(self) -> None:
        if len(self.seqs) < 6:
            self.seqs.append(self.arena.new_sequence())
            self.model.append([[] for _ in range(N_LAYERS)])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), n=st.integers(0, 11))
    def append_and_write(self, i: int, n: int) -> None:
        i %= len(self.seqs)
        seq, model = self.seqs[i], self.model[i]
        start = max((p for layer in model for p, _, _ in layer), default=-1) + 1
        try:
            seq.append(range(start, start + n))
        except ArenaFullError:
            return
        for layer in range(N_LAYERS):
            k, v = self.fresh(n), self.fresh(n)
            seq.write_kv(layer, k, v)
            model[layer] += [(start + j, k[j], v[j]) for j in range(n)]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), layer=st.integers(0, N_LAYERS - 1), data=st.data())
    def overwrite_some_slots(self, i: int, layer: int, data) -> None:
        i %= len(self.seqs)
        n_tokens = len(self.model[i][layer])
        if n_tokens == 0:
            return
        slots = data.draw(st.lists(st.integers(0, n_tokens - 1), min_size=1, max_size=5, unique=True))
        k, v = self.fresh(len(slots)), self.fresh(len(slots))
        try:
            self.seqs[i].write_kv(layer, k, v, slots=slots)
        except ArenaFullError:  # copy-on-write needed a block
            return
        for j, s in enumerate(slots):
            self.model[i][layer][s] = (self.model[i][layer][s][0], k[j], v[j])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5))
    def fork(self, i: int) -> None:
        i %= len(self.seqs)
        if len(self.seqs) >= 6:
            return
        try:
            child = self.seqs[i].fork()
        except ArenaFullError:
            return
        self.seqs.append(child)
        self.model.append([list(layer) for layer in self.model[i]])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), p0=st.integers(0, 40), width=st.integers(0, 40))
    def truncate(self, i: int, p0: int, width: int) -> None:
        i %= len(self.seqs)
        try:
            self.seqs[i].truncate(p0, p0 + width)
        except ArenaFullError:
            return
        self.model[i] = [[t for t in layer if not (p0 <= t[0] < p0 + width)] for layer in self.model[i]]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), layer=st.integers(0, N_LAYERS - 1), data=st.data())
    def compact(self, i: int, layer: int, data) -> None:
        i %= len(self.seqs)
        n_tokens = len(self.model[i][layer])
        keep = sorted(data.draw(st.sets(st.integers(0, max(n_tokens - 1, 0)), max_size=n_tokens)) if n_tokens else [])
        try:
            self.seqs[i].compact(layer, keep)
        except ArenaFullError:
            return
        self.model[i][layer] = [self.model[i][layer][s] for s in keep]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5))
    def free_sequence(self, i: int) -> None:
        i %= len(self.seqs)
        self.seqs.pop(i).free()
        self.model.pop(i)

    @rule(tag=st.integers(0, 7), n=st.integers(1, 9))
    def cache_image(self, tag: int, n: int) -> None:
        key = bytes([tag]) * 32
        if key in self.images and self.arena.acquire_image(key) is not None:
            return
        self.images.pop(key, None)
        try:
            entry = self.arena.create_image(key, n)
        except ArenaFullError:
            return
        k = self.fresh(n)
        for layer in range(N_LAYERS):
            entry.write(layer, k, k)
        entry.commit()
        entry.release()
        self.images[key] = k

    @precondition(lambda self: self.seqs)
    @rule(picks=st.lists(st.integers(0, 5), min_size=1, max_size=STEP_SEQS, unique=True))
    def decode_step(self, picks: list[int]) -> None:
        chosen = sorted({i % len(self.seqs) for i in picks})
        if any(len(layer) + 1 > STEP_TOKENS for i in chosen for layer in self.model[i]):
            return  # past the step's capacity
        positions = [max((p for layer in self.model[i] for p, _, _ in layer), default=-1) + 1 for i in chosen]
        try:
            self.step.prepare([self.seqs[i] for i in chosen], positions)
        except ArenaFullError:
            return
        scale = HEAD_DIM**-0.5
        for layer in range(N_LAYERS):
            k, v = self.fresh(len(chosen)), self.fresh(len(chosen))
            self.step.write_kv(layer, k, v)
            q = self.fresh(len(chosen) * STEP_HEADS).reshape(len(chosen), STEP_HEADS, HEAD_DIM)
            out = self.step.attention(layer, q, None, scale)
            for j, i in enumerate(chosen):
                self.model[i][layer].append((positions[j], k[j], v[j]))
                rows = self.model[i][layer]
                want, _ = reference.attention(q[j:j + 1], torch.stack([r[1] for r in rows]),
                                              torch.stack([r[2] for r in rows]), torch.tensor([positions[j]]),
                                              torch.tensor([r[0] for r in rows]), scale)
                torch.testing.assert_close(out[j:j + 1].double(), want, atol=1e-5, rtol=1e-5)

    # -- invalid calls among the valid ones: each raises its typed error and changes nothing -------
    def next_position(self, i: int) -> int:
        return max((p for layer in self.model[i] for p, _, _ in layer), default=-1) + 1

    def rejected(self, error: type[Exception], call, extra_seqs: tuple = ()) -> None:
        invalid.expect_rejected(self.arena, [*self.seqs, *extra_seqs], self.images, error, call)

    def unchanged_by(self, call) -> None:
        """A call that is valid but has nothing to do: it must not raise and must change nothing."""
        before = invalid.snapshot(self.arena, self.seqs, self.images)
        call()
        invalid.assert_unchanged(before, invalid.snapshot(self.arena, self.seqs, self.images))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), layer=st.sampled_from([-1, N_LAYERS, 2**31 - 1]),
          call=st.sampled_from(["write", "read", "positions", "compact", "attention", "stats", "restore"]))
    def bad_layer(self, i: int, layer: int, call: str) -> None:
        seq, kv = self.seqs[i % len(self.seqs)], self.fresh(1)
        q, q_pos = self.fresh(STEP_HEADS).reshape(1, STEP_HEADS, HEAD_DIM), torch.tensor([0], dtype=torch.int32)
        calls = {"write": lambda: seq.write_kv(layer, kv, kv), "read": lambda: seq.read_kv(layer),
                 "positions": lambda: seq.positions(layer), "compact": lambda: seq.compact(layer, []),
                 "attention": lambda: seq.attention(layer, q, q_pos, 1.0),
                 "stats": lambda: seq.attention_stats(layer, q, q_pos, 1.0),
                 "restore": lambda: seq.restore_images([], layers=range(layer, layer + 1))}
        self.rejected(InvalidArgumentError, calls[call])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), layer=st.integers(0, N_LAYERS - 1), past=st.integers(0, 3),
          kind=st.sampled_from(["slot past the end", "negative slot", "repeated slot", "more tokens than held",
                                "slot count", "head_dim", "dtype", "RoPE without RoPE"]))
    def bad_write(self, i: int, layer: int, past: int, kind: str) -> None:
        i %= len(self.seqs)
        seq, n = self.seqs[i], len(self.model[i][layer])
        one, two = self.fresh(1), self.fresh(2)
        calls = {"slot past the end": lambda: seq.write_kv(layer, one, one, slots=[n + past]),
                 "negative slot": lambda: seq.write_kv(layer, one, one, slots=[-1 - past]),
                 "repeated slot": lambda: seq.write_kv(layer, two, two, slots=[max(n - 1, 0)] * 2),
                 "more tokens than held": lambda: seq.write_kv(layer, self.fresh(n + 1), self.fresh(n + 1)),
                 "slot count": lambda: seq.write_kv(layer, two, two, slots=[0]),
                 "head_dim": lambda: seq.write_kv(layer, *[torch.randn(1, N_KV, HEAD_DIM + 8)] * 2),
                 "dtype": lambda: seq.write_kv(layer, one.double(), one.double()),
                 "RoPE without RoPE": lambda: seq.write_kv(layer, one, one, rope_pos=torch.zeros(1, dtype=torch.int32))}
        self.rejected(InvalidArgumentError, calls[kind])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), layer=st.integers(0, N_LAYERS - 1),
          kind=st.sampled_from(["unsorted", "repeated", "past the end", "negative", "too many"]))
    def bad_compaction(self, i: int, layer: int, kind: str) -> None:
        i %= len(self.seqs)
        n = len(self.model[i][layer])
        keep = {"unsorted": [1, 0], "repeated": [0, 0], "past the end": [n], "negative": [-1],
                "too many": list(range(n + 1))}[kind]
        self.rejected(InvalidArgumentError, lambda: self.seqs[i].compact(layer, keep))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), width=st.integers(1, 5),
          kind=st.sampled_from(["reversed truncate", "position outside int32", "step at a stored position",
                                "step of one sequence twice", "step position count"]))
    def bad_positions(self, i: int, width: int, kind: str) -> None:
        i %= len(self.seqs)
        seq, p = self.seqs[i], self.next_position(i)
        calls = {"reversed truncate": lambda: seq.truncate(p, p - width),
                 "position outside int32": lambda: seq.append([2**31 + width]),
                 "step at a stored position": lambda: self.step.prepare([seq], [p - 1]),  # not after every one
                 "step of one sequence twice": lambda: self.step.prepare([seq, seq], [p, p]),
                 "step position count": lambda: self.step.prepare([seq], [p, p + 1])}
        if kind == "step at a stored position" and p == 0:
            kind = "step of one sequence twice"  # an empty sequence takes any position
        self.rejected(InvalidArgumentError, calls[kind])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), past=st.integers(0, 5))
    def calls_with_nothing_to_do(self, i: int, past: int) -> None:
        i %= len(self.seqs)
        seq, p = self.seqs[i], self.next_position(i)
        self.unchanged_by(lambda: seq.truncate(p + past))  # past every stored position
        self.unchanged_by(lambda: seq.compact(0, range(len(self.model[i][0]))))  # keeps every slot
        self.unchanged_by(lambda: seq.restore_images([]))
        self.unchanged_by(lambda: seq.append([]))

    @rule(n=st.integers(0, 6), call=st.sampled_from(["append", "write", "read", "positions", "n_tokens", "truncate",
                                                     "compact", "fork", "attention", "step", "restore"]))
    def use_a_freed_sequence(self, n: int, call: str) -> None:
        seq = self.arena.new_sequence()
        try:
            seq.append(range(n))
        except ArenaFullError:
            pass
        seq.free()
        kv, q = self.fresh(1), self.fresh(STEP_HEADS).reshape(1, STEP_HEADS, HEAD_DIM)
        calls = {"append": lambda: seq.append([n]), "write": lambda: seq.write_kv(0, kv, kv),
                 "read": lambda: seq.read_kv(0), "positions": lambda: seq.positions(0),
                 "n_tokens": lambda: seq.n_tokens(0), "truncate": lambda: seq.truncate(0),
                 "compact": lambda: seq.compact(0, []), "fork": lambda: seq.fork(),
                 "attention": lambda: seq.attention(0, q, torch.tensor([n], dtype=torch.int32), 1.0),
                 "step": lambda: self.step.prepare([seq], [n]), "restore": lambda: seq.restore_images([])}
        self.rejected(InvalidArgumentError, calls[call])
        self.unchanged_by(seq.free)  # freeing twice is a no-op

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), change=st.sampled_from(["free", "truncate", "fork", "compact", "append"]),
          call=st.sampled_from(["write", "attention", "write and attention"]))
    def step_after_its_sequence_changed(self, i: int, change: str, call: str) -> None:
        """A step's kernels read the block tables of its last prepare: once one of its sequences was
        freed or changed, they refuse to run (the blocks may belong to another sequence by now)."""
        i %= len(self.seqs)
        p = self.next_position(i)
        if any(len(layer) + 2 > STEP_TOKENS for layer in self.model[i]):
            return
        try:
            self.step.prepare([self.seqs[i]], [p])
        except ArenaFullError:
            return
        for layer in range(N_LAYERS):
            k, v = self.fresh(1), self.fresh(1)
            self.step.write_kv(layer, k, v)
            self.model[i][layer].append((p, k[0], v[0]))
        if not self.change_sequence(i, change, p):
            return
        k, q = self.fresh(1), self.fresh(STEP_HEADS).reshape(1, STEP_HEADS, HEAD_DIM)
        calls = {"write": lambda: self.step.write_kv(0, k, k), "attention": lambda: self.step.attention(0, q),
                 "write and attention": lambda: self.step.write_kv_attention(0, k, k, None, None, q)}
        self.rejected(InvalidArgumentError, calls[call])

    def change_sequence(self, i: int, change: str, p: int) -> bool:
        """Changes sequence i validly (and its model) in one of the ways a step must notice; False if the
        arena had no room for it."""
        seq, model = self.seqs[i], self.model[i]
        try:
            if change == "free":
                self.seqs.pop(i).free()
                self.model.pop(i)
            elif change == "truncate":  # the step's token (the only one at p or after)
                seq.truncate(p)
                self.model[i] = [layer[:-1] for layer in model]
            elif change == "fork" and len(self.seqs) < 6:
                self.seqs.append(seq.fork())
                self.model.append([list(layer) for layer in model])
            elif change == "compact":
                seq.compact(0, range(1, len(model[0])))
                model[0] = model[0][1:]
            else:  # append (also for a fork with no room for another sequence)
                seq.append([p + 1])
                kv = [(self.fresh(1), self.fresh(1)) for _ in range(N_LAYERS)]
                try:
                    for layer, (k, v) in enumerate(kv):
                        seq.write_kv(layer, k, v)
                except ArenaFullError:  # a copy-on-write found no block: take the token back
                    seq.truncate(p + 1)
                    raise
                for layer, (k, v) in enumerate(kv):
                    model[layer].append((p + 1, k[0], v[0]))
        except ArenaFullError:
            return False
        return True

    @rule(call=st.sampled_from(["append", "fork", "image", "step"]))
    def exhaust_the_pool(self, call: str) -> None:
        """Fills the pool with one sequence while the image entries are held (so that they stay), then
        tries calls that need more blocks than are free. "append" and "image" ask for more than the
        free blocks and the entries (released first) together: the call fails without evicting any."""
        held = [self.arena.acquire_image(key) for key in self.images if self.arena.has_image(key)]
        filler, start = self.arena.new_sequence(), 10_000
        while True:
            before = invalid.snapshot(self.arena, [*self.seqs, filler], self.images)
            try:
                filler.append(range(start, start + BLOCK))
            except ArenaFullError:
                invalid.assert_unchanged(before, invalid.snapshot(self.arena, [*self.seqs, filler], self.images))
                break
            for layer in range(N_LAYERS):
                filler.write_kv(layer, self.fresh(BLOCK), self.fresh(BLOCK))
            start += BLOCK
        # Fewer than N_LAYERS blocks are free now; a fork takes one per layer that ends in a partial block.
        partial = [s for s, m in zip(self.seqs, self.model) if all(len(layer) % BLOCK for layer in m)]
        if call == "fork" and not partial:
            call = "append"
        if call in ("append", "image"):
            for entry in held:
                entry.release()
        stats = self.arena.stats()
        per_layer = (stats.n_blocks_free + stats.n_blocks_image) // N_LAYERS + 1  # blocks, beyond both
        empty = self.arena.new_sequence()
        calls = {"append": lambda: filler.append(range(start, start + per_layer * BLOCK)),
                 "fork": lambda: partial[0].fork(),
                 "image": lambda: self.arena.create_image(b"\xff" * 32, per_layer * BLOCK),
                 "step": lambda: self.step.prepare([empty], [0])}
        self.rejected(ArenaFullError, calls[call], extra_seqs=(filler, empty))
        for entry in held:
            entry.release()
        filler.free()
        empty.free()

    @rule(tag=st.integers(0, 7), n=st.integers(1, 9), i=st.integers(0, 5),
          kind=st.sampled_from(["no tokens", "over the budget", "existing key", "unknown key", "evict in use",
                                "budget held by entries in use", "write shape", "write dtype", "write layer",
                                "write after commit", "restore more tokens than held", "restore to slots past the end",
                                "released entry"]))
    def bad_image_call(self, tag: int, n: int, i: int, kind: str) -> None:
        key = bytes([0x80 + tag]) * 32  # never committed (cache_image uses 0..7, "write after commit" 0xc0..)
        committed = [k for k in self.images if self.arena.has_image(k)]
        if kind in ("existing key", "evict in use", "budget held by entries in use") and not committed:
            kind = "unknown key"
        if kind == "no tokens":
            self.rejected(InvalidArgumentError, lambda: self.arena.create_image(key, 1 - n))
        elif kind == "over the budget":  # more blocks than image_cache_bytes, whatever is evicted
            self.rejected(ArenaFullError, lambda: self.arena.create_image(key, IMAGE_BLOCKS // N_LAYERS * BLOCK + n))
        elif kind == "existing key":
            self.rejected(AlreadyExistsError, lambda: self.arena.create_image(committed[tag % len(committed)], n))
        elif kind == "unknown key":
            assert self.arena.acquire_image(key) is None
            self.rejected(NotFoundError, lambda: self.arena.evict_image(key))
        elif kind in ("evict in use", "budget held by entries in use"):
            self.with_entries_held(committed, kind, key, tag)
        else:
            self.bad_entry_use(key, n, i, kind)

    def with_entries_held(self, committed: list[bytes], kind: str, key: bytes, tag: int) -> None:
        """Entries with a reference are never evicted, and a store they fill refuses a new entry."""
        held = [self.arena.acquire_image(k) for k in committed]
        if kind == "evict in use":
            self.rejected(InUseError, lambda: self.arena.evict_image(committed[tag % len(committed)]))
        else:
            free_blocks = IMAGE_BLOCKS - self.arena.stats().n_blocks_image  # of the budget
            self.rejected(ArenaFullError, lambda: self.arena.create_image(key, (free_blocks // N_LAYERS) * BLOCK + 1))
        for entry in held:
            entry.release()

    def bad_entry_use(self, key: bytes, n: int, i: int, kind: str) -> None:
        """Misuses of a pending, committed or released entry of n tokens."""
        if kind == "write after commit":
            key = bytes([0x40 + key[0]]) * 32
        try:
            entry = self.arena.create_image(key, n)
        except (ArenaFullError, AlreadyExistsError):  # no room, or committed by an earlier "write after commit"
            return
        k = self.fresh(n)
        if kind == "write after commit":
            for layer in range(N_LAYERS):
                entry.write(layer, k, k)
            entry.commit()
            self.images[key] = k
            self.rejected(InvalidArgumentError, lambda: entry.write(0, k, k))
        elif kind.startswith("write"):
            args = {"write shape": (0, self.fresh(n + 1), self.fresh(n + 1)),
                    "write dtype": (0, k.double(), k.double()), "write layer": (N_LAYERS, k, k)}[kind]
            self.rejected(InvalidArgumentError, lambda: entry.write(*args))
        elif kind == "released entry":
            entry.release()
            self.rejected(InvalidArgumentError, lambda: entry.read(0))
            if self.seqs:
                self.rejected(InvalidArgumentError, lambda: self.seqs[i % len(self.seqs)].restore_images([entry]))
        elif self.seqs:
            i %= len(self.seqs)
            held = min(len(layer) for layer in self.model[i])
            slots = None if kind == "restore more tokens than held" else range(held, held + n)
            if slots is not None or n > held:
                self.rejected(InvalidArgumentError, lambda: self.seqs[i].restore_images([entry], slots))
        entry.release()

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 5), name=st.sampled_from(sorted(invalid.RAW_CALLS)))
    def raw_invalid_call(self, i: int, name: str) -> None:
        args = invalid.RawArgs(self.arena, self.seqs[i % len(self.seqs)], self.step)
        self.rejected(InvalidArgumentError, invalid.raw_call(args, name))

    @invariant()
    def contents_match_the_model(self) -> None:
        for seq, model in zip(self.seqs, self.model):
            for layer in range(N_LAYERS):
                k, v = seq.read_kv(layer)
                assert seq.positions(layer).tolist() == [p for p, _, _ in model[layer]]
                if model[layer]:
                    assert torch.equal(k, torch.stack([t[1] for t in model[layer]]))
                    assert torch.equal(v, torch.stack([t[2] for t in model[layer]]))

    @invariant()
    def block_counts_are_exact(self) -> None:
        stats = self.arena.stats()
        assert stats.n_blocks_used + stats.n_blocks_free == stats.n_blocks_total == N_BLOCKS
        assert stats.n_seqs == len(self.seqs)
        per_seq = [sum(-(-len(layer) // BLOCK) for layer in model) for model in self.model]
        for seq, blocks in zip(self.seqs, per_seq):
            assert seq.nbytes == blocks * stats.block_bytes
        held = sum(per_seq) + stats.n_blocks_image
        # shared blocks are counted once per holder in `held`, once in the pool
        assert stats.n_blocks_used <= held
        if stats.n_blocks_shared == 0:
            assert stats.n_blocks_used == held
        assert stats.image_bytes == stats.n_blocks_image * stats.block_bytes <= self.arena.image_cache_bytes

    @invariant()
    def cached_images_read_back_intact(self) -> None:
        for key, k in list(self.images.items()):
            entry = self.arena.acquire_image(key)
            if entry is None:  # evicted to make room: allowed, it was unreferenced
                del self.images[key]
                continue
            assert torch.equal(entry.read(0)[0], k)
            entry.release()

    def teardown(self) -> None:
        for seq in self.seqs:
            seq.free()
        for key in list(self.images):
            self.arena.evict_image(key)
        stats = self.arena.stats()
        assert stats.n_blocks_used == 0 and stats.n_blocks_free == N_BLOCKS, "blocks leaked"
        self.arena.close()


TestArenaOperations = ArenaMachine.TestCase
TestArenaOperations.settings = settings(max_examples=80, stateful_step_count=50, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
