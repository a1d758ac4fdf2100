"""Task families: what the pages of a request look like and what is asked about them.

Each family draws its pages from one layout (``generator.LAYOUTS``) and its questions from one rule:

| family | pages | tokens a page | question -> answer | what stale KV breaks |
| --- | --- | ---: | --- | --- |
| ``lookup`` | dense 8x8 | 64 | "bee red?" -> "K7Q" (or two fields) | which page a field is on |
| ``fields`` | sparse 16x16, 4 fields | 256 | as ``lookup``, ~93% of the page white | the same, among mostly background |
| ``where`` | sparse 16x16, 4 fields | 256 | "where K7Q?" -> "bee" (find the image) | the page's tag itself |
| ``describe`` | 24x24 posters, 3-5 fields | 576 | "bee colours?" -> "red blue pink" | which page's fields are listed |

``lookup`` and ``fields`` ask within one or two images; ``where`` asks across all images (the code
is on exactly one of them); ``describe`` answers with several tokens that depend on the whole of one
image. Every family shows 1-8 pages under fresh tags; a request is deterministic from (seed, split,
index, family and the page-count options), so new test sets are drawn by moving the start index.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .generator import MAX_PAGES, TAGS, Ask, Page, Question, Request


@dataclass(frozen=True, slots=True)
class Family:
    """A family's page layout (``generator.LAYOUTS``) and question kind (``generator.QUESTION_KINDS``)."""

    layout: str
    kind: str


FAMILIES: dict[str, Family] = {
    "lookup": Family("dense", "code"),
    "fields": Family("sparse", "code"),
    "where": Family("sparse", "where"),
    "describe": Family("poster", "colours"),
}


def family_layout(family: str) -> str:
    """The page layout ``family`` draws from (ValueError naming the families for an unknown one)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, not {family!r}")
    return FAMILIES[family].layout


def _pick_colour(pages: Sequence[Page], position: int, rng: random.Random) -> str:
    """A colour of page ``position`` that some other page also has (a distractor), when there is one."""
    others = {colour for index, page in enumerate(pages) if index != position for colour in page.colours}
    shared = sorted(set(pages[position].colours) & others)
    return rng.choice(shared or sorted(pages[position].colours))


def _code_question(pages: Sequence[Page], pair_fraction: float, rng: random.Random) -> Question:
    """One or (with probability ``pair_fraction``, two pages or more) two fields' codes; the colour
    asked also appears on another page whenever it can, so the colour alone does not find the field."""
    num_asks = 2 if len(pages) >= 2 and rng.random() < pair_fraction else 1
    positions = rng.sample(range(len(pages)), num_asks)
    return Question("code", tuple(Ask(position, _pick_colour(pages, position, rng)) for position in positions))


def _where_question(pages: Sequence[Page], rng: random.Random) -> Question:
    """Which page holds one of the request's codes (a code written on one page only)."""
    counts: dict[str, int] = {}
    for page in pages:
        for field in page.fields:
            counts[field.code] = counts.get(field.code, 0) + 1
    unique = [field.code for page in pages for field in page.fields if counts[field.code] == 1]
    return Question("where", code=rng.choice(unique))


def _colours_question(pages: Sequence[Page], rng: random.Random) -> Question:
    return Question("colours", position=rng.randrange(len(pages)))


def draw_question(kind: str, pages: Sequence[Page], pair_fraction: float, rng: random.Random) -> Question:
    """A question of ``kind`` about ``pages``, drawn from ``rng``."""
    if kind == "code":
        return _code_question(pages, pair_fraction, rng)
    if kind == "where":
        return _where_question(pages, rng)
    return _colours_question(pages, rng)


def make_request(
    pool: Sequence[Page],
    split: str,
    seed: int,
    index: int,
    *,
    family: str = "lookup",
    min_pages: int = 1,
    max_pages: int = MAX_PAGES,
    pair_fraction: float = 0.3,
    max_followups: int = 0,
) -> Request:
    """Request ``index`` of ``family`` over ``pool`` (pages of ``split`` in the family's layout),
    deterministic from its arguments.

    1..8 distinct pages drawn uniformly from the pool, distinct tags, a question of the family's
    kind (``pair_fraction``: the chance of a two-field code question), then 0 to ``max_followups``
    follow-up questions (drawn last: they never change the rest).
    """
    if not 1 <= min_pages <= max_pages <= min(MAX_PAGES, len(TAGS), len(pool)):
        raise ValueError(f"need 1 <= min_pages <= max_pages <= {MAX_PAGES} pages, pool {len(pool)}")
    family_layout(family)  # names the families when ``family`` is not one
    kind = FAMILIES[family].kind
    stream = f"quality-request:{seed}:{split}:{index}:{min_pages}:{max_pages}:{pair_fraction}"
    rng = random.Random(stream if family == "lookup" else f"{stream}:{family}")
    num_pages = rng.randint(min_pages, max_pages)
    page_ids = tuple(rng.sample(range(len(pool)), num_pages))
    pages = tuple(pool[page_id] for page_id in page_ids)
    tags = tuple(rng.sample(TAGS, num_pages))
    questions = [draw_question(kind, pages, pair_fraction, rng)]
    num_followups = rng.randint(0, max_followups) if max_followups else 0
    for _ in range(num_followups):
        for _attempt in range(4):  # a repeated question could be answered by copying the earlier answer
            followup = draw_question(kind, pages, pair_fraction, rng)
            if followup not in questions:
                break
        questions.append(followup)
    return Request(split, page_ids, pages, tags, tuple(questions), family)
