"""InternVL3 against Hugging Face transformers, on a tiny random ``-hf`` checkpoint (CPU fp32; CUDA bf16 under `gpu`).

The checkpoint (``build_tiny_internvl``) is converted to f32 GGUF and loaded with ``load_model`` /
``Runtime``; the reference is ``InternVLForConditionalGeneration.from_pretrained`` on the source
folder (fp32, eager attention) fed by transformers' own tokenizer and image processor
(``crop_to_patches=True``, as ``InternVLProcessor`` asks). The prompt is expanded as
``InternVLProcessor`` does: each ``<IMG_CONTEXT>`` becomes ``<img>``, one ``<IMG_CONTEXT>`` per
embedding of every tile, ``</img>`` (the processor class itself needs torchvision for its video
part, which is not installed here). Image sizes differ so that the tilings differ (3, 5, 4 and 7 tiles).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from gguf import GGUFReader
from PIL import Image
from safetensors.torch import load_file, save_file

from conduit_rt import Runtime
from conduit_rt.chat import build_prompt
from conduit_rt.convert.checkpoint import convert_checkpoint
from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.model_file import load_model_dir
from conduit_rt.models import ForwardBatch, load_model
from conduit_rt.preprocess_tiles import TilePreprocessParams
from conduit_rt.refresh import POLICIES
from conduit_rt.selection import budget_tokens
from tests.fixtures.references import Reference, build_and_convert, load_reference
from tests.fixtures.tiny_internvl import IMAGE_END, IMAGE_START, IMAGE_TOKEN, TOKENS_PER_TILE, build_tiny_internvl
from tests.test_compress import record, reference_keep
from tests.test_conduit import RecordingConduit, reference_selection
from tests.test_model_file import rewrite_gguf
from tests.test_qwen2vl import N_NEW, assert_close_logits, interleaved

IMAGE_SIZES = [(41, 97), (250, 250), (100, 300), (13, 300)]  # (height, width): 3, 5, 4 and 7 tiles


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(source folder, converted folder)."""
    return build_and_convert(build_tiny_internvl, tmp_path_factory, "internvl")


@pytest.fixture(scope="module")
def hf(checkpoint):
    source, _ = checkpoint
    return load_reference(transformers.InternVLForConditionalGeneration, source)


@pytest.fixture(scope="module")
def model(checkpoint):
    _, converted = checkpoint
    return load_model(converted / "model.gguf", converted / "mmproj.gguf", "cpu", torch.float32)


def new_runtime(converted: Path, device: str = "cpu", **options) -> Runtime:
    """The image-KV store is off unless asked for: most tests check the model path."""
    return Runtime(converted / "model.gguf", device=device, kv_cache_bytes=16 << 20, **options)


@pytest.fixture(scope="module")
def runtime(checkpoint):
    return new_runtime(checkpoint[1])


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZES[i % 4], 3), dtype=np.uint8)) for i in range(n)]


def payloads(messages: list[dict]) -> list[Image.Image]:
    return [p["image"] for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image"]


def hf_inputs(ref: Reference, messages: list[dict]) -> dict[str, torch.Tensor]:
    """What ``InternVLProcessor(text=apply_chat_template(...), images=...)`` gives, built from its parts."""
    plain = [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
         else [{k: v for k, v in p.items() if k != "image"} for p in m["content"]]}
        for m in messages
    ]
    text = ref.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    imgs = payloads(messages)
    inputs: dict[str, torch.Tensor] = {}
    if imgs:
        processed = ref.image_processor(images=imgs, crop_to_patches=True, return_tensors="pt")
        inputs["pixel_values"] = processed["pixel_values"]
        pieces = text.split(IMAGE_TOKEN)
        text = pieces[0] + "".join(
            IMAGE_START + IMAGE_TOKEN * TOKENS_PER_TILE * int(n) + IMAGE_END + rest
            for n, rest in zip(processed["num_patches"], pieces[1:])
        )
    encoded = ref.tokenizer(text, return_tensors="pt")
    return inputs | {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def our_prompt(model, messages: list[dict]):
    """(prompt, prepared images) as the Runtime builds them."""
    prepared = [model.prepare_image(np.asarray(image)) for image in payloads(messages)]
    a = model.assets
    prompt = build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id, [p.n_tokens for p in prepared],
                          image_wrap=a.image_wrap)
    return prompt, prepared


