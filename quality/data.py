"""Page pools as pixel arrays, requests as token ids, and the training batch stream.

A pool is the first ``size`` pages of a split, rendered once (in several processes when asked)
into one uint8 array; training and evaluation gather pages from it by id, on the GPU when there is
one, so rendering never sits on the training path. Requests are tokenized exactly as the chat
template renders them (``prompt_text`` equals the template's output; a test checks it), with each
``<image>`` expanded to the page's 64 image tokens as transformers' LlavaProcessor does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from quality.generator import IMAGE_SIZE, MAX_PAGES, Page, Request, make_request, page_for
from quality.model_config import CLIP_MEAN, CLIP_STD, NUM_IMAGE_TOKENS
from quality.tokenizer import BOS, EOS, IMAGE_TOKEN, PAD

IGNORE_INDEX = -100
PAD_MULTIPLE = 64


@dataclass(frozen=True)
class PagePool:
    """Pages 0..size-1 of a split and their pixels: ``pixels`` uint8, shape [size, 64, 64, 3]."""

    seed: int
    split: str
    pages: tuple[Page, ...]
    pixels: np.ndarray

    def requests(self, count: int, *, start: int = 0, **options) -> list[Request]:
        """Requests start..start+count-1 of this split (``options``: see ``make_request``)."""
        return [make_request(self.pages, self.split, self.seed, index, **options) for index in range(start, start + count)]


def _render_range(seed: int, split: str, start: int, stop: int) -> tuple[list[Page], bytes]:
    pages = [page_for(seed, split, index) for index in range(start, stop)]
    pixels = np.stack([np.asarray(page.render(), dtype=np.uint8) for page in pages])
    return pages, pixels.tobytes()


def build_pool(seed: int, split: str, size: int, processes: int = 1) -> PagePool:
    """Generate and render pages 0..size-1 of ``split`` (``processes`` > 1: in a process pool)."""
    chunk = max(1, math.ceil(size / max(1, processes) / 4))
    ranges = [(start, min(size, start + chunk)) for start in range(0, size, chunk)]
    if processes > 1 and len(ranges) > 1:
        with ProcessPoolExecutor(processes) as executor:
            parts = list(executor.map(_render_range, *zip(*[(seed, split, a, b) for a, b in ranges])))
    else:
        parts = [_render_range(seed, split, a, b) for a, b in ranges]
    pages = tuple(page for part_pages, _ in parts for page in part_pages)
    pixels = np.frombuffer(bytearray(b"".join(blob for _, blob in parts)), dtype=np.uint8)
    return PagePool(seed, split, pages, pixels.reshape(size, IMAGE_SIZE, IMAGE_SIZE, 3))


def normalize_pixels(pixels: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pages [n, 64, 64, 3] -> CLIP-normalized ``pixel_values`` [n, 3, 64, 64] in ``dtype``.

    Equals the CLIPImageProcessor of the model folder on 64x64 RGB inputs (resize and crop are
    identities there): x / 255, then (x - mean) / std, in float32.
    """
    mean = torch.tensor(CLIP_MEAN, device=pixels.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=pixels.device).view(1, 3, 1, 1)
    values = pixels.permute(0, 3, 1, 2).float() / 255.0
    return ((values - mean) / std).to(dtype)


def prompt_text(request: Request, answer: str | None = None) -> str:
    """The chat template's rendering of ``request.messages()`` with the generation prompt, or of
    the whole conversation ending in ``answer</s>`` when ``answer`` is given."""
    pages = "".join(request.text_before_page(position) + IMAGE_TOKEN + "\n" for position in range(request.num_pages))
    text = f"{BOS}USER: {pages}{request.question_text()} ASSISTANT:"
    return text if answer is None else f"{text} {answer}{EOS}"


@dataclass(frozen=True, slots=True)
class EncodedRequest:
    """Token ids with images expanded; ids[:num_prompt_tokens] is the prompt (generation prompt included)."""

    ids: np.ndarray  # int64 [num_tokens]
    num_prompt_tokens: int
    page_ids: tuple[int, ...]


