"""Next-token sampling: greedy, temperature and nucleus (top-p), seeded, on the logits' device."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import validation


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy; top_p in (0, 1] keeps the smallest set of tokens whose probability
    mass reaches top_p; seed makes sampling repeatable; stop strings end the text before them.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        validation.integer(self.max_tokens, "max_tokens", 0)
        validation.real(self.temperature, "temperature", 0.0)
        validation.real(self.top_p, "top_p", 0.0, 1.0, low_open=True)
        if self.seed is not None:
            validation.integer(self.seed, "seed", *validation.SEED_RANGE)


class Sampler:
    """Draws tokens for one request; holds its own generator so that a seed is reproducible."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: float32 [vocab] -> (token: int64 scalar, finite: bool scalar, whether every logit
        is finite), both on the logits' device, with no host sync. Non-finite logits are sampled as
        uniform ones (multinomial on NaN would stop a CUDA device with an assert); the caller reads
        ``finite`` back with the token and refuses the answer."""
        finite = torch.isfinite(logits).all()
        if self.params.temperature == 0:
            return torch.argmax(logits), finite
        logits = torch.where(finite, logits, torch.zeros_like(logits))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep a token if the mass before it is still below top_p (the first token always stays)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs = torch.where(mass_before < self.params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
            return order[choice[0]], finite
        return torch.multinomial(probs, 1, generator=self.generator)[0], finite


class TokenReadback:
    """Brings sampled token ids, and whether their logits were finite, to the host without waiting
    for work enqueued after them.

    ``int(token)`` on a CUDA tensor waits for the whole stream, so the decode loop could not enqueue
    the next step before reading a token. ``start`` copies the token and its finiteness flag, as one
    int64 pair, into pinned host memory and records an event; ``wait`` waits for that event only, so
    the GPU can already run a step enqueued between the two calls. The flag rides on the copy the
    token needs anyway: checking the logits adds no sync. One token at a time: ``start`` again only
    after ``wait`` returned.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host = torch.empty(2, dtype=torch.long, pin_memory=self._cuda)
        self._event = torch.cuda.Event() if self._cuda else None

    def start(self, token: torch.Tensor, finite: torch.Tensor) -> None:
        """token: int64 scalar tensor; finite: bool scalar tensor; both on the device."""
        self._host.copy_(torch.stack((token, finite.to(torch.long))), non_blocking=self._cuda)
        if self._event is not None:
            self._event.record()

    def wait(self) -> tuple[int, bool]:
        """(token id, whether the logits it was sampled from were all finite)."""
        if self._event is not None:
            self._event.synchronize()
        token, finite = self._host.tolist()
        return token, bool(finite)
