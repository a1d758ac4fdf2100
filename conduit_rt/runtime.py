"""The Runtime: load a converted model and answer chat requests on the native KV arena.

The request path, top-down (``Runtime._run``), one owner per step:
  1. messages -> chat template -> token ids and segments            (chat.build_prompt)
  2. images -> pixels -> identity, features                          (preprocess, model.encode_images)
  3. plan: which prefix of the sequence is already in the arena      (ChatSession exact-prefix reuse)
  4. prefill the rest in chunks through the decoder                  (model.forward on the arena)
  5. decode: sample, append, forward one token at a time; stream text (sampling, tokenizer)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import native
from .chat import Prompt, build_prompt, validate_messages
from .errors import RequestError
from .models.base import ForwardBatch, PreparedImage
from .preprocess import image_key, to_rgb_array
from .sampling import Sampler, SamplingParams

logger = logging.getLogger(__name__)

PREFILL_CHUNK = 2048
DEFAULT_CONTEXT_TOKENS = 32768


@dataclass(slots=True)
class GenerationStats:
    """What one request cost (times in seconds, sizes in bytes)."""

    ttft_s: float = 0.0                # request start -> first token sampled
    prefill_tokens: int = 0            # prompt tokens computed in this request
    reused_tokens: int = 0             # prompt tokens whose KV was already in the arena (chat session)
    prompt_tokens: int = 0
    decode_tokens: int = 0             # tokens generated
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_s: float = 0.0
    images: int = 0
    kv_bytes: int = 0                  # arena bytes held by the request's sequence at the end
    finish_reason: str = ""            # "eos", "stop" or "length"


@dataclass(slots=True)
class GenerationResult:
    """The answer: ``text``, its ``tokens``, the per-step ``logits`` ([steps, vocab] float32, when
    asked) and ``stats``."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    logits: torch.Tensor | None = None


class TextStream:
    """Iterate to get text pieces as they decode; ``result`` is set once the stream is exhausted."""

    def __init__(self, pieces: Iterator[str], holder: list) -> None:
        self._pieces = pieces
        self._holder = holder

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    @property
    def result(self) -> GenerationResult:
        if not self._holder:
            raise RuntimeError("the stream has not finished yet; iterate it to the end first")
        return self._holder[0]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) != "auto":
        return torch.device(device)
    if torch.cuda.is_available() and native.backends()["cuda"]["available"]:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(slots=True)
class _Turn:
    """The state a chat session keeps between requests: its sequence and what is in it."""

    seq: Any = None
    identity: list = field(default_factory=list)  # one entry per position in the sequence


