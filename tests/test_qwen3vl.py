"""Qwen3-VL against Hugging Face transformers, on a tiny random checkpoint.

The checkpoint (``build_tiny_qwen3vl``: DeepStack after vision blocks 0 and 2, interleaved M-RoPE
sections (6, 3, 3), q/k norms, head_dim 24 != hidden / heads, 16-px patches, a 4 x 4 learned
position grid) is converted to f32 GGUF and loaded with ``load_model`` / ``Runtime``; the reference
is ``Qwen3VLForConditionalGeneration.from_pretrained`` on the source folder (fp32, eager attention)
fed by transformers' own tokenizer and image processor, the prompt expanded as the processor does
(``test_qwen2vl.hf_inputs``). The preprocessing, position and multi-turn tests are ``test_qwen2vl``'s,
collected here on this module's fixtures.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from gguf import GGUFReader
from safetensors.torch import load_file, save_file

from conduit_rt import Runtime
from conduit_rt import compress as compression
from conduit_rt.convert.checkpoint import convert_checkpoint
from conduit_rt.errors import ModelFormatError
from conduit_rt.model_file import check_pair, load_model_dir
from conduit_rt.models import load_model
from conduit_rt.refresh import POLICIES
from conduit_rt.selection import budget_tokens
from tests.test_compress import record, reference_keep
from tests.test_conduit import RecordingConduit, reference_selection
from tests.fixtures.references import build_and_convert, load_reference
from tests.fixtures.tiny_qwen3vl import DEEPSTACK_INDEXES, MROPE_SECTION, build_tiny_qwen3vl
from tests.test_qwen2vl import (  # noqa: F401 (the tests imported run here on this module's fixtures)
    N_NEW,
    Reference,
    assert_close_logits,
    hf_generate,
    hf_inputs,
    images,
    interleaved,
    our_prompt,
    prefill_logits,
    test_multi_turn_equals_one_request_with_the_whole_history,
    test_preprocessing_equals_the_hf_image_processor,
    test_rope_positions_equal_hf_get_rope_index,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(source folder, converted folder)."""
    return build_and_convert(build_tiny_qwen3vl, tmp_path_factory, "qwen3vl")


@pytest.fixture(scope="module")
def hf(checkpoint):
    source, _ = checkpoint
    return load_reference(transformers.Qwen3VLForConditionalGeneration, source)


@pytest.fixture(scope="module")
def model(checkpoint):
    _, converted = checkpoint
    return load_model(converted / "model.gguf", converted / "mmproj.gguf", "cpu", torch.float32)


@pytest.fixture(scope="module")
def runtime(checkpoint):
    _, converted = checkpoint
    return Runtime(converted / "model.gguf", device="cpu", kv_cache_bytes=8 << 20)


def key_values(path: Path) -> dict:
    """Every key of a GGUF file and its value, as the ``gguf`` package reads them."""
    return {field.name: field.contents() for field in GGUFReader(path).fields.values()}


def test_conversion_writes_llama_cpp_names_and_keys(checkpoint):
    source, converted = checkpoint
    text_fields, fields = key_values(converted / "model.gguf"), key_values(converted / "mmproj.gguf")
    assert text_fields["general.architecture"] == "qwen3vl"
    assert text_fields["qwen3vl.rope.dimension_sections"] == [*MROPE_SECTION, 0]
    assert text_fields["qwen3vl.n_deepstack_layers"] == len(DEEPSTACK_INDEXES)
    assert text_fields["qwen3vl.attention.key_length"] == 24
    generation = json.loads((source / "generation_config.json").read_text())
    assert text_fields["conduit.eos_token_ids"] == generation["eos_token_id"] and len(generation["eos_token_id"]) == 2
    assert fields["clip.projector_type"] == "qwen3vl_merger"
    assert fields["clip.vision.is_deepstack_layers"] == [True, False, True, False]
    assert fields["clip.vision.image_size"] == 4 * 16  # a 4 x 4 position grid of 16-px patches
    weights = load_file(source / "model.safetensors")
    text, vision = load_model_dir(converted)
    conv = weights["model.visual.patch_embed.proj.weight"]
    torch.testing.assert_close(vision.tensor("v.patch_embd.weight.1"), conv[:, :, 1], rtol=0, atol=0)
    pairs = {
        "v.blk.3.attn_qkv.weight": "model.visual.blocks.3.attn.qkv.weight",
        "v.patch_embd.bias": "model.visual.patch_embed.proj.bias",
        "v.position_embd.weight": "model.visual.pos_embed.weight",
        "v.deepstack.2.fc1.weight": "model.visual.deepstack_merger_list.1.linear_fc1.weight",
        "v.deepstack.0.norm.bias": "model.visual.deepstack_merger_list.0.norm.bias",
        "mm.2.weight": "model.visual.merger.linear_fc2.weight",
        "v.post_ln.bias": "model.visual.merger.norm.bias",
    }
    for gguf_name, stored in pairs.items():
        torch.testing.assert_close(vision.tensor(gguf_name), weights[stored], rtol=0, atol=0)
    q_norm = weights["model.language_model.layers.2.self_attn.q_norm.weight"]
    torch.testing.assert_close(text.tensor("blk.2.attn_q_norm.weight"), q_norm, rtol=0, atol=0)
    raw = next(t for t in GGUFReader(converted / "model.gguf").tensors if t.name == "blk.1.attn_k.weight")
    torch.testing.assert_close(torch.from_numpy(np.array(raw.data)),
                               weights["model.language_model.layers.1.self_attn.k_proj.weight"], rtol=0, atol=0)


