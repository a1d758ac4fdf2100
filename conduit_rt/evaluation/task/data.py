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

from .families import family_layout, make_request
from .generator import COLOURS, LAYOUTS, MAX_PAGES, TAGS, Page, Question, Request, page_for
from .model_config import CLIP_MEAN, CLIP_STD
from .tokenizer import BOS, EOS, IM_END, IM_START, IMAGE_PAD, IMAGE_TOKEN, PAD, QWEN_IMAGE_PART, QWEN_PAD

IGNORE_INDEX = -100
FIELD_HINT_TOKENS = 3  # the question's last tokens (colour, "?", " ASSISTANT:") trained to look at the asked fields
PAD_MULTIPLE = 64


@dataclass(frozen=True)
class PagePool:
    """Pages 0..size-1 of a split in one layout (``generator.LAYOUTS``) and their pixels: ``pixels``
    uint8, shape [size, S, S, 3] with S = 8 * the layout's grid."""

    seed: int
    split: str
    pages: tuple[Page, ...]
    pixels: np.ndarray
    layout: str = "dense"

    def requests(self, count: int, *, start: int = 0, family: str = "lookup", **options) -> list[Request]:
        """Requests start..start+count-1 of ``family`` on this split (``options``: see
        ``families.make_request``); the family must draw its pages from this pool's layout."""
        if family_layout(family) != self.layout:
            raise ValueError(f"family {family!r} draws {family_layout(family)} pages, this pool holds {self.layout} ones")
        return [make_request(self.pages, self.split, self.seed, index, family=family, **options)
                for index in range(start, start + count)]


def _render_range(seed: int, split: str, start: int, stop: int, layout: str) -> tuple[list[Page], bytes]:
    pages = [page_for(seed, split, index, layout) for index in range(start, stop)]
    pixels = np.stack([np.asarray(page.render(), dtype=np.uint8) for page in pages])
    return pages, pixels.tobytes()


def build_pool(seed: int, split: str, size: int, processes: int = 1, layout: str = "dense") -> PagePool:
    """Generate and render pages 0..size-1 of ``split`` in ``layout`` (``processes`` > 1: in a process pool)."""
    chunk = max(1, math.ceil(size / max(1, processes) / 4))
    ranges = [(start, min(size, start + chunk), layout) for start in range(0, size, chunk)]
    if processes > 1 and len(ranges) > 1:
        with ProcessPoolExecutor(processes) as executor:
            parts = list(executor.map(_render_range, *zip(*[(seed, split, *r) for r in ranges])))
    else:
        parts = [_render_range(seed, split, *r) for r in ranges]
    pages = tuple(page for part_pages, _ in parts for page in part_pages)
    pixels = np.frombuffer(bytearray(b"".join(blob for _, blob in parts)), dtype=np.uint8)
    side = LAYOUTS[layout].grid * 8
    return PagePool(seed, split, pages, pixels.reshape(size, side, side, 3), layout)


def build_pools(seed: int, split: str, size: int, families, processes: int = 1) -> dict[str, PagePool]:
    """One pool per layout that ``families`` draw from, keyed by family (families sharing a layout
    share its pool)."""
    by_layout: dict[str, PagePool] = {}
    for family in families:
        layout = family_layout(family)
        if layout not in by_layout:
            by_layout[layout] = build_pool(seed, split, size, processes, layout)
    return {family: by_layout[family_layout(family)] for family in families}


