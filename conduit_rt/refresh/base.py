"""What a refresh policy sees, and the default way it refreshes (docs/methods.md §1, steps 5-8).

After the text pass (``reuse.ReusePass``) a policy gets a ``RefreshContext``: the restored visual
tokens, the budget ceil(r * N_vis), lazy scores, the options, and the calls that recompute tokens
over the mixed KV. ``RefreshPolicy.refresh`` returns the last prompt token's logits and how many
visual tokens it recomputed; its default is score -> select under the budget -> one recompute pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..arena import Sequence
from .. import validation
from ..errors import RequestError
from ..models.base import ModelConfig

FILL_MODES = ("isolated", "in_context")


@dataclass(frozen=True, slots=True)
class RefreshOptions:
    """Per-request knobs of refresh (defaults from docs/methods.md §1).

    lam: image-level amplification strength λ (conduit).
    query_tokens: the query rows of the score; None = the trailing text segment (after the last
        image), N = the last N prompt tokens.
    layers: decoder layers averaged in the score; None = all.
    fill: how a missing image's KV is made: "isolated" (the image prefilled alone in a one-image
        chat wrapper, the reference code's default) or "in_context" (as computed in the request).
    seed: the random policy's seed.
    """

    lam: float = 1.0
    query_tokens: int | None = None
    layers: tuple[int, ...] | None = None
    fill: str = "isolated"
    seed: int = 0

    def __post_init__(self) -> None:
        """Checks every field's type and range (RequestError); ``layers`` becomes a tuple. Whether the
        layers exist is checked per request, against the model."""
        if not isinstance(self.fill, str) or self.fill not in FILL_MODES:
            raise RequestError(f"fill must be one of {FILL_MODES}, got {self.fill!r}")
        layers = self.layers
        if layers is not None:
            if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple, range)):
                raise RequestError(f"layers must be a list of layer indices or None (all), got {layers!r}")
            if not layers:
                raise RequestError("layers must name at least one layer (None = all)")
            layers = tuple(validation.integer(layer, "each of layers") for layer in layers)
        fields = {
            "lam": validation.real(self.lam, "lam", 0.0),
            "query_tokens": None if self.query_tokens is None else validation.integer(self.query_tokens,
                                                                                      "query_tokens", 1),
            "layers": layers,
            "seed": validation.integer(self.seed, "seed", *validation.SEED_RANGE),
        }
        validation.set_fields(self, fields)


@dataclass(frozen=True, slots=True)
class VisualTokens:
    """The restored visual tokens of a request, in prompt order.

    slots: int64 [N] their slots (= causal positions) in the sequence; image: int64 [N] which restored
    image each belongs to (0..n_images-1, prompt order); n_images.
    """

    slots: torch.Tensor
    image: torch.Tensor
    n_images: int

    @property
    def n(self) -> int:
        return int(self.slots.numel())


class ScoreSource(Protocol):
    """Scores computed on demand, over the chosen layers (``options.layers``)."""

    def attention(self) -> torch.Tensor:
        """a_l(t): float32 [n_layers_chosen, N], attention mass per query row and head."""

    def value_norms(self) -> torch.Tensor:
        """||V_l(t)||_2 over all KV heads: float32 [n_layers_chosen, N]."""


class LayerObserver(Protocol):
    """Sees one decoder layer of a layer-wise recompute (``RefreshContext.forward_layer``)."""

    def on_layer(self, layer: int, q: torch.Tensor, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        """q [n, n_heads, head_dim] after RoPE; k_pre_rope, v [n, n_kv_heads, head_dim]; model dtype."""


class PromptRows(Protocol):
    """The prompt positions a policy may score with (``request.Request``)."""

    def query_positions(self, query_tokens: int | None) -> list[int]:
        """The trailing text segment, or the last ``query_tokens`` tokens (docs/methods.md §1 step 4)."""

    def text_after_first_image(self) -> list[int]:
        """Every text token from the first image on."""


class RefreshContext(Protocol):
    """A request's state after its text pass, as a refresh policy sees it."""

    tokens: VisualTokens    # the restored visual tokens (N_vis of them)
    budget: int             # B = ceil(r * N_vis)
    options: RefreshOptions
    scores: ScoreSource     # computed on first use
    seq: Sequence           # the request's sequence: restored and text KV written
    config: ModelConfig

    def start_scoring(self) -> None:
        """Queues the scores on the device (when the budget selects anything) and prepares the
        recompute's inputs on the host while they run."""

    def recompute(self, selected: torch.Tensor) -> torch.Tensor:
        """One pass over the selected visual tokens (int64 [k] indices into ``tokens``, sorted) and
        every non-restored position after the first of them, causal over the mixed KV, overwriting
        their KV: the last prompt token's logits, float32 [vocab]. Nothing selected: the text
        pass's logits (a recompute would reproduce them)."""

    def queries(self, layer: int) -> tuple[torch.Tensor, list[int]]:
        """q of the score's query rows at ``layer`` as the text pass computed them: ([n, n_heads,
        head_dim] after RoPE, their positions)."""

    def text_pass_logits(self) -> torch.Tensor:
        """The last prompt token's logits from the text pass, float32 [vocab]."""

    def recompute_rows(self, slots: np.ndarray) -> np.ndarray:
        """The positions a recompute of these visual slots forwards: them and every non-restored
        position after the first of them, sorted (int64)."""

    def embed(self, positions: list[int]) -> torch.Tensor:
        """Input embeddings of prompt positions: [len(positions), hidden], model dtype."""

    def forward_layer(self, layer: int, rows: list[int], x: torch.Tensor, observer: LayerObserver) -> torch.Tensor:
        """One decoder layer over the prompt positions ``rows`` (x [n, hidden] -> [n, hidden]),
        writing their KV at that layer; ``observer`` sees the layer's q, K and V."""

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached pre-RoPE K and V of every restored token at ``layer``: [N, n_kv_heads, head_dim] each."""

    def last_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of the last row of ``hidden`` [n, hidden]: float32 [vocab]."""


@dataclass(frozen=True, slots=True)
class Refreshed:
    """What a refresh produced: the last prompt token's logits (float32 [vocab]) and the number of
    visual tokens it recomputed (a layer-wise policy: per layer on average)."""

    logits: torch.Tensor
    refreshed_tokens: int


class RefreshPolicy:
    """Base: a named rule choosing ``budget`` of the N restored visual tokens (``select``), then
    recomputing them in one pass. ``uses_scores``: ``select`` reads the attention scores."""

    name = ""
    uses_scores = False

    def query_positions(self, prompt: PromptRows, options: RefreshOptions) -> list[int]:
        """The prompt positions whose q the text pass keeps as the score's query rows Q."""
        return prompt.query_positions(options.query_tokens)

    def refresh(self, context: RefreshContext) -> Refreshed:
        """Score -> select under the budget -> one recompute pass over the mixed KV."""
        if self.uses_scores:
            context.start_scoring()
        selected = self.select(context.tokens, context.budget, context.scores, context.options)
        return Refreshed(context.recompute(selected), int(selected.numel()))

    def select(self, tokens: VisualTokens, budget: int, scores: ScoreSource, options: RefreshOptions) -> torch.Tensor:
        """Sorted indices (int64 [k], CPU) into ``tokens`` of the tokens to recompute."""
        raise NotImplementedError

