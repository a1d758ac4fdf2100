"""The policies beyond the papers (docs/methods.md, "Policies beyond the papers") on the tiny LLaVA of
test_conduit (CPU fp32; CUDA bf16 under `gpu`): budgets, r = 1 / keep 1, float64 references."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conduit_rt.models.rope import apply_rope
from conduit_rt.refresh import POLICIES, ConduitAllQ, ConduitDeviation, ConduitFocus, ConduitLocal, ConduitRescore
from conduit_rt.selection import budget_tokens
from tests.test_compress import record, reference_keep, runtime  # noqa: F401
from tests.test_conduit import (NUM_IMAGE_TOKENS, TOLERANCE, RecordingConduit, cold_logits, first_logits,  # noqa: F401
                                model_dir, new_runtime, picture, reference_scores, reference_selection, snapshot,
                                warm)

NEW_REFRESH = ["conduit_allq", "conduit_rescore", "conduit_deviation", "conduit_focus", "conduit_local"]


def interleaved(pics, question: str) -> list[dict]:
    """A prompt with text before, between and after the pictures."""
    content = [{"type": "text", "text": "Three pages."}]
    for i, pic in enumerate(pics):
        content += [{"type": "text", "text": f"Page {i + 1} of the report:"}, {"type": "image", "image": pic}]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def text_after_first_image(runtime, messages) -> list[int]:
    """Every position from the first image token on whose token is not the image token."""
    ids = runtime.requests.read(messages).token_ids.tolist()
    image = runtime.model.assets.image_token_id
    first = ids.index(image)
    return [p for p in range(first, len(ids)) if ids[p] != image]


class Recompute:
    """Wraps a context's ``recompute``: the state before each call (``snapshot``) and its selection."""

    def __init__(self, context) -> None:
        self.context, self.inner = context, context.recompute
        self.states, self.selected = [], []
        context.recompute = self

    def __call__(self, selected: torch.Tensor) -> torch.Tensor:
        self.states.append(snapshot(self.context))
        self.selected.append(selected.clone())
        return self.inner(selected)


class RecordingAllQ(RecordingConduit, ConduitAllQ):
    """conduit_allq, keeping what it saw (RecordingConduit's record)."""


class RecordingRescore(ConduitRescore):
    def refresh(self, context):
        self.calls = Recompute(context)
        return super().refresh(context)


class RecordingFocus(ConduitFocus):
    def refresh(self, context):
        self.calls = Recompute(context)
        return super().refresh(context)


class RecordingLocal(ConduitLocal):
    def refresh(self, context):
        self.calls = Recompute(context)
        return super().refresh(context)


class RecordingDeviation(ConduitDeviation):
    def refresh(self, context):
        self.calls = Recompute(context)
        self.embeds = context.embed(context.tokens.slots.tolist()).clone()
        self.cached = [t.clone() for t in context.cached_kv(1)]
        return super().refresh(context)


def recompute_rows(selected_slots: list[int], visual: set[int], n_prompt: int) -> int:
    """How many rows a recompute of these slots forwards: them and every non-visual position after the first."""
    return len(selected_slots) + sum(1 for p in range(min(selected_slots), n_prompt) if p not in visual)


# -- refresh -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", NEW_REFRESH)
def test_refresh_everything_equals_a_cold_full_prefill(model_dir, warm, policy):
    runtime, pics = warm
    messages = interleaved([pics[2], pics[0], pics[1]], "Which page is brightest?")
    logits, stats = first_logits(runtime, messages, refresh=policy, refresh_budget=1.0)
    assert stats.image_hits == 3 and stats.refreshed_tokens == stats.visual_tokens == 3 * NUM_IMAGE_TOKENS
    expected = cold_logits(model_dir, messages, runtime.device.type)
    assert (logits - expected).abs().max() <= TOLERANCE[runtime.device.type] * expected.abs().max()


def test_conduit_allq_scores_with_every_text_row_after_the_first_image(warm, monkeypatch):
    runtime, pics = warm
    recorder = RecordingAllQ()
    monkeypatch.setitem(POLICIES, "conduit_allq", recorder)
    messages = interleaved(pics[::-1], "Which page has the most red?")
    runtime.generate(messages, max_tokens=1, refresh="conduit_allq", refresh_budget=0.2)
    rows = text_after_first_image(runtime, messages)
    assert recorder.seen["query_positions"] == rows
    assert len(rows) > len(runtime.requests.read(messages).query_positions(None))  # more rows than CONDUIT's
    expected = reference_selection(recorder.seen)
    if runtime.device.type == "cpu":
        assert torch.equal(recorder.chosen, expected)
    else:
        assert len(set(recorder.chosen.tolist()) & set(expected.tolist())) >= 0.9 * expected.numel()


