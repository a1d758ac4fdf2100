"""An auxiliary training loss that teaches the vision side to read: a per-token cell classifier.

From scratch, a LLaVA model learns to read only through the answer tokens, a sparse signal that
leaves a long plateau. This side loss classifies, from each image token's projector output, the
character in its cell (blank or one of 27) and its colour (none, the 6 field colours, grey). It is
a training-time device only: the head is discarded and the shipped model is a plain
``LlavaForConditionalGeneration``. It makes visual content readable without saying anything about
which page a token belongs to, so it does not weaken the reliance on the text before each page.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from .generator import CODE_ALPHABET, COLOURS, Page

NUM_CHAR_CLASSES = 1 + len(CODE_ALPHABET)  # 0: blank cell
COLOUR_CLASSES = ("none", *COLOURS, "grey")


def cell_labels(pages: Sequence[Page]) -> np.ndarray:
    """Per page and cell (row-major, as image tokens are ordered): [n, 2, cells] uint8 (pages of one
    grid), [:, 0] the character class (0 blank, 1 + index in CODE_ALPHABET), [:, 1] the colour class."""
    labels = np.zeros((len(pages), 2, pages[0].num_cells), dtype=np.uint8)
    grey = COLOUR_CLASSES.index("grey")
    for index, page in enumerate(pages):
        for field in page.fields:
            for char, cell in zip(field.code, page.cells_of(field)):
                labels[index, :, cell] = (1 + CODE_ALPHABET.index(char), COLOUR_CLASSES.index(field.colour))
        for row, column, char in page.distractors:
            labels[index, :, row * page.grid + column] = (1 + CODE_ALPHABET.index(char), grey)
    return labels


class ReadingHead(nn.Module):
    """Linear char and colour classifiers on the projector's output (visual tokens, row-major per
    image, images in order: LLaVA's [num_images, cells, text_hidden], Qwen2-VL's merger output
    [visual tokens, text_hidden]).

    ``attach(model)`` hooks the model's projector; after a forward, ``loss(labels)`` with
    ``labels`` [num_images, 2, cells] (int64, images in the order of ``pixel_values``) returns the
    summed cross-entropies. ``detach()`` removes the hook.
    """

    def __init__(self, text_hidden: int) -> None:
        super().__init__()
        self.chars = nn.Linear(text_hidden, NUM_CHAR_CLASSES)
        self.colours = nn.Linear(text_hidden, len(COLOUR_CLASSES))
        self._features: torch.Tensor | None = None
        self._handle = None

    def attach(self, model) -> None:
        def keep(_module, _inputs, output):
            self._features = output

        projector = getattr(model.model, "multi_modal_projector", None) or model.model.visual.merger
        self._handle = projector.register_forward_hook(keep)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def loss(self, labels: torch.Tensor) -> torch.Tensor:
        features, self._features = self._features, None
        if features is None:
            raise RuntimeError("ReadingHead.loss needs a model forward with images since attach()")
        features = features.reshape(-1, features.shape[-1])
        chars = self.chars(features).float()
        colours = self.colours(features).float()
        return nn.functional.cross_entropy(chars, labels[:, 0].flatten()) + nn.functional.cross_entropy(
            colours, labels[:, 1].flatten()
        )
