"""Long random sequences of arena operations (hypothesis), checked against a plain-Python model.

The model keeps, per live sequence and layer, the list of (position, K row, V row). After every step
each sequence's KV read back from the arena must equal the model (so a write to a fork never shows
in the sequence it was forked from), block counts must be exact, and at teardown every block must be
back in the pool. Decode steps over a few of the sequences at once run among the other operations,
so that the step's device tables must follow forks, truncations, compactions and frees; their
attention is checked against a float64 reference over the model.
"""
from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conduit_rt.arena import KVArena
from conduit_rt.errors import ArenaFullError

from . import reference

N_LAYERS, N_KV, HEAD_DIM, BLOCK = 2, 1, 8, 4
N_BLOCKS = 48
STEP_SEQS, STEP_TOKENS, STEP_HEADS = 3, 40, 2


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena = KVArena(n_layers=N_LAYERS, n_kv_heads=N_KV, head_dim=HEAD_DIM, block_size=BLOCK,
                             kv_bytes=N_BLOCKS * 2 * N_KV * BLOCK * HEAD_DIM * 4, image_cache_bytes=16 * 2 * BLOCK * HEAD_DIM * 4)
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