def test_every_eos_id_of_the_generation_config_ends_an_answer(checkpoint, model):
    source, _ = checkpoint
    generation = json.loads((source / "generation_config.json").read_text())
    assert model.assets.eos_token_ids == frozenset(generation["eos_token_id"])


def test_broken_checkpoints_are_refused_before_writing(checkpoint, tmp_path):
    source, _ = checkpoint
    broken = Path(shutil.copytree(source, tmp_path / "broken"))
    weights = load_file(broken / "model.safetensors")
    del weights["model.visual.deepstack_merger_list.1.norm.bias"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"v\.deepstack\.2\.norm\.bias"):
        convert_checkpoint(broken, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [502, 100000]}))
    with pytest.raises(ModelFormatError, match="generation_config.json: eos_token_id"):
        convert_checkpoint(broken, tmp_path / "out", progress=False)


def test_a_mmproj_of_another_deepstack_depth_is_refused(checkpoint):
    _, converted = checkpoint
    text, vision = load_model_dir(converted)
    text.config = dataclasses.replace(text.config, num_deepstack_layers=1)
    with pytest.raises(ModelFormatError, match=r"2 DeepStack blocks .* takes 1"):
        check_pair(text, converted / "mmproj.gguf", vision.config)


def test_vision_tower_and_deepstack_features_equal_hf_for_a_batch_of_sizes(hf, model):
    imgs = images(4, seed=4)
    inputs = hf.image_processor(images=imgs, return_tensors="pt")
    with torch.no_grad():
        out = hf.model.model.get_image_features(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    expected = torch.cat([torch.cat(out.pooler_output), *map(torch.cat, out.deepstack_features)], dim=-1)
    ours = torch.cat(model.encode_images([model.prepare_image(np.asarray(image)) for image in imgs]))
    assert ours.shape == expected.shape == (expected.shape[0], 64 * (1 + len(DEEPSTACK_INDEXES)))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_prefill_logits_match_transformers_also_in_chunks(hf, model, n_images):
    messages = interleaved(images(n_images, seed=13))
    inputs = hf_inputs(hf, messages)
    with torch.no_grad():
        expected = hf.model(**inputs).logits[0].float()
    prompt, prepared = our_prompt(model, messages)
    assert_close_logits(prefill_logits(model, prompt, prepared), expected)
    if n_images:
        first = prompt.image_slots[0]
        n = len(prompt.token_ids)
        cuts = [0, first.start + first.n_tokens // 2, n - 1, n]  # cut inside an image
        assert_close_logits(prefill_logits(model, prompt, prepared, cuts), expected)


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_greedy_tokens_and_logits_equal_transformers_generate(hf, runtime, n_images):
    messages = interleaved(images(n_images, seed=20 + n_images), "Describe them.")
    expected, expected_logits = hf_generate(hf, messages)
    result = runtime.generate(messages, max_tokens=N_NEW, return_logits=True)
    assert result.tokens == expected
    assert_close_logits(result.logits, expected_logits[: result.logits.shape[0]])
    assert result.stats.images == n_images


# -- both methods on Qwen3-VL (docs/methods.md §1 and §2) -------------------------------------------------
REFRESH_POLICIES = sorted(set(POLICIES) - {"none"})


def method_runtime(converted: Path, device: str) -> Runtime:
    return Runtime(converted / "model.gguf", device=device, kv_cache_bytes=16 << 20, prefix_cache_entries=0)


@pytest.fixture
def warm(checkpoint, device):
    """A runtime that has seen three pictures of different sizes (their KV and embeddings stored)."""
    runtime, pics = method_runtime(checkpoint[1], device), images(3, seed=50)
    runtime.generate(interleaved(pics, "Which is brightest?"), max_tokens=1, refresh="conduit")
    assert runtime.arena.stats().n_image_entries == 3
    return runtime, pics


def changed_prefix(pics) -> list[dict]:
    return [{"role": "system", "content": "Another prefix."}] + interleaved([pics[2], pics[0], pics[1]], "Changes?")


@pytest.mark.parametrize("policy", REFRESH_POLICIES)
def test_refreshing_every_restored_image_token_equals_a_cold_prefill(checkpoint, warm, policy, device):
    """The recompute of a visual token takes its DeepStack features from the embedding cache again."""
    runtime, pics = warm
    messages = changed_prefix(pics)
    refreshed = runtime.generate(messages, max_tokens=1, return_logits=True, refresh=policy, refresh_budget=1.0)
    assert refreshed.stats.image_hits == 3 and refreshed.stats.refreshed_tokens == refreshed.stats.visual_tokens > 0
    cold = method_runtime(checkpoint[1], device).generate(messages, max_tokens=1, return_logits=True).logits[0]
    assert_close_logits(refreshed.logits[0], cold, rtol=1e-5 if device == "cpu" else 3e-2)
    stale = runtime.generate(messages, max_tokens=1, return_logits=True, refresh="none").logits[0]
    assert (stale - cold).abs().max() > 1e-3 * cold.abs().max()


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"full"}))
def test_every_policy_refreshes_exactly_its_budget(warm, policy):
    runtime, pics = warm
    result = runtime.generate(interleaved([pics[0], pics[2]], "Tell me."), max_tokens=1, refresh=policy,
                              refresh_budget=0.1)
    n_vis = sum(runtime.model.prepare_image(np.asarray(pic)).n_tokens for pic in (pics[0], pics[2]))
    assert result.stats.visual_tokens == n_vis
    assert result.stats.refreshed_tokens == budget_tokens(0.1, n_vis) * (policy != "none")