def normalize_pixels(pixels: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pages [n, S, S, 3] -> CLIP-normalized ``pixel_values`` [n, 3, S, S] in ``dtype``.

    Equals the CLIPImageProcessor of the model folder on 64x64 RGB inputs (resize and crop are
    identities there): x / 255, then (x - mean) / std, in float32.
    """
    mean = torch.tensor(CLIP_MEAN, device=pixels.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=pixels.device).view(1, 3, 1, 1)
    values = pixels.permute(0, 3, 1, 2).float() / 255.0
    return ((values - mean) / std).to(dtype)


@dataclass(frozen=True, slots=True)
class ChatFrame:
    """The text a chat template puts around a request's parts, its answers and later turns.

    A prompt is ``start`` + (text before page, ``image``) per page + the question text + ``prompt_end``;
    an answer is ``answer_prefix`` + answer + ``turn_end``; a follow-up turn is ``next_turn`` +
    question + ``prompt_end``.
    """

    start: str
    image: str
    prompt_end: str
    answer_prefix: str
    turn_end: str
    next_turn: str
    image_token: str  # the placeholder in ``image`` that stands for one visual token (expanded per page)
    pad_token: str
    hint_tokens: int = 3  # prompt tokens before each answer that the field hint trains: the question's
    #                       last word, "?" and the tokens the frame puts between it and the answer


LLAVA_FRAME = ChatFrame(start=f"{BOS}USER: ", image=IMAGE_TOKEN + "\n", prompt_end=" ASSISTANT:", answer_prefix=" ",
                        turn_end=EOS, next_turn="USER: ", image_token=IMAGE_TOKEN, pad_token=PAD)
# tokenizer.QWEN_CHAT_TEMPLATE: answers follow the newline of the assistant turn, with no space
QWEN_FRAME = ChatFrame(start=f"{IM_START}user\n", image=QWEN_IMAGE_PART, prompt_end=f"{IM_END}\n{IM_START}assistant\n",
                       answer_prefix="", turn_end=IM_END, next_turn=f"\n{IM_START}user\n", image_token=IMAGE_PAD,
                       pad_token=QWEN_PAD, hint_tokens=7)  # colour, "?", <|im_end|>, "\n", <|im_start|>, assistant, "\n"


def prompt_text(request: Request, answer: str | None = None, frame: ChatFrame = LLAVA_FRAME) -> str:
    """The chat template's rendering of ``request.messages()`` with the generation prompt, or of
    the whole conversation ending in ``answer`` and the end of turn when ``answer`` is given."""
    pages = "".join(request.text_before_page(position) + frame.image for position in range(request.num_pages))
    text = f"{frame.start}{pages}{request.question_text()}{frame.prompt_end}"
    return text if answer is None else f"{text}{frame.answer_prefix}{answer}{frame.turn_end}"


def conversation_text(request: Request, frame: ChatFrame = LLAVA_FRAME) -> tuple[str, list[tuple[int, int]]]:
    """The whole training conversation (first question, answer, then each follow-up turn) as the
    chat template renders it, and the character spans [start, stop) of the answers (each with its
    leading space and its end of turn): the tokens trained on."""
    text = prompt_text(request, frame=frame)
    spans = []
    for turn, question in enumerate(request.questions):
        if turn:
            text += f"{frame.next_turn}{request.question_for(question)}{frame.prompt_end}"
        answer = f"{frame.answer_prefix}{request.answer_to(question)}{frame.turn_end}"
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
    """Tokenizes requests in a chat frame and expands each image placeholder to the page's tokens
    (one per glyph cell)."""

    def __init__(self, tokenizer: Tokenizer, frame: ChatFrame = LLAVA_FRAME) -> None:
        self.tokenizer, self.frame = tokenizer, frame
        self.image_token_id = tokenizer.token_to_id(frame.image_token)
        self.pad_token_id = tokenizer.token_to_id(frame.pad_token)
        self.eos_token_id = tokenizer.token_to_id(frame.turn_end)

    def _expand(self, ids: np.ndarray, request: Request, mask: np.ndarray | None = None):
        """``ids`` (and ``mask``) with the i-th image placeholder repeated page i's cell count times."""
        repeats = np.ones(len(ids), dtype=np.int64)
        placeholders = np.flatnonzero(ids == self.image_token_id)
        if len(placeholders) != request.num_pages:
            raise ValueError(f"{len(placeholders)} image placeholders for {request.num_pages} pages")
        repeats[placeholders] = [page.num_cells for page in request.pages]
        return np.repeat(ids, repeats), None if mask is None else np.repeat(mask, repeats)

    def encode(self, requests: Sequence[Request], with_answer: bool) -> list[EncodedRequest]:
        """The prompt of each request (generation prompt included), or, ``with_answer``, the whole
        training conversation (``conversation_text``) with its answer tokens marked."""
        if not with_answer:
            texts = [prompt_text(r, frame=self.frame) for r in requests]
            encoded = []
            for prompt, request in zip(self.tokenizer.encode_batch(texts, add_special_tokens=False), requests):
                ids, _ = self._expand(np.asarray(prompt.ids, dtype=np.int64), request)
                encoded.append(EncodedRequest(ids, None, request.page_ids, request))
            return encoded
        texts, all_spans = zip(*[conversation_text(r, self.frame) for r in requests])
        encoded = []
        for encoding, spans, request in zip(self.tokenizer.encode_batch(list(texts), add_special_tokens=False), all_spans, requests):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            starts, stops = np.asarray(encoding.offsets, dtype=np.int64).T
            mask = np.zeros(len(ids), dtype=bool)
            for start, stop in spans:
                mask |= (starts >= start) & (stops <= stop)
            ids, mask = self._expand(ids, request, mask)
            encoded.append(EncodedRequest(ids, mask, request.page_ids, request))
        return encoded

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True).strip()


