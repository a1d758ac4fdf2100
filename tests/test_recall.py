"""Recall of the needed tokens (``conduit_rt.evaluation.recall``): the measures against a direct
computation from the traced positions, on the bundled task model (CPU) replaying task requests, and
the plot."""
from __future__ import annotations

import random

import pytest
import torch

import conduit_rt
from conduit_rt import Runtime
from conduit_rt.errors import RequestError
from conduit_rt.evaluation.recall import (
    has_recall,
    layer_values,
    needed_positions,
    plot_recall,
    recall_table,
    selection_measures,
)
from conduit_rt.evaluation.replay import REFERENCE_KEY, Replay, ReplayRequest, Setting, run_requests
from conduit_rt.results import GenerationStats

SEED = 3


def direct_recall(needed: set[int], per_layer: list[list[int]]) -> list[float]:
    return [sum(p in set(layer) for p in needed) / len(needed) for layer in per_layer]


def test_measures_equal_a_direct_computation_on_synthetic_traces():
    rng = random.Random(SEED)
    spans = [(5, 69), (75, 139), (150, 214)]
    restored = list(range(75, 139)) + list(range(150, 214))  # image 0 computed in the request
    refreshed = [sorted(rng.sample(restored, 20)) for _ in range(4)]
    kept = [sorted(rng.sample(range(230), 40)) for _ in range(4)]
    cells = [(0, 3), (1, 10), (1, 11), (2, 63), (2, 0)]
    stats = GenerationStats(image_spans=spans, restored_positions=restored, refreshed_positions=refreshed,
                            kept_positions=kept)
    positions = {spans[image][0] + cell for image, cell in cells}
    stale = positions & set(restored)
    measures = selection_measures(cells, stats)
    expected_refresh, expected_kept = direct_recall(stale, refreshed), direct_recall(positions, kept)
    assert [measures[f"needed_recall_l{i}"] for i in range(4)] == pytest.approx(expected_refresh)
    assert measures["needed_recall"] == pytest.approx(sum(expected_refresh) / 4)
    assert [measures[f"kept_recall_l{i}"] for i in range(4)] == pytest.approx(expected_kept)
    assert measures["kept_recall"] == pytest.approx(sum(expected_kept) / 4)
    only_kept = GenerationStats(image_spans=spans, restored_positions=[], kept_positions=kept)
    assert selection_measures(cells, only_kept) == {"needed_recall": pytest.approx(sum(expected_kept) / 4),
                                                    **{f"needed_recall_l{i}": pytest.approx(v)
                                                       for i, v in enumerate(expected_kept)}}
    assert selection_measures(cells, GenerationStats(image_spans=spans)) == {}
    assert selection_measures((), stats) == {}


@pytest.mark.parametrize("cells", [[(3, 0)], [(0, 64)], [(-1, 2)], [(1, -1)]])
def test_cells_outside_the_request_are_request_errors(cells):
    with pytest.raises(RequestError, match="needed cell"):
        needed_positions(cells, [(5, 69), (75, 139)])


# -- the bundled task model, replaying task requests --------------------------------------------------------
SETTINGS = [Setting("reference"), Setting("refresh", "full", 1.0), Setting("refresh", "none", 0.0),
            Setting("refresh", "conduit", 0.1), Setting("refresh", "conduit", 0.3), Setting("refresh", "cacheblend", 0.1),
            Setting("compress", compress="none", keep=1.0), Setting("compress", compress="vlcache", keep=0.1),
            Setting("compress", compress="snapkv", keep=0.3),
            Setting("together", "conduit", 0.1, "vlcache", 0.1),
            Setting("together", "conduit_local", 0.1, "vlcache_draft", 0.1)]