class Runtime:
    """A converted model, ready to chat.

    Args:
        model_path: the text model GGUF (``model.gguf``).
        mmproj: the vision GGUF (``mmproj.gguf``); default: ``mmproj.gguf`` beside the model if present.
        device: "auto" (CUDA when available), "cpu" or "cuda[:N]".
        dtype: weights and KV dtype; default bfloat16 on CUDA, float32 on CPU.
        kv_cache_bytes: size of the KV arena; default: room for 32K tokens (capped at half of the
            free GPU memory).
    """

    def __init__(self, model_path: str | Path, mmproj: str | Path | None = None, device: str | torch.device = "auto",
                 dtype: torch.dtype | None = None, kv_cache_bytes: int | None = None) -> None:
        from .models import load_model

        self.device = resolve_device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model_path = Path(model_path)
        if mmproj is None and (model_path.parent / "mmproj.gguf").is_file():
            mmproj = model_path.parent / "mmproj.gguf"
        self.model = load_model(model_path, mmproj, self.device, self.dtype)
        self.assets = self.model.assets  # tokenizer, chat template, preprocessing, ids
        self.arena = self.model.new_arena(self._kv_bytes(kv_cache_bytes))
        logger.info("runtime: %s on %s (%s), KV arena %.1f MiB", model_path.name, self.device, self.dtype,
                    self.arena.kv_bytes / 2**20)

    def _kv_bytes(self, requested: int | None) -> int:
        if requested is not None:
            return int(requested)
        c = self.model.config
        per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.tensor([], dtype=self.dtype).element_size()
        want = per_token * DEFAULT_CONTEXT_TOKENS
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            want = min(want, free // 2)
        return want

    # -- public API -----------------------------------------------------------------------------------
    def generate(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop: str | list[str] | None = None,
                 return_logits: bool = False) -> GenerationResult:
        """Answers the messages (OpenAI chat style, images as parts) in one go."""
        stream = self.stream(messages, max_tokens, temperature, top_p, seed, stop, return_logits)
        for _ in stream:
            pass
        return stream.result

    def stream(self, messages: list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop: str | list[str] | None = None, return_logits: bool = False) -> TextStream:
        """Like ``generate``, yielding text pieces as they decode; ``.result`` holds the whole answer."""
        sampling = SamplingParams.build(max_tokens, temperature, top_p, seed, stop)
        holder: list = []
        return TextStream(self._run(messages, sampling, return_logits, None, holder), holder)

    def chat(self) -> "ChatSession":
        """A multi-turn session that keeps its sequence in the arena between turns."""
        return ChatSession(self)

    # -- the request path -----------------------------------------------------------------------------
    def _run(self, messages: list[dict], sampling: SamplingParams, return_logits: bool, turn: _Turn | None,
             holder: list) -> Iterator[str]:
        start = time.perf_counter()
        request = self._request(messages)                                 # 1, 2
        seq, reused = self._plan(turn, request.identity)                  # 3
        n = len(request.prompt.token_ids)
        stats = GenerationStats(prompt_tokens=n, reused_tokens=reused, prefill_tokens=n - reused,
                                images=len(request.images))
        try:
            logits = self._prefill(seq, request, reused)                  # 4
            yield from self._decode(seq, logits, request, sampling, return_logits, stats, start, holder)  # 5
        finally:
            if turn is None:
                seq.free()
            else:
                generated = holder[0].tokens if holder else []
                turn.seq = seq
                turn.identity = (request.identity + [("t", t) for t in generated])[: seq.n_tokens(0)]

    def _request(self, messages: list[dict]) -> "_Request":
        """Messages -> prompt tokens and segments, prepared images, their identities, RoPE positions."""
        a = self.assets
        _, payloads = validate_messages(messages)
        if payloads and not self.model.has_vision:
            raise RequestError("this model has no vision tower: load it with its mmproj.gguf to send images")
        pixels = [to_rgb_array(payload) for payload in payloads]
        images = [self.model.prepare_image(rgb) for rgb in pixels]
        keys = [image_key(rgb, a.preprocess.as_dict(), a.vision_model_id) for rgb in pixels]
        prompt = build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id,
                              [image.n_tokens for image in images])
        rope = self.model.rope_positions(prompt, images)
        return _Request(prompt, images, keys, rope, _identity(prompt, keys))

    def _plan(self, turn: _Turn | None, identity: list) -> tuple[Any, int]:
        """The sequence to prefill into and how many leading tokens it already holds (exact prefix)."""
        if turn is None or turn.seq is None:
            return self.arena.new_sequence(), 0
        reused = 0
        for held, new in zip(turn.identity, identity):
            if held != new:
                break
            reused += 1
        reused = min(reused, len(identity) - 1)  # the last prompt token is always recomputed: its logits
        turn.seq.truncate(reused)
        return turn.seq, reused

    def _prefill(self, seq, request: "_Request", reused: int) -> torch.Tensor:
        """Runs prompt tokens [reused, n) through the decoder; returns the last token's logits [vocab]."""
        embeds = self._embeddings(request, reused)
        n = len(request.prompt.token_ids)
        hidden = None
        for lo in range(reused, n, PREFILL_CHUNK):
            hi = min(lo + PREFILL_CHUNK, n)
            positions = torch.arange(lo, hi, dtype=torch.int32)
            seq.append(positions)
            batch = self._batch(positions, request.rope[..., lo:hi])
            hidden = self.model.forward(seq, embeds[lo - reused: hi - reused], batch)
        return self.model.logits(hidden[-1:])[0]

    def _embeddings(self, request: "_Request", reused: int) -> torch.Tensor:
        """Input embeddings of prompt tokens [reused, n): [n - reused, hidden], model dtype."""
        prompt = request.prompt
        ids = torch.tensor(prompt.token_ids[reused:], dtype=torch.long, device=self.device)
        embeds = self.model.embed_tokens(ids)
        slots = [s for s in prompt.image_slots if s.start + s.n_tokens > reused]
        features = self.model.encode_images([request.images[s.image_index] for s in slots])
        for slot, feats in zip(slots, features):
            lo = max(slot.start, reused)
            embeds[lo - reused: slot.start + slot.n_tokens - reused] = feats[lo - slot.start:]
        return embeds

    def _batch(self, positions: torch.Tensor, rope: torch.Tensor) -> ForwardBatch:
        return ForwardBatch(positions=positions.to(self.device), rope_positions=rope.to(self.device).contiguous())

    def _decode(self, seq, logits: torch.Tensor, request: "_Request", sampling: SamplingParams, return_logits: bool,
                stats: GenerationStats, start: float, holder: list) -> Iterator[str]:
        sampler = Sampler(sampling, self.device)
        detok = self.assets.tokenizer.detokenizer()
        eos = self.assets.eos_token_ids
        tokens: list[int] = []
        step_logits: list[torch.Tensor] = []
        text, emitted = "", 0
        finish = "length"
        hold_back = max((len(s) for s in sampling.stop), default=1) - 1
        decode_start = None
        for step in range(sampling.max_tokens):
            if return_logits:
                step_logits.append(logits.float().cpu())
            token = int(sampler(logits))
            if step == 0:
                stats.ttft_s = time.perf_counter() - start
                decode_start = time.perf_counter()
            if token in eos:
                finish = "eos"
                break
            tokens.append(token)
            text += detok.push(token)
            cut = _find_stop(text, sampling.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            if len(text) - hold_back > emitted:
                yield text[emitted: len(text) - hold_back]
                emitted = len(text) - hold_back
            if step + 1 < sampling.max_tokens:
                logits = self._step(seq, token, len(request.prompt.token_ids) + step, request.next_rope + step)
        if finish != "stop":  # release characters the detokenizer held back (an unfinished byte run)
            text += detok.flush()
            cut = _find_stop(text, sampling.stop)
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
        holder.append(GenerationResult(text=text, tokens=tokens, stats=stats,
                                       logits=torch.stack(step_logits) if return_logits and step_logits else None))

    def _step(self, seq, token: int, position: int, rope_position: int) -> torch.Tensor:
        """One decode step: the token at causal ``position`` -> next-token logits [vocab]."""
        positions = torch.tensor([position], dtype=torch.int32)
        seq.append(positions)
        embeds = self.model.embed_tokens(torch.tensor([token], dtype=torch.long, device=self.device))
        rope = torch.full((*self._rope_rows(), 1), rope_position, dtype=torch.int32)
        hidden = self.model.forward(seq, embeds, self._batch(positions, rope))
        return self.model.logits(hidden)[0]

    def _rope_rows(self) -> tuple[int, ...]:
        return (3,) if self.model.config.rope.sections else ()


@dataclass(frozen=True, slots=True)
class _Request:
    """One request after tokenization: what every later step of the path reads."""

    prompt: Prompt
    images: list[PreparedImage]
    keys: list[bytes]          # 32-byte identity of each image
    rope: torch.Tensor         # int32 [n] or [3, n], CPU
    identity: list             # one hashable entry per prompt token (exact-prefix matching)

    @property
    def next_rope(self) -> int:
        """RoPE position of the first generated token."""
        return int(self.rope.max()) + 1 if self.rope.numel() else 0


def _identity(prompt: Prompt, keys: list[bytes]) -> list:
    """One hashable entry per prompt token: ("t", id) for text, ("i", image key, index) for image tokens."""
    out: list = [("t", t) for t in prompt.token_ids]
    for slot in prompt.image_slots:
        for j in range(slot.n_tokens):
            out[slot.start + j] = ("i", keys[slot.image_index], j)
    return out


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(cuts) if cuts else None


class ChatSession:
    """A conversation whose sequence stays in the arena: each turn prefills only what is new.

    ``send`` takes the new user message (a string, or a content list with images), answers it and
    keeps both in the history; ``history`` is the whole conversation in chat format.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.history: list[dict] = []
        self._turn = _Turn()

    def send(self, content: str | list[dict], **kwargs: Any) -> GenerationResult:
        stream = self.stream(content, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def stream(self, content: str | list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop: str | list[str] | None = None, return_logits: bool = False) -> TextStream:
        sampling = SamplingParams.build(max_tokens, temperature, top_p, seed, stop)
        messages = self.history + [{"role": "user", "content": content}]
        holder: list = []

        def pieces() -> Iterator[str]:
            yield from self.runtime._run(messages, sampling, return_logits, self._turn, holder)
            self.history = messages + [{"role": "assistant", "content": holder[0].text}]

        return TextStream(pieces(), holder)

    def close(self) -> None:
        if self._turn.seq is not None:
            self._turn.seq.free()
            self._turn = _Turn()
