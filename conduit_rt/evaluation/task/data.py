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

from .generator import COLOURS, GRID_SIZE, IMAGE_SIZE, MAX_PAGES, TAGS, Page, Request, make_request, page_for
from .model_config import CLIP_MEAN, CLIP_STD, NUM_IMAGE_TOKENS
from .tokenizer import BOS, EOS, IMAGE_TOKEN, PAD

IGNORE_INDEX = -100
FIELD_HINT_TOKENS = 3  # the question's last tokens (colour, "?", " ASSISTANT:") trained to look at the asked fields
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


def conversation_text(request: Request) -> tuple[str, list[tuple[int, int]]]:
    """The whole training conversation (first question, answer, then each follow-up turn) as the
    chat template renders it, and the character spans [start, stop) of the answers (each with its
    leading space and its EOS): the tokens trained on."""
    text = prompt_text(request)
    spans = []
    for turn, asks in enumerate((request.asks, *request.followups)):
        if turn:
            text += f"USER: {request.question_for(asks)} ASSISTANT:"
        answer = f" {request.answer_to(asks)}{EOS}"
        spans.append((len(text), len(text) + len(answer)))
        text += answer
    return text, spans


@dataclass(frozen=True, slots=True)
class EncodedRequest:
    """Token ids with images expanded, and which of them are trained on (answers and EOS)."""

    ids: np.ndarray  # int64 [num_tokens]
    label_mask: np.ndarray | None  # bool [num_tokens]; None for a prompt alone
    page_ids: tuple[int, ...]
    request: Request


