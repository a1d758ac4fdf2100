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
SPARSE_DISTRACTORS = 6
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
    """One page: its fields (distinct colours) and grey distractor characters (row, column, char) on
    a canvas of ``grid`` x ``grid`` cells (one glyph cell = one visual token; cell index = row *
    grid + column)."""

    fields: tuple[Field, ...]
    distractors: tuple[tuple[int, int, str], ...]
    grid: int = GRID_SIZE

    @property
    def colours(self) -> tuple[str, ...]:
        return tuple(field.colour for field in self.fields)

    def code_of(self, colour: str) -> str:
        """The code written in ``colour``; KeyError when the page has no field of that colour."""
        return self.field_of(colour).code

    @property
    def key(self) -> str:
        """Canonical text of the page's content (two pages render alike iff their keys are equal)."""
        fields = ";".join(f"{f.colour}:{f.code}@{f.row},{f.column}" for f in self.fields)
        distractors = ";".join(f"{char}@{row},{column}" for row, column, char in self.distractors)
        canvas = "" if self.grid == GRID_SIZE else f"|{self.grid}"
        return f"{fields}|{distractors}{canvas}"

    @property
    def split(self) -> str:
        """The split this page belongs to (a hash of its content decides)."""
        digest = hashlib.sha256(self.key.encode()).digest()
        return _SPLIT_OF_BUCKET[int.from_bytes(digest[:4], "little") % 10]

    @property
    def num_cells(self) -> int:
        """Cells of the canvas: the page's visual tokens."""
        return self.grid * self.grid

    def field_of(self, colour: str) -> Field:
        """The field written in ``colour``; KeyError when the page has none."""
        for field in self.fields:
            if field.colour == colour:
                return field
        raise KeyError(f"page has no {colour} field")

    def cells_of(self, field: Field) -> tuple[int, ...]:
        """The cell indices of ``field``'s characters, in order."""
        return tuple(field.row * self.grid + field.column + offset for offset in range(len(field.code)))

    def render(self) -> Image.Image:
        """The page as a (grid * 8)-pixel square RGB image: one glyph per 8x8 cell, offset (1, 1)
        inside the cell."""
        size = self.grid * CELL_SIZE
        image = Image.new("RGB", (size, size), BACKGROUND_RGB)
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
    """A dense page drawn from ``rng``: 4 of the 6 colours in 4 of the 16 slots, distractors elsewhere."""
    slots = rng.sample([(row, column) for row in range(GRID_SIZE) for column in SLOT_COLUMNS], FIELDS_PER_PAGE)
    return _page_with_fields(rng, GRID_SIZE, slots, DISTRACTORS_PER_PAGE)


def random_sparse_page(rng: random.Random, grid: int, min_fields: int, max_fields: int) -> Page:
    """A mostly empty page of ``grid`` x ``grid`` cells: ``min_fields``..``max_fields`` fields of distinct
    colours anywhere on the canvas (never touching another field on its row), a few grey distractors,
    white elsewhere: the shape of a photo or a form, where a few small regions hold the answer."""
    num_fields = rng.randint(min_fields, max_fields)
    slots: list[tuple[int, int]] = []
    taken: set[tuple[int, int]] = set()
    while len(slots) < num_fields:
        row, column = rng.randrange(grid), rng.randrange(grid - CODE_LENGTH + 1)
        span = {(row, column + offset) for offset in range(-1, CODE_LENGTH + 1)}  # a blank cell each side
        if not span & taken:
            slots.append((row, column))
            taken |= span
    return _page_with_fields(rng, grid, slots, SPARSE_DISTRACTORS, grid_key=True)


def _page_with_fields(rng: random.Random, grid: int, slots: Sequence[tuple[int, int]], num_distractors: int,
                      grid_key: bool = False) -> Page:
    """Fields of distinct random colours and random codes in ``slots``, then grey distractor characters
    in cells no field uses."""
    colours = rng.sample(sorted(COLOURS), len(slots))
    fields = tuple(
        Field(colour, "".join(rng.choices(CODE_ALPHABET, k=CODE_LENGTH)), row, column)
        for colour, (row, column) in zip(colours, slots)
    )
    used = {(f.row, f.column + offset) for f in fields for offset in range(CODE_LENGTH)}
    free = [(row, column) for row in range(grid) for column in range(grid) if (row, column) not in used]
    cells = sorted(rng.sample(free, num_distractors))
    distractors = tuple((row, column, rng.choice(CODE_ALPHABET)) for row, column in cells)
    return Page(fields, distractors, grid)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a family's pages look: ``grid`` cells a side, and for sparse canvases the field count range
    (``max_fields`` 0: the dense 8x8 page of ``random_page``)."""

    grid: int
    min_fields: int = FIELDS_PER_PAGE
    max_fields: int = 0

    def draw(self, rng: random.Random) -> Page:
        if not self.max_fields:
            return random_page(rng)
        return random_sparse_page(rng, self.grid, self.min_fields, self.max_fields)


LAYOUTS: dict[str, Layout] = {
    "dense": Layout(GRID_SIZE),                 # 64 tokens, every cell written or a distractor
    "sparse": Layout(16, 4, 4),                 # 256 tokens, 12 field cells: ~93% background
    "poster": Layout(24, 3, 5),                 # 576 tokens (LLaVA-1.5's count), 9-15 field cells
}


def page_for(seed: int, split: str, index: int, layout: str = "dense") -> Page:
    """Page ``index`` of ``split`` in ``layout``: the first page drawn from its own stream that hashes
    into the split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, not {layout!r}")
    stream = f"quality-page:{seed}:{split}:{index}" + ("" if layout == "dense" else f":{layout}")
    rng = random.Random(stream)
    while True:
        page = LAYOUTS[layout].draw(rng)
        if page.split == split:
            return page