@pytest.mark.parametrize("n_images,lam", [(1, 1.0), (3, 2.5)])
def test_conduit_selection_equals_a_float64_reference(warm, monkeypatch, n_images, lam):
    runtime, pics = warm
    recorder = RecordingConduit()
    monkeypatch.setitem(POLICIES, "conduit", recorder)
    runtime.generate(interleaved(pics[:n_images][::-1], "Which one has the most red?"), max_tokens=1,
                     refresh="conduit", refresh_budget=0.2, refresh_options={"lam": lam})
    expected = reference_selection(recorder.seen)
    if runtime.device.type == "cpu":
        assert torch.equal(recorder.chosen, expected)
    else:  # bf16: near-ties may swap
        assert len(set(recorder.chosen.tolist()) & set(expected.tolist())) >= 0.9 * expected.numel()


@pytest.mark.parametrize("name", sorted(compression.POLICIES))
def test_keep_everything_equals_no_compression(checkpoint, device, name):
    runtime, messages = method_runtime(checkpoint[1], device), interleaved(images(2, seed=60), "Describe them.")
    plain = runtime.generate(messages, max_tokens=6, return_logits=True)
    kept = runtime.generate(messages, max_tokens=6, return_logits=True, compress=name, keep=1.0)
    assert kept.tokens == plain.tokens
    torch.testing.assert_close(kept.logits, plain.logits, atol=1e-5 * plain.logits.abs().max(), rtol=0)
    assert kept.stats.kv_bytes_after_compress == kept.stats.kv_bytes_before_compress


