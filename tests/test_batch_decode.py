"""The batched decode step (batch_decode.BatchDecoder): the logits of a batch of sequences, of
different prompt lengths, equal those of each sequence decoded alone through the Runtime's own
single-sequence step, token after token, in float32; a batch padded to its CUDA graph bucket gives
the same rows as the batch alone."""
from __future__ import annotations

import pytest
import torch

import conduit_rt
from conduit_rt.batch_decode import BatchDecoder, buckets
from conduit_rt.errors import InvalidArgumentError
from conduit_rt.evaluation.task.data import build_pool
from conduit_rt.options import GenerationOptions
from conduit_rt.runtime import Runtime

from .conftest import DEVICES

STEPS = 6


def test_buckets_are_powers_of_two_then_the_largest_batch() -> None:
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_decodes_as_each_sequence_alone(device: str) -> None:
    with Runtime(conduit_rt.BUNDLED_MODEL, device=device, dtype=torch.float32, prefix_cache_entries=0) as runtime:
        pool = build_pool(seed=0, split="test", size=64)
        messages = [r.messages() for r in pool.requests(3, min_pages=1, max_pages=3)]
        with runtime.lock:
            started = [runtime.start(m, GenerationOptions(max_tokens=STEPS + 1)) for m in messages]
        assert len({s.request.n_tokens for s in started}) > 1  # the sequences differ in length
        alone = [s.seq.fork() for s in started]
        batch = BatchDecoder(runtime.model, runtime.arena, max_batch=4, cuda_graphs=device == "cuda")
        tokens = [int(torch.argmax(s.logits)) for s in started]
        for t in range(STEPS):
            positions = [s.request.n_tokens + t for s in started]
            ropes = [s.request.next_rope + t for s in started]
            ids = torch.tensor(tokens, dtype=torch.long, device=runtime.device)
            batched = batch.step([s.seq for s in started], ids, positions, ropes)  # 3 rows: bucket 4 on CUDA
            assert batched.shape == (3, runtime.model.config.vocab) and batched.dtype == torch.float32
            singles = [runtime.decoder.step(seq, ids[i], positions[i], ropes[i]) for i, seq in enumerate(alone)]
            for i, single in enumerate(singles):
                torch.testing.assert_close(batched[i], single, rtol=1e-4, atol=1e-4)
            tokens = [int(torch.argmax(single)) for single in singles]
        if device == "cuda":
            assert batch.replays == STEPS
        for s in started:
            assert s.seq.n_tokens(0) == s.request.n_tokens + STEPS
        batch.close()
        for seq in alone + [s.seq for s in started]:
            seq.free()
        assert runtime.arena.stats().n_seqs == 0


def test_bad_batches_raise_and_change_nothing() -> None:
    with Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", prefix_cache_entries=0) as runtime:
        batch = BatchDecoder(runtime.model, runtime.arena, max_batch=2)
        seqs = [runtime.arena.new_sequence() for _ in range(3)]
        ids = torch.zeros(3, dtype=torch.long)
        with pytest.raises(InvalidArgumentError):
            batch.step(seqs, ids, [0, 0, 0], [0, 0, 0])  # more than max_batch
        with pytest.raises(InvalidArgumentError):
            batch.step(seqs[:2], ids[:2], [0], [0, 0])
        assert all(seq.n_tokens(0) == 0 for seq in seqs)
        with pytest.raises(InvalidArgumentError):
            BatchDecoder(runtime.model, runtime.arena, max_batch=0)