@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.5])
def test_conduit_rescore_picks_half_then_the_rest_from_the_partly_refreshed_kv(warm, monkeypatch, ratio):
    """First share: CONDUIT's top ceil(B/2); second: the top B - ceil(B/2) of the others by the score
    recomputed from the first recompute's query rows over the KV it left (value norms of the cached
    entries); the second pass recomputes both shares. Token-layers count both passes."""
    runtime, pics = warm
    recorder = RecordingRescore()
    monkeypatch.setitem(POLICIES, "conduit_rescore", recorder)
    messages = interleaved([pics[1], pics[2], pics[0]], "Which page is darkest?")
    stats = runtime.generate(messages, max_tokens=1, refresh="conduit_rescore", refresh_budget=ratio).stats
    calls = recorder.calls
    budget = budget_tokens(ratio, 3 * NUM_IMAGE_TOKENS)
    first_k = math.ceil(budget / 2)
    assert stats.refreshed_tokens == budget and len(calls.selected) == 2
    first, union = calls.selected
    assert first.numel() == first_k and union.numel() == budget and set(first.tolist()) <= set(union.tolist())

    stale, fresh = calls.states
    expected_first = torch.sort(torch.topk(reference_scores(stale), first_k).indices).values
    second_scores = reference_scores(fresh, values=[v for _, v in stale["kv"]])
    second_scores[expected_first] = float("-inf")
    expected_second = torch.topk(second_scores, budget - first_k).indices
    expected_union = torch.sort(torch.cat([expected_first, expected_second])).values
    if runtime.device.type == "cpu":
        assert torch.equal(first, expected_first) and torch.equal(union, expected_union)
    else:
        assert len(set(union.tolist()) & set(expected_union.tolist())) >= 0.9 * budget

    slots = stale["tokens"].slots
    visual = set(slots.tolist())
    rows = sum(recompute_rows(slots[s].tolist(), visual, stats.prompt_tokens) for s in (first, union))
    assert stats.recomputed_token_layers == rows * runtime.model.config.n_layers


