"""The selection trace (``GenerationOptions.trace_selection``) on a converted tiny LLaVA-1.5 (CPU, fp32):
the traced positions equal the policies' own reference selections (float64 torch, from
tests/test_conduit.py and tests/test_compress.py), their counts equal the statistics, and tracing
off leaves the answer bit-identical."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conduit_rt import compress as compression
from conduit_rt.refresh import POLICIES, CacheBlend
from conduit_rt.selection import budget_tokens
from tests.test_compress import MESSAGES, record, reference_keep
from tests.test_conduit import (  # noqa: F401  (model_dir and warm are fixtures)
    NUM_IMAGE_TOKENS,
    RecordingConduit,
    model_dir,
    new_runtime,
    picture,
    reference_selection,
    request,
    warm,
)

TRACE_FIELDS = ("restored_positions", "refreshed_positions", "kept_positions")


def image_runs(runtime, messages) -> list[tuple[int, int]]:
    """Each image's [start, stop) found from the prompt's image placeholder tokens, in message order."""
    ids = torch.tensor(runtime.requests.read(messages).prompt.token_ids)
    positions = torch.nonzero(ids == runtime.assets.image_token_id).flatten().tolist()
    runs = [positions[i: i + NUM_IMAGE_TOKENS] for i in range(0, len(positions), NUM_IMAGE_TOKENS)]
    assert all(run == list(range(run[0], run[0] + NUM_IMAGE_TOKENS)) for run in runs)
    return [(run[0], run[0] + NUM_IMAGE_TOKENS) for run in runs]


def traced(runtime, messages, **options):
    return runtime.generate(messages, max_tokens=1, trace_selection=True, **options).stats


@pytest.mark.parametrize("n_images,layers", [(1, None), (3, None), (3, (1,))])
def test_traced_refresh_is_the_conduit_reference_selection_on_every_layer(warm, monkeypatch, n_images, layers):
    runtime, pics = warm
    recorder = RecordingConduit()
    monkeypatch.setitem(POLICIES, "conduit", recorder)
    messages = request("Yet another prefix.", pics[:n_images][::-1], "Which one has the most red?")
    stats = traced(runtime, messages, refresh="conduit", refresh_budget=0.2, refresh_options={"layers": layers})
    tokens = recorder.seen["tokens"]
    expected = reference_selection(recorder.seen)
    assert stats.image_spans == image_runs(runtime, messages)
    assert stats.restored_positions == [p for start, stop in stats.image_spans for p in range(start, stop)]
    assert len(stats.refreshed_positions) == runtime.model.config.n_layers
    for positions in stats.refreshed_positions:
        assert len(positions) == stats.refreshed_tokens == budget_tokens(0.2, n_images * NUM_IMAGE_TOKENS)
        if runtime.device.type == "cpu":
            assert positions == sorted(tokens.slots[expected].tolist())
        else:  # bf16: near-ties may swap
            assert len(set(positions) & set(tokens.slots[expected].tolist())) >= 0.9 * expected.numel()


@pytest.mark.parametrize("policy", ["full", "none", "random"])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.3])
def test_traced_refresh_of_the_one_pass_baselines(warm, policy, ratio):
    runtime, pics = warm
    messages = request("Prefix C:", [pics[2], pics[0]], "Tell me.")
    stats = traced(runtime, messages, refresh=policy, refresh_budget=ratio)
    visual = stats.restored_positions
    if policy == "full":
        expected = visual
    elif policy == "none" or ratio == 0:
        expected = []
    else:  # the random policy's rule, seeded as RefreshOptions.seed (0) says
        chosen = torch.randperm(len(visual), generator=torch.Generator().manual_seed(0))[:budget_tokens(ratio, len(visual))]
        expected = sorted(visual[i] for i in chosen.tolist())
    assert stats.refreshed_positions == [expected] * runtime.model.config.n_layers
    assert all(len(layer) == stats.refreshed_tokens for layer in stats.refreshed_positions)


@pytest.mark.parametrize("ratio", [0.05, 0.3])
def test_traced_cacheblend_recomputes_its_layer_counts_in_nested_sets(warm, ratio):
    runtime, pics = warm
    stats = traced(runtime, request("Prefix D:", [pics[1], pics[0], pics[2]], "Which?"), refresh="cacheblend",
                   refresh_budget=ratio)
    n_layers, n_visual = runtime.model.config.n_layers, stats.visual_tokens
    counts = CacheBlend.layer_counts(n_visual, budget_tokens(ratio, n_visual), n_layers)
    assert [len(layer) for layer in stats.refreshed_positions] == counts
    assert stats.refreshed_positions[0] == stats.restored_positions  # every token on the first layers
    for shallow, deep in zip(stats.refreshed_positions, stats.refreshed_positions[1:]):
        assert set(deep) <= set(shallow)


@pytest.mark.parametrize("name", sorted(compression.POLICIES))
def test_traced_kept_positions_are_the_compression_reference(model_dir, device, monkeypatch, name):
    runtime = new_runtime(model_dir, device, prefix_cache_entries=0)
    recorder = record(monkeypatch, name)
    messages = MESSAGES([picture(i) for i in range(3)])
    stats = traced(runtime, messages, compress=name, keep=0.2)
    assert stats.refreshed_positions is None and stats.restored_positions == []
    assert [len(layer) for layer in stats.kept_positions] == stats.kept_tokens_per_layer
    expected = [sorted(recorder.positions[slots].tolist()) for slots in reference_keep(recorder)]
    if runtime.device.type == "cpu":
        assert stats.kept_positions == expected
    else:
        for ours, ref in zip(stats.kept_positions, expected):
            assert len(ours) == len(ref) and len(set(ours) & set(ref)) >= 0.9 * len(ref)


@pytest.mark.parametrize("options", [dict(refresh="conduit", refresh_budget=0.2, compress="vlcache", keep=0.3),
                                     dict(refresh="cacheblend", refresh_budget=0.1),
                                     dict(refresh="attention", refresh_budget=0.3, compress="snapkv", keep=0.5)])
def test_tracing_off_leaves_the_answer_bit_identical_and_records_nothing(warm, options):
    runtime, pics = warm
    messages = request("A new prefix:", pics[::-1], "Which is darkest?")
    plain = runtime.generate(messages, max_tokens=4, return_logits=True, **options)
    trace = runtime.generate(messages, max_tokens=4, return_logits=True, trace_selection=True, **options)
    assert plain.tokens == trace.tokens and torch.equal(plain.logits, trace.logits)
    assert all(getattr(plain.stats, name) is None for name in TRACE_FIELDS)
    assert all(getattr(trace.stats, name) is not None for name in TRACE_FIELDS if name != "kept_positions"
               or "compress" in options)
    untimed = [f.name for f in dataclasses.fields(plain.stats) if f.name not in TRACE_FIELDS and not f.name.endswith("_s")]
    assert {n: getattr(plain.stats, n) for n in untimed} == {n: getattr(trace.stats, n) for n in untimed}