@pytest.fixture(scope="module")
def replayed():
    """Two task requests (the dense family the bundled model reads) replayed on the bundled model:
    (replay, requests, outcomes per request)."""
    from conduit_rt.evaluation.sessions import request_messages, seen_before
    from conduit_rt.evaluation.task.families import make_request
    from conduit_rt.evaluation.task.generator import page_for

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runtime = Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", kv_cache_bytes=64 << 20, prefix_cache_entries=0)
    pool = [page_for(SEED, "test", index) for index in range(30)]
    requests = []
    for index in range(2):
        task = make_request(pool, "test", SEED, index, family="lookup", min_pages=2, max_pages=3)
        assert task.needed_cells
        requests.append(ReplayRequest(request_messages(task), task.answer, task.num_pages,
                                      seen_before(task, pool, "sessions", salt=index), task.family,
                                      task.needed_cells))
    replay = Replay(runtime, SETTINGS, max_tokens=2)
    outcomes = [replay.session(request.messages, request.seen) for request in requests]
    yield replay, requests, outcomes
    torch.set_num_threads(threads)
    runtime.close()


def test_replayed_recall_equals_the_traced_positions(replayed):
    replay, requests, outcomes = replayed
    n_layers = replay.runtime.model.config.n_layers
    for request, by_key in zip(requests, outcomes):
        for setting in SETTINGS:
            stats = by_key[setting.key].stats
            measures = selection_measures(request.needed_cells, stats)
            if setting.kind == "reference":
                assert measures == {}
                continue
            # each image's tokens, found from the trace: image i's span, cell c at start + c
            needed = {stats.image_spans[image][0] + cell for image, cell in request.needed_cells}
            assert len(needed) == len(request.needed_cells)
            if setting.refresh is not None:
                assert needed <= set(stats.restored_positions)  # every page was restored from the store
                expected = direct_recall(needed, stats.refreshed_positions)
            else:
                expected = direct_recall(needed, stats.kept_positions)
            assert len(expected) == n_layers
            assert [measures[f"needed_recall_l{i}"] for i in range(n_layers)] == pytest.approx(expected)
            assert measures["needed_recall"] == pytest.approx(sum(expected) / n_layers)
            if setting.kind == "together":
                kept = direct_recall(needed, stats.kept_positions)
                assert measures["kept_recall"] == pytest.approx(sum(kept) / n_layers)
            if setting.refresh == "full" or setting.compress == "none":
                assert expected == [1.0] * n_layers
            if setting.refresh == "none":
                assert expected == [0.0] * n_layers


def test_run_requests_records_the_recall_of_every_setting(replayed, tmp_path):
    replay, requests, outcomes = replayed
    scores, _ = run_requests(replay, requests)
    for setting in SETTINGS:
        measures = scores[setting.key].measures
        if setting.kind == "reference":
            assert not any(name.startswith("needed_recall") for name in measures)
            continue
        expected = [selection_measures(request.needed_cells, by_key[setting.key].stats)["needed_recall"]
                    for request, by_key in zip(requests, outcomes)]
        assert measures["needed_recall"] == pytest.approx(expected)  # the replay is deterministic

    results = {"n_requests": len(requests), "rows": []}
    for setting in SETTINGS:
        row = {"key": setting.key, "kind": setting.kind, "refresh": setting.refresh, "budget": setting.budget,
               "compress": setting.compress, "keep": setting.keep}
        results["rows"].append({**row, **scores[setting.key].summary(None)})
    assert has_recall(results) and not has_recall({"rows": [{"key": REFERENCE_KEY}]})
    conduit = next(row for row in results["rows"] if row["key"] == "refresh:conduit@0.1")
    per_layer = layer_values(conduit)
    assert len(per_layer) == replay.runtime.model.config.n_layers
    assert conduit["needed_recall"] == pytest.approx(sum(per_layer) / len(per_layer))
    table = recall_table(results)
    assert "`refresh:conduit@0.1`" in table and REFERENCE_KEY not in table
    plot_recall(results, tmp_path / "recall.png")
    assert (tmp_path / "recall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