def rms(x: torch.Tensor, norm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double().cpu()


def linear(x: torch.Tensor, module) -> torch.Tensor:
    out = x @ module.weight.double().cpu().T
    return out if module.bias is None else out + module.bias.double().cpu()


def reference_first_layer_kv(runtime, seen: dict, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0 over every visual token in float64 (attending to the sequence's layer-0 KV, causal by
    position), then layer 1's pre-RoPE K and V of its output: [N, n_kv_heads, head_dim] each."""
    lm = runtime.model.language_model
    block, attn, rot = lm.layers[0], lm.layers[0].self_attn, lm.rotary
    slots = seen["tokens"].slots
    x = embeds.double().cpu()
    n = x.shape[0]
    q = linear(rms(x, block.input_layernorm), attn.q_proj).view(n, attn.n_heads, attn.head_dim)
    q = apply_rope(q, slots.to(torch.int32), rot.inv_freq.cpu(), rot.attention_scaling).double()
    k, v = (t.double().cpu().repeat_interleave(attn.n_heads // attn.n_kv_heads, 1) for t in seen["kv"][0])
    scores = torch.einsum("qhd,khd->hqk", q, k) * attn.scale
    scores = scores.masked_fill(seen["positions"].long()[None, None, :] > slots[None, :, None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    x = x + linear(out, attn.o_proj)
    h = rms(x, block.post_attention_layernorm)
    x = x + linear(F.silu(linear(h, block.mlp.gate_proj)) * linear(h, block.mlp.up_proj), block.mlp.down_proj)
    nxt = lm.layers[1]
    h = rms(x, nxt.input_layernorm)
    shape = (n, nxt.self_attn.n_kv_heads, nxt.self_attn.head_dim)
    return linear(h, nxt.self_attn.k_proj).view(shape), linear(h, nxt.self_attn.v_proj).view(shape)


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_conduit_deviation_ranks_by_score_times_layer_one_deviation(warm, monkeypatch, ratio):
    runtime, pics = warm
    recorder = RecordingDeviation()
    monkeypatch.setitem(POLICIES, "conduit_deviation", recorder)
    messages = interleaved([pics[0], pics[2], pics[1]], "Which page is greenest?")
    stats = runtime.generate(messages, max_tokens=1, refresh="conduit_deviation", refresh_budget=ratio).stats
    (seen,), (selected,) = recorder.calls.states, recorder.calls.selected
    n_visual, budget = 3 * NUM_IMAGE_TOKENS, budget_tokens(ratio, 3 * NUM_IMAGE_TOKENS)
    assert stats.refreshed_tokens == selected.numel() == budget

    k1, v1 = reference_first_layer_kv(runtime, seen, recorder.embeds)
    k_old, v_old = (t.double().cpu() for t in recorder.cached)
    deviation = (k1 - k_old).flatten(1).norm(dim=1) + (v1 - v_old).flatten(1).norm(dim=1)
    assert deviation.min() > 0  # the tokens' context changed: every layer-1 KV moved
    expected = torch.sort(torch.topk(reference_scores(seen) * deviation, budget).indices).values
    if runtime.device.type == "cpu":
        assert torch.equal(selected, expected)
    else:
        assert len(set(selected.tolist()) & set(expected.tolist())) >= 0.9 * budget

    slots = seen["tokens"].slots
    rows = recompute_rows(slots[selected].tolist(), set(slots.tolist()), stats.prompt_tokens)
    assert stats.recomputed_token_layers == n_visual + rows * runtime.model.config.n_layers


def reference_focus_selection(seen) -> torch.Tensor:
    """conduit_focus in float64 from what a recorder saw: per-head softmax over every visible key,
    each head's share of its visual attention, weighted by (share on its top B)^4, summed, times the
    layer mean of ||V||; then per image the top tokens, B split by largest remainder of size."""
    tokens, positions, budget = seen["tokens"], seen["positions"].long(), seen["budget"]
    q_pos = torch.tensor(seen["query_positions"])
    weighted, norms = 0.0, []
    for layer in range(len(seen["kv"])):
        k, v = (t.double().cpu() for t in seen["kv"][layer])
        q = seen["q"][layer].double().cpu()
        keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * seen["scale"]
        scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        per_head = torch.softmax(scores, dim=-1).mean(dim=1)[:, tokens.slots]        # [H, N]
        share = per_head / per_head.sum(dim=1, keepdim=True)
        focus = torch.sort(share, dim=1, descending=True).values[:, :budget].sum(dim=1)
        weighted = weighted + (share * focus[:, None] ** 4).sum(dim=0)
        norms.append(v.flatten(1).norm(dim=1)[tokens.slots])
    score = weighted * torch.stack(norms).mean(dim=0)
    return top_of_each_image(score, tokens, size_shares(tokens, budget))


def size_shares(tokens, budget: int) -> list[int]:
    """``budget`` split among the images by largest remainder of their sizes (ties: the first image)."""
    sizes = [int((tokens.image == j).sum()) for j in range(tokens.n_images)]
    quotas = [budget * size / sum(sizes) for size in sizes]
    shares = [math.floor(x) for x in quotas]
    for j in sorted(range(len(sizes)), key=lambda i: (-(quotas[i] - shares[i]), i))[:budget - sum(shares)]:
        shares[j] += 1
    return shares


def top_of_each_image(score: torch.Tensor, tokens, shares: list[int]) -> torch.Tensor:
    """Per image its top ``shares[j]`` tokens by ``score``: sorted indices."""
    chosen = []
    for j, k in enumerate(shares):
        members = torch.nonzero(tokens.image == j).flatten()
        chosen += members[torch.topk(score[members], k).indices].tolist()
    return torch.tensor(sorted(chosen))


def per_head_visual_attention(seen, layer: int) -> torch.Tensor:
    """float64 [H, N]: each head's softmax over every key its query rows see, mean over the rows, at the
    restored visual tokens."""
    tokens, positions = seen["tokens"], seen["positions"].long()
    q_pos = torch.tensor(seen["query_positions"])
    k = seen["kv"][layer][0].double().cpu()
    q = seen["q"][layer].double().cpu()
    keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * seen["scale"]
    scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.softmax(scores, dim=-1).mean(dim=1)[:, tokens.slots]


def reference_local_selection(seen) -> torch.Tensor:
    """conduit_local in float64: over the first ceil(L/2) layers, each head's attention share within
    each image, weighted by (its share on that image's top B_j)^4, summed, times the mean ||V|| of
    those layers; per image its top B_j, B split by largest remainder of size."""
    tokens, budget = seen["tokens"], seen["budget"]
    shares = size_shares(tokens, budget)
    layers = range((len(seen["kv"]) + 1) // 2)
    weighted = torch.zeros(tokens.n, dtype=torch.float64)
    for layer in layers:
        attention = per_head_visual_attention(seen, layer)                           # [H, N]
        for j, k in enumerate(shares):
            members = torch.nonzero(tokens.image == j).flatten()
            within = attention[:, members] / attention[:, members].sum(dim=1, keepdim=True)
            focus = torch.sort(within, dim=1, descending=True).values[:, :k].sum(dim=1)
            weighted[members] += (within * focus[:, None] ** 4).sum(dim=0)
    norms = torch.stack([seen["kv"][layer][1].double().cpu().flatten(1).norm(dim=1)[tokens.slots] for layer in layers])
    return top_of_each_image(weighted * norms.mean(dim=0), tokens, shares)


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_conduit_focus_equals_a_float64_reference(warm, monkeypatch, ratio):
    runtime, pics = warm
    recorder = RecordingFocus()
    monkeypatch.setitem(POLICIES, "conduit_focus", recorder)
    messages = interleaved([pics[1], pics[0], pics[2]], "Which page is bluest?")
    stats = runtime.generate(messages, max_tokens=1, refresh="conduit_focus", refresh_budget=ratio).stats
    (seen,), (selected,) = recorder.calls.states, recorder.calls.selected
    budget = budget_tokens(ratio, 3 * NUM_IMAGE_TOKENS)
    assert stats.refreshed_tokens == selected.numel() == budget
    per_image = torch.bincount(seen["tokens"].image[selected], minlength=3).tolist()
    assert max(per_image) - min(per_image) <= 1  # three images of one size: the budget split evenly
    expected = reference_focus_selection(seen)
    if runtime.device.type == "cpu":
        assert torch.equal(selected, expected)
    else:
        assert len(set(selected.tolist()) & set(expected.tolist())) >= 0.9 * budget


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_conduit_local_equals_a_float64_reference(warm, monkeypatch, ratio):
    runtime, pics = warm
    recorder = RecordingLocal()
    monkeypatch.setitem(POLICIES, "conduit_local", recorder)
    messages = interleaved([pics[2], pics[0], pics[1]], "Which page is reddest?")
    stats = runtime.generate(messages, max_tokens=1, refresh="conduit_local", refresh_budget=ratio).stats
    (seen,), (selected,) = recorder.calls.states, recorder.calls.selected
    budget = budget_tokens(ratio, 3 * NUM_IMAGE_TOKENS)
    assert stats.refreshed_tokens == selected.numel() == budget
    expected = reference_local_selection(seen)
    assert not torch.equal(expected, reference_focus_selection(seen))  # the two rules choose differently here
    if runtime.device.type == "cpu":
        assert torch.equal(selected, expected)
    else:
        assert len(set(selected.tolist()) & set(expected.tolist())) >= 0.9 * budget


# -- compression -------------------------------------------------------------------------------------------
def test_vlcache_all_keeps_everything_at_keep_1(runtime):
    messages = interleaved([picture(i) for i in range(2)], "Which page has the most blue?")
    plain = runtime.generate(messages, max_tokens=6, return_logits=True)
    kept = runtime.generate(messages, max_tokens=6, return_logits=True, compress="vlcache_all", keep=1.0)
    assert kept.tokens == plain.tokens
    torch.testing.assert_close(kept.logits, plain.logits, atol=1e-5 * plain.logits.abs().max(), rtol=0)
    assert kept.stats.kv_bytes_after_compress == kept.stats.kv_bytes_before_compress


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_vlcache_all_scores_with_every_text_row_after_the_first_image(runtime, monkeypatch, ratio):
    recorder = record(monkeypatch, "vlcache_all")
    messages = interleaved([picture(i) for i in range(3)], "Which page has the most blue, and why?")
    result = runtime.generate(messages, max_tokens=1, compress="vlcache_all", keep=ratio)
    rows = text_after_first_image(runtime, messages)
    assert recorder.post_vision == rows
    after_last_image = runtime.requests.read(messages).post_vision_positions()
    assert len(rows) > len(after_last_image) and rows[-len(after_last_image):] == after_last_image
    assert sum(result.stats.kept_tokens_per_layer) == round(ratio * result.stats.prompt_tokens * runtime.model.config.n_layers)
    expected = reference_keep(recorder)  # VL-Cache's rule scored over those rows, in float64
    if runtime.device.type == "cpu":
        assert recorder.kept == expected
    else:
        for ours, ref in zip(recorder.kept, expected):
            assert len(ours) == len(ref) and len(set(ours) & set(ref)) >= 0.9 * len(ref)