@pytest.mark.parametrize("name", sorted(compression.POLICIES))
def test_kept_sets_are_exact_in_count_and_equal_a_float64_reference(checkpoint, device, monkeypatch, name):
    runtime, recorder = method_runtime(checkpoint[1], device), record(monkeypatch, name)
    result = runtime.generate(interleaved(images(3, seed=61), "Which picture has the most blue?"), max_tokens=1,
                              compress=name, keep=0.3)
    kept_fraction = 1.0 if name == "none" else 0.3
    assert sum(result.stats.kept_tokens_per_layer) == round(
        kept_fraction * result.stats.prompt_tokens * runtime.model.config.n_layers)
    expected = reference_keep(recorder)
    if runtime.device.type == "cpu":
        assert recorder.kept == expected
    else:
        for ours, ref in zip(recorder.kept, expected):
            assert len(ours) == len(ref) and len(set(ours) & set(ref)) >= 0.9 * len(ref)


def test_a_restart_on_the_disk_store_refreshes_with_the_stored_deepstack_features(checkpoint, tmp_path):
    """The persistent image-KV store keeps the whole embedding width: after a restart, refreshing
    every restored token equals a cold prefill."""
    converted, pics = checkpoint[1], images(2, seed=70)
    with Runtime(converted / "model.gguf", device="cpu", kv_cache_bytes=16 << 20, prefix_cache_entries=0,
                 cache_dir=tmp_path) as first:
        first.generate(interleaved(pics, "Which is brightest?"), max_tokens=1)
    messages = [{"role": "system", "content": "Another prefix."}] + interleaved(pics[::-1], "Changes?")
    with Runtime(converted / "model.gguf", device="cpu", kv_cache_bytes=16 << 20, prefix_cache_entries=0,
                 cache_dir=tmp_path) as restarted:
        refreshed = restarted.generate(messages, max_tokens=1, return_logits=True, refresh="conduit",
                                       refresh_budget=1.0)
        assert refreshed.stats.image_disk_hits == 2
        key = restarted.requests.read(messages).keys[0]
        assert restarted.requests.embeddings.get(key).shape[1] == restarted.model.config.embedding_width
    cold = method_runtime(converted, "cpu").generate(messages, max_tokens=1, return_logits=True).logits[0]
    assert_close_logits(refreshed.logits[0], cold, rtol=1e-5)


def hf_logits(ref: Reference, source: Path, messages: list[dict]) -> dict[str, torch.Tensor]:
    """HF fp32 (CPU) and bf16 (CUDA, SDPA) logits of every prompt position, float32 CPU."""
    inputs = hf_inputs(ref, messages)
    hf_bf16 = type(ref.model).from_pretrained(source, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").eval()
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    cuda_inputs["pixel_values"] = cuda_inputs["pixel_values"].bfloat16()
    with torch.no_grad():
        return {"fp32": ref.model(**inputs).logits[0].float(), "bf16": hf_bf16(**cuda_inputs).logits[0].float().cpu()}


@pytest.mark.gpu
@pytest.mark.parametrize("n_images", [1, 3])
def test_bf16_cuda_logits_track_transformers(checkpoint, hf, n_images):
    """bf16 on CUDA: our error against HF fp32 stays within bf16's own (HF bf16 vs HF fp32)."""
    source, converted = checkpoint
    messages = interleaved(images(n_images, seed=n_images + 10))
    ref = hf_logits(hf, source, messages)
    gpu_model = load_model(converted / "model.gguf", converted / "mmproj.gguf", "cuda", torch.bfloat16)
    ours = prefill_logits(gpu_model, *our_prompt(gpu_model, messages))
    hf_error = (ref["bf16"] - ref["fp32"]).abs().max().item()
    our_error = (ours - ref["fp32"]).abs().max().item()
    assert our_error <= 2 * hf_error + 1e-2 * ref["fp32"].abs().max().item(), (our_error, hf_error)


@pytest.mark.gpu
def test_bf16_cuda_runtime_first_logits_track_transformers(checkpoint, hf):
    """The whole request path on CUDA in bf16 (eager prefill with DeepStack, graphed decode)."""
    source, converted = checkpoint
    runtime = Runtime(converted / "model.gguf", device="cuda", kv_cache_bytes=16 << 20, image_cache_bytes=0)
    messages = interleaved(images(3, seed=40), "Describe them.")
    ref = hf_logits(hf, source, messages)
    result = runtime.generate(messages, max_tokens=N_NEW, return_logits=True)
    expected = ref["fp32"][-1]
    hf_error = (ref["bf16"][-1] - expected).abs().max().item()
    our_error = (result.logits[0] - expected).abs().max().item()
    assert our_error <= 2 * hf_error + 1e-2 * expected.abs().max().item(), (our_error, hf_error)
