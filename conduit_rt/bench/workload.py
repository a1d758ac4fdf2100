"""What the end-to-end sections run on: a random-weight model of a named shape (``synthetic.SHAPES``
for LLaVA, ``family_models.SHAPES`` for the other families), built on the device by
``models.random_init``, and the image requests sent to it.

``first`` shows ``n_images`` random images after a system prefix, with a question; ``second`` shows
the same images in another order (``shuffled``) under another prefix and question. The words come
from the model's filler ids (``synthetic.WordVocabulary.fillers``), one token each. The model never
stops at EOS (its weights are random): every request generates the length asked for.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from PIL import Image

from conduit_rt.models.random_init import random_llava, random_model

from . import family_models, synthetic
from .config import E2ESizes, FamilySizes


@dataclass(slots=True)
class Workload:
    """The model, the ids its request words are drawn from, the images (``images`` and
    ``shuffled``: the same ones in another order) and the two requests over them."""

    model: object
    fillers: range
    images: list[Image.Image]
    shuffled: list[Image.Image]
    first: list[dict]
    second: list[dict]
    sizes: E2ESizes | FamilySizes

    def under_new_prefix(self, seed: int) -> list[dict]:
        """``second``'s images in its order under a system prefix and question of ``seed`` (the
        prompt's length is ``second``'s; its text differs from the first token on)."""
        s = self.sizes
        return synthetic.image_request(self.shuffled, s.prefix_words + 3, s.question_words, self.fillers, seed)


def build(sizes: E2ESizes, device: torch.device, dtype: torch.dtype, image_seed: int = 10) -> Workload:
    """The LLaVA model of ``sizes.shape`` in ``dtype`` on ``device`` (seed 0) and ``sizes.n_images``
    images of ``image_seed``."""
    text, vision = synthetic.llava_configs(sizes.shape, max_positions=max(65536, 2 * sizes.long_context))
    model = never_stopping(random_llava(text, vision, device, dtype, seed=0))
    return requests(model, synthetic.llava_vocabulary(text.vocab_size).fillers, sizes, image_seed)


def build_family(name: str, sizes: FamilySizes, device: torch.device, dtype: torch.dtype,
                 image_seed: int = 10) -> Workload:
    """The model of ``family_models.SHAPES[name]`` in ``dtype`` on ``device`` (seed 0) and
    ``sizes.n_images`` images of the shape's side, of ``image_seed``."""
    shape = family_models.SHAPES[name]
    text, vision = shape.configs(name)
    model = never_stopping(random_model(text, vision, device, dtype, seed=0))
    return requests(model, shape.vocabulary().fillers, sizes, image_seed, side=shape.vision.image_side)


def never_stopping(model):
    """``model`` without EOS ids: a request always generates the length asked for."""
    model.assets = dataclasses.replace(model.assets, eos_token_ids=frozenset())
    return model


def requests(model, fillers: range, sizes: E2ESizes | FamilySizes, image_seed: int,
             side: int | None = None) -> Workload:
    """``first`` and ``second`` over ``sizes.n_images`` fresh images of ``image_seed`` for ``model``,
    ``side`` pixels square (default: the tower's input side)."""
    images = synthetic.random_images(sizes.n_images, side or model.config.image_size, seed=image_seed)
    order = torch.randperm(sizes.n_images, generator=torch.Generator().manual_seed(4))
    shuffled = [images[i] for i in order]
    first = synthetic.image_request(images, sizes.prefix_words, sizes.question_words, fillers, 1)
    second = synthetic.image_request(shuffled, sizes.prefix_words + 3, sizes.question_words, fillers, 2)
    return Workload(model, fillers, images, shuffled, first, second, sizes)
