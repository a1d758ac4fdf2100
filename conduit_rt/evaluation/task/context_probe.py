"""An auxiliary training loss on the decoder: linear probes for context at a middle layer.

Learning from scratch to answer "bee red?" needs two things to appear together before the answer
signal can shape them: the image tokens of a page must know the tag written before the page, and
the position that predicts the answer must know the asked tag and colour. Each alone gets almost
no gradient while the other is missing (the usual plateau of retrieval tasks). These probes give
each its own signal, at the output of decoder layer ``layer``:

- every image token predicts the tag of its page (12 classes),
- the last prompt token of every question turn (" ASSISTANT:") predicts the tag and the colour of
  the turn's first ask.

The first probe makes, by construction, the deeper-layer states of image tokens depend on the text
before the page, which is what stale KV gets wrong (docs/quality/task.md). The heads are training-time only;
the shipped model is a plain ``LlavaForConditionalGeneration``.
"""

from __future__ import annotations

import torch
from torch import nn

from .generator import COLOURS, TAGS


def probe_layer(num_layers: int) -> int:
    """The decoder layer whose output is probed: a third of the way up (at least the first)."""
    return max(1, num_layers // 3)


class ContextProbe(nn.Module):
    """Three linear heads on ``hidden_states[layer]`` [B, T, D] (transformers' ``output_hidden_states``
    tuple: index 0 is the embeddings, index i the output of decoder layer i, counted from 1)."""

    def __init__(self, text_hidden: int, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.page_tag = nn.Linear(text_hidden, len(TAGS))
        self.query_tag = nn.Linear(text_hidden, len(TAGS))
        self.query_colour = nn.Linear(text_hidden, len(COLOURS))

    def loss(self, hidden_states: tuple[torch.Tensor, ...], batch: dict[str, torch.Tensor], image_token_id: int) -> torch.Tensor:
        """Summed cross-entropies. ``batch``: ``input_ids`` [B, T], ``image_tags`` and ``image_tokens``
        [num_images], ``query_rows``/``query_positions``/``query_tags``/``query_colours``
        [num_questions] (int64; -100: no target)."""
        hidden = hidden_states[self.layer]
        image_hidden = hidden[batch["input_ids"] == image_token_id]  # [visual tokens, D], image order
        page_tags = batch["image_tags"].repeat_interleave(batch["image_tokens"])
        query_hidden = hidden[batch["query_rows"], batch["query_positions"]]  # [num_questions, D]
        cross_entropy = nn.functional.cross_entropy
        return (
            cross_entropy(self.page_tag(image_hidden).float(), page_tags)
            + _optional_cross_entropy(self.query_tag(query_hidden).float(), batch["query_tags"])
            + _optional_cross_entropy(self.query_colour(query_hidden).float(), batch["query_colours"])
        )


def _optional_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the rows with a target (-100: none); 0 when no row has one."""
    if not bool((targets != -100).any()):
        return logits.sum() * 0.0
    return nn.functional.cross_entropy(logits, targets, ignore_index=-100)
