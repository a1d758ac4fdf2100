"""The tagged-pages task: pages rendered with Pillow, multi-page requests, questions, splits.

A page (64x64 RGB, an 8x8 grid of 8-pixel cells) holds four coloured fields, each a 3-character
code written in one colour (two field slots per row: cells 0-2 and 4-6), plus a few grey
distractor characters. A request shows 1-8 pages; the text just before each page names it with a
tag ("ant", "bee", ...) that is new in every request, and the question names a page by its tag
and a colour: "bee red?" -> the red code of the page tagged bee. A two-page question asks for two
codes: "bee red and cat blue?" -> "K7Q 4ZB". The asked colour also appears on other pages of the
request whenever it can, so the colour alone does not identify the field.

Why stale KV hurts (see docs/quality/task.md): nothing on a page says which tag it carries, so the page's
image tokens can only learn "I belong to page bee" by attending to the text before them. KV
computed under another prefix (another tag, or a one-image wrapper with no tag) carries the wrong
membership, while the colour and the code (read by the vision tower) stay right.

Everything is deterministic from a seed: page i of a split and request i of a split each come
from their own ``random.Random`` seeded with a string, so pools and request lists can be built in
any order or in parallel. Pages are assigned to splits by a hash of their content, so the splits
never share a page.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw

from .font import GLYPH_CHARS, glyph_mask

IMAGE_SIZE = 64
CELL_SIZE = 8
GRID_SIZE = IMAGE_SIZE // CELL_SIZE
CODE_LENGTH = 3
FIELDS_PER_PAGE = 4
DISTRACTORS_PER_PAGE = 6
SLOT_COLUMNS = (0, 4)
MAX_PAGES = 8
CODE_ALPHABET = GLYPH_CHARS
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (0, 150, 0),
    "blue": (20, 60, 230),
    "orange": (240, 140, 0),
    "purple": (150, 30, 190),
    "pink": (240, 60, 170),
}
DISTRACTOR_RGB = (150, 150, 150)
BACKGROUND_RGB = (255, 255, 255)
TAGS = ("ant", "bee", "cat", "dog", "elk", "fox", "gnu", "hen", "owl", "pig", "ram", "yak")
SPLITS = ("train", "val", "test")
# page-content hash bucket (mod 10) -> split: 80% / 10% / 10% of all possible pages
_SPLIT_OF_BUCKET = ("train",) * 8 + ("val", "test")


@dataclass(frozen=True, slots=True)
class Field:
    """A code written in one colour in cells (row, column) .. (row, column + CODE_LENGTH - 1)."""

    colour: str
    code: str
    row: int
    column: int


@dataclass(frozen=True, slots=True)
class Page:
    """One page: its fields (distinct colours) and grey distractor characters (row, column, char)."""

    fields: tuple[Field, ...]
    distractors: tuple[tuple[int, int, str], ...]

    @property
    def colours(self) -> tuple[str, ...]:
        return tuple(field.colour for field in self.fields)

    def code_of(self, colour: str) -> str:
        """The code written in ``colour``; KeyError when the page has no field of that colour."""
        for field in self.fields:
            if field.colour == colour:
                return field.code
        raise KeyError(f"page has no {colour} field")

    @property
    def key(self) -> str:
        """Canonical text of the page's content (two pages render alike iff their keys are equal)."""
        fields = ";".join(f"{f.colour}:{f.code}@{f.row},{f.column}" for f in self.fields)
        distractors = ";".join(f"{char}@{row},{column}" for row, column, char in self.distractors)
        return f"{fields}|{distractors}"

    @property
    def split(self) -> str:
        """The split this page belongs to (a hash of its content decides)."""
        digest = hashlib.sha256(self.key.encode()).digest()
        return _SPLIT_OF_BUCKET[int.from_bytes(digest[:4], "little") % 10]

    def render(self) -> Image.Image:
        """The page as a 64x64 RGB image: one glyph per 8x8 cell, offset (1, 1) inside the cell."""
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND_RGB)
        draw = ImageDraw.Draw(image)
        for field in self.fields:
            for offset, char in enumerate(field.code):
                _draw_char(draw, field.row, field.column + offset, char, COLOURS[field.colour])
        for row, column, char in self.distractors:
            _draw_char(draw, row, column, char, DISTRACTOR_RGB)
        return image


def _draw_char(draw: ImageDraw.ImageDraw, row: int, column: int, char: str, rgb: tuple[int, int, int]) -> None:
    draw.bitmap((column * CELL_SIZE + 1, row * CELL_SIZE + 1), glyph_mask(char), fill=rgb)


def random_page(rng: random.Random) -> Page:
    """A page drawn from ``rng``: 4 of the 6 colours in 4 of the 16 slots, distractors elsewhere."""
    slots = rng.sample([(row, column) for row in range(GRID_SIZE) for column in SLOT_COLUMNS], FIELDS_PER_PAGE)
    colours = rng.sample(sorted(COLOURS), FIELDS_PER_PAGE)
    fields = tuple(
        Field(colour, "".join(rng.choices(CODE_ALPHABET, k=CODE_LENGTH)), row, column)
        for colour, (row, column) in zip(colours, slots)
    )
    used = {(f.row, f.column + offset) for f in fields for offset in range(CODE_LENGTH)}
    free = [(row, column) for row in range(GRID_SIZE) for column in range(GRID_SIZE) if (row, column) not in used]
    cells = sorted(rng.sample(free, DISTRACTORS_PER_PAGE))
    distractors = tuple((row, column, rng.choice(CODE_ALPHABET)) for row, column in cells)
    return Page(fields, distractors)


