"""Multi-turn chat: a conversation whose sequence stays in the arena, each turn prefilling only
what is new (the exact prefix of the history is shared, not recomputed)."""
from __future__ import annotations

from collections.abc import Generator

from .options import GenerationOptions
from .planning import HeldSequence
from .results import GenerationResult, TextStream
from .runtime import Runtime


class ChatSession:
    """``send`` takes the new user message (a string, or a content list with images), answers it and
    keeps both in ``history`` (the whole conversation in chat format); ``held`` is the sequence the
    session keeps in the arena between turns.

    One conversation: send its turns one after another (from any thread). Sessions of one Runtime
    may run at once on different threads, as any requests may (see ``Runtime``)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.history: list[dict] = []
        self.held = HeldSequence()

    def send(self, content: str | list[dict], options: GenerationOptions | None = None,
             **overrides) -> GenerationResult:
        """Answers ``content``; ``options`` and ``overrides`` as in ``Runtime.generate``."""
        return self.stream(content, options, **overrides).finish()

    def stream(self, content: str | list[dict], options: GenerationOptions | None = None,
               **overrides) -> TextStream:
        """Like ``send``, yielding text pieces as they decode; the turn joins ``history`` once the
        stream is exhausted."""
        messages = self.history + [{"role": "user", "content": content}]
        answer = self.runtime.stream(messages, options, held=self.held, **overrides)

        def turn() -> Generator[str, None, GenerationResult]:
            yield from answer
            self.history = messages + [{"role": "assistant", "content": answer.result.text}]
            return answer.result

        return TextStream(turn(), self.runtime.lock)

    def close(self) -> None:
        """Frees the session's sequence."""
        with self.runtime.lock:
            self.held.free()