def prefill_logits(model, prompt, prepared, cuts: list[int] | None = None) -> torch.Tensor:
    """float32 [n, vocab] of every prompt position, the prompt run in chunks [cuts[i], cuts[i+1])."""
    embeds = model.embed_tokens(torch.tensor(prompt.token_ids, device=model.device))
    for slot, features in zip(prompt.image_slots, model.encode_images(prepared)):
        embeds[slot.start: slot.start + slot.n_tokens] = features
    rope = model.rope_positions(prompt, prepared)
    n = len(prompt.token_ids)
    hidden = []
    with model.new_arena(16 << 20) as arena, arena.new_sequence() as seq:
        for lo, hi in itertools.pairwise(cuts or [0, n]):
            positions = torch.arange(lo, hi, dtype=torch.int32)
            seq.append(positions)
            batch = ForwardBatch(positions=positions.to(model.device), rope_positions=rope[lo:hi].to(model.device))
            hidden.append(model.forward(seq, embeds[lo:hi], batch))
    return model.logits(torch.cat(hidden)).cpu()


def test_conversion_writes_llama_cpp_names_keys_and_shapes(checkpoint):
    source, converted = checkpoint
    weights = load_file(source / "model.safetensors")
    text, vision = load_model_dir(converted)
    fields = {field.name: field.contents() for field in GGUFReader(converted / "mmproj.gguf").fields.values()}
    text_fields = {field.name: field.contents() for field in GGUFReader(converted / "model.gguf").fields.values()}
    assert text_fields["general.architecture"] == "qwen2" and text_fields["qwen2.block_count"] == 2
    assert fields["clip.projector_type"] == "internvl" and fields["clip.vision.projector.scale_factor"] == 2
    assert fields["clip.use_gelu"] is True and fields["clip.vision.image_size"] == 64
    assert fields["clip.vision.preproc_max_tiles"] == 6
    tower = "vision_tower.encoder.layer.1."
    pairs = {
        "v.blk.1.ls1.weight": tower + "lambda_1", "v.blk.1.ls2.weight": tower + "lambda_2",
        "v.blk.1.attn_out.weight": tower + "attention.projection_layer.weight",
        "v.blk.1.ln1.bias": tower + "layernorm_before.bias", "v.blk.1.ffn_up.weight": tower + "mlp.fc1.weight",
        "v.patch_embd.bias": "vision_tower.embeddings.patch_embeddings.projection.bias",
        "mm.0.weight": "multi_modal_projector.layer_norm.weight", "mm.1.weight": "multi_modal_projector.linear_1.weight",
        "mm.3.bias": "multi_modal_projector.linear_2.bias",
    }
    for gguf_name, hf_name in pairs.items():
        torch.testing.assert_close(vision.tensor(gguf_name), weights[hf_name], rtol=0, atol=0)
    torch.testing.assert_close(vision.tensor("v.class_embd"), weights["vision_tower.embeddings.cls_token"])
    torch.testing.assert_close(vision.tensor("v.position_embd.weight"), weights["vision_tower.embeddings.position_embeddings"])
    # Qwen2's q/k rows are stored as they are (llama.cpp permutes only Llama's); embeddings tied
    raw = {t.name: t for t in GGUFReader(converted / "model.gguf").tensors}
    torch.testing.assert_close(torch.from_numpy(np.array(raw["blk.1.attn_q.weight"].data)),
                               weights["language_model.model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0)
    assert "blk.0.attn_k.bias" in text and "blk.0.attn_output.bias" not in text and "output.weight" not in text


def test_broken_checkpoints_are_refused_before_writing(checkpoint, tmp_path):
    source, _ = checkpoint
    broken = Path(shutil.copytree(source, tmp_path / "broken"))
    weights = load_file(broken / "model.safetensors")
    del weights["vision_tower.encoder.layer.1.lambda_2"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"v\.blk\.1\.ls2\.weight"):
        convert_checkpoint(broken, tmp_path / "out", progress=False)
    config = json.loads((source / "config.json").read_text())
    config["vision_config"] |= {"use_qk_norm": True, "norm_type": "rms_norm"}
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="norm_type, use_qk_norm"):
        convert_checkpoint(broken, tmp_path / "out", progress=False)
    (broken / "config.json").write_text(json.dumps(json.loads((source / "config.json").read_text()) | {"image_seq_length": 64}))
    (broken / "processor_config.json").unlink()
    shutil.copy(source / "model.safetensors", broken / "model.safetensors")
    with pytest.raises(ModelFormatError, match="image_seq_length 64 != the 16 tokens"):
        convert_checkpoint(broken, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_mmproj_with_llama_cpp_keys_only_loads_and_a_missing_tensor_is_named(checkpoint, model, tmp_path):
    """Without the conduit.* keys and the preprocessor JSON (as llama.cpp writes the file), the tower's
    activation, pixel shuffle and tiling come from llama.cpp's clip.* keys and give the same features."""
    _, converted = checkpoint
    reader = GGUFReader(converted / "mmproj.gguf")
    conduit_keys = tuple(key for key in reader.fields if key.startswith("conduit.")) + ("clip.vision.preprocessor_config",)
    shutil.copy(converted / "model.gguf", tmp_path / "model.gguf")
    rewrite_gguf(converted / "mmproj.gguf", tmp_path / "mmproj.gguf", drop_keys=conduit_keys)
    plain = load_model(tmp_path / "model.gguf", tmp_path / "mmproj.gguf", "cpu", torch.float32)
    prepared = [m.prepare_image(np.asarray(image)) for m in (plain, model) for image in images(4, seed=3)]
    assert [p.n_tokens for p in prepared[:4]] == [p.n_tokens for p in prepared[4:]]
    for ours, full in zip(plain.encode_images(prepared[:4]), model.encode_images(prepared[4:])):
        torch.testing.assert_close(ours, full, rtol=0, atol=0)
    rewrite_gguf(converted / "mmproj.gguf", tmp_path / "mmproj.gguf", drop_tensors=("v.blk.1.ls1.weight",))
    with pytest.raises(ModelFormatError, match=r"missing tensor v\.blk\.1\.ls1\.weight"):
        load_model(tmp_path / "model.gguf", tmp_path / "mmproj.gguf", "cpu", torch.float32)


def test_the_text_file_alone_is_a_qwen2_model_with_transformers_logits(checkpoint, hf):
    _, converted = checkpoint
    text_only = load_model(converted / "model.gguf", None, "cpu", torch.float32)
    assert not text_only.has_vision and text_only.config.architecture == "qwen2"
    messages = interleaved([], "No pictures today.")
    prompt, prepared = our_prompt(text_only, messages)
    with torch.no_grad():
        expected = hf.model(**hf_inputs(hf, messages)).logits[0].float()
    assert_close_logits(prefill_logits(text_only, prompt, prepared), expected)


@pytest.mark.parametrize("size", [(41, 97), (13, 300), (500, 31), (7, 9), (1000, 777), (250, 250), (64, 64)])
def test_tiling_and_preprocessing_equal_the_hf_image_processor(hf, model, size):
    rgb = np.random.default_rng(size[0]).integers(0, 256, (*size, 3), dtype=np.uint8)
    expected = hf.image_processor(images=[Image.fromarray(rgb)], crop_to_patches=True, return_tensors="np")
    prepared = model.prepare_image(rgb)
    assert prepared.n_tokens == int(expected["num_patches"][0]) * TOKENS_PER_TILE
    np.testing.assert_array_equal(prepared.pixel_values.numpy(), expected["pixel_values"])
    assert isinstance(model.assets.preprocess, TilePreprocessParams)


def test_vision_features_equal_hf_image_features_for_a_batch_of_sizes(hf, model):
    imgs = images(4, seed=4)
    inputs = hf.image_processor(images=imgs, crop_to_patches=True, return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    ours = torch.cat(model.encode_images([model.prepare_image(np.asarray(image)) for image in imgs]))
    torch.testing.assert_close(ours, expected.reshape(ours.shape), rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_prompt_and_prefill_logits_match_transformers(hf, model, n_images):
    messages = interleaved(images(n_images, seed=13 + n_images))
    inputs = hf_inputs(hf, messages)
    prompt, prepared = our_prompt(model, messages)
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = hf.model(**inputs).logits[0].float()
    assert_close_logits(prefill_logits(model, prompt, prepared), expected)
    if n_images:  # a chunk boundary inside an image
        first = prompt.image_slots[0]
        cuts = [0, first.start + first.n_tokens // 2, len(prompt.token_ids) - 1, len(prompt.token_ids)]
        assert_close_logits(prefill_logits(model, prompt, prepared, cuts), expected)


def hf_generate(ref: Reference, messages: list[dict], n_new: int = N_NEW) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: (new ids without a final EOS, per-step logits [steps, vocab])."""
    inputs = hf_inputs(ref, messages)
    with torch.no_grad():
        out = ref.model.generate(**inputs, max_new_tokens=n_new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    if new and new[-1] == ref.model.generation_config.eos_token_id:
        new = new[:-1]
    return new, torch.stack(out.logits)[:, 0]


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_greedy_tokens_and_logits_equal_transformers_generate(hf, runtime, n_images):
    messages = interleaved(images(n_images, seed=20 + n_images), "Describe them.")
    expected, expected_logits = hf_generate(hf, messages)
    result = runtime.generate(messages, max_tokens=N_NEW, return_logits=True)
    assert result.tokens == expected
    assert_close_logits(result.logits, expected_logits[: result.logits.shape[0]])
    assert result.stats.images == n_images


def test_multi_turn_equals_one_request_with_the_whole_history(runtime):
    session = runtime.chat()
    imgs = images(2, seed=30)
    first = session.send(interleaved(imgs[:1], "What is this?")[0]["content"], max_tokens=6)
    second = session.send([{"type": "image", "image": imgs[1]}, {"type": "text", "text": "And this one?"}],
                          max_tokens=8, return_logits=True)
    assert second.stats.reused_tokens > 3 * TOKENS_PER_TILE  # the first image and turn stayed in the arena
    whole = runtime.generate(session.history[:-1], max_tokens=8, return_logits=True)
    assert second.tokens == whole.tokens
    torch.testing.assert_close(second.logits, whole.logits, atol=1e-4 * whole.logits.abs().max().item(), rtol=0)
    assert first.text == session.history[1]["content"]
    session.close()


@pytest.fixture
def warm(checkpoint, device):
    """A runtime whose image-KV store holds three images (seen under one prefix), and the images."""
    runtime, pics = new_runtime(checkpoint[1], device, prefix_cache_entries=0), images(3, seed=50)
    runtime.generate(interleaved(pics, "Which is brightest?"), max_tokens=1, refresh="conduit")
    assert runtime.arena.stats().n_image_entries == 3
    return runtime, pics


@pytest.mark.parametrize("policy", ["conduit", "cacheblend", "conduit_allq", "full"])
def test_refreshing_every_restored_image_token_equals_a_cold_prefill(checkpoint, warm, policy, device):
    """CONDUIT at r = 1: cached images restored under a new prefix and order, then fully refreshed."""
    runtime, pics = warm
    messages = [{"role": "system", "content": "Another prefix."}] + interleaved([pics[2], pics[0], pics[1]], "Changes?")
    refreshed = runtime.generate(messages, max_tokens=1, return_logits=True, refresh=policy, refresh_budget=1.0)
    assert refreshed.stats.image_hits == 3 and refreshed.stats.refreshed_tokens == refreshed.stats.visual_tokens > 0
    cold = new_runtime(checkpoint[1], device, prefix_cache_entries=0).generate(messages, max_tokens=1, return_logits=True)
    assert_close_logits(refreshed.logits[0], cold.logits[0], rtol=1e-5 if device == "cpu" else 3e-2)
    stale = runtime.generate(messages, max_tokens=1, return_logits=True, refresh="none").logits[0]
    assert (stale - cold.logits[0]).abs().max() > 1e-3 * cold.logits[0].abs().max()  # restored KV was used


@pytest.mark.parametrize("n_images,ratio", [(1, 0.1), (3, 0.2)])
def test_conduit_refreshes_its_budget_and_selects_as_a_torch_reference(warm, monkeypatch, n_images, ratio):
    runtime, pics = warm
    recorder = RecordingConduit()
    monkeypatch.setitem(POLICIES, "conduit", recorder)
    result = runtime.generate(interleaved(pics[:n_images][::-1], "Which one has the most red?"), max_tokens=1,
                              refresh="conduit", refresh_budget=ratio)
    n_visual = result.stats.visual_tokens
    assert recorder.seen["budget"] == budget_tokens(ratio, n_visual) == result.stats.refreshed_tokens
    expected = reference_selection(recorder.seen)
    if runtime.device.type == "cpu":
        assert torch.equal(recorder.chosen, expected)
    else:  # bf16: near-ties may swap
        assert len(set(recorder.chosen.tolist()) & set(expected.tolist())) >= 0.9 * expected.numel()


@pytest.mark.parametrize("name", ["vlcache", "snapkv"])
def test_vlcache_keeping_everything_equals_no_compression(runtime, name):
    messages = interleaved(images(2, seed=60), "Which picture has the most blue?")
    plain = runtime.generate(messages, max_tokens=6, return_logits=True)
    kept = runtime.generate(messages, max_tokens=6, return_logits=True, compress=name, keep=1.0)
    assert kept.tokens == plain.tokens
    torch.testing.assert_close(kept.logits, plain.logits, atol=1e-5 * plain.logits.abs().max(), rtol=0)


@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_vlcache_keeps_its_budget_and_the_set_of_a_torch_reference(checkpoint, monkeypatch, ratio):
    runtime = new_runtime(checkpoint[1], prefix_cache_entries=0)
    recorder = record(monkeypatch, "vlcache")
    result = runtime.generate(interleaved(images(3, seed=70), "Which is darkest?"), max_tokens=1, compress="vlcache",
                              keep=ratio)
    stats, n_layers = result.stats, runtime.model.config.n_layers
    assert sum(stats.kept_tokens_per_layer) == round(ratio * stats.prompt_tokens * n_layers)
    assert recorder.kept == reference_keep(recorder)


@pytest.mark.gpu
@pytest.mark.parametrize("n_images", [1, 3])
def test_bf16_cuda_logits_track_transformers(checkpoint, hf, n_images):
    """bf16 on CUDA: our error against HF fp32 stays within bf16's own (HF bf16 vs HF fp32)."""
    source, converted = checkpoint
    messages = interleaved(images(n_images, seed=n_images + 10))
    inputs = hf_inputs(hf, messages)
    hf_bf16 = type(hf.model).from_pretrained(source, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    cuda_inputs["pixel_values"] = cuda_inputs["pixel_values"].bfloat16()
    with torch.no_grad():
        expected = hf.model(**inputs).logits[0].float()
        hf_error = (hf_bf16(**cuda_inputs).logits[0].float().cpu() - expected).abs().max().item()
    gpu_model = load_model(converted / "model.gguf", converted / "mmproj.gguf", "cuda", torch.bfloat16)
    ours = prefill_logits(gpu_model, *our_prompt(gpu_model, messages))
    assert (ours - expected).abs().max().item() <= 2 * hf_error + 1e-2 * expected.abs().max().item()


@pytest.mark.gpu
def test_graph_replayed_decode_equals_eager_decode(checkpoint):
    """The captured decode step of the Qwen2 decoder (1-D RoPE, q/k/v biases) against eager decoding."""
    from tests.test_runtime import graphed_and_eager_agree

    graphed_and_eager_agree(checkpoint[1] / "model.gguf", interleaved(images(2, seed=41), "Describe them."), max_tokens=20)
