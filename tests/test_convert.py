"""``convert``: a tiny random LLaVA-1.5 checkpoint -> model.gguf + mmproj.gguf, checked against transformers."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.model_file import load_model_dir
from conduit_rt.convert import OutputDtype, convert_checkpoint
from conduit_rt.convert.cli import main as convert_main
from tests.fixtures.tiny_llava import NUM_IMAGE_TOKENS, build_tiny_llava
from tests.fixtures.tiny_tokenizer import CHAT_TEMPLATE

DTYPES = [dtype.value for dtype in OutputDtype]

# GGUF name pattern -> transformers' in-memory LlavaForConditionalGeneration name (written out
# independently of the converter's own mapping).
_HF_NAMES = [
    (r"token_embd\.weight", "model.language_model.embed_tokens.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.language_model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", r"model.language_model.layers.\1.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", r"model.language_model.layers.\1.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", r"model.language_model.layers.\1.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.language_model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.language_model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.language_model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.language_model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.language_model.layers.\1.mlp.down_proj.weight"),
    (r"output_norm\.weight", "model.language_model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"v\.patch_embd\.weight", "model.vision_tower.embeddings.patch_embedding.weight"),
    (r"v\.class_embd", "model.vision_tower.embeddings.class_embedding"),
    (r"v\.position_embd\.weight", "model.vision_tower.embeddings.position_embedding.weight"),
    (r"v\.pre_ln\.(weight|bias)", r"model.vision_tower.pre_layrnorm.\1"),
    (r"v\.blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"model.vision_tower.encoder.layers.\1.self_attn.\2_proj.\3"),
    (r"v\.blk\.(\d+)\.attn_out\.(weight|bias)", r"model.vision_tower.encoder.layers.\1.self_attn.out_proj.\2"),
    (r"v\.blk\.(\d+)\.ln(1|2)\.(weight|bias)", r"model.vision_tower.encoder.layers.\1.layer_norm\2.\3"),
    (r"v\.blk\.(\d+)\.ffn_up\.(weight|bias)", r"model.vision_tower.encoder.layers.\1.mlp.fc1.\2"),
    (r"v\.blk\.(\d+)\.ffn_down\.(weight|bias)", r"model.vision_tower.encoder.layers.\1.mlp.fc2.\2"),
    (r"mm\.0\.(weight|bias)", r"model.multi_modal_projector.linear_1.\1"),
    (r"mm\.2\.(weight|bias)", r"model.multi_modal_projector.linear_2.\1"),
]


def hf_name(gguf_name: str) -> str:
    for pattern, replacement in _HF_NAMES:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, replacement, gguf_name)
    raise KeyError(gguf_name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), seed=0)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def hf_weights(hf_model) -> dict[str, torch.Tensor]:
    return {name.replace(".vision_model.", "."): tensor for name, tensor in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    """dtype -> the output folder of converting the tiny checkpoint with that dtype (converted once)."""
    cache: dict[str, Path] = {}

    def get(dtype: str) -> Path:
        if dtype not in cache:
            cache[dtype] = tmp_path_factory.mktemp(f"gguf_{dtype}")
            convert_checkpoint(checkpoint, cache[dtype], dtype=dtype, progress=False)
        return cache[dtype]

    return get


def assert_round_trip(name: str, stored_type: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if stored_type == "F32":
        assert torch.equal(actual, expected), name
    elif stored_type == "F16":
        assert torch.equal(actual, expected.half().float()), name
    elif stored_type == "BF16":
        assert torch.equal(actual, expected.bfloat16().float()), name
    else:  # Q8_0: blocks of 32 scaled by absmax/127 (f16 scale): error <= 0.5 step + scale rounding
        blocks, actual_blocks = expected.reshape(-1, 32), actual.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127
        assert ((actual_blocks - blocks).abs() <= 0.6 * step + 1e-12).all(), name
        assert (actual - expected).abs().max() > 0, f"{name}: Q8_0 should not be lossless on random weights"


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_reads_back_the_source_tensors(converted, hf_weights, dtype):
    text, vision = load_model_dir(converted(dtype))
    for model_file in (text, vision):
        for name in model_file.tensor_names:
            expected = hf_weights[hf_name(name)]
            actual = model_file.tensor(name)
            assert actual.shape == expected.shape and model_file.shape(name) == tuple(expected.shape), name
            assert_round_trip(name, model_file.ggml_type(name), actual, expected)


@pytest.mark.parametrize(
    ("dtype", "matrix", "position_embd", "conv"),
    [("f32", "F32", "F32", "F32"), ("f16", "F16", "F16", "F16"), ("bf16", "BF16", "BF16", "BF16"),
     ("q8_0", "Q8_0", "F16", "F16")],
)
def test_storage_types_follow_dtype_and_one_d_tensors_stay_f32(converted, dtype, matrix, position_embd, conv):
    text, vision = load_model_dir(converted(dtype))
    for name in ("token_embd.weight", "blk.1.attn_k.weight", "blk.0.ffn_down.weight", "output.weight"):
        assert text.ggml_type(name) == matrix, name
    assert vision.ggml_type("v.blk.1.ffn_up.weight") == matrix
    assert vision.ggml_type("mm.2.weight") == matrix
    assert vision.ggml_type("v.position_embd.weight") == position_embd
    assert vision.ggml_type("v.patch_embd.weight") == conv
    for name in ("blk.0.attn_norm.weight", "output_norm.weight"):
        assert text.ggml_type(name) == "F32"
    for name in ("v.class_embd", "v.pre_ln.bias", "v.blk.0.attn_q.bias", "mm.0.bias"):
        assert vision.ggml_type(name) == "F32"


def _llama_cpp_order(hf_rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Row r of head h in llama.cpp's layout: pair j = r // 2 of the head, half r % 2 (element-wise, no reshape)."""
    head_dim = hf_rows.shape[0] // num_heads
    order = [h * head_dim + (r % 2) * (head_dim // 2) + r // 2 for h in range(num_heads) for r in range(head_dim)]
    return hf_rows[order]


def test_attn_q_and_k_rows_are_stored_permuted_as_llama_cpp_does(converted, hf_weights):
    reader = gguf.GGUFReader(converted("f32") / "model.gguf")
    raw = {tensor.name: torch.from_numpy(tensor.data.copy()) for tensor in reader.tensors}
    for layer in range(2):
        q = hf_weights[f"model.language_model.layers.{layer}.self_attn.q_proj.weight"]
        k = hf_weights[f"model.language_model.layers.{layer}.self_attn.k_proj.weight"]
        v = hf_weights[f"model.language_model.layers.{layer}.self_attn.v_proj.weight"]
        assert torch.equal(raw[f"blk.{layer}.attn_q.weight"], _llama_cpp_order(q, num_heads=4))
        assert torch.equal(raw[f"blk.{layer}.attn_k.weight"], _llama_cpp_order(k, num_heads=2))
        assert torch.equal(raw[f"blk.{layer}.attn_v.weight"], v)  # V is never permuted
        assert not torch.equal(raw[f"blk.{layer}.attn_q.weight"], q)


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def test_text_file_carries_llama_cpp_keys_from_the_hf_config(converted, hf_model):
    fields = _fields(converted("f16") / "model.gguf")
    text = hf_model.config.text_config
    assert fields["general.architecture"] == "llama" and fields["general.type"] == "model"
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    expected = {
        "llama.vocab_size": text.vocab_size, "llama.context_length": text.max_position_embeddings,
        "llama.embedding_length": text.hidden_size, "llama.block_count": text.num_hidden_layers,
        "llama.feed_forward_length": text.intermediate_size, "llama.attention.head_count": text.num_attention_heads,
        "llama.attention.head_count_kv": text.num_key_value_heads, "llama.rope.dimension_count": text.head_dim,
        "tokenizer.ggml.bos_token_id": text.bos_token_id, "tokenizer.ggml.eos_token_id": text.eos_token_id,
        "tokenizer.ggml.padding_token_id": text.pad_token_id, "conduit.image_token_id": hf_model.config.image_token_id,
    }
    assert {key: fields[key] for key in expected} == expected
    assert fields["llama.rope.freq_base"] == pytest.approx(text.rope_parameters["rope_theta"])
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(text.rms_norm_eps)
    assert fields["tokenizer.ggml.model"] == "llama"


def test_tokenizer_and_chat_template_travel_inside_the_text_file(converted, checkpoint):
    from tokenizers import Tokenizer

    fields = _fields(converted("f32") / "model.gguf")
    assert fields["tokenizer.huggingface.json"] == (checkpoint / "tokenizer.json").read_text()
    assert fields["tokenizer.chat_template"] == CHAT_TEMPLATE
    source = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert fields["tokenizer.ggml.tokens"] == [source.id_to_token(i) for i in range(source.get_vocab_size())]
    types = fields["tokenizer.ggml.token_type"]
    assert types[source.token_to_id("<image>")] == gguf.TokenType.CONTROL
    assert types[source.token_to_id("<0x41>")] == gguf.TokenType.BYTE
    assert types[source.token_to_id("<unk>")] == gguf.TokenType.UNKNOWN


def test_mmproj_carries_clip_keys_and_preprocessing(converted, hf_model, checkpoint):
    fields = _fields(converted("f16") / "mmproj.gguf")
    vision = hf_model.config.vision_config
    assert fields["general.architecture"] == "clip" and fields["general.type"] == "mmproj"
    assert fields["clip.projector_type"] == "mlp" and fields["clip.has_vision_encoder"] is True
    expected = {
        "clip.vision.image_size": vision.image_size, "clip.vision.patch_size": vision.patch_size,
        "clip.vision.embedding_length": vision.hidden_size, "clip.vision.feed_forward_length": vision.intermediate_size,
        "clip.vision.attention.head_count": vision.num_attention_heads,
        "clip.vision.block_count": vision.num_hidden_layers - 1,  # feature layer -2: the last block is not stored
        "clip.vision.projection_dim": hf_model.config.text_config.hidden_size,
        "conduit.vision.feature_layer": -2, "conduit.vision.feature_select_strategy": "default",
        "conduit.vision.hidden_act": "quick_gelu", "conduit.projector.hidden_act": "gelu", "clip.use_gelu": False,
    }
    assert {key: fields[key] for key in expected} == expected
    preprocessor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert json.loads(fields["clip.vision.preprocessor_config"]) == preprocessor
    assert fields["clip.vision.image_mean"] == pytest.approx(preprocessor["image_mean"])
    assert fields["clip.vision.image_std"] == pytest.approx(preprocessor["image_std"])
    assert json.loads(fields["conduit.source_config"]) == json.loads((checkpoint / "config.json").read_text())


def test_mmproj_stores_only_the_blocks_up_to_the_feature_layer(converted):
    _, vision = load_model_dir(converted("f32"))
    assert vision.config.num_hidden_layers == 2 and vision.config.num_image_tokens == NUM_IMAGE_TOKENS
    assert not any(name.startswith(("v.blk.2.", "v.post_ln")) for name in vision.tensor_names)


def test_unsupported_architecture_is_refused_with_the_supported_list(checkpoint, tmp_path):
    source = tmp_path / "qwen"
    shutil.copytree(checkpoint, source)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["Qwen2VLForConditionalGeneration"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="Qwen2VLForConditionalGeneration(.|\n)*LlavaForConditionalGeneration"):
        convert_checkpoint(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_non_clip_vision_tower_is_refused(checkpoint, tmp_path):
    source = tmp_path / "siglip"
    shutil.copytree(checkpoint, source)
    config = json.loads((source / "config.json").read_text())
    config["vision_config"]["model_type"] = "siglip_vision_model"
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="siglip_vision_model"):
        convert_checkpoint(source, tmp_path / "out", progress=False)


def test_missing_source_tensor_is_refused_before_writing(checkpoint, tmp_path):
    source = tmp_path / "broken"
    shutil.copytree(checkpoint, source)
    weights = load_file(source / "model.safetensors")
    dropped = next(name for name in weights if name.endswith("layers.1.mlp.up_proj.weight"))
    del weights[dropped]
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"blk\.1\.ffn_up\.weight"):
        convert_checkpoint(source, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_converts_and_reports_refusals(checkpoint, tmp_path, capsys):
    assert convert_main([str(checkpoint), "--outdir", str(tmp_path / "out"), "--dtype", "bf16", "--quiet"]) == 0
    assert (tmp_path / "out" / "model.gguf").is_file() and (tmp_path / "out" / "mmproj.gguf").is_file()
    assert convert_main([str(tmp_path / "nowhere" / "x"), "--outdir", str(tmp_path / "o2"), "--quiet"]) == 1
    assert "no such folder" in capsys.readouterr().err
    assert convert_main([str(checkpoint), "--outdir", str(tmp_path / "o3"), "--dtype", "q4"]) == 2


def test_hub_repo_id_is_fetched_with_snapshot_download(checkpoint, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision, allow_patterns))
        return str(checkpoint)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    files = convert_checkpoint("llava-hf/tiny-llava", tmp_path / "out", dtype="f32", revision="main", progress=False)
    assert calls == [("llava-hf/tiny-llava", "main", ["*.json", "*.safetensors", "*.jinja"])]
    assert _fields(files.text_model)["general.name"] == "llava-hf/tiny-llava"


def test_failed_hub_download_is_reported_by_the_cli(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def unreachable(repo_id, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    assert convert_main(["someone/missing-model", "--outdir", str(tmp_path / "out"), "--quiet"]) == 1
    assert "hub failed: offline" in capsys.readouterr().err


def _copy_checkpoint(checkpoint: Path, dest: Path, edit_config=None, edit_weights=None) -> Path:
    shutil.copytree(checkpoint, dest)
    if edit_config is not None:
        config = json.loads((dest / "config.json").read_text())
        edit_config(config)
        (dest / "config.json").write_text(json.dumps(config))
    if edit_weights is not None:
        weights = edit_weights(load_file(dest / "model.safetensors"))
        save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _assert_same_tensors(left_dir: Path, right_dir: Path) -> None:
    for left, right in zip(load_model_dir(left_dir), load_model_dir(right_dir)):
        assert left.tensor_names == right.tensor_names
        for name in left.tensor_names:
            assert torch.equal(left.tensor(name), right.tensor(name)), name


def test_older_hub_layout_converts_to_the_same_tensors(checkpoint, converted, tmp_path):
    """llava-hf's hub names (vision_tower.vision_model.*) and pre-transformers-5 config keys (rope_theta)."""
    def old_config(config):
        text = config["text_config"]
        text["rope_theta"] = text.pop("rope_parameters")["rope_theta"]
        del text["head_dim"], text["initializer_range"]  # head_dim is derived: hidden / heads

    def hub_names(weights):
        return {name.replace("vision_tower.", "vision_tower.vision_model."): tensor for name, tensor in weights.items()}

    source = _copy_checkpoint(checkpoint, tmp_path / "hub", old_config, hub_names)
    convert_checkpoint(source, tmp_path / "out", dtype="f32", progress=False)
    _assert_same_tensors(converted("f32"), tmp_path / "out")


def test_sharded_checkpoint_converts_to_the_same_tensors(checkpoint, converted, tmp_path):
    source = tmp_path / "sharded"
    shutil.copytree(checkpoint, source)
    weights = load_file(source / "model.safetensors")
    (source / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, members in shards.items():
        save_file({name: weights[name] for name in members}, source / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: file for file, members in shards.items() for name in members}}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    convert_checkpoint(source, tmp_path / "out", dtype="f32", progress=False)
    _assert_same_tensors(converted("f32"), tmp_path / "out")


def test_embedding_rows_past_the_tokenizer_become_unused_pad_tokens(checkpoint, tmp_path):
    """llava-hf pads the vocabulary (32064 rows for 32002 tokens); so does this copy (512 rows, 502 tokens)."""
    extra = 10

    def pad_rows(weights):
        for name in [n for n in weights if n.endswith(("embed_tokens.weight", "lm_head.weight"))]:
            weights[name] = torch.cat([weights[name], torch.randn(extra, weights[name].shape[1])])
        return weights

    def pad_config(config):
        config["text_config"]["vocab_size"] += extra

    source = _copy_checkpoint(checkpoint, tmp_path / "padded", pad_config, pad_rows)
    text, _ = load_model_dir(convert_checkpoint(source, tmp_path / "out", dtype="f32", progress=False).text_model.parent)
    vocab = text.config.vocab_size
    assert vocab == 512 and text.shape("token_embd.weight") == (512, 64)
    assert text.config.tokens[-1] == "[PAD511]" and text.config.tokens[501] == "<pad>"
    types = _fields(text.path)["tokenizer.ggml.token_type"]
    assert types[502:] == [gguf.TokenType.UNUSED] * extra


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_rope_permutation_of_biases_and_its_inverse(num_heads):
    from conduit_rt.gguf_names import llama_rope_permute, llama_rope_unpermute

    bias = torch.randn(num_heads * 8)
    permuted = llama_rope_permute(bias, num_heads)
    assert torch.equal(permuted, _llama_cpp_order(bias, num_heads))
    assert torch.equal(llama_rope_unpermute(permuted, num_heads), bias)
