"""CONDUIT and the refresh baselines on a converted tiny LLaVA-1.5 (CPU, fp32)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from conduit_rt import Runtime, reuse
from conduit_rt.errors import RequestError
from conduit_rt.refresh import POLICIES, Conduit
from conduit_rt.selection import budget_tokens
from conduit_rt.convert.cli import main as convert_main
from tests.fixtures.tiny_llava import NUM_IMAGE_TOKENS, build_tiny_llava


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf_dir = build_tiny_llava(tmp_path_factory.mktemp("hf"), seed=11)
    out = tmp_path_factory.mktemp("gguf")
    assert convert_main([str(hf_dir), "--outdir", str(out), "--dtype", "f32"]) == 0
    return out


def new_runtime(model_dir, device: str = "cpu", **kw) -> Runtime:
    return Runtime(model_dir / "model.gguf", device=device, kv_cache_bytes=kw.pop("kv_cache_bytes", 16 << 20), **kw)


# fp32 on the CPU must match to rounding; bf16 on CUDA to bf16's precision (different batch shapes
# take different GEMM tilings, so even identical math rounds differently)
TOLERANCE = {"cpu": 1e-5, "cuda": 3e-2}


def picture(seed: int, size=(40, 52)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


def request(prefix: str, images: list[Image.Image], question: str) -> list[dict]:
    content = [{"type": "text", "text": prefix}] + [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def first_logits(runtime: Runtime, messages, **kw) -> tuple[torch.Tensor, object]:
    result = runtime.generate(messages, max_tokens=1, return_logits=True, **kw)
    return result.logits[0], result.stats


def cold_logits(model_dir, messages, device: str = "cpu") -> torch.Tensor:
    return first_logits(new_runtime(model_dir, device, prefix_cache_entries=0), messages)[0]


@pytest.fixture
def warm(model_dir, device):
    """A runtime that has seen three pictures (their KV stored, isolated fill) and the pictures."""
    runtime = new_runtime(model_dir, device, prefix_cache_entries=0)
    pics = [picture(i) for i in range(3)]
    runtime.generate(request("Look:", pics, "Which is brightest?"), max_tokens=1, refresh="conduit")
    assert runtime.arena.stats().n_image_entries == 3
    return runtime, pics


@pytest.mark.parametrize("policy,budget", [("full", 0.1), ("conduit", 1.0), ("attention", 1.0), ("random", 1.0),
                                           ("first", 1.0), ("cacheblend", 1.0)])
def test_refresh_everything_equals_a_cold_full_prefill(model_dir, warm, policy, budget):
    runtime, pics = warm
    messages = request("A different prefix, then the pictures in a new order:", [pics[2], pics[0], pics[1]],
                       "What changed?")
    logits, stats = first_logits(runtime, messages, refresh=policy, refresh_budget=budget)
    assert stats.image_hits == 3 and stats.image_misses == 0
    assert stats.refreshed_tokens == stats.visual_tokens == 3 * NUM_IMAGE_TOKENS
    expected = cold_logits(model_dir, messages, runtime.device.type)
    assert (logits - expected).abs().max() <= TOLERANCE[runtime.device.type] * expected.abs().max()


def test_a_policy_that_only_selects_recomputes_its_choice_in_one_pass(model_dir, warm, monkeypatch):
    """A new policy needs only ``select``: the base class scores (if asked), selects and recomputes;
    choosing every token equals a cold full prefill, as ``full`` does."""
    from conduit_rt.refresh import RefreshPolicy

    class Everything(RefreshPolicy):
        name = "everything"

        def select(self, tokens, budget, scores, options):
            return torch.arange(tokens.n)

    monkeypatch.setitem(POLICIES, "everything", Everything())
    runtime, pics = warm
    messages = request("Yet another order:", [pics[1], pics[2], pics[0]], "Which?")
    logits, stats = first_logits(runtime, messages, refresh="everything", refresh_budget=0.1)
    assert stats.refreshed_tokens == stats.visual_tokens == 3 * NUM_IMAGE_TOKENS
    expected = cold_logits(model_dir, messages, runtime.device.type)
    assert (logits - expected).abs().max() <= TOLERANCE[runtime.device.type] * expected.abs().max()


def test_recompute_rows_embedded_after_the_selection_give_the_same_logits(warm, monkeypatch):
    """Past MAX_CANDIDATES positions the recompute's rows are embedded after the selection instead of
    gathered from the candidates embedded while the scoring ran: the same numbers."""
    runtime, pics = warm
    messages = request("Yet another prefix:", [pics[1], pics[0], pics[2]], "Which one?")
    early, _ = first_logits(runtime, messages, refresh="conduit", refresh_budget=0.3)
    monkeypatch.setattr(reuse, "MAX_CANDIDATES", 0)
    late, stats = first_logits(runtime, messages, refresh="conduit", refresh_budget=0.3)
    assert stats.refreshed_tokens == budget_tokens(0.3, stats.visual_tokens) > 0
    assert torch.equal(early, late)


def test_no_refresh_reuses_stale_kv_and_differs_from_full_prefill(model_dir, warm):
    runtime, pics = warm
    messages = request("Another prefix entirely:", [pics[1], pics[2]], "Same question?")
    logits, stats = first_logits(runtime, messages, refresh="none")
    assert stats.refreshed_tokens == 0 and stats.visual_tokens == 2 * NUM_IMAGE_TOKENS
    assert stats.prefill_flops_ratio < 0.6
    expected = cold_logits(model_dir, messages, runtime.device.type)
    assert (logits - expected).abs().max() > 3 * TOLERANCE[runtime.device.type] * expected.abs().max()


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"full"}))
@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.1, 0.3])
def test_every_policy_refreshes_exactly_its_budget(model_dir, warm, policy, ratio):
    runtime, pics = warm
    messages = request("Prefix B:", [pics[0], pics[2]], "Tell me.")
    _, stats = first_logits(runtime, messages, refresh=policy, refresh_budget=ratio)
    n_vis = 2 * NUM_IMAGE_TOKENS
    expected = 0 if policy == "none" else math.ceil(ratio * n_vis - 1e-9)
    assert stats.visual_tokens == n_vis and stats.refreshed_tokens == expected == budget_tokens(ratio, n_vis) * (policy != "none")
    if expected and policy != "cacheblend":
        assert stats.recomputed_token_layers >= expected * runtime.model.config.n_layers
    if policy == "cacheblend" and expected:
        # every visual token on the first two layers, then counts whose mean is the budget where it leaves room
        n_layers = runtime.model.config.n_layers
        assert stats.recomputed_token_layers >= max(min(2, n_layers) * n_vis, expected * n_layers)


def snapshot(context) -> dict:
    """What a reference needs to redo a selection from a refresh context's state now: the query rows'
    q per chosen layer, every layer's KV and the slots' positions."""
    config, seq = context.config, context.seq
    layers = context.options.layers or range(config.n_layers)
    return dict(tokens=context.tokens, budget=context.budget, options=context.options,
                query_positions=context.queries(layers[0])[1],
                q={layer: context.queries(layer)[0].clone() for layer in layers},
                kv=[seq.read_kv(layer) for layer in range(config.n_layers)],
                positions=seq.positions(0).clone(), n_heads=config.n_heads, scale=config.attention_scale)


class RecordingConduit(Conduit):
    """The conduit policy, keeping what it saw so that a reference can redo the selection."""

    def refresh(self, context):
        self.seen = snapshot(context)
        return super().refresh(context)

    def select(self, tokens, budget, scores, options):
        self.chosen = super().select(tokens, budget, scores, options)
        return self.chosen


def reference_selection(seen) -> torch.Tensor:
    """docs/methods.md §1 steps 5-7 in plain torch: full softmax over every visible key, value norms,
    layer mean, image amplification, one global top-k."""
    return torch.sort(torch.topk(reference_scores(seen), seen["budget"]).indices).values


def reference_scores(seen, values=None) -> torch.Tensor:
    """s'(t) of docs/methods.md §1 steps 5-6 (float64 [N]) from what a recorder saw; ``values``: the
    sequence's V per layer to take the value norms from (default: the V ``seen`` holds)."""
    tokens, positions = seen["tokens"], seen["positions"].long()
    q_pos = torch.tensor(seen["query_positions"])
    per_layer = []
    chosen = seen["options"].layers or range(len(seen["kv"]))
    for layer in chosen:
        k, v = seen["kv"][layer]
        q, k, v = seen["q"][layer].double().cpu(), k.double().cpu(), v.double().cpu()  # q [|Q|, H, d]
        group = q.shape[1] // k.shape[1]
        keys = k.repeat_interleave(group, dim=1)                         # [n, H, d]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * seen["scale"]
        scores = scores.masked_fill(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        attention = torch.softmax(scores, dim=-1).sum(dim=(0, 1)) / (q.shape[0] * seen["n_heads"])  # [n]
        if values is not None:
            v = values[layer].double().cpu()
        value_norm = v.flatten(1).norm(dim=1)                            # [n]
        per_layer.append((attention * value_norm)[tokens.slots])
    s = torch.stack(per_layer).mean(0)
    if tokens.n_images > 1:
        m = torch.stack([s[tokens.image == j].clamp(min=0).mean() for j in range(tokens.n_images)])
        c = 1 + seen["options"].lam * (m / m.mean() - 1)
        s = c[tokens.image] * s
    return s


@pytest.mark.parametrize("n_images,lam,layers", [(1, 1.0, None), (3, 1.0, None), (3, 2.5, None), (3, 1.0, (1,))])
def test_conduit_selection_equals_a_torch_reference(warm, monkeypatch, n_images, lam, layers):
    """Exact on the CPU; in bf16 on CUDA, near-ties may swap, so 90% of the set must agree."""
    runtime, pics = warm
    recorder = RecordingConduit()
    monkeypatch.setitem(POLICIES, "conduit", recorder)
    messages = request("Yet another prefix.", pics[:n_images][::-1], "Which one has the most red?")
    runtime.generate(messages, max_tokens=1, refresh="conduit", refresh_budget=0.2,
                     refresh_options={"lam": lam, "layers": layers})
    assert recorder.seen["budget"] == budget_tokens(0.2, n_images * NUM_IMAGE_TOKENS)
    expected = reference_selection(recorder.seen)
    if runtime.device.type == "cpu":
        assert torch.equal(recorder.chosen, expected)
    else:
        overlap = len(set(recorder.chosen.tolist()) & set(expected.tolist()))
        assert overlap >= 0.9 * expected.numel()


@pytest.mark.parametrize("options", [{"lam": -1.0}, {"query_tokens": 0}, {"layers": ()}, {"layers": (99,)},
                                     {"layers": (-1,)}, {"fill": "sideways"}])
def test_bad_refresh_options_are_request_errors_and_the_runtime_keeps_answering(warm, options):
    runtime, pics = warm
    messages = request("Another prefix.", pics[::-1], "Which is darkest?")
    with pytest.raises(RequestError):
        runtime.generate(messages, max_tokens=1, refresh="conduit", refresh_options=options)
    assert runtime.generate(messages, max_tokens=1, refresh="conduit").stats.image_hits == 3


@pytest.mark.parametrize("signs", ["mixed", "all non-positive"])
def test_amplification_equals_its_formula(signs):
    """c_j = 1 + lam (m_j / mean m - 1), m_j the mean of max(s, 0) over image j; c = 1 when every m_j is 0."""
    from conduit_rt.refresh import amplify

    gen = torch.Generator().manual_seed(3)
    image = torch.tensor([0] * 5 + [1] * 3 + [2] * 7)
    scores = torch.randn(15, generator=gen, dtype=torch.float64)
    if signs != "mixed":
        scores = -scores.abs()
    m = torch.stack([scores[image == j].clamp(min=0).mean() for j in range(3)])
    c = torch.ones(3, dtype=torch.float64) if float(m.mean()) == 0 else 1 + 1.5 * (m / m.mean() - 1)
    assert torch.allclose(amplify(scores, image, 3, 1.5), c[image] * scores, rtol=1e-12, atol=0)


def test_exact_prefix_reuse_equals_a_cold_run(model_dir):
    runtime = new_runtime(model_dir)
    pics = [picture(7), picture(8)]
    messages = request("Shared prefix.", pics, "First question?")
    runtime.generate(messages, max_tokens=1)
    follow_up = request("Shared prefix.", pics, "A second, longer question about them?")
    logits, stats = first_logits(runtime, follow_up)
    assert stats.reused_tokens >= 2 * NUM_IMAGE_TOKENS and stats.image_hits == 2
    assert stats.prefill_tokens == stats.prompt_tokens - stats.reused_tokens
    assert runtime.arena.stats().n_blocks_shared > 0
    expected = cold_logits(model_dir, follow_up)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_images_differing_in_one_pixel_never_share_kv(warm):
    runtime, pics = warm
    pixels = np.array(pics[0])
    pixels[3, 4, 1] ^= 1
    _, stats = first_logits(runtime, request("P:", [Image.fromarray(pixels)], "Q?"), refresh="none",
                            refresh_options={"fill": "in_context"})
    assert stats.image_hits == 0 and stats.image_misses == 1 and stats.visual_tokens == 0
    assert runtime.arena.stats().n_image_entries == 4  # stored beside the original, not over it


def test_hits_and_misses_under_new_prefix_order_and_companions(warm):
    runtime, pics = warm
    fresh = picture(99)
    _, stats = first_logits(runtime, request("New prefix.", [pics[1], fresh, pics[0]], "Compare."), refresh="conduit")
    assert (stats.images, stats.image_hits, stats.image_misses) == (3, 2, 1)
    assert stats.visual_tokens == 3 * NUM_IMAGE_TOKENS  # the new one was filled alone, then restored too
    _, again = first_logits(runtime, request("Other prefix.", [fresh], "And this?"), refresh="conduit")
    assert (again.image_hits, again.image_misses) == (1, 0)  # stored (isolated fill) by the request above
    _, plain = first_logits(runtime, request("Other prefix.", [fresh, pics[2]], "And this?"))
    assert (plain.image_hits, plain.image_misses, plain.visual_tokens) == (0, 2, 0)  # refresh=None restores nothing


def test_a_small_image_budget_evicts_and_keeps_answering_correctly(model_dir):
    per_image = 2 * 2 * 2 * 16 * 4 * 2 * 16  # 2 layers x 2 blocks of 16 tokens x (K+V) x 2 heads x 16 dims x 4 B
    runtime = new_runtime(model_dir, image_cache_bytes=per_image + per_image // 2, prefix_cache_entries=0)
    pics = [picture(20 + i) for i in range(3)]
    for pic in pics:
        runtime.generate(request("Show:", [pic], "Describe."), max_tokens=1, refresh="conduit")
    assert runtime.arena.stats().n_image_entries == 1 and runtime.arena.stats().n_image_evictions == 2
    _, last = first_logits(runtime, request("Again:", [pics[2]], "Still there?"), refresh="conduit")
    assert (last.image_hits, last.image_misses) == (1, 0)  # the most recent one survived
    messages = request("Later:", pics, "All three?")
    logits, stats = first_logits(runtime, messages, refresh="full")
    assert stats.image_misses >= 2 and runtime.arena.stats().image_bytes <= runtime.arena.image_cache_bytes
    expected = cold_logits(model_dir, messages)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("n_visual,budget,n_layers", [(100, 10, 32), (576 * 8, 461, 32), (50, 30, 4), (50, 3, 2), (64, 20, 6)])
def test_cacheblend_layer_counts_start_full_decay_and_keep_the_budget(n_visual, budget, n_layers):
    from conduit_rt.refresh import CacheBlend

    counts = CacheBlend.layer_counts(n_visual, budget, n_layers)
    assert counts[: min(2, n_layers)] == [n_visual] * min(2, n_layers)
    assert all(a >= b for a, b in zip(counts, counts[1:]))
    assert sum(counts) == max(budget * n_layers, min(2, n_layers) * n_visual)
