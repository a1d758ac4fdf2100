"""Decoding a prefilled request: sample, append, forward one token at a time, with the text streamed
as it decodes (stop strings held back until they cannot start) and the request's statistics."""
from __future__ import annotations

import time
from collections.abc import Generator, Iterator

import torch

from .arena import KVArena, Sequence
from .compress import Recompressor
from .decode_graph import GraphedDecoder
from .errors import NonFiniteLogitsError
from .models.base import ForwardBatch
from .results import GenerationResult, GenerationStats
from .sampling import Sampler, SamplingParams, TokenReadback


class Decoder:
    """The decode loop over one arena. On a CUDA device with ``cuda_graphs``, each step replays a
    captured CUDA graph (``decode_graph.GraphedDecoder``) instead of launching it from Python.
    ``source`` names the model (its file) in the error that NaN or infinite logits raise."""

    def __init__(self, model, arena: KVArena, cuda_graphs: bool, source: str = "the model") -> None:
        self.model, self.source = model, source
        self.graphed = GraphedDecoder(model, arena) if cuda_graphs and model.device.type == "cuda" else None

    def run(self, seq: Sequence, logits: torch.Tensor, first_position: int, first_rope: int,
            sampling: SamplingParams, return_logits: bool, stats: GenerationStats, start: float,
            recompress: Recompressor | None = None) -> Generator[str, None, GenerationResult]:
        """Decodes after a prompt of ``first_position`` tokens whose last row gave ``logits`` (float32
        [vocab]); the first generated token sits at RoPE position ``first_rope``. Yields text pieces;
        returns the result, its ``stats`` completed (``start``: the request's perf_counter start)."""
        detok = self.model.assets.tokenizer.detokenizer()
        eos = self.model.assets.eos_token_ids
        tokens: list[int] = []
        step_logits: list[torch.Tensor] | None = [] if return_logits else None
        text, emitted = "", 0
        finish = "length"
        hold_back = max((len(s) for s in sampling.stop), default=1) - 1
        decode_start = None
        sampled = self._sampled_tokens(seq, logits, first_position, first_rope, sampling, step_logits, recompress)
        try:
            for token in sampled:
                if decode_start is None:
                    stats.ttft_s = time.perf_counter() - start
                    decode_start = time.perf_counter()
                if token in eos:
                    finish = "eos"
                    break
                tokens.append(token)
                text += detok.push(token)
                cut = find_stop(text, sampling.stop)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                if len(text) - hold_back > emitted:
                    yield text[emitted: len(text) - hold_back]
                    emitted = len(text) - hold_back
        finally:
            sampled.close()  # undoes a step run ahead for a token that ended the answer
        if finish != "stop":  # release characters the detokenizer held back (an unfinished byte run)
            text += detok.flush()
            cut = find_stop(text, sampling.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
        if len(text) > emitted:
            yield text[emitted:]
        end = time.perf_counter()
        stats.decode_tokens = len(tokens)
        stats.decode_s = end - decode_start if decode_start else 0.0
        stats.decode_tokens_per_s = (len(tokens) - 1) / stats.decode_s if stats.decode_s > 0 and len(tokens) > 1 else 0.0
        stats.total_s = end - start
        stats.finish_reason = finish
        stats.kv_bytes = seq.nbytes
        return GenerationResult(text=text, tokens=tokens, stats=stats,
                                logits=torch.stack(step_logits) if step_logits else None)

    def _sampled_tokens(self, seq: Sequence, logits: torch.Tensor, first_position: int, first_rope: int,
                        sampling: SamplingParams, step_logits: list[torch.Tensor] | None,
                        recompress: Recompressor | None) -> Iterator[int]:
        """Samples up to ``max_tokens`` tokens from ``logits`` (the prompt's last row) and the decode
        steps that follow, yielding each token id as the caller accepts them one by one.

        From the second token on, the step that consumes a token is enqueued before the token reaches
        the host (the sampled id goes to the step on the device; only the host copy is waited for), so
        the GPU runs step i while the caller detokenizes and streams token i: the host's share of a
        step (preparing it, filling its inputs, detokenizing) does not add to the GPU's. A token the
        caller stops at (EOS, a stop string) then has a step it should not have had: closing the
        generator truncates it from the sequence, which ends as it would have without running ahead.
        The first token goes out before any step is enqueued: time to first token never waits for one
        (nor for a first step's graph capture). ``step_logits`` collects each step's logits (CPU).
        Logits with a NaN or an infinity raise NonFiniteLogitsError when their token is read back
        (the prompt's own, unsampled when ``max_tokens`` is 0, are checked on their own).
        """
        sampler = Sampler(sampling, self.model.device)
        readback = TokenReadback(self.model.device)
        if sampling.max_tokens == 0 and not bool(torch.isfinite(logits).all()):
            raise self._non_finite(first_position)
        ahead = None  # position of a step enqueued for a token the caller has not accepted yet
        try:
            for i in range(sampling.max_tokens):
                if step_logits is not None:
                    step_logits.append(logits.float().cpu())
                token, finite = sampler(logits)
                readback.start(token, finite)
                position, rope_position = first_position + i, first_rope + i
                more = i + 1 < sampling.max_tokens
                if more and i > 0:
                    logits = self._step(seq, token, position, rope_position, recompress)
                    ahead = position
                token_id, finite_logits = readback.wait()
                if not finite_logits:
                    raise self._non_finite(position)
                yield token_id
                ahead = None
                if more and i == 0:
                    logits = self._step(seq, token, position, rope_position, recompress)
                if more and recompress is not None:
                    recompress.after_step(position)
        finally:
            if ahead is not None:
                seq.truncate(ahead)

    def _non_finite(self, n_tokens: int) -> NonFiniteLogitsError:
        """The error for NaN or infinite logits after ``n_tokens`` tokens of the sequence."""
        return NonFiniteLogitsError(
            f"{self.source}: the model's logits after {n_tokens} tokens are NaN or infinite, so its answer "
            f"would be garbage; its weights are corrupted or overflow in {self.model.dtype}: convert the "
            "checkpoint again, or load the model in float32")

    def _step(self, seq: Sequence, token: torch.Tensor, position: int, rope_position: int,
              capture: Recompressor | None = None) -> torch.Tensor:
        """One decode step: the token (int64 scalar on the device) at causal ``position`` -> next-token
        logits [vocab]. Replayed from a CUDA graph when there is one and no layer observer needs the
        eager path."""
        if self.graphed is not None and capture is None:
            # a copy: the graph's logits are overwritten by its next replay, which another stream's
            # step may run before this one samples (streams interleave step by step, see Runtime)
            return self.graphed.step(seq, token, position, rope_position).clone()
        device = self.model.device
        # full_ writes the scalars on the device (no blocking host-to-device copy)
        positions = torch.full((1,), position, dtype=torch.int32, device=device)
        seq.append([position])
        embeds = self.model.embed_tokens(token.reshape(1))
        rows = (3, 1) if self.model.config.rope.sections else (1,)
        rope = torch.full(rows, rope_position, dtype=torch.int32, device=device)
        hidden = self.model.forward(seq, embeds, ForwardBatch(positions=positions, rope_positions=rope), capture)
        return self.model.logits(hidden)[0]


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first of the stop strings starts in ``text``, or None."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(cuts) if cuts else None
