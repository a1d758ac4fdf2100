"""Qwen2-VL and Qwen2.5-VL against Hugging Face transformers, on tiny random checkpoints.

Each checkpoint (``build_tiny_qwen2vl``, both versions) is converted to f32 GGUF and loaded with
``load_model`` / ``Runtime``; the reference is ``*ForConditionalGeneration.from_pretrained`` on the
source folder (fp32, eager attention) fed by transformers' own tokenizer and image processor. The
prompt is expanded as ``Qwen2VLProcessor`` does (one ``<|image_pad|>`` per merged token; the
processor class itself needs torchvision for its video part, which is not installed here).
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
from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.model_file import load_model_dir
from conduit_rt.models import ForwardBatch, load_model
from conduit_rt.preprocess import QwenVLPreprocessParams
from conduit_rt.convert.checkpoint import convert_checkpoint
from tests.fixtures.references import Reference, build_and_convert, load_reference
from tests.fixtures.tiny_qwen2vl import IMAGE_TOKEN, MROPE_SECTION, build_tiny_qwen2vl

RTOL = 1e-4  # of max |reference logits|
N_NEW = 16
IMAGE_SIZES = [(41, 97), (90, 130), (500, 31), (13, 300)]  # (height, width): 8, 15, 18 and 10 merged tokens


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2vl", "qwen2.5vl"])
def checkpoint(request, tmp_path_factory):
    """(version, source folder, converted folder)."""
    source, converted = build_and_convert(build_tiny_qwen2vl, tmp_path_factory, f"qwen{request.param}",
                                          version=request.param)
    return request.param, source, converted


@pytest.fixture(scope="module")
def hf(checkpoint):
    version, source, _ = checkpoint
    model_class = (
        transformers.Qwen2VLForConditionalGeneration
        if version == "2"
        else transformers.Qwen2_5_VLForConditionalGeneration
    )
    return load_reference(model_class, source)


@pytest.fixture(scope="module")
def model(checkpoint):
    _, _, converted = checkpoint
    return load_model(converted / "model.gguf", converted / "mmproj.gguf", "cpu", torch.float32)


@pytest.fixture(scope="module")
def runtime(checkpoint):
    """The image-KV store is off: these tests check the model path (CONDUIT reuse has its own tests)."""
    _, _, converted = checkpoint
    return Runtime(converted / "model.gguf", device="cpu", kv_cache_bytes=8 << 20)


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*IMAGE_SIZES[i % 4], 3), dtype=np.uint8)) for i in range(n)]


def interleaved(imgs: list[Image.Image], question: str = "What colour is it?") -> list[dict]:
    """One user message: text, then each image followed by a few words, then the question."""
    parts: list[dict] = [{"type": "text", "text": "Look:"}]
    for index, image in enumerate(imgs):
        parts += [{"type": "image", "image": image}, {"type": "text", "text": f" picture {index + 1};"}]
    return [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


def hf_inputs(ref: Reference, messages: list[dict]) -> dict[str, torch.Tensor]:
    """What ``Qwen2VLProcessor(text=apply_chat_template(...), images=...)`` gives, built from its parts."""
    plain = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else [{k: v for k, v in p.items() if k != "image"} for p in m["content"]],
        }
        for m in messages
    ]
    text = ref.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    imgs = [
        p["image"] for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image"
    ]
    inputs: dict[str, torch.Tensor] = {}
    if imgs:
        inputs = dict(ref.image_processor(images=imgs, return_tensors="pt"))
        merge = ref.image_processor.merge_size**2
        pieces = text.split(IMAGE_TOKEN)
        text = pieces[0] + "".join(
            IMAGE_TOKEN * int(g.prod() // merge) + rest for g, rest in zip(inputs["image_grid_thw"], pieces[1:])
        )
    encoded = ref.tokenizer(text, return_tensors="pt")
    inputs |= {
        "input_ids": encoded["input_ids"],
        "attention_mask": encoded["attention_mask"],
        "mm_token_type_ids": (encoded["input_ids"] == ref.model.config.image_token_id).int(),
    }
    return inputs


def our_prompt(model, messages: list[dict]):
    """(prompt, prepared images) as the Runtime builds them."""
    payloads = [
        p["image"] for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image"
    ]
    prepared = [model.prepare_image(np.asarray(image)) for image in payloads]
    a = model.assets
    return build_prompt(
        messages, a.chat_template, a.tokenizer, a.image_token_id, [p.n_tokens for p in prepared]
    ), prepared


def prefill_logits(model, prompt, prepared, cuts: list[int] | None = None) -> torch.Tensor:
    """float32 [n, vocab] of every prompt position, the prompt run in chunks [cuts[i], cuts[i+1])."""
    ids = torch.tensor(prompt.token_ids, device=model.device)
    embeds = model.embed_tokens(ids)
    for slot, features in zip(prompt.image_slots, model.encode_images(prepared)):
        embeds[slot.start : slot.start + slot.n_tokens] = features
    rope = model.rope_positions(prompt, prepared)
    n = len(prompt.token_ids)
    cuts = cuts or [0, n]
    hidden = []
    with model.new_arena(16 << 20) as arena, arena.new_sequence() as seq:
        for lo, hi in itertools.pairwise(cuts):
            positions = torch.arange(lo, hi, dtype=torch.int32)
            seq.append(positions)
            batch = ForwardBatch(
                positions=positions.to(model.device), rope_positions=rope[:, lo:hi].contiguous().to(model.device)
            )
            hidden.append(model.forward(seq, embeds[lo:hi], batch))
    return model.logits(torch.cat(hidden)).cpu()


def assert_close_logits(ours: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    scale = expected.abs().max().item()
    error = (ours.float().cpu() - expected).abs().max().item()
    assert error <= rtol * scale, f"max |diff| {error:.3g} > {rtol} x {scale:.3g}"


def test_conversion_writes_llama_cpp_names_keys_and_splits(checkpoint, hf):
    version, source, converted = checkpoint
    weights = load_file(source / "model.safetensors")
    text, vision = load_model_dir(converted)
    fields = {field.name: field.contents() for field in GGUFReader(converted / "mmproj.gguf").fields.values()}
    text_fields = {field.name: field.contents() for field in GGUFReader(converted / "model.gguf").fields.values()}
    assert text_fields["general.architecture"] == "qwen2vl"
    assert text_fields["qwen2vl.rope.dimension_sections"] == [*MROPE_SECTION, 0]
    assert fields["clip.projector_type"] == ("qwen2.5vl_merger" if version == "2.5" else "qwen2vl_merger")
    conv = weights["visual.patch_embed.proj.weight"]  # [E, C, 2, p, p]
    torch.testing.assert_close(vision.tensor("v.patch_embd.weight"), conv[:, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(vision.tensor("v.patch_embd.weight.1"), conv[:, :, 1], rtol=0, atol=0)
    qkv, qkv_bias = weights["visual.blocks.2.attn.qkv.weight"], weights["visual.blocks.2.attn.qkv.bias"]
    for third, part in enumerate("qkv"):
        rows = slice(third * qkv.shape[1], (third + 1) * qkv.shape[1])
        torch.testing.assert_close(vision.tensor(f"v.blk.2.attn_{part}.weight"), qkv[rows], rtol=0, atol=0)
        torch.testing.assert_close(vision.tensor(f"v.blk.2.attn_{part}.bias"), qkv_bias[rows], rtol=0, atol=0)
    # Qwen2's q/k rows are stored as they are (llama.cpp permutes only Llama's)
    raw = GGUFReader(converted / "model.gguf").tensors
    q_proj = next(t for t in raw if t.name == "blk.1.attn_q.weight")
    torch.testing.assert_close(
        torch.from_numpy(np.array(q_proj.data)), weights["model.layers.1.self_attn.q_proj.weight"], rtol=0, atol=0
    )
    assert "blk.0.attn_q.bias" in text and "blk.0.attn_output.bias" not in text
    if version == "2.5":
        assert fields["clip.vision.n_wa_pattern"] == 2 and fields["conduit.vision.fullatt_block_indexes"] == [1]
        assert vision.config.window_size == 56 and "v.blk.0.ffn_gate.weight" in vision
    else:
        assert "clip.vision.n_wa_pattern" not in fields and "v.blk.0.ln1.bias" in vision


def test_broken_checkpoints_are_refused_before_writing(checkpoint, tmp_path):
    _, source, _ = checkpoint
    broken = Path(shutil.copytree(source, tmp_path / "broken"))
    weights = load_file(broken / "model.safetensors")
    del weights["visual.blocks.1.attn.qkv.bias"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"v\.blk\.1\.attn_q\.bias"):
        convert_checkpoint(broken, tmp_path / "out", progress=False)
    config = json.loads((source / "config.json").read_text()) | {"model_type": "llava"}
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="model_type is 'llava'"):
        convert_checkpoint(broken, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", [(41, 97), (13, 300), (500, 31), (7, 9), (1000, 777), (250, 250)])
def test_preprocessing_equals_the_hf_image_processor(hf, model, size):
    rgb = np.random.default_rng(size[0]).integers(0, 256, (*size, 3), dtype=np.uint8)
    expected = hf.image_processor(images=[Image.fromarray(rgb)], return_tensors="np")
    prepared = model.prepare_image(rgb)
    assert prepared.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert prepared.n_tokens == int(np.prod(prepared.grid_thw)) // 4
    np.testing.assert_array_equal(prepared.pixel_values.numpy(), expected["pixel_values"])
    assert isinstance(model.assets.preprocess, QwenVLPreprocessParams)


def test_vision_tower_equals_hf_image_features_for_a_batch_of_sizes(hf, model):
    imgs = images(4, seed=4)
    inputs = hf.image_processor(images=imgs, return_tensors="pt")
    with torch.no_grad():
        expected = hf.model.model.get_image_features(
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        ).pooler_output
    ours = model.encode_images([model.prepare_image(np.asarray(image)) for image in imgs])
    assert [o.shape for o in ours] == [e.shape for e in expected]
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_rope_positions_equal_hf_get_rope_index(hf, model, n_images):
    messages = interleaved(images(n_images, seed=5))
    inputs = hf_inputs(hf, messages)
    prompt, prepared = our_prompt(model, messages)
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    ours = model.rope_positions(prompt, prepared)
    assert ours.dtype == torch.int32 and ours.shape == (3, len(prompt.token_ids))
    if n_images:
        expected, _ = hf.model.model.get_rope_index(
            inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
        )
        torch.testing.assert_close(ours.long(), expected[:, 0], rtol=0, atol=0)
    else:  # text only: transformers numbers tokens 0..n-1 on every row
        torch.testing.assert_close(ours.long(), torch.arange(len(prompt.token_ids)).expand(3, -1), rtol=0, atol=0)


def test_prefill_logits_match_transformers_also_in_chunks(hf, model):
    messages = interleaved(images(3, seed=13))
    inputs = hf_inputs(hf, messages)
    with torch.no_grad():
        expected = hf.model(**inputs).logits[0].float()
    prompt, prepared = our_prompt(model, messages)
    assert_close_logits(prefill_logits(model, prompt, prepared), expected)
    first = prompt.image_slots[0]
    cuts = [
        0,
        first.start + first.n_tokens // 2,
        len(prompt.token_ids) - 1,
        len(prompt.token_ids),
    ]  # cut inside an image
    assert_close_logits(prefill_logits(model, prompt, prepared, cuts), expected)


def hf_generate(ref: Reference, messages: list[dict], n_new: int = N_NEW) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: (new ids without a final EOS, per-step logits [steps, vocab])."""
    inputs = hf_inputs(ref, messages)
    with torch.no_grad():
        out = ref.model.generate(
            **inputs, max_new_tokens=n_new, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    eos = ref.model.generation_config.eos_token_id  # an id, or a list of ids (Qwen3-VL's hub configs)
    if new and new[-1] in (eos if isinstance(eos, list) else [eos]):
        new = new[:-1]
    return new, torch.stack(out.logits)[:, 0]


@pytest.mark.parametrize("n_images", [1, 3])
def test_greedy_tokens_and_logits_equal_transformers_generate(hf, runtime, n_images):
    messages = interleaved(images(n_images, seed=20 + n_images), "Describe them.")
    expected, expected_logits = hf_generate(hf, messages)
    result = runtime.generate(messages, max_tokens=N_NEW, return_logits=True)
    assert result.tokens == expected
    assert_close_logits(result.logits, expected_logits[: result.logits.shape[0]])
    assert result.stats.images == n_images and result.stats.prompt_tokens > n_images * 8


def test_multi_turn_equals_one_request_with_the_whole_history(runtime):
    session = runtime.chat()
    imgs = images(2, seed=30)
    first = session.send(interleaved(imgs[:1], "What is this?")[0]["content"], max_tokens=6)
    second = session.send(
        [{"type": "image", "image": imgs[1]}, {"type": "text", "text": "And this one?"}],
        max_tokens=8,
        return_logits=True,
    )
    assert second.stats.reused_tokens > 8  # the first image and turn stayed in the arena
    whole = runtime.generate(session.history[:-1], max_tokens=8, return_logits=True)
    assert second.tokens == whole.tokens
    torch.testing.assert_close(second.logits, whole.logits, atol=1e-4 * whole.logits.abs().max().item(), rtol=0)
    assert first.text == session.history[1]["content"]
    session.close()


@pytest.mark.parametrize("policy", ["conduit", "cacheblend", "conduit_allq", "conduit_rescore", "conduit_deviation"])
def test_refreshing_every_restored_image_token_equals_a_cold_prefill(checkpoint, policy, device):
    """CONDUIT on M-RoPE: cached images restored at new (t, h, w) positions, then fully refreshed.
    fp32 on the CPU matches to rounding; bf16 on CUDA to bf16's precision (batch shapes differ)."""
    _, _, converted = checkpoint

    def fresh_runtime() -> Runtime:
        return Runtime(converted / "model.gguf", device=device, kv_cache_bytes=16 << 20, prefix_cache_entries=0)

    warm, pics = fresh_runtime(), images(3, seed=50)
    warm.generate(interleaved(pics, "Which is brightest?"), max_tokens=1, refresh="conduit")
    assert warm.arena.stats().n_image_entries == 3
    messages = [{"role": "system", "content": "Another prefix."}] + interleaved([pics[2], pics[0], pics[1]], "Changes?")
    refreshed = warm.generate(messages, max_tokens=1, return_logits=True, refresh=policy, refresh_budget=1.0)
    assert refreshed.stats.image_hits == 3 and refreshed.stats.refreshed_tokens == refreshed.stats.visual_tokens > 0
    cold = fresh_runtime().generate(messages, max_tokens=1, return_logits=True).logits[0]
    assert_close_logits(refreshed.logits[0], cold, rtol=1e-5 if device == "cpu" else 3e-2)
    stale = warm.generate(messages, max_tokens=1, return_logits=True, refresh="none").logits[0]
    assert (stale - cold).abs().max() > 1e-3 * cold.abs().max()  # the restored, unrefreshed KV was used


def hf_bf16_reference(ref: Reference, source, messages: list[dict]) -> dict[str, torch.Tensor]:
    """HF fp32 (CPU) and bf16 (CUDA, SDPA) logits of every prompt position and image features, float32 CPU."""
    inputs = hf_inputs(ref, messages)
    hf_bf16 = (
        type(ref.model).from_pretrained(source, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").eval()
    )
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    cuda_inputs["pixel_values"] = cuda_inputs["pixel_values"].bfloat16()
    out = {}
    with torch.no_grad():
        for name, model, given in (("fp32", ref.model, inputs), ("bf16", hf_bf16, cuda_inputs)):
            out[f"{name}_logits"] = model(**given).logits[0].float().cpu()
            features = model.model.get_image_features(
                pixel_values=given["pixel_values"], image_grid_thw=given["image_grid_thw"]
            ).pooler_output
            out[f"{name}_features"] = torch.cat(features).float().cpu()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("n_images", [1, 3])
def test_bf16_cuda_logits_and_features_track_transformers(checkpoint, hf, n_images):
    """bf16 on CUDA: our error against HF fp32 stays within bf16's own (HF bf16 vs HF fp32)."""
    _, source, converted = checkpoint
    messages = interleaved(images(n_images, seed=n_images + 10))
    ref = hf_bf16_reference(hf, source, messages)
    gpu_model = load_model(converted / "model.gguf", converted / "mmproj.gguf", "cuda", torch.bfloat16)
    assert gpu_model.dtype == torch.bfloat16 and gpu_model.device.type == "cuda"
    prompt, prepared = our_prompt(gpu_model, messages)
    for kind, ours in (
        ("features", torch.cat(gpu_model.encode_images(prepared)).float().cpu()),
        ("logits", prefill_logits(gpu_model, prompt, prepared)),
    ):
        expected = ref[f"fp32_{kind}"]
        hf_error = (ref[f"bf16_{kind}"] - expected).abs().max().item()
        our_error = (ours - expected).abs().max().item()
        assert our_error <= 2 * hf_error + 1e-2 * expected.abs().max().item(), (kind, our_error, hf_error)
    logits, expected = ours, ref["fp32_logits"]
    assert (
        logits[-1].argmax() == expected[-1].argmax()
        or (logits - expected).abs().max() <= (ref["bf16_logits"] - expected).abs().max()
    )


@pytest.mark.gpu
def test_bf16_cuda_runtime_first_logits_track_transformers(checkpoint, hf):
    """The whole request path on CUDA in bf16 (preprocess, tower, M-RoPE prefill, decode) through the Runtime."""
    _, source, converted = checkpoint
    gpu_runtime = Runtime(converted / "model.gguf", device="cuda", kv_cache_bytes=16 << 20, image_cache_bytes=0)
    messages = interleaved(images(3, seed=40), "Describe them.")
    ref = hf_bf16_reference(hf, source, messages)
    result = gpu_runtime.generate(messages, max_tokens=N_NEW, return_logits=True)
    assert result.stats.images == 3 and 1 <= result.logits.shape[0] <= N_NEW
    assert torch.isfinite(result.logits).all()
    expected = ref["fp32_logits"][-1]
    hf_error = (ref["bf16_logits"][-1] - expected).abs().max().item()
    our_error = (result.logits[0] - expected).abs().max().item()
    assert our_error <= 2 * hf_error + 1e-2 * expected.abs().max().item(), (our_error, hf_error)


@pytest.mark.gpu
def test_graph_replayed_decode_equals_eager_decode_with_mrope(checkpoint):
    """The captured decode step with M-RoPE ([3, 1] RoPE positions) against eager decoding."""
    from tests.test_runtime import graphed_and_eager_agree

    _, _, converted = checkpoint
    graphed_and_eager_agree(converted / "model.gguf", interleaved(images(2, seed=41), "Describe them."), max_tokens=20)
