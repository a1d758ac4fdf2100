"""How a request is answered: sampling, refresh of cached images and KV compression, in one
validated object (``GenerationOptions``). ``Runtime.generate``, ``Runtime.stream`` and
``ChatSession.send`` take one, or its field names as keyword overrides."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import compress, refresh, validation
from .compress import CompressionPolicy, CompressOptions
from .errors import RequestError
from .refresh import RefreshOptions, RefreshPolicy
from .sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """Everything a request may set besides its messages; every field is checked at construction
    (RequestError), whether or not a request's path reads it.

    Sampling: ``max_tokens`` (an integer >= 0; with the prompt, at most the model's context length,
    checked per request); ``temperature`` (>= 0) 0 is greedy; ``top_p`` in (0, 1] keeps the smallest
    set of tokens whose probability mass reaches it; ``seed`` (an integer) makes sampling repeatable;
    ``stop``: a string or strings that end the text before them; ``return_logits``: the result keeps
    each step's logits.
    Refresh (docs/methods.md §1): ``refresh`` None restores no image KV (every token not in an exact
    prefix is computed); a policy name ("conduit", "full", "none", "first", "random", "attention",
    "cacheblend") restores cached images at their new positions and recomputes ``refresh_budget``
    (in [0, 1]) of their tokens, with ``refresh_options`` (a ``RefreshOptions`` or a dict of its fields).
    Compression (docs/methods.md §2): ``compress`` None keeps the whole KV; a policy name
    ("vlcache", "none", "random", "streamingllm", "h2o", "snapkv", "pyramidkv") keeps ``keep`` (in
    (0, 1]) of the prompt's KV per layer for decoding, with ``compress_options`` (``CompressOptions``
    or a dict).
    Diagnostics: ``trace_selection`` fills the selection trace of ``GenerationStats`` (the prompt
    positions each layer refreshed and kept); off, the request path records nothing of it.
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
    trace_selection: bool = False

    def __post_init__(self) -> None:
        """Checks and normalises every field (a bad ``refresh_budget`` is an error even for a request
        whose whole prompt is an exact prefix, where nothing is refreshed)."""
        fields = {
            "max_tokens": validation.integer(self.max_tokens, "max_tokens", 0),
            "temperature": validation.real(self.temperature, "temperature", 0.0),
            "top_p": validation.real(self.top_p, "top_p", 0.0, 1.0, low_open=True),
            "seed": None if self.seed is None else validation.integer(self.seed, "seed", *validation.SEED_RANGE),
            "stop": _stops(self.stop),
            "return_logits": validation.flag(self.return_logits, "return_logits"),
            "refresh": _name(self.refresh, "refresh"),
            "refresh_budget": validation.real(self.refresh_budget, "refresh_budget", 0.0, 1.0),
            "refresh_options": _options(RefreshOptions, self.refresh_options, "refresh_options"),
            "compress": _name(self.compress, "compress"),
            # keep 0 would leave the layers no KV to attend to
            "keep": validation.real(self.keep, "keep", 0.0, 1.0, low_open=True),
            "compress_options": _options(CompressOptions, self.compress_options, "compress_options"),
            "trace_selection": validation.flag(self.trace_selection, "trace_selection"),
        }
        validation.set_fields(self, fields)
        self.sampling()
        self.refresh_policy()  # an unknown name is a RequestError
        self.compression_policy()

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


def _stops(stop) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list or tuple of them) as a tuple of non-empty strings."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stops)


def _name(value, option: str) -> str | None:
    """A policy name: None or a string (looked up by the policy registry)."""
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{option} must be a policy name (a string) or None, got {value!r}")
    return value


def _options(kind: type, value, name: str):
    """``value`` as a ``kind`` (a dict of its fields, or None for the defaults)."""
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    if isinstance(value, dict):
        valid = [f.name for f in dataclasses.fields(kind)]
        unknown = [str(key) for key in value if key not in valid]
        if unknown:
            raise RequestError(f"unknown {name} {', '.join(sorted(unknown))}; use {', '.join(valid)}")
        return kind(**value)
    raise RequestError(f"{name} must be a {kind.__name__} or a dict, got {type(value).__name__}")