def _probe_targets(request: Request, question: Question) -> tuple[int, int]:
    """The context probe's targets at a question: the tag index of the page it names and the colour
    index it asks (IGNORE_INDEX where the question names none)."""
    if question.kind == "code":
        ask = question.asks[0]
        return TAGS.index(request.tags[ask.position]), list(COLOURS).index(ask.colour)
    if question.kind == "colours":
        return TAGS.index(request.tags[question.position]), IGNORE_INDEX
    return IGNORE_INDEX, IGNORE_INDEX


def collate_for_training(encoded: Sequence[EncodedRequest], pad_token_id: int, image_token_id: int,
                         hint_tokens: int = FIELD_HINT_TOKENS) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` [B, T] int64 (T a multiple of 64; labels are the
    answers' tokens and end of turn, -100 elsewhere) and ``page_ids`` [num_images] int64 in the order
    the images appear (row by row), as the models consume ``pixel_values``; ``image_tokens``
    [num_images], each image's visual token count.

    For the context probe (``context_probe.py``): ``image_tags`` [num_images], the tag index of
    each image's page; per question turn, ``query_rows``/``query_positions`` (the token before its
    answer) and ``query_tags``/``query_colours`` [num_questions] (-100 where the question names no
    page or colour); for ``attention_hint.py``, per answer token before the end of turn,
    ``hint_rows``/``hint_positions`` (the token that predicts it) and ``hint_targets`` (the position
    of the cell it reads, ``Request.reads_of``) [num_answer_tokens]; per question turn and each of
    its last ``hint_tokens`` prompt tokens, ``field_rows``/``field_positions``
    [num_field_queries], and for each cell the turn's answer needs (``Request.cells_of``)
    ``field_queries`` (index into the former) and ``field_targets`` (its position) [num_pairs]; all
    int64."""
    length = max(len(item.ids) for item in encoded)
    length = math.ceil(length / PAD_MULTIPLE) * PAD_MULTIPLE
    input_ids = np.full((len(encoded), length), pad_token_id, dtype=np.int64)
    labels = np.full((len(encoded), length), IGNORE_INDEX, dtype=np.int64)
    for row, item in enumerate(encoded):
        input_ids[row, : len(item.ids)] = item.ids
        labels[row, : len(item.ids)][item.label_mask] = item.ids[item.label_mask]
    page_ids = [page_id for item in encoded for page_id in item.page_ids]
    image_tokens = [page.num_cells for item in encoded for page in item.request.pages]
    image_tags = [TAGS.index(tag) for item in encoded for tag in item.request.tags]
    query, hints = [], []  # (row, position, tag, colour), (row, position, target)
    field_queries, field_cells = [], []  # (row, position), (query index, cell position)
    for row, item in enumerate(encoded):
        request = item.request
        answer_starts = np.flatnonzero(item.label_mask & ~np.r_[False, item.label_mask[:-1]])
        is_image = item.ids == image_token_id
        image_starts = np.flatnonzero(is_image & ~np.r_[False, is_image[:-1]])
        for start, question in zip(answer_starts, request.questions):
            start = int(start)
            query.append((row, start - 1, *_probe_targets(request, question)))
            for offset, (position, cell) in enumerate(request.reads_of(question)):
                hints.append((row, start + offset - 1, int(image_starts[position]) + cell))
            cells = [int(image_starts[position]) + cell for position, cell in request.cells_of(question)]
            for position in range(start - hint_tokens, start):
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
        "image_tokens": torch.tensor(image_tokens, dtype=torch.int64),
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


def batch_size_for(pages: Sequence[Page], batch_size: int) -> int:
    """Requests per batch over ``pages``: ``batch_size`` for 64-token pages, fewer for larger pages so
    that a batch holds about as many tokens."""
    return max(2, batch_size * 64 // pages[0].num_cells)


class TrainStream(torch.utils.data.IterableDataset):
    """Endless training batches over the train pools of some task families, length-bucketed to cut
    padding.

    ``pools``: family -> the pages its requests draw from (``families.FAMILIES``). Worker rounds
    take the families in turn, ``weights[family]`` rounds each (default 1); a round draws ``bucket`` batches of one family
    (``batch_size_for`` requests each), sorts them by length and yields them in random order, each
    with ``family`` (int64 scalar: the index of its family in ``pools``). ``progress`` (a shared
    ``multiprocessing.Value``, 0..1) drives the page-count curriculum.
    """

    def __init__(self, pools: dict[str, Sequence[Page]], seed: int, tokenizer: Tokenizer, batch_size: int,
                 progress, curriculum_fraction: float = 0.2, bucket: int = 8, max_pages: int = MAX_PAGES,
                 max_followups: int = 0, frame: ChatFrame = LLAVA_FRAME, weights: dict[str, int] | None = None) -> None:
        self.pools = {family: tuple(pages) for family, pages in pools.items()}
        weights = weights or {}
        self.schedule = [family for family in self.pools for _ in range(max(1, weights.get(family, 1)))]
        self.seed, self.tokenizer, self.frame = seed, tokenizer, frame
        self.batch_size, self.progress, self.bucket = batch_size, progress, bucket
        self.curriculum_fraction, self.max_pages, self.max_followups = curriculum_fraction, max_pages, max_followups

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        encoder = PromptEncoder(self.tokenizer, self.frame)
        shuffle = random.Random(f"quality-stream:{self.seed}:{worker}")
        families = list(self.pools)
        for round_index in range(worker, 1 << 40, num_workers):
            family_index = families.index(self.schedule[round_index % len(self.schedule)])
            pages = self.pools[families[family_index]]
            batch_size = batch_size_for(pages, self.batch_size)
            group = self.bucket * batch_size
            max_pages = max_pages_for(self.progress.value, self.curriculum_fraction, self.max_pages)
            start = round_index * group
            requests = [make_request(pages, "train", self.seed, index, family=families[family_index],
                                     max_pages=max_pages, max_followups=self.max_followups)
                        for index in range(start, start + group)]
            encoded = sorted(encoder.encode(requests, with_answer=True), key=lambda item: len(item.ids))
            batches = [encoded[i : i + batch_size] for i in range(0, group, batch_size)]
            shuffle.shuffle(batches)
            for batch in batches:
                collated = collate_for_training(batch, encoder.pad_token_id, encoder.image_token_id,
                                                self.frame.hint_tokens)
                collated["family"] = torch.tensor(family_index, dtype=torch.int64)
                yield collated
