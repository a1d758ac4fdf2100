"""LLaVA-1.5 model code against Hugging Face transformers, on a tiny random checkpoint.

The checkpoint is built with ``build_tiny_llava``, converted to f32 GGUF with ``conduit_rt.convert.cli.main``
and loaded with ``conduit_rt.models.load_model``; the reference is
``LlavaForConditionalGeneration.from_pretrained`` on the source folder (fp32, eager attention).
Prompt ids and pixel values come from HF's ``LlavaProcessor``, so both sides see identical inputs.
Logits must agree within 1e-4 of their largest magnitude.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from conduit_rt.errors import ModelFormatError
from conduit_rt.models import ForwardBatch, load_model
from conduit_rt.models.rope import RopeConfig, apply_rope, inverse_frequencies
from tests.fixtures.tiny_llava import build_tiny_llava

RTOL = 1e-4  # of max |reference logits|
IMAGE_SIZES = [(41, 57), (30, 30), (64, 33)]  # (height, width) before preprocessing


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(source folder, converted folder) of the tiny model."""
    import conduit_rt.convert.cli

    source = build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))
    converted = tmp_path_factory.mktemp("tiny_llava_gguf")
    assert conduit_rt.convert.cli.main([str(source), "--outdir", str(converted), "--dtype", "f32", "--quiet"]) == 0
    return source, converted


@pytest.fixture(scope="module")
def reference(checkpoint):
    source, _ = checkpoint
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        source, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    return transformers.AutoProcessor.from_pretrained(checkpoint[0])


@pytest.fixture(scope="module")
def model(checkpoint):
    _, converted = checkpoint
    return load_model(converted / "model.gguf", converted / "mmproj.gguf", "cpu", torch.float32)


