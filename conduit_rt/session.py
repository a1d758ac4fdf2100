"""Multi-turn chat: a conversation whose sequence stays in the arena, each turn prefilling only
what is new (the exact prefix of the history is shared, not recomputed)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .compress import CompressOptions
from .refresh import RefreshOptions
from .results import GenerationResult, TextStream
from .runtime import CompressSpec, RefreshSpec, Runtime
from .sampling import SamplingParams


@dataclass(slots=True)
class Turn:
    """What a session keeps between requests: its sequence and the identity of each token in it."""

    seq: Any = None
    identity: list = field(default_factory=list)


class ChatSession:
    """``send`` takes the new user message (a string, or a content list with images), answers it and
    keeps both in ``history`` (the whole conversation in chat format)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.history: list[dict] = []
        self._turn = Turn()

    def send(self, content: str | list[dict], **kwargs: Any) -> GenerationResult:
        stream = self.stream(content, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def stream(self, content: str | list[dict], max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop: str | list[str] | None = None, return_logits: bool = False,
               refresh: str | None = None, refresh_budget: float = 0.1,
               refresh_options: RefreshOptions | dict | None = None, compress: str | None = None,
               keep: float = 0.1, compress_options: CompressOptions | dict | None = None) -> TextStream:
        sampling = SamplingParams.build(max_tokens, temperature, top_p, seed, stop)
        spec = RefreshSpec.build(refresh, refresh_budget, refresh_options)
        squeeze = CompressSpec.build(compress, keep, compress_options)
        messages = self.history + [{"role": "user", "content": content}]
        holder: list = []

        def pieces() -> Iterator[str]:
            yield from self.runtime._run(messages, sampling, spec, squeeze, return_logits, self._turn, holder)
            self.history = messages + [{"role": "assistant", "content": holder[0].text}]

        return TextStream(pieces(), holder)

    def close(self) -> None:
        if self._turn.seq is not None:
            self._turn.seq.free()
            self._turn = Turn()
