"""``conduit_rt.model_file``: loading converted GGUF files, and every way a file can be wrong."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.model_file import load_mmproj_file, load_model_dir, load_text_model_file
from conduit_rt.convert import convert_checkpoint
from tests.fixtures.tiny_llava import CLIP_MEAN, CLIP_STD, IMAGE_SIZE, NUM_IMAGE_TOKENS, PATCH_SIZE, build_tiny_llava
from tests.fixtures.tiny_tokenizer import CHAT_TEMPLATE


def rewrite_gguf(
    src: Path, dst: Path, *, drop_tensors: tuple[str, ...] = (), drop_keys: tuple[str, ...] = (),
    set_keys: dict[str, tuple[Any, GGUFValueType]] | None = None,
    replace_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    add_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Copy a GGUF file with keys and tensors dropped, changed or added (the way a bad file would look)."""
    set_keys, replace_tensors, add_tensors = set_keys or {}, replace_tensors or {}, add_tensors or {}
    reader = GGUFReader(src)
    arch = set_keys.get("general.architecture", (reader.fields["general.architecture"].contents(),))[0]
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in set_keys:
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, (value, value_type) in set_keys.items():
        if key != "general.architecture":
            writer.add_key_value(key, value, value_type)
    for tensor in reader.tensors:
        if tensor.name not in drop_tensors:
            data, kind = replace_tensors.get(tensor.name, (np.array(tensor.data), tensor.tensor_type))
            writer.add_tensor(tensor.name, data, raw_dtype=kind)
    for name, data in add_tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def random_array(*shape: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), seed=0)


@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("gguf")
    convert_checkpoint(checkpoint, outdir, dtype="f32", progress=False)
    return outdir


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """Same configuration, other random weights (seed 1)."""
    source = build_tiny_llava(tmp_path_factory.mktemp("tiny_llava_seed1"), seed=1)
    outdir = tmp_path_factory.mktemp("gguf_seed1")
    convert_checkpoint(source, outdir, dtype="f32", progress=False)
    return outdir


@pytest.fixture(scope="module")
def hf_config(checkpoint):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint)


def test_text_config_holds_the_hf_hyperparameters_and_tokenizer(model_dir, hf_config, checkpoint):
    config = load_text_model_file(model_dir / "model.gguf").config
    text = hf_config.text_config
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size) == (
        "llama", text.vocab_size, text.hidden_size, text.intermediate_size)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.head_dim)
    assert config.num_key_value_groups == 2
    assert config.rms_norm_eps == pytest.approx(text.rms_norm_eps)
    assert config.rope_theta == pytest.approx(text.rope_parameters["rope_theta"])
    assert config.rope_scaling_type is None and config.max_position_embeddings == text.max_position_embeddings
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        text.bos_token_id, text.eos_token_id, text.pad_token_id)
    assert config.image_token_id == hf_config.image_token_id and not config.tie_word_embeddings
    assert config.add_bos_token and not config.add_eos_token
    assert config.chat_template == CHAT_TEMPLATE
    assert config.tokenizer_json == (checkpoint / "tokenizer.json").read_text()
    assert config.source_config["architectures"] == ["LlavaForConditionalGeneration"]