def page_for(seed: int, split: str, index: int) -> Page:
    """Page ``index`` of ``split``: the first page drawn from its own stream that hashes into the split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    rng = random.Random(f"quality-page:{seed}:{split}:{index}")
    while True:
        page = random_page(rng)
        if page.split == split:
            return page


@dataclass(frozen=True, slots=True)
class Ask:
    """One part of a question: the field of colour ``colour`` on the page at ``position``."""

    position: int
    colour: str


@dataclass(frozen=True, slots=True)
class Request:
    """Pages in order with their tags, and the question (one or two asks).

    ``page_ids[i]`` indexes the page pool of ``split`` (``pages[i]`` is that page).
    ``followups``: further questions asked in later turns of the same conversation (training only:
    more answer tokens per forward pass; evaluation asks the first question alone).
    """

    split: str
    page_ids: tuple[int, ...]
    pages: tuple[Page, ...]
    tags: tuple[str, ...]
    asks: tuple[Ask, ...]
    followups: tuple[tuple[Ask, ...], ...] = ()

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    def answer_to(self, asks: Sequence[Ask]) -> str:
        return " ".join(self.pages[ask.position].code_of(ask.colour) for ask in asks)

    def question_for(self, asks: Sequence[Ask]) -> str:
        return " and ".join(f"{self.tags[ask.position]} {ask.colour}" for ask in asks) + "?"

    @property
    def answer(self) -> str:
        return self.answer_to(self.asks)

    @property
    def question(self) -> str:
        return self.question_for(self.asks)

    def text_before_page(self, position: int) -> str:
        """The text part just before page ``position``: its tag (after a space, except the first)."""
        return self.tags[position] if position == 0 else " " + self.tags[position]

    def question_text(self) -> str:
        """The text part after the last page."""
        return " " + self.question

    def messages(self, images: Sequence | None = None) -> list[dict]:
        """One user message, OpenAI-style parts: tag, page, tag, page, ..., question.

        ``images``: one payload per page (path, bytes, PIL image); default: the rendered pages.
        """
        images = [page.render() for page in self.pages] if images is None else list(images)
        parts: list[dict] = []
        for position, image in enumerate(images):
            parts.append({"type": "text", "text": self.text_before_page(position)})
            parts.append({"type": "image", "image": image})
        parts.append({"type": "text", "text": self.question_text()})
        return [{"role": "user", "content": parts}]


def _pick_colour(pages: Sequence[Page], position: int, rng: random.Random) -> str:
    """A colour of page ``position`` that some other page also has (a distractor), when there is one."""
    others = {colour for index, page in enumerate(pages) if index != position for colour in page.colours}
    shared = sorted(set(pages[position].colours) & others)
    return rng.choice(shared or sorted(pages[position].colours))


def _random_asks(pages: Sequence[Page], pair_fraction: float, rng: random.Random) -> tuple[Ask, ...]:
    num_asks = 2 if len(pages) >= 2 and rng.random() < pair_fraction else 1
    positions = rng.sample(range(len(pages)), num_asks)
    return tuple(Ask(position, _pick_colour(pages, position, rng)) for position in positions)


def make_request(
    pool: Sequence[Page],
    split: str,
    seed: int,
    index: int,
    *,
    min_pages: int = 1,
    max_pages: int = MAX_PAGES,
    pair_fraction: float = 0.3,
    max_followups: int = 0,
) -> Request:
    """Request ``index`` over ``pool`` (the pages of ``split``), deterministic from its arguments.

    1..8 distinct pages drawn uniformly from the pool, distinct tags, and with probability
    ``pair_fraction`` (when there are at least two pages) a two-page question; then 0 to
    ``max_followups`` follow-up questions (drawn last: they never change the rest).
    """
    if not 1 <= min_pages <= max_pages <= min(MAX_PAGES, len(TAGS), len(pool)):
        raise ValueError(f"need 1 <= min_pages <= max_pages <= {MAX_PAGES} pages, pool {len(pool)}")
    rng = random.Random(f"quality-request:{seed}:{split}:{index}:{min_pages}:{max_pages}:{pair_fraction}")
    num_pages = rng.randint(min_pages, max_pages)
    page_ids = tuple(rng.sample(range(len(pool)), num_pages))
    pages = tuple(pool[page_id] for page_id in page_ids)
    tags = tuple(rng.sample(TAGS, num_pages))
    asks = _random_asks(pages, pair_fraction, rng)
    num_followups = rng.randint(0, max_followups) if max_followups else 0
    questions = [asks]
    for _ in range(num_followups):
        for _attempt in range(4):  # a repeated question could be answered by copying the earlier answer
            followup = _random_asks(pages, pair_fraction, rng)
            if followup not in questions:
                break
        questions.append(followup)
    followups = tuple(questions[1:])
    return Request(split, page_ids, pages, tags, asks, followups)


def retagged_request(request: Request, salt: int) -> Request:
    """The same pages seen earlier in another session: shuffled order and other tags.

    Each page gets a tag different from its tag in ``request`` (a changed prefix for every page);
    the asks follow their pages. Deterministic from ``request`` and ``salt``.
    """
    rng = random.Random(f"quality-retag:{salt}:{request.split}:{request.page_ids}:{request.tags}")
    order = list(range(request.num_pages))
    rng.shuffle(order)
    tags: list[str] = []
    for position in order:
        choices = [tag for tag in TAGS if tag not in tags and tag != request.tags[position]]
        tags.append(rng.choice(choices))
    new_position = {old: new for new, old in enumerate(order)}
    asks = tuple(Ask(new_position[ask.position], ask.colour) for ask in request.asks)
    return Request(
        request.split,
        tuple(request.page_ids[old] for old in order),
        tuple(request.pages[old] for old in order),
        tuple(tags),
        asks,
    )