def make_inputs(processor, n_images: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt ids int64 [n] (image tokens expanded) and pixel values [n_images, 3, 30, 30] | None."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in IMAGE_SIZES[:n_images]]
    text = "USER: " + "<image>\n" * n_images + "What is in these pictures, and why? ASSISTANT:"
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    return inputs["input_ids"][0], inputs.get("pixel_values")


def reference_logits(reference, ids: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
    """HF logits float32 [n, vocab] of every prompt position."""
    with torch.no_grad():
        return reference(input_ids=ids[None], pixel_values=pixel_values).logits[0].float()


def input_embeddings(model, ids: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
    """[n, hidden]: token embeddings with each image's features at its placeholder tokens."""
    embeds = model.embed_tokens(ids.to(model.device))
    if pixel_values is not None:
        features = model.encode_pixels(pixel_values)  # [n_img, tokens_per_image, hidden]
        embeds[ids.to(model.device) == model.config.image_token_id] = features.reshape(-1, features.shape[-1])
    return embeds


def prefill(model, seq, embeds: torch.Tensor, start: int) -> torch.Tensor:
    """Appends tokens at positions [start, start + n) and runs them; hidden states [n, hidden]."""
    end = start + embeds.shape[0]
    seq.append(torch.arange(start, end, dtype=torch.int32))
    return model.forward(seq, embeds, ForwardBatch.contiguous(start, end, model.device))


def assert_close_logits(ours: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    scale = expected.abs().max().item()
    error = (ours.float().cpu() - expected).abs().max().item()
    assert error <= rtol * scale, f"max |diff| {error:.3g} > {rtol} x {scale:.3g}"


def test_image_features_match_transformers(model, reference, processor):
    _, pixel_values = make_inputs(processor, 3)
    with torch.no_grad():
        expected = reference.get_image_features(
            pixel_values=pixel_values, vision_feature_layer=-2, vision_feature_select_strategy="default"
        ).pooler_output
    ours = model.encode_pixels(pixel_values)
    assert ours.shape == (3, model.config.tokens_per_image, model.config.hidden)
    torch.testing.assert_close(ours, torch.stack(list(expected)), rtol=0, atol=1e-5 * ours.abs().max().item())


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_next_token_logits_match_transformers(model, reference, processor, n_images):
    ids, pixel_values = make_inputs(processor, n_images, seed=n_images)
    assert int((ids == model.config.image_token_id).sum()) == n_images * model.config.tokens_per_image
    expected = reference_logits(reference, ids, pixel_values)[-1]
    with model.new_arena(4 << 20) as arena, arena.new_sequence() as seq:
        hidden = prefill(model, seq, input_embeddings(model, ids, pixel_values), 0)
        assert_close_logits(model.logits(hidden[-1:])[0], expected)


def test_prefill_logits_of_every_position_match_transformers(model, reference, processor):
    ids, pixel_values = make_inputs(processor, 1, seed=7)
    expected = reference_logits(reference, ids, pixel_values)
    with model.new_arena(4 << 20) as arena, arena.new_sequence() as seq:
        hidden = prefill(model, seq, input_embeddings(model, ids, pixel_values), 0)
        assert_close_logits(model.logits(hidden), expected)


def test_chunked_prefill_and_decode_steps_equal_one_shot(model, reference, processor):
    ids, pixel_values = make_inputs(processor, 3, seed=11)
    expected = reference_logits(reference, ids, pixel_values)
    embeds = input_embeddings(model, ids, pixel_values)
    n = ids.shape[0]
    # the first cut falls inside the second image; the last two tokens go one at a time, like decode steps
    cuts = [0, 40, 61, n - 2, n - 1, n]
    with model.new_arena(4 << 20, block_size=8) as arena, arena.new_sequence() as seq:
        chunks = [prefill(model, seq, embeds[a:b], a) for a, b in itertools.pairwise(cuts)]
        assert seq.n_tokens() == n
        assert_close_logits(model.logits(torch.cat(chunks)), expected)
    with model.new_arena(4 << 20, block_size=8) as arena, arena.new_sequence() as seq:
        one_shot = prefill(model, seq, embeds, 0)
    torch.testing.assert_close(torch.cat(chunks), one_shot, rtol=0, atol=1e-5 * one_shot.abs().max().item())


def test_stacked_projections_are_views_holding_the_checkpoint_weights(model, reference):
    """Decode steps read q/k/v and gate/up as one tensor each; the parameters are views of it, hold
    transformers' values and keep its names."""
    theirs = reference.model.language_model.layers
    for ours, layer in zip(model.language_model.layers, theirs):
        attn, mlp = ours.self_attn, ours.mlp
        for stack, parts, reference_parts in (
            (attn.qkv_weight, [attn.q_proj, attn.k_proj, attn.v_proj],
             [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
            (mlp.gate_up_weight, [mlp.gate_proj, mlp.up_proj], [layer.mlp.gate_proj, layer.mlp.up_proj]),
        ):
            assert torch.equal(stack, torch.cat([linear.weight for linear in reference_parts]))
            rows = 0
            for linear in parts:
                assert linear.weight.data_ptr() == stack[rows:].data_ptr()
                rows += linear.weight.shape[0]
            assert rows == stack.shape[0]
    assert "layers.0.self_attn.q_proj.weight" in model.language_model.state_dict()


def test_a_converted_module_restacks_its_projections(model):
    """module.to / .double() replace parameters with new tensors; the stack follows them."""
    mlp = model.language_model.layers[0].mlp
    x = torch.randn(1, mlp.gate_proj.in_features, dtype=torch.float64)
    want = mlp.down_proj.weight.double() @ (F.silu(mlp.gate_proj.weight.double() @ x[0]) * (mlp.up_proj.weight.double() @ x[0]))
    try:
        mlp.double()
        assert mlp.gate_up_weight.dtype == torch.float64
        assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
        torch.testing.assert_close(mlp(x)[0], want)
    finally:
        mlp.float()
    assert mlp.gate_up_weight.dtype == torch.float32 and mlp.up_proj.weight.dtype == torch.float32


def test_recompute_into_explicit_slots_reproduces_prefill(model, processor):
    """Re-running scattered tokens into their own slots (CONDUIT's recompute path) changes nothing."""
    ids, pixel_values = make_inputs(processor, 1, seed=3)
    embeds = input_embeddings(model, ids, pixel_values)
    chosen = torch.tensor([2, 9, 17, 30, ids.shape[0] - 1])
    with model.new_arena(4 << 20) as arena, arena.new_sequence() as seq:
        full = prefill(model, seq, embeds, 0)
        before = [seq.read_kv(layer) for layer in range(model.config.n_layers)]
        positions = chosen.to(torch.int32)
        batch = ForwardBatch(positions=positions, rope_positions=positions, slots=chosen.tolist())
        again = model.forward(seq, embeds[chosen], batch)
        after = [seq.read_kv(layer) for layer in range(model.config.n_layers)]
    torch.testing.assert_close(again, full[chosen], rtol=0, atol=1e-5 * full.abs().max().item())
    for (k0, v0), (k1, v1) in zip(before, after):
        torch.testing.assert_close(k1, k0, rtol=0, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=0, atol=1e-5)


def test_capture_sees_rotated_q_and_pre_rope_kv(model, processor):
    ids, _ = make_inputs(processor, 0, seed=5)

    class Recorder:
        def __init__(self):
            self.seen, self.lse = {}, {}

        def on_layer(self, layer, q, k_pre_rope, v):
            self.seen[layer] = (q.clone(), k_pre_rope.clone(), v.clone())

        def on_attention(self, layer, lse):
            self.lse[layer] = lse

    recorder = Recorder()
    c = model.config
    n = ids.shape[0]
    with model.new_arena(4 << 20) as arena, arena.new_sequence() as seq:
        seq.append(torch.arange(n, dtype=torch.int32))
        model.forward(seq, model.embed_tokens(ids), ForwardBatch.contiguous(0, n, "cpu"), capture=recorder)
        stored = [seq.read_kv(layer) for layer in range(c.n_layers)]
    inv_freq, scaling = inverse_frequencies(c.rope)
    positions = torch.arange(n)
    assert sorted(recorder.seen) == list(range(c.n_layers))
    for layer, (q, k, v) in recorder.seen.items():
        assert q.shape == (n, c.n_heads, c.head_dim) and k.shape == v.shape == (n, c.n_kv_heads, c.head_dim)
        torch.testing.assert_close(stored[layer][0], apply_rope(k, positions, inv_freq, scaling), rtol=0, atol=1e-5)
        torch.testing.assert_close(stored[layer][1], v, rtol=0, atol=0)
        # the rows' log-sum-exp after the attention: causal scores of q over the stored (rotated) keys
        keys = stored[layer][0].double().repeat_interleave(c.n_heads // c.n_kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * c.attention_scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        want_lse = torch.logsumexp(scores.masked_fill(~causal, float("-inf")), -1).T
        torch.testing.assert_close(recorder.lse[layer].double(), want_lse, rtol=1e-5, atol=1e-5)


def test_text_only_load_without_mmproj(checkpoint, reference, processor):
    _, converted = checkpoint
    text_only = load_model(converted / "model.gguf", None, "cpu")
    assert not text_only.has_vision and text_only.config.tokens_per_image == 0
    ids, _ = make_inputs(processor, 0, seed=2)
    with text_only.new_arena(4 << 20) as arena, arena.new_sequence() as seq:
        hidden = prefill(text_only, seq, text_only.embed_tokens(ids), 0)
        assert_close_logits(text_only.logits(hidden[-1:])[0], reference_logits(reference, ids, None)[-1])
    with pytest.raises(ModelFormatError, match="mmproj"):
        text_only.encode_pixels(torch.zeros(1, 3, 30, 30))


@pytest.mark.parametrize("content", [b"NOPE" + bytes(40), b"GGUF\x03\x00\x00\x00" + bytes(6)])
def test_broken_text_file_raises_model_format_error_naming_it(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match="broken.gguf"):
        load_model(path, None, "cpu")


def test_mmproj_given_as_text_model_is_refused(checkpoint):
    _, converted = checkpoint
    with pytest.raises(ModelFormatError, match="is a vision"):
        load_model(converted / "mmproj.gguf", None, "cpu")


@pytest.mark.parametrize(
    "parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_rope_frequencies_and_rotation_match_transformers(parameters):
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim = 16
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(parameters)))
    rope = RopeConfig(
        theta=parameters["rope_theta"],
        rotary_dim=head_dim,
        scaling_type=parameters["rope_type"],
        **{k: v for k, v in parameters.items() if k not in ("rope_type", "rope_theta")},
    )
    inv_freq, scaling = inverse_frequencies(rope)
    torch.testing.assert_close(inv_freq, hf.inv_freq, rtol=1e-6, atol=0)
    assert scaling == hf.attention_scaling
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4, head_dim, generator=gen)
    positions = torch.randint(0, 5000, (9,), generator=gen)
    cos, sin = hf(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(
        apply_rope(x, positions, inv_freq, scaling), expected[0].transpose(0, 1), rtol=0, atol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_bf16_cuda_logits_track_transformers(checkpoint, reference, processor, n_images):
    """bf16 on CUDA: our error against HF fp32 stays within bf16's own (HF bf16 vs HF fp32)."""
    source, converted = checkpoint
    ids, pixel_values = make_inputs(processor, n_images, seed=n_images)
    expected = reference_logits(reference, ids, pixel_values)
    hf_bf16 = (
        transformers.LlavaForConditionalGeneration.from_pretrained(
            source, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
        .to("cuda")
        .eval()
    )
    with torch.no_grad():
        bf16_logits = hf_bf16(
            input_ids=ids[None].cuda(), pixel_values=None if pixel_values is None else pixel_values.cuda().bfloat16()
        ).logits[0]
    hf_error = (bf16_logits.float().cpu() - expected).abs().max().item()
    gpu_model = load_model(converted / "model.gguf", converted / "mmproj.gguf", "cuda", torch.bfloat16)
    assert gpu_model.dtype == torch.bfloat16 and gpu_model.device.type == "cuda"
    pixels = None if pixel_values is None else pixel_values.cuda()
    with gpu_model.new_arena(16 << 20) as arena, arena.new_sequence() as seq:
        ours = gpu_model.logits(prefill(gpu_model, seq, input_embeddings(gpu_model, ids.cuda(), pixels), 0))
    our_error = (ours.cpu() - expected).abs().max().item()
    assert our_error <= 2 * hf_error + 1e-2 * expected.abs().max().item(), (our_error, hf_error)
    assert (ours[-1].argmax().item() == expected[-1].argmax().item()) or our_error <= hf_error


def test_stack_follows_loads_and_detects_replaced_parameters(model):
    """load_state_dict(assign=True) restacks; a parameter replaced by hand makes decode take the
    separate projections (the stale stack is never read)."""
    attn = model.language_model.layers[1].self_attn
    h = torch.randn(1, attn.q_proj.in_features)
    original = {name: p.detach().clone() for name, p in attn.state_dict().items()}
    try:
        doubled = {name: 2 * p for name, p in original.items()}
        attn.load_state_dict(doubled, assign=True)
        assert attn.stack_current()
        torch.testing.assert_close(attn.qkv_weight[: attn.q_proj.out_features], doubled["q_proj.weight"])
        attn.k_proj.weight = torch.nn.Parameter(3 * original["k_proj.weight"], requires_grad=False)
        assert not attn.stack_current()
    finally:
        attn.load_state_dict(original, assign=True)
    assert attn.stack_current()
    torch.testing.assert_close(attn.qkv_weight[: attn.q_proj.out_features], original["q_proj.weight"])
    torch.testing.assert_close(F.linear(h, attn.qkv_weight),
                               torch.cat([F.linear(h, original[f"{n}_proj.weight"]) for n in "qkv"], dim=-1))
