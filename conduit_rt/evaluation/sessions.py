"""Where a test request's pages were seen before: the earlier requests of its replayed session.

A session warms the runtime's image-KV store with every page of the test request, each computed in
a context other than the test request's (so the stored KV is stale there), then asks the test
request. Three ways to have seen the pages (``SEEN_MODES``):

- ``sessions`` (default): the pages spread over earlier requests of 1-3 of them each, in a new
  order, among 0-2 companion pages from the same pool, every page under a tag other than its tag
  in the test request: changed prefix, order and companions (the in-context fill);
- ``retagged``: one earlier request with the same pages shuffled under other tags
  (``conduit_rt.evaluation.task.generator.retagged_request``, the source ``conduit_rt.evaluation.task.stale_kv`` calls retagged);
- ``isolated``: each page alone in a one-image chat message, the wrapper the runtime's
  ``fill="isolated"`` uses.

Everything is deterministic from the request and the salt.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Sequence

from conduit_rt.evaluation.task.generator import MAX_PAGES, TAGS, Ask, Page, Question, Request, retagged_request

SEEN_MODES = ("sessions", "retagged", "isolated")
MAX_GROUP = 3
MAX_COMPANIONS = 2


@functools.lru_cache(maxsize=512)
def render(page: Page):
    """The page's PIL image, rendered once (the runtime only reads it)."""
    return page.render()


def request_messages(request: Request) -> list[dict]:
    return request.messages([render(page) for page in request.pages])


def isolated_messages(page: Page) -> list[dict]:
    """The page alone in one user message: the chat wrapper of the runtime's isolated fill."""
    return [{"role": "user", "content": [{"type": "image", "image": render(page)}]}]


def earlier_sessions(request: Request, pool: Sequence[Page], salt: int = 1) -> list[Request]:
    """Earlier requests that together show every page of ``request`` once (see ``sessions`` above)."""
    rng = random.Random(f"conduit-eval-seen:{salt}:{request.split}:{request.page_ids}:{request.tags}")
    shown = set(request.page_ids)
    others = [page_id for page_id in range(len(pool)) if page_id not in shown]
    order = list(range(request.num_pages))
    rng.shuffle(order)
    earlier = []
    while order:
        size = rng.randint(1, min(MAX_GROUP, len(order)))
        group, order = order[:size], order[size:]
        num_companions = min(rng.randint(0, MAX_COMPANIONS), MAX_PAGES - size, len(others))
        items = [(request.page_ids[p], request.tags[p]) for p in group]
        items += [(page_id, None) for page_id in rng.sample(others, num_companions)]
        rng.shuffle(items)
        earlier.append(_request_with_new_tags(request.split, pool, items, rng))
    return earlier


def _request_with_new_tags(split: str, pool: Sequence[Page], items: list[tuple[int, str | None]],
                           rng: random.Random) -> Request:
    """A request over ``items`` (page id, the tag to avoid or None) with fresh distinct tags and one ask."""
    tags: list[str] = []
    for _, avoid in items:
        tags.append(rng.choice([tag for tag in TAGS if tag not in tags and tag != avoid]))
    pages = tuple(pool[page_id] for page_id, _ in items)
    position = rng.randrange(len(items))
    ask = Ask(position, rng.choice(pages[position].colours))
    return Request(split, tuple(page_id for page_id, _ in items), pages, tuple(tags), (Question("code", (ask,)),))


def seen_before(request: Request, pool: Sequence[Page], mode: str = "sessions", salt: int = 1) -> list[list[dict]]:
    """The messages of the earlier requests in which ``request``'s pages were seen (``mode``: SEEN_MODES)."""
    if mode == "isolated":
        return [isolated_messages(page) for page in request.pages]
    if mode == "retagged":
        return [request_messages(retagged_request(request, salt))]
    if mode == "sessions":
        return [request_messages(earlier) for earlier in earlier_sessions(request, pool, salt)]
    raise ValueError(f"seen mode must be one of {SEEN_MODES}, not {mode!r}")