class PromptEncoder:
    """Tokenizes requests with the task tokenizer and expands image placeholders."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = tokenizer.token_to_id(IMAGE_TOKEN)
        self.pad_token_id = tokenizer.token_to_id(PAD)
        self.eos_token_id = tokenizer.token_to_id(EOS)

    def _expand(self, ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        repeats = np.where(ids == self.image_token_id, NUM_IMAGE_TOKENS, 1)
        return np.repeat(ids, repeats)

    def encode(self, requests: Sequence[Request], with_answer: bool) -> list[EncodedRequest]:
        """Prompt ids (and, ``with_answer``, the answer and EOS after them) of each request."""
        prompts = self.tokenizer.encode_batch([prompt_text(r) for r in requests], add_special_tokens=False)
        if not with_answer:
            return [EncodedRequest(self._expand(p.ids), 0, r.page_ids) for p, r in zip(prompts, requests)]
        fulls = self.tokenizer.encode_batch([prompt_text(r, r.answer) for r in requests], add_special_tokens=False)
        encoded = []
        for prompt, full, request in zip(prompts, fulls, requests):
            if full.ids[: len(prompt.ids)] != prompt.ids:
                raise ValueError(f"the answer changed the prompt's tokens: {prompt_text(request, request.answer)!r}")
            num_prompt = len(prompt.ids) + (NUM_IMAGE_TOKENS - 1) * request.num_pages
            encoded.append(EncodedRequest(self._expand(full.ids), num_prompt, request.page_ids))
        return encoded

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True).strip()


def collate_for_training(encoded: Sequence[EncodedRequest], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` [B, T] int64 (T a multiple of 64; labels are the
    answer tokens and EOS, -100 elsewhere) and ``page_ids`` [num_images] int64 in the order the
    images appear (row by row), as LlavaForConditionalGeneration consumes ``pixel_values``."""
    length = max(len(item.ids) for item in encoded)
    length = math.ceil(length / PAD_MULTIPLE) * PAD_MULTIPLE
    input_ids = np.full((len(encoded), length), pad_token_id, dtype=np.int64)
    labels = np.full((len(encoded), length), IGNORE_INDEX, dtype=np.int64)
    for row, item in enumerate(encoded):
        input_ids[row, : len(item.ids)] = item.ids
        labels[row, item.num_prompt_tokens : len(item.ids)] = item.ids[item.num_prompt_tokens :]
    page_ids = [page_id for item in encoded for page_id in item.page_ids]
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "page_ids": torch.tensor(page_ids, dtype=torch.int64),
    }


def max_pages_for(progress: float, warmup_fraction: float, cap: int = MAX_PAGES) -> int:
    """Curriculum: up to 2 pages at the start, ``cap`` once ``progress`` reaches ``warmup_fraction``."""
    if warmup_fraction <= 0:
        return cap
    return min(cap, 2 + int((MAX_PAGES - 1) * progress / warmup_fraction))


class TrainStream(torch.utils.data.IterableDataset):
    """Endless training batches over a train pool, length-bucketed to cut padding.

    Each worker draws ``bucket`` x ``batch_size`` requests, sorts them by length and yields
    ``bucket`` batches in random order. ``progress`` (a shared ``multiprocessing.Value``, 0..1)
    drives the page-count curriculum.
    """

    def __init__(self, pages: Sequence[Page], seed: int, tokenizer: Tokenizer, batch_size: int,
                 progress, curriculum_fraction: float = 0.2, bucket: int = 8, max_pages: int = MAX_PAGES) -> None:
        self.pages, self.seed, self.tokenizer = tuple(pages), seed, tokenizer
        self.batch_size, self.progress, self.bucket = batch_size, progress, bucket
        self.curriculum_fraction, self.max_pages = curriculum_fraction, max_pages

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        encoder = PromptEncoder(self.tokenizer)
        shuffle = random.Random(f"quality-stream:{self.seed}:{worker}")
        group = self.bucket * self.batch_size
        for round_index in range(worker, 1 << 40, num_workers):
            max_pages = max_pages_for(self.progress.value, self.curriculum_fraction, self.max_pages)
            start = round_index * group
            requests = [make_request(self.pages, "train", self.seed, index, max_pages=max_pages)
                        for index in range(start, start + group)]
            encoded = sorted(encoder.encode(requests, with_answer=True), key=lambda item: len(item.ids))
            batches = [encoded[i : i + self.batch_size] for i in range(0, group, self.batch_size)]
            shuffle.shuffle(batches)
            for batch in batches:
                yield collate_for_training(batch, encoder.pad_token_id)
