"""VL-Cache and the compression baselines on a converted tiny LLaVA-1.5 (CPU fp32; CUDA bf16 under `gpu`)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conduit_rt import compress as compression
from conduit_rt.models.rope import apply_rope
from tests.test_conduit import NUM_IMAGE_TOKENS, RecordingConduit, model_dir, new_runtime, picture, reference_selection, request  # noqa: F401

POLICY_NAMES = sorted(compression.POLICIES)
MESSAGES = lambda pics: request("Read these:", pics, "Which picture has the most blue, and why?")  # noqa: E731


@pytest.fixture
def runtime(model_dir, device):
    return new_runtime(model_dir, device, prefix_cache_entries=0)


class Recording:
    """Wraps a policy: keeps the prompt's KV, positions and the q it was given, and the kept slots."""

    def __init__(self, policy) -> None:
        self.policy, self.name = policy, policy.name

    def query_rows(self, prompt):
        self.after_last_image = prompt.post_vision_positions()  # VL-Cache's P, whatever rows the policy reads
        return self.policy.query_rows(prompt)

    def observed_positions(self, n_prompt, post_vision, options):
        return self.policy.observed_positions(n_prompt, post_vision, options)

    def keep(self, stats, ratio):
        n_layers = stats.n_layers
        self.kv = [stats.seq.read_kv(layer) for layer in range(n_layers)]
        self.positions = stats.seq.positions(0).long()
        rows = list(range(stats.m))
        self.q = [dict(zip(*reversed(stats.queries(layer, rows)))) for layer in range(n_layers)]
        self.post_vision, self.options, self.m, self.ratio = stats.post_vision, stats.options, stats.m, ratio
        self.n_heads, self.scale = stats.n_heads, stats.scale
        self.kept = self.policy.keep(stats, ratio)
        if self.name == "vlcache_draft":  # the drafted steps' q join the prompt's, by position
            drafted, positions = stats.drafted_queries()
            for layer in range(n_layers):
                self.q[layer].update(zip(positions, drafted[layer]))
            self.draft_positions = positions
            self.positions_after_draft = stats.seq.positions(0).long()
        return self.kept


def record(monkeypatch, name: str) -> Recording:
    recorder = Recording(compression.POLICIES[name])
    monkeypatch.setitem(compression.POLICIES, name, recorder)
    return recorder


