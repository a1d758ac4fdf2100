"""Oracle refresh on the quality task: which cached image tokens must a request recompute?

    CONDUIT_LIB=... python tools/quality_oracle.py [--n 12] [--model conduit_rt/data/quality_model]

For test requests of 2-8 pages whose pages were seen alone (isolated KV), answers the request with
refresh sets chosen from the ground truth instead of a score: the asked field's cells (3 per ask),
every cell of the asked colour(s) on every page, every cell of the asked page(s), and nothing.
Prints exact-match counts. docs/quality/findings.md reports what it said and why it mattered.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch

from conduit_rt import Runtime
from conduit_rt import refresh
from conduit_rt.demo import BUNDLED_MODEL, converted_model
from conduit_rt.evaluation.sessions import request_messages, seen_before
from conduit_rt.evaluation.task.data import build_pool
from conduit_rt.evaluation.task.generator import GRID_SIZE, Request
from conduit_rt.evaluation.task.model_config import NUM_IMAGE_TOKENS

SETS = ("asked_field", "asked_colour_all_pages", "asked_pages", "nothing")


class GivenTokens(refresh.RefreshPolicy):
    """Refreshes exactly ``indices`` (positions in the request's restored visual tokens)."""

    name = "given"
    indices: list[int] = []

    def select(self, tokens, budget, scores, options):
        return torch.tensor(sorted(self.indices), dtype=torch.long)


@contextlib.contextmanager
def registered(policy: refresh.RefreshPolicy):
    refresh.POLICIES[policy.name] = policy
    try:
        yield policy
    finally:
        del refresh.POLICIES[policy.name]


def oracle_tokens(request: Request, which: str) -> list[int]:
    """Visual-token indices (page-major, 64 per page) of the set ``which`` (see SETS)."""
    indices = []
    for position, page in enumerate(request.pages):
        base = position * NUM_IMAGE_TOKENS
        if which == "asked_pages" and any(ask.position == position for ask in request.asks):
            indices += range(base, base + NUM_IMAGE_TOKENS)
            continue
        for field in page.fields:
            asked = any(a.position == position and a.colour == field.colour for a in request.asks)
            same_colour = any(a.colour == field.colour for a in request.asks)
            if (which == "asked_field" and asked) or (which == "asked_colour_all_pages" and same_colour):
                first = base + field.row * GRID_SIZE + field.column
                indices += range(first, first + len(field.code))
    return indices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    runtime = Runtime(converted_model(args.model), device=args.device, prefix_cache_entries=0)
    pool = build_pool(0, "test", 4000)
    correct = dict.fromkeys(SETS, 0)
    with registered(GivenTokens()) as given:
        for number, request in enumerate(pool.requests(args.n, min_pages=2), 1):
            for messages in seen_before(request, pool.pages, "isolated"):
                runtime.generate(messages, max_tokens=1, refresh="none")  # a miss: stored isolated
            for which in SETS:
                given.indices = oracle_tokens(request, which)
                answer = runtime.generate(request_messages(request), max_tokens=8, refresh="given").text.strip()
                correct[which] += answer == request.answer
            print(f"{number:3d} pages {request.num_pages}: " + ", ".join(f"{k} {v}" for k, v in correct.items()), flush=True)


if __name__ == "__main__":
    main()