def test_vision_config_holds_the_hf_hyperparameters_and_preprocessing(model_dir, hf_config):
    text, vision_file = load_model_dir(model_dir)
    config, vision = vision_file.config, hf_config.vision_config
    assert (config.image_size, config.patch_size, config.hidden_size, config.intermediate_size) == (
        IMAGE_SIZE, PATCH_SIZE, vision.hidden_size, vision.intermediate_size)
    assert config.num_attention_heads == vision.num_attention_heads and config.head_dim == 8
    assert config.num_hidden_layers == vision.num_hidden_layers - 1 and config.feature_layer == -2
    assert config.layer_norm_eps == pytest.approx(vision.layer_norm_eps)
    assert (config.hidden_act, config.projector_hidden_act, config.projector_type) == ("quick_gelu", "gelu", "mlp")
    assert config.projection_dim == text.config.hidden_size
    assert config.num_image_tokens == NUM_IMAGE_TOKENS and config.num_positions == NUM_IMAGE_TOKENS + 1
    assert config.image_mean == tuple(CLIP_MEAN) and config.image_std == tuple(CLIP_STD)
    assert config.preprocessor_config["crop_size"] == {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    assert config.processor_config["num_additional_image_tokens"] == 1
    assert config.source_id == text.config.source_id and len(config.source_id) == 64


def test_tensor_is_a_fresh_copy_in_the_requested_dtype(model_dir):
    text = load_text_model_file(model_dir / "model.gguf")
    first = text.tensor("blk.0.ffn_gate.weight", dtype=torch.float16)
    assert first.dtype == torch.float16 and first.shape == (128, 64) and first.abs().sum() > 0
    first.zero_()
    assert text.tensor("blk.0.ffn_gate.weight").abs().sum() > 0
    state = text.state_dict()
    assert set(state) == set(text.tensor_names) and "output.weight" in text


def test_file_without_output_tensor_reads_as_tied_embeddings(model_dir, tmp_path):
    path = rewrite_gguf(model_dir / "model.gguf", tmp_path / "tied.gguf", drop_tensors=("output.weight",))
    text = load_text_model_file(path)
    assert text.config.tie_word_embeddings and "output.weight" not in text


@pytest.mark.parametrize("keep_bytes", [10, 2000, -100])
def test_truncated_file_is_reported(model_dir, tmp_path, keep_bytes):
    data = (model_dir / "model.gguf").read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(data[:keep_bytes])
    with pytest.raises(ModelFormatError, match="truncated") as error:
        load_text_model_file(path)
    assert str(path) in str(error.value)


def test_wrong_magic_is_reported(model_dir, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + (model_dir / "model.gguf").read_bytes()[4:])
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_text_model_file(path)


def test_missing_file_says_to_convert(tmp_path):
    with pytest.raises(FileNotFoundError, match="conduit convert"):
        load_text_model_file(tmp_path / "model.gguf")


def test_missing_tensor_is_named(model_dir, tmp_path):
    path = rewrite_gguf(model_dir / "mmproj.gguf", tmp_path / "mmproj.gguf", drop_tensors=("v.blk.1.ln2.bias",))
    with pytest.raises(ModelFormatError, match=r"missing tensor v\.blk\.1\.ln2\.bias"):
        load_mmproj_file(path)


def test_tensor_with_wrong_shape_is_named(model_dir, tmp_path):
    bad = {"blk.1.ffn_norm.weight": (random_array(60), GGMLQuantizationType.F32)}
    path = rewrite_gguf(model_dir / "model.gguf", tmp_path / "model.gguf", replace_tensors=bad)
    with pytest.raises(ModelFormatError, match=r"blk\.1\.ffn_norm\.weight has shape \[60\], expected \[64\]"):
        load_text_model_file(path)


def test_unexpected_tensor_is_named(model_dir, tmp_path):
    path = rewrite_gguf(model_dir / "model.gguf", tmp_path / "model.gguf", add_tensors={"blk.2.attn_q.weight": random_array(64, 64)})
    with pytest.raises(ModelFormatError, match=r"unexpected tensor\(s\) blk\.2\.attn_q\.weight"):
        load_text_model_file(path)


def test_tensor_type_the_loader_cannot_read_is_named(model_dir, tmp_path):
    q4 = quantize(random_array(128, 64), GGMLQuantizationType.Q4_0)
    path = rewrite_gguf(model_dir / "model.gguf", tmp_path / "model.gguf",
                        replace_tensors={"blk.0.ffn_up.weight": (q4, GGMLQuantizationType.Q4_0)})
    with pytest.raises(ModelFormatError, match=r"blk\.0\.ffn_up\.weight has type Q4_0"):
        load_text_model_file(path)


def test_key_with_wrong_type_is_named(model_dir, tmp_path):
    path = rewrite_gguf(model_dir / "model.gguf", tmp_path / "model.gguf",
                        set_keys={"llama.block_count": ("2", GGUFValueType.STRING)})
    with pytest.raises(ModelFormatError, match="llama.block_count should be an integer, found STRING"):
        load_text_model_file(path)


def test_missing_key_is_named(model_dir, tmp_path):
    path = rewrite_gguf(model_dir / "mmproj.gguf", tmp_path / "mmproj.gguf", drop_keys=("clip.vision.patch_size",))
    with pytest.raises(ModelFormatError, match="missing key clip.vision.patch_size"):
        load_mmproj_file(path)


def test_inconsistent_hyperparameters_are_reported_with_the_file(model_dir, tmp_path):
    path = rewrite_gguf(model_dir / "model.gguf", tmp_path / "model.gguf",
                        set_keys={"llama.attention.head_count_kv": (3, GGUFValueType.UINT32)})
    with pytest.raises(ModelFormatError, match="model.gguf: num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        load_text_model_file(path)


def test_mmproj_from_another_checkpoint_is_refused(model_dir, other_model_dir):
    text = load_text_model_file(model_dir / "model.gguf")
    with pytest.raises(ModelFormatError, match="different model"):
        load_mmproj_file(other_model_dir / "mmproj.gguf", text)


def test_mmproj_projecting_to_another_width_is_refused(model_dir, tmp_path):
    width = 32  # the text model is 64 wide
    narrow = {
        "mm.0.weight": (random_array(width, 32), GGMLQuantizationType.F32), "mm.0.bias": (random_array(width), GGMLQuantizationType.F32),
        "mm.2.weight": (random_array(width, width), GGMLQuantizationType.F32), "mm.2.bias": (random_array(width), GGMLQuantizationType.F32),
    }
    path = rewrite_gguf(model_dir / "mmproj.gguf", tmp_path / "mmproj.gguf", drop_keys=("conduit.source_id",),
                        set_keys={"clip.vision.projection_dim": (width, GGUFValueType.UINT32)}, replace_tensors=narrow)
    assert load_mmproj_file(path).config.projection_dim == width  # consistent on its own
    with pytest.raises(ModelFormatError, match="projector output 32 != text embedding length 64"):
        load_mmproj_file(path, load_text_model_file(model_dir / "model.gguf"))


def test_text_and_mmproj_files_swapped_are_refused(model_dir):
    with pytest.raises(ModelFormatError, match="not a text model"):
        load_text_model_file(model_dir / "mmproj.gguf")
    with pytest.raises(ModelFormatError, match="not an mmproj file"):
        load_mmproj_file(model_dir / "model.gguf")


def test_unsupported_architecture_and_projector_are_refused(model_dir, tmp_path):
    text = rewrite_gguf(model_dir / "model.gguf", tmp_path / "model.gguf",
                        set_keys={"general.architecture": ("gemma3", GGUFValueType.STRING)})
    with pytest.raises(UnsupportedArchitectureError, match="'gemma3' is not supported; supported: llama, qwen2vl"):
        load_text_model_file(text)
    mmproj = rewrite_gguf(model_dir / "mmproj.gguf", tmp_path / "mmproj.gguf",
                          set_keys={"clip.projector_type": ("gemma3", GGUFValueType.STRING)})
    with pytest.raises(UnsupportedArchitectureError, match="projector type 'gemma3'"):
        load_mmproj_file(mmproj)


def test_model_dir_copy_loads_as_a_pair(model_dir, tmp_path):
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    text, vision = load_model_dir(copy)
    assert text.path == copy / "model.gguf" and vision.path == copy / "mmproj.gguf"
