"""The task families (conduit_rt/evaluation/task/families.py): pages, questions, answers, needed cells.

The reference is the pixels: a template-matching reader (tests/test_quality_task.py ``read_cells``)
recovers every page's inked cells from the rendered image alone, and each family's answer and
needed cells are recomputed from what it reads.
"""

from __future__ import annotations

import numpy as np
import pytest

from conduit_rt.evaluation.task import data, generator
from conduit_rt.evaluation.task.families import FAMILIES, family_layout, make_request
from conduit_rt.evaluation.task.tokenizer import build_tokenizer
from tests.test_quality_task import read_cells

SEED = 11
SPARSE_FAMILIES = [family for family in FAMILIES if family != "lookup"]


@pytest.fixture(scope="module")
def pools():
    return data.build_pools(SEED, "val", 24, list(FAMILIES))


def fields_read(pixels: np.ndarray) -> list[tuple[int, int, str, str]]:
    """(row, first column, colour, code) of every coloured run of cells, in reading order."""
    runs: list[list] = []
    for (row, column), (char, colour) in sorted(read_cells(pixels).items()):
        if colour == "grey":
            continue
        last = runs[-1] if runs else None
        if last and last[0] == row and last[2] == colour and last[1] + len(last[3]) == column:
            last[3] += char
        else:
            runs.append([row, column, colour, char])
    return [tuple(run) for run in runs]


def expected_answer(request, pixels_of_pages) -> tuple[str, set[tuple[int, int]]]:
    """The asked question's answer and needed (page, cell) pairs, from the pixels alone."""
    question = request.asked
    read = [fields_read(pixels) for pixels in pixels_of_pages]
    grid = [pixels.shape[0] // generator.CELL_SIZE for pixels in pixels_of_pages]

    def cells(position, run):
        return {(position, run[0] * grid[position] + run[1] + k) for k in range(len(run[3]))}

    if question.kind == "code":
        runs = [(ask.position, next(r for r in read[ask.position] if r[2] == ask.colour)) for ask in question.asks]
        return " ".join(run[3] for _, run in runs), set().union(*(cells(p, run) for p, run in runs))
    if question.kind == "where":
        holders = [(p, run) for p, runs in enumerate(read) for run in runs if run[3] == question.code]
        assert len(holders) == 1
        position, run = holders[0]
        return request.tags[position], cells(position, run)
    position = question.position
    return " ".join(run[2] for run in read[position]), set().union(*(cells(position, run) for run in read[position]))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_answers_and_needed_cells_match_the_pixels(pools, family):
    pool = pools[family]
    requests = pool.requests(40, family=family)
    assert {r.family for r in requests} == {family} and {r.asked.kind for r in requests} == {FAMILIES[family].kind}
    assert min(r.num_pages for r in requests) == 1 and max(r.num_pages for r in requests) >= 7
    for request in requests:
        pixels = [pool.pixels[page_id] for page_id in request.page_ids]
        answer, needed = expected_answer(request, pixels)
        assert request.answer == answer
        assert set(request.needed_cells) == needed and len(request.needed_cells) == len(needed)


def test_layouts_have_the_promised_token_counts_and_background(pools):
    for family in FAMILIES:
        pool = pools[family]
        grid = generator.LAYOUTS[family_layout(family)].grid
        assert pool.pixels.shape[1:] == (8 * grid, 8 * grid, 3)
        assert {page.num_cells for page in pool.pages} == {grid * grid}
    posters = pools["describe"]
    assert {page.num_cells for page in posters.pages} == {576}
    for family in SPARSE_FAMILIES:  # most cells of a sparse canvas are white
        inked = [len(read_cells(pixels)) / page.num_cells for page, pixels in zip(pools[family].pages, pools[family].pixels)]
        assert max(inked) < 0.1


def test_families_are_deterministic_and_splits_disjoint():
    for family in SPARSE_FAMILIES:
        layout = family_layout(family)
        pages = {split: [generator.page_for(SEED, split, i, layout) for i in range(30)] for split in generator.SPLITS}
        keys = {split: {page.key for page in split_pages} for split, split_pages in pages.items()}
        assert not keys["train"] & keys["val"] and not keys["val"] & keys["test"] and not keys["train"] & keys["test"]
        again = [generator.page_for(SEED, "val", i, layout) for i in range(30)]
        assert again == pages["val"]
        first = [make_request(pages["val"], "val", SEED, i, family=family, max_followups=2) for i in range(10)]
        assert first == [make_request(pages["val"], "val", SEED, i, family=family, max_followups=2) for i in range(10)]
        other = [make_request(pages["val"], "val", SEED + 1, i, family=family) for i in range(10)]
        assert [r.page_ids for r in other] != [r.page_ids for r in first]


def test_retagging_moves_every_question_with_its_page(pools):
    for family in FAMILIES:
        for request in pools[family].requests(20, family=family, min_pages=2, max_followups=2):
            seen = generator.retagged_request(request, salt=3)
            moved = [seen.answer_to(q) for q in seen.questions]
            if request.asked.kind == "where":  # the answer is the holder's tag, which retagging changes
                assert seen.pages[seen.holder_of(request.asked.code)] == request.pages[request.holder_of(request.asked.code)]
            else:
                assert moved == [request.answer_to(q) for q in request.questions]


def test_training_targets_point_at_the_cells_each_answer_token_reads(pools):
    """Per answer token the read hint's target is an image position of the page and cell it copies;
    the field hint's targets are the question's needed cells."""
    tokenizer = build_tokenizer()
    encoder = data.PromptEncoder(tokenizer)
    for family in SPARSE_FAMILIES:
        requests = pools[family].requests(6, family=family, max_pages=3, max_followups=2)
        encoded = encoder.encode(requests, with_answer=True)
        batch = data.collate_for_training(encoded, encoder.pad_token_id, encoder.image_token_id)
        assert batch["image_tokens"].tolist() == [page.num_cells for r in requests for page in r.pages]
        hints = list(zip(*(batch[k].tolist() for k in ("hint_rows", "hint_positions", "hint_targets"))))
        assert len(hints) == sum(len(r.reads_of(q)) for r in requests for q in r.questions)
        for row, position, target in hints:
            request, ids = requests[row], batch["input_ids"][row]
            image_positions = (ids == encoder.image_token_id).nonzero().flatten().tolist()
            offset = image_positions.index(target)
            starts = np.cumsum([0] + [page.num_cells for page in request.pages])
            page = int(np.searchsorted(starts, offset, side="right") - 1)
            predicted = tokenizer.id_to_token(int(batch["labels"][row, position + 1])).lstrip("\u2581")
            char, colour = read_cells(pools[family].pixels[request.page_ids[page]])[divmod(offset - starts[page], request.pages[page].grid)]
            if request.asked.kind == "where":  # the holder's tag, read at the code's first cell
                assert predicted == request.tags[page] and colour in generator.COLOURS
            elif request.asked.kind == "colours":  # each field's colour, at its first cell
                assert predicted == colour and colour in generator.COLOURS
            else:  # each code character at its cell
                assert predicted == char and colour in generator.COLOURS
