"""How a request is answered: sampling, refresh of cached images and KV compression, in one
validated object (``GenerationOptions``). ``Runtime.generate``, ``Runtime.stream`` and
``ChatSession.send`` take one, or its field names as keyword overrides."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import compress, refresh
from .compress import CompressionPolicy, CompressOptions
from .errors import RequestError
from .refresh import RefreshOptions, RefreshPolicy
from .sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """Everything a request may set besides its messages; validated at construction (RequestError).

    Sampling: ``max_tokens``; ``temperature`` 0 is greedy; ``top_p`` in (0, 1] keeps the smallest set
    of tokens whose probability mass reaches it; ``seed`` makes sampling repeatable; ``stop``: a
    string or strings that end the text before them; ``return_logits``: the result keeps each step's
    logits.
    Refresh (docs/methods.md §1): ``refresh`` None restores no image KV (every token not in an exact
    prefix is computed); a policy name ("conduit", "full", "none", "first", "random", "attention",
    "cacheblend") restores cached images at their new positions and recomputes ``refresh_budget``
    of their tokens, with ``refresh_options`` (a ``RefreshOptions`` or a dict of its fields).
    Compression (docs/methods.md §2): ``compress`` None keeps the whole KV; a policy name
    ("vlcache", "none", "random", "streamingllm", "h2o", "snapkv", "pyramidkv") keeps ``keep`` of
    the prompt's KV per layer for decoding, with ``compress_options`` (``CompressOptions`` or a dict).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | tuple[str, ...] | list[str] | None = ()
    return_logits: bool = False
    refresh: str | None = None
    refresh_budget: float = 0.1
    refresh_options: RefreshOptions | dict | None = None
    compress: str | None = None
    keep: float = 0.1
    compress_options: CompressOptions | dict | None = None

    def __post_init__(self) -> None:
        for name, kind in (("max_tokens", int), ("temperature", float), ("top_p", float), ("refresh_budget", float),
                           ("keep", float)):
            object.__setattr__(self, name, _number(kind, getattr(self, name), name))
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise RequestError("stop must be a non-empty string or a list of them")
        object.__setattr__(self, "stop", stops)
        object.__setattr__(self, "refresh_options", _options(RefreshOptions, self.refresh_options, "refresh_options"))
        object.__setattr__(self, "compress_options", _options(CompressOptions, self.compress_options, "compress_options"))
        self.sampling()  # SamplingParams checks max_tokens, temperature and top_p
        self.refresh_policy()  # an unknown name is a RequestError
        self.compression_policy()
        for name in ("refresh_budget", "keep"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise RequestError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @classmethod
    def of(cls, options: "GenerationOptions | None" = None, **overrides) -> "GenerationOptions":
        """``options`` (default: the defaults) with the named fields replaced; an unknown name is a
        RequestError that lists the valid ones."""
        unknown = sorted(set(overrides) - set(FIELD_NAMES))
        if unknown:
            raise RequestError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(FIELD_NAMES)}")
        if options is None:
            return cls(**overrides)
        if not isinstance(options, cls):
            raise RequestError(f"options must be a GenerationOptions, got {type(options).__name__}")
        return dataclasses.replace(options, **overrides) if overrides else options

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.seed, self.stop)

    def refresh_policy(self) -> RefreshPolicy | None:
        """The refresh policy named by ``refresh`` (looked up now: the registry may change)."""
        return refresh.get_policy(self.refresh) if self.refresh is not None else None

    def compression_policy(self) -> CompressionPolicy | None:
        """The compression policy named by ``compress`` (looked up now)."""
        return compress.get_policy(self.compress) if self.compress is not None else None


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(GenerationOptions))


def _number(kind: type, value, name: str):
    """``value`` as an int or a float; a RequestError when it is not a number."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be a number, got {value!r}") from None


def _options(kind: type, value, name: str):
    """``value`` as a ``kind`` (a dict of its fields, or None for the defaults)."""
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    if isinstance(value, dict):
        valid = [f.name for f in dataclasses.fields(kind)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise RequestError(f"unknown {name} {', '.join(unknown)}; use {', '.join(valid)}")
        return kind(**value)
    raise RequestError(f"{name} must be a {kind.__name__} or a dict, got {type(value).__name__}")
