"""Decoding a prefilled request: sample, append, forward one token at a time, with the text streamed
as it decodes (stop strings held back until they cannot start) and the request's statistics."""
from __future__ import annotations

import time
from collections.abc import Generator, Iterator

import torch

from .arena import KVArena, Sequence
from .compress import QueryRecorder, Recompressor
from .decode_graph import GraphedDecoder
from .errors import NonFiniteLogitsError
from .models.base import ForwardBatch, LayerCapture
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
        answer = AnswerText(self.model.assets, sampling, stats, start)
        step_logits: list[torch.Tensor] | None = [] if return_logits else None
        sampled = self._sampled_tokens(seq, logits, first_position, first_rope, sampling, step_logits, recompress)
        try:
            for token in sampled:
                piece, ended = answer.accept(token)
                if piece:
                    yield piece
                if ended:
                    break
        finally:
            sampled.close()  # undoes a step run ahead for a token that ended the answer
        tail, result = answer.end(seq, step_logits)
        if tail:
            yield tail
        return result

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
            raise self.non_finite_error(first_position)
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
                    logits = self.step(seq, token, position, rope_position, recompress)
                    ahead = position
                token_id, finite_logits = readback.wait()
                if not finite_logits:
                    raise self.non_finite_error(position)
                yield token_id
                ahead = None
                if more and i == 0:
                    logits = self.step(seq, token, position, rope_position, recompress)
                if more and recompress is not None:
                    recompress.after_step(position)
        finally:
            if ahead is not None:
                seq.truncate(ahead)

    def draft_queries(self, seq: Sequence, logits: torch.Tensor, first_position: int, first_rope: int,
                      n_steps: int) -> tuple[dict[int, torch.Tensor], list[int]]:
        """Drafts ``n_steps`` greedy decode steps after a prompt of ``first_position`` tokens whose last
        row gave ``logits`` and drops them again: the sequence ends as it began. Returns each layer's
        q of the steps ([n_steps, n_heads, head_dim], model dtype) and their causal positions (what a
        compression policy scores with before it keeps part of the prompt)."""
        recorder = QueryRecorder()
        token = logits.argmax()
        try:
            for i in range(n_steps):
                token = self.step(seq, token, first_position + i, first_rope + i, recorder).argmax()
        finally:
            seq.truncate(first_position)
        return ({layer: recorder.stacked(layer) for layer in recorder.q},
                list(range(first_position, first_position + n_steps)))

    def non_finite_error(self, n_tokens: int) -> NonFiniteLogitsError:
        """The error for NaN or infinite logits after ``n_tokens`` tokens of the sequence."""
        return NonFiniteLogitsError(
            f"{self.source}: the model's logits after {n_tokens} tokens are NaN or infinite, so its answer "
            f"would be garbage; its weights are corrupted or overflow in {self.model.dtype}: convert the "
            "checkpoint again, or load the model in float32")

    def step(self, seq: Sequence, token: torch.Tensor, position: int, rope_position: int,
             capture: LayerCapture | None = None) -> torch.Tensor:
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


class AnswerText:
    """The text of one answer as its sampled tokens arrive, one at a time (``accept``), and its
    decode statistics (``end``).

    An EOS token ends the answer without being part of it; a stop string cuts the text before it,
    and text that could still be the start of one is held back until it cannot be; characters the
    detokenizer holds back (an unfinished byte run) are released at the end. ``eos``: the token ids
    that end the answer (default: the model's; empty to decode through them). ``stats`` gets the
    time to first token at the first ``accept`` and the rest at ``end`` (``start``: the request's
    perf_counter start)."""

    def __init__(self, assets, sampling: SamplingParams, stats: GenerationStats, start: float,
                 eos: frozenset[int] | set[int] | None = None) -> None:
        self._detok = assets.tokenizer.detokenizer()
        self._eos = assets.eos_token_ids if eos is None else eos
        self._stops = sampling.stop
        self._hold_back = max((len(s) for s in sampling.stop), default=1) - 1
        self.stats, self._start = stats, start
        self.tokens: list[int] = []
        self.text, self._emitted = "", 0
        self.finish = "length"
        self._decode_start: float | None = None

    def accept(self, token: int) -> tuple[str, bool]:
        """Takes the next sampled token: (the text it releases, possibly empty; whether the answer
        ended at it: EOS or a stop string)."""
        if self._decode_start is None:
            self.stats.ttft_s = time.perf_counter() - self._start
            self._decode_start = time.perf_counter()
        if token in self._eos:
            self.finish = "eos"
            return "", True
        self.tokens.append(token)
        self.text += self._detok.push(token)
        cut = find_stop(self.text, self._stops)
        if cut is not None:
            self.text, self.finish = self.text[:cut], "stop"
            return "", True
        if len(self.text) - self._hold_back > self._emitted:
            piece = self.text[self._emitted: len(self.text) - self._hold_back]
            self._emitted = len(self.text) - self._hold_back
            return piece, False
        return "", False

    def end(self, seq: Sequence, step_logits: list[torch.Tensor] | None = None) -> tuple[str, GenerationResult]:
        """The answer is over (ended, or out of tokens): (the text not released yet, the result with
        its statistics completed; ``seq`` is the request's sequence, ``step_logits`` each step's
        logits on the CPU, when kept)."""
        if self.finish != "stop":  # release characters the detokenizer held back (an unfinished byte run)
            self.text += self._detok.flush()
            cut = find_stop(self.text, self._stops)
            if cut is not None:
                self.text, self.finish = self.text[:cut], "stop"
        tail, self._emitted = self.text[self._emitted:], len(self.text)
        end, stats, n = time.perf_counter(), self.stats, len(self.tokens)
        stats.decode_tokens = n
        stats.decode_s = end - self._decode_start if self._decode_start else 0.0
        stats.decode_tokens_per_s = (n - 1) / stats.decode_s if stats.decode_s > 0 and n > 1 else 0.0
        stats.total_s = end - self._start
        stats.finish_reason = self.finish
        stats.kv_bytes = seq.nbytes
        return tail, GenerationResult(text=self.text, tokens=self.tokens, stats=stats,
                                      logits=torch.stack(step_logits) if step_logits else None)