# -- a plain-torch reference of docs/methods.md §2 --------------------------------------------------------
def probabilities(rec: Recording, layer: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Full softmax [H, |rows|, m] (float64) of the rows that were computed, and the visible mask."""
    rows = [r for r in rows if r in rec.q[layer]]
    q = torch.stack([rec.q[layer][r] for r in rows]).double().cpu()
    k = rec.kv[layer][0].double().cpu()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    visible = rec.positions[None, :] <= torch.tensor(rows)[:, None]
    scores = torch.einsum("qhd,khd->hqk", q, k) * rec.scale
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1), visible


def largest_remainder(weights: list[float], total: int, cap: int) -> list[int]:
    quotas = [total * w / sum(weights) for w in weights]
    shares = [min(cap, math.floor(q)) for q in quotas]
    for i in sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - math.floor(quotas[i])), i)):
        if sum(shares) < total and shares[i] < cap:
            shares[i] += 1
    return shares


def best(scores: torch.Tensor, k: int, forced: list[int]) -> list[int]:
    keep = sorted(set(forced))[:k]
    scores = scores.clone()
    scores[keep] = float("-inf")
    return sorted(keep + torch.topk(scores, k - len(keep)).indices.tolist())


def reference_keep(rec: Recording) -> list[list[int]]:
    m, n_layers, o = rec.m, len(rec.kv), rec.options
    total = round(rec.ratio * m * n_layers)
    uniform = largest_remainder([1.0] * n_layers, total, m)
    window = list(range(m - o.window, m)) if m > o.window else list(range(m))
    out = []
    for layer in range(n_layers):
        k = uniform[layer]
        if rec.name == "none":
            out.append(list(range(m)))
        elif rec.name == "random":
            g = torch.Generator().manual_seed(o.seed * 100003 + layer)
            out.append(sorted(torch.randperm(m, generator=g)[:k].tolist()))
        elif rec.name == "streamingllm":
            out.append(sorted(set(range(min(o.sinks, k))) | set(range(m - (k - min(o.sinks, k)), m))))
        elif rec.name == "h2o":
            p, _ = probabilities(rec, layer, list(range(m)))
            out.append(best(p.sum((0, 1)), k, list(range(m - k // 2, m))))
        elif rec.name in ("snapkv", "pyramidkv"):
            if rec.name == "pyramidkv":
                top, bottom = 1 / o.pyramid_beta, 2 - 1 / o.pyramid_beta
                k = largest_remainder([bottom + (top - bottom) * i / (n_layers - 1) for i in range(n_layers)], total, m)[layer]
            p, _ = probabilities(rec, layer, window)
            pooled = F.avg_pool1d(p.sum((0, 1))[None, None], o.pool_kernel, 1, o.pool_kernel // 2, count_include_pad=False)[0, 0]
            out.append(best(pooled, k, window))
        elif rec.name in ("vlcache", "vlcache_all"):  # vlcache_all: scored by every text token from the first image on
            densities = []
            for i in range(n_layers):
                p, visible = probabilities(rec, i, rec.post_vision)
                below = (p < o.threshold * p.amax(-1, keepdim=True)) & visible
                densities.append(1 - float((below.sum((1, 2)) / visible.sum()).mean()))
            betas = [min(1.0, max(o.min_layer_ratio, d / sum(densities) * rec.ratio * n_layers)) for d in densities]
            k = largest_remainder(betas, total, m)[layer]
            p, _ = probabilities(rec, layer, rec.post_vision)
            kept_rows = rec.post_vision if rec.name == "vlcache" else rec.after_last_image
            out.append(best(p.sum((0, 1)), k, kept_rows))
        elif rec.name == "vlcache_flat":  # VL-Cache's scores, every layer the same budget
            p, _ = probabilities(rec, layer, rec.post_vision)
            out.append(best(p.sum((0, 1)), k, rec.post_vision))
        elif rec.name == "vlcache_draft":  # each token's share of P's attention plus its share of the drafted steps'
            post_vision = probabilities(rec, layer, rec.post_vision)[0].sum((0, 1))
            drafted = probabilities(rec, layer, rec.draft_positions)[0].sum((0, 1))
            out.append(best(post_vision / post_vision.sum() + drafted / drafted.sum(), k, rec.post_vision[-2:]))
    return out


# -- tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_keep_everything_equals_no_compression(runtime, name):
    pics = [picture(i) for i in range(2)]
    plain = runtime.generate(MESSAGES(pics), max_tokens=6, return_logits=True)
    kept = runtime.generate(MESSAGES(pics), max_tokens=6, return_logits=True, compress=name, keep=1.0)
    assert kept.tokens == plain.tokens
    torch.testing.assert_close(kept.logits, plain.logits, atol=1e-5 * plain.logits.abs().max(), rtol=0)
    assert kept.stats.kv_bytes_after_compress == kept.stats.kv_bytes_before_compress


@pytest.mark.parametrize("name", sorted(set(POLICY_NAMES) - {"none"}))
@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.2, 0.4])
def test_kept_counts_sum_exactly_and_blocks_are_freed(runtime, name, ratio):
    pics = [picture(i) for i in range(3)]
    result = runtime.generate(MESSAGES(pics), max_tokens=1, compress=name, keep=ratio)
    s, c = result.stats, runtime.model.config
    assert sum(s.kept_tokens_per_layer) == round(ratio * s.prompt_tokens * c.n_layers)
    block = runtime.arena.block_size
    block_bytes = runtime.arena.stats().block_bytes
    assert s.kv_bytes_after_compress == sum(-(-k // block) for k in s.kept_tokens_per_layer) * block_bytes
    # about α of before, plus at most one partial block per layer
    assert s.kv_bytes_after_compress <= ratio * s.kv_bytes_before_compress + c.n_layers * block_bytes * 1.01 + block_bytes


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_kept_sets_equal_a_torch_reference(runtime, monkeypatch, name, ratio):
    recorder = record(monkeypatch, name)
    runtime.generate(MESSAGES([picture(i) for i in range(3)]), max_tokens=1, compress=name, keep=ratio)
    expected = reference_keep(recorder)
    if runtime.device.type == "cpu":
        assert recorder.kept == expected
    else:  # bf16: near-ties may swap
        for ours, ref in zip(recorder.kept, expected):
            assert len(ours) == len(ref) and len(set(ours) & set(ref)) >= 0.9 * len(ref)


def reference_decode_logits(runtime, rec: Recording, token: int, position: int) -> torch.Tensor:
    """One decode step in plain torch over the full prompt KV with the dropped tokens masked out."""
    model = runtime.model.language_model
    x = model.embed_tokens(torch.tensor([token], device=runtime.device)).double()
    pos = torch.tensor([position], dtype=torch.int32)
    for layer, block in enumerate(model.layers):
        attn = block.self_attn
        h = block.input_layernorm(x.to(runtime.dtype)).double()
        q = (h @ attn.q_proj.weight.double().T).view(1, attn.n_heads, attn.head_dim)
        k = (h @ attn.k_proj.weight.double().T).view(1, attn.n_kv_heads, attn.head_dim)
        v = (h @ attn.v_proj.weight.double().T).view(1, attn.n_kv_heads, attn.head_dim)
        rot = model.rotary
        q = apply_rope(q, pos.to(q.device), rot.inv_freq, rot.attention_scaling).double()
        k = apply_rope(k, pos.to(k.device), rot.inv_freq, rot.attention_scaling).double()
        kept = torch.tensor(rec.kept[layer])
        keys = torch.cat([rec.kv[layer][0][kept].double(), k])
        values = torch.cat([rec.kv[layer][1][kept].double(), v])
        group = attn.n_heads // attn.n_kv_heads
        scores = torch.einsum("hd,khd->hk", q[0], keys.repeat_interleave(group, 1)) * attn.scale
        out = torch.einsum("hk,khd->hd", scores.softmax(-1), values.repeat_interleave(group, 1))
        x = x + out.reshape(1, -1) @ attn.o_proj.weight.double().T
        x = x + block.mlp.double()(block.post_attention_layernorm.double()(x))
        block.mlp.to(runtime.dtype), block.post_attention_layernorm.to(runtime.dtype)
    return model.lm_head.double()(model.norm.double()(x)).float()[0]


@pytest.mark.parametrize("name", ["vlcache", "snapkv", "streamingllm"])
def test_decode_after_compaction_equals_a_reference_that_masks_the_dropped_tokens(runtime, monkeypatch, name):
    if runtime.device.type != "cpu":
        pytest.skip("the float64 reference runs on the CPU model")
    recorder = record(monkeypatch, name)
    result = runtime.generate(MESSAGES([picture(i) for i in range(2)]), max_tokens=2, return_logits=True,
                              compress=name, keep=0.25)
    expected = reference_decode_logits(runtime, recorder, result.tokens[0], result.stats.prompt_tokens)
    runtime.model.language_model.float()
    assert (result.logits[1] - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("steps", [1, 3])
def test_drafted_steps_are_the_greedy_answers_steps_and_leave_the_prompt_as_it_was(runtime, monkeypatch, steps):
    if runtime.device.type != "cpu":
        pytest.skip("the float64 reference runs on the CPU model")
    messages = MESSAGES([picture(i) for i in range(2)])
    plain = runtime.generate(messages, max_tokens=steps + 1)
    recorder = record(monkeypatch, "vlcache_draft")
    runtime.generate(messages, max_tokens=1, compress="vlcache_draft", keep=0.3,
                     compress_options={"draft_steps": steps})
    m = recorder.m
    assert recorder.draft_positions == list(range(m, m + steps))
    # layer 0's q of step i: the greedy answer's token i, embedded, normed, projected and rotated at m + i
    model = runtime.model.language_model
    attn, rot = model.layers[0].self_attn, model.rotary
    h = model.layers[0].input_layernorm(model.embed_tokens(torch.tensor(plain.tokens[:steps]))).double()
    q = (h @ attn.q_proj.weight.double().T).view(steps, attn.n_heads, attn.head_dim)
    q = apply_rope(q, torch.arange(m, m + steps, dtype=torch.int32), rot.inv_freq, rot.attention_scaling)
    drafted = torch.stack([recorder.q[0][p] for p in recorder.draft_positions]).double()
    torch.testing.assert_close(drafted, q.double(), atol=1e-4 * float(q.abs().max()), rtol=0)
    assert torch.equal(recorder.positions_after_draft, recorder.positions)  # the drafted steps were dropped again
    assert runtime.arena.stats().n_seqs == 0


def test_recompress_every_n_keeps_decoding_within_the_budget(runtime):
    every = 4
    result = runtime.generate(MESSAGES([picture(1)]), max_tokens=9, compress="vlcache", keep=0.2,
                              compress_options={"recompress_every": every})
    s, block = result.stats, runtime.arena.block_size
    # without re-compression each layer would grow by one token per step; with it, it returns to
    # its budget (plus the post-vision and recent tokens it always keeps) every 4 steps
    bound = sum(-(-(k + every + 16) // block) for k in s.kept_tokens_per_layer) * runtime.arena.stats().block_bytes
    assert s.kv_bytes <= bound
    assert runtime.arena.stats().n_seqs == 0  # compressed sequences are not kept as prefixes


def test_conduit_and_vlcache_together_equal_the_two_references_in_sequence(model_dir, device, monkeypatch):
    runtime = new_runtime(model_dir, device, prefix_cache_entries=0)
    pics = [picture(i) for i in range(3)]
    runtime.generate(request("First look:", pics, "Describe."), max_tokens=1, refresh="conduit")
    conduit = RecordingConduit()
    from conduit_rt.refresh import POLICIES as REFRESH
    monkeypatch.setitem(REFRESH, "conduit", conduit)
    squeeze = record(monkeypatch, "vlcache")
    result = runtime.generate(request("A new prefix:", pics[::-1], "Which is darkest?"), max_tokens=1,
                              refresh="conduit", refresh_budget=0.2, compress="vlcache", keep=0.3)
    assert result.stats.image_hits == 3 and result.stats.refreshed_tokens > 0
    assert sum(result.stats.kept_tokens_per_layer) == round(0.3 * result.stats.prompt_tokens * 2)
    if device == "cpu":
        assert torch.equal(conduit.chosen, reference_selection(conduit.seen))
        assert squeeze.kept == reference_keep(squeeze)