@dataclass(frozen=True, slots=True)
class Ask:
    """One part of a code question: the field of colour ``colour`` on the page at ``position``."""

    position: int
    colour: str


QUESTION_KINDS = ("code", "where", "colours")


@dataclass(frozen=True, slots=True)
class Question:
    """A question about a request's pages, by page position (tags are attached when it is rendered).

    ``kind``:
    - "code": the codes of ``asks`` (one or two fields): "bee red?" -> "K7Q", "bee red and cat
      blue?" -> "K7Q 4ZB";
    - "where": which page holds ``code``: "where K7Q?" -> "bee";
    - "colours": the colours of page ``position``'s fields in reading order: "bee colours?" ->
      "red blue pink".
    """

    kind: str
    asks: tuple[Ask, ...] = ()
    code: str = ""
    position: int = -1

    def moved(self, new_position: dict[int, int]) -> Question:
        """The same question after the pages moved (``new_position``: old -> new position)."""
        asks = tuple(Ask(new_position[ask.position], ask.colour) for ask in self.asks)
        position = new_position[self.position] if self.position >= 0 else -1
        return Question(self.kind, asks, self.code, position)


@dataclass(frozen=True, slots=True)
class Request:
    """Pages in order with their tags, and the questions about them.

    ``page_ids[i]`` indexes the page pool of ``split`` (``pages[i]`` is that page). ``questions[0]``
    is the question asked; the rest are follow-ups asked in later turns of the same conversation
    (training only: more answer tokens per forward pass; evaluation asks the first alone).
    ``family``: the task family that drew it (``families.FAMILIES``).
    """

    split: str
    page_ids: tuple[int, ...]
    pages: tuple[Page, ...]
    tags: tuple[str, ...]
    questions: tuple[Question, ...]
    family: str = "lookup"

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def asked(self) -> Question:
        return self.questions[0]

    @property
    def followups(self) -> tuple[Question, ...]:
        return self.questions[1:]

    def holder_of(self, code: str) -> int:
        """The position of the page that holds ``code`` (ValueError when none does)."""
        for position, page in enumerate(self.pages):
            if any(field.code == code for field in page.fields):
                return position
        raise ValueError(f"no page holds {code}")

    def answer_to(self, question: Question) -> str:
        if question.kind == "code":
            return " ".join(self.pages[ask.position].code_of(ask.colour) for ask in question.asks)
        if question.kind == "where":
            return self.tags[self.holder_of(question.code)]
        return " ".join(field.colour for field in reading_order(self.pages[question.position]))

    def question_for(self, question: Question) -> str:
        if question.kind == "code":
            return " and ".join(f"{self.tags[ask.position]} {ask.colour}" for ask in question.asks) + "?"
        if question.kind == "where":
            return f"where {question.code}?"
        return f"{self.tags[question.position]} colours?"

    def reads_of(self, question: Question) -> tuple[tuple[int, int], ...]:
        """Per answer word piece, the (page position, cell) it is read from: each code character's
        cell; for "where", the first cell of the code on its page; for "colours", each field's first
        cell. One entry per answer token before the end of turn."""
        if question.kind == "code":
            return tuple((ask.position, cell) for ask in question.asks
                         for cell in self._cells(ask.position, self.pages[ask.position].field_of(ask.colour)))
        if question.kind == "where":
            position = self.holder_of(question.code)
            field = next(f for f in self.pages[position].fields if f.code == question.code)
            return ((position, self._cells(position, field)[0]),)
        page = self.pages[question.position]
        return tuple((question.position, self._cells(question.position, field)[0]) for field in reading_order(page))

    def cells_of(self, question: Question) -> tuple[tuple[int, int], ...]:
        """The (page position, cell) pairs the answer needs: every cell of every field it reads."""
        if question.kind == "code":
            fields = [(ask.position, self.pages[ask.position].field_of(ask.colour)) for ask in question.asks]
        elif question.kind == "where":
            position = self.holder_of(question.code)
            fields = [(position, next(f for f in self.pages[position].fields if f.code == question.code))]
        else:
            fields = [(question.position, field) for field in reading_order(self.pages[question.position])]
        return tuple((position, cell) for position, field in fields for cell in self._cells(position, field))

    def _cells(self, position: int, field: Field) -> tuple[int, ...]:
        return self.pages[position].cells_of(field)

    @property
    def answer(self) -> str:
        return self.answer_to(self.asked)

    @property
    def question(self) -> str:
        return self.question_for(self.asked)

    @property
    def needed_cells(self) -> tuple[tuple[int, int], ...]:
        """The cells the asked question's answer needs (``cells_of``)."""
        return self.cells_of(self.asked)

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


def reading_order(page: Page) -> list[Field]:
    """The page's fields top to bottom, left to right."""
    return sorted(page.fields, key=lambda field: (field.row, field.column))


def retagged_request(request: Request, salt: int) -> Request:
    """The same pages seen earlier in another session: shuffled order and other tags.

    Each page gets a tag different from its tag in ``request`` (a changed prefix for every page);
    the questions follow their pages. Deterministic from ``request`` and ``salt``.
    """
    rng = random.Random(f"quality-retag:{salt}:{request.split}:{request.page_ids}:{request.tags}")
    order = list(range(request.num_pages))
    rng.shuffle(order)
    tags: list[str] = []
    for position in order:
        choices = [tag for tag in TAGS if tag not in tags and tag != request.tags[position]]
        tags.append(rng.choice(choices))
    new_position = {old: new for new, old in enumerate(order)}
    return Request(
        request.split,
        tuple(request.page_ids[old] for old in order),
        tuple(request.pages[old] for old in order),
        tuple(tags),
        tuple(question.moved(new_position) for question in request.questions),
        request.family,
    )