class PromptEncoder:
    """Tokenizes requests with the task tokenizer and expands image placeholders."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = tokenizer.token_to_id(IMAGE_TOKEN)
        self.pad_token_id = tokenizer.token_to_id(PAD)
        self.eos_token_id = tokenizer.token_to_id(EOS)

    def _repeats(self, ids: np.ndarray) -> np.ndarray:
        return np.where(ids == self.image_token_id, NUM_IMAGE_TOKENS, 1)

    def encode(self, requests: Sequence[Request], with_answer: bool) -> list[EncodedRequest]:
        """The prompt of each request (generation prompt included), or, ``with_answer``, the whole
        training conversation (``conversation_text``) with its answer tokens marked."""
        if not with_answer:
            prompts = self.tokenizer.encode_batch([prompt_text(r) for r in requests], add_special_tokens=False)
            encoded = []
            for prompt, request in zip(prompts, requests):
                ids = np.asarray(prompt.ids, dtype=np.int64)
                encoded.append(EncodedRequest(np.repeat(ids, self._repeats(ids)), None, request.page_ids, request))
            return encoded
        texts, all_spans = zip(*[conversation_text(r) for r in requests])
        encoded = []
        for encoding, spans, request in zip(self.tokenizer.encode_batch(list(texts), add_special_tokens=False), all_spans, requests):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            starts, stops = np.asarray(encoding.offsets, dtype=np.int64).T
            mask = np.zeros(len(ids), dtype=bool)
            for start, stop in spans:
                mask |= (starts >= start) & (stops <= stop)
            repeats = self._repeats(ids)
            encoded.append(EncodedRequest(np.repeat(ids, repeats), np.repeat(mask, repeats), request.page_ids, request))
        return encoded

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True).strip()


def collate_for_training(encoded: Sequence[EncodedRequest], pad_token_id: int, image_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` [B, T] int64 (T a multiple of 64; labels are the
    answers' tokens and EOS, -100 elsewhere) and ``page_ids`` [num_images] int64 in the order the
    images appear (row by row), as LlavaForConditionalGeneration consumes ``pixel_values``.

    For the context probe (``context_probe.py``): ``image_tags`` [num_images], the tag index of
    each image's page; per question turn, ``query_rows``/``query_positions`` (the token before its
    answer) and ``query_tags``/``query_colours`` of its first ask [num_questions]; for
    ``attention_hint.py``, per answer character, ``hint_rows``/``hint_positions`` (the token that
    predicts it) and ``hint_targets`` (the position of its cell) [num_answer_chars]; per question
    turn and each of its last ``FIELD_HINT_TOKENS`` prompt tokens, ``field_rows``/``field_positions``
    [num_field_queries], and for each cell of the turn's asked fields ``field_queries`` (index into
    the former) and ``field_targets`` (its position) [num_pairs]; all int64."""
    length = max(len(item.ids) for item in encoded)
    length = math.ceil(length / PAD_MULTIPLE) * PAD_MULTIPLE
    input_ids = np.full((len(encoded), length), pad_token_id, dtype=np.int64)
    labels = np.full((len(encoded), length), IGNORE_INDEX, dtype=np.int64)
    for row, item in enumerate(encoded):
        input_ids[row, : len(item.ids)] = item.ids
        labels[row, : len(item.ids)][item.label_mask] = item.ids[item.label_mask]
    page_ids = [page_id for item in encoded for page_id in item.page_ids]
    image_tags = [TAGS.index(tag) for item in encoded for tag in item.request.tags]
    colour_index = {colour: index for index, colour in enumerate(COLOURS)}
    query, hints = [], []  # (row, position, tag, colour), (row, position, target)
    field_queries, field_cells = [], []  # (row, position), (query index, cell position)
    for row, item in enumerate(encoded):
        request = item.request
        answer_starts = np.flatnonzero(item.label_mask & ~np.r_[False, item.label_mask[:-1]])
        is_image = item.ids == image_token_id
        image_starts = np.flatnonzero(is_image & ~np.r_[False, is_image[:-1]])
        for start, asks in zip(answer_starts, (request.asks, *request.followups)):
            query.append((row, int(start) - 1, TAGS.index(request.tags[asks[0].position]), colour_index[asks[0].colour]))
            cells = []
            for index, ask in enumerate(asks):  # answer tokens: one per code character, then EOS
                field = next(f for f in request.pages[ask.position].fields if f.colour == ask.colour)
                first_cell = int(image_starts[ask.position]) + field.row * GRID_SIZE + field.column
                for offset in range(len(field.code)):
                    hints.append((row, int(start) + index * len(field.code) + offset - 1, first_cell + offset))
                    cells.append(first_cell + offset)
            for position in range(int(start) - FIELD_HINT_TOKENS, int(start)):
                field_cells += [(len(field_queries), cell) for cell in cells]
                field_queries.append((row, position))
    query_columns = torch.tensor(query, dtype=torch.int64).T
    hint_columns = torch.tensor(hints, dtype=torch.int64).T
    field_query_columns = torch.tensor(field_queries, dtype=torch.int64).T
    field_cell_columns = torch.tensor(field_cells, dtype=torch.int64).T
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "page_ids": torch.tensor(page_ids, dtype=torch.int64),
        "image_tags": torch.tensor(image_tags, dtype=torch.int64),
        "query_rows": query_columns[0], "query_positions": query_columns[1],
        "query_tags": query_columns[2], "query_colours": query_columns[3],
        "hint_rows": hint_columns[0], "hint_positions": hint_columns[1], "hint_targets": hint_columns[2],
        "field_rows": field_query_columns[0], "field_positions": field_query_columns[1],
        "field_queries": field_cell_columns[0], "field_targets": field_cell_columns[1],
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
                 progress, curriculum_fraction: float = 0.2, bucket: int = 8, max_pages: int = MAX_PAGES,
                 max_followups: int = 0) -> None:
        self.pages, self.seed, self.tokenizer = tuple(pages), seed, tokenizer
        self.batch_size, self.progress, self.bucket = batch_size, progress, bucket
        self.curriculum_fraction, self.max_pages, self.max_followups = curriculum_fraction, max_pages, max_followups

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        encoder = PromptEncoder(self.tokenizer)
        shuffle = random.Random(f"quality-stream:{self.seed}:{worker}")
        group = self.bucket * self.batch_size
        for round_index in range(worker, 1 << 40, num_workers):
            max_pages = max_pages_for(self.progress.value, self.curriculum_fraction, self.max_pages)
            start = round_index * group
            requests = [make_request(self.pages, "train", self.seed, index, max_pages=max_pages,
                                     max_followups=self.max_followups)
                        for index in range(start, start + group)]
            encoded = sorted(encoder.encode(requests, with_answer=True), key=lambda item: len(item.ids))
            batches = [encoded[i : i + self.batch_size] for i in range(0, group, self.batch_size)]
            shuffle.shuffle(batches)
            for batch in batches:
                yield collate_for_training(batch, encoder.pad_token_id, encoder.image_token_id)
