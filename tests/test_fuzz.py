"""Malformed model files, images and messages: each class the fuzzers of ``fuzz/`` found, as a test.

The model-file cases edit the committed real files of ``fuzz/corpus/gguf`` (converted from the
tiny test checkpoints) through ``fuzz.gguf_mutator``'s file structure, so that the one field under
test is wrong and everything else stays consistent; each asserts ``ModelFormatError`` naming the
file and the field. The last tests run each harness for 20,000 executions on the committed corpus
(skipped where atheris is not installed) and fail on any finding.
"""
from __future__ import annotations

import io
import json
import math
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from PIL import Image

from conduit_rt import BUNDLED_MODEL, preprocess
from conduit_rt.chat import ChatTemplate, build_prompt
from conduit_rt.gguf_names import is_rope_permuted
from conduit_rt.errors import ImageTooLargeError, ModelFormatError, RequestError
from conduit_rt.model_file import load_mmproj_file, load_text_model_file
from conduit_rt.models import load_model
from conduit_rt.preprocess import to_rgb_array
from conduit_rt.tokenizer import TextTokenizer
from fuzz.gguf_mutator import ARRAY, STRING, UINT32, GGUFModel, KeyValue, TensorEntry, parse
from fuzz.make_corpus import bomb_png

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
LLAVA_TEXT, LLAVA_MMPROJ = CORPUS / "gguf" / "llava-model.gguf", CORPUS / "gguf" / "llava-mmproj.gguf"
QWEN_TEXT, QWEN_MMPROJ = CORPUS / "gguf" / "qwen25-model.gguf", CORPUS / "gguf" / "qwen25-mmproj.gguf"


def structure(path: Path) -> GGUFModel:
    return parse(path.read_bytes())


def write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def key(model: GGUFModel, name: str) -> KeyValue:
    return next(kv for kv in model.keys if kv.key == name.encode())


def tensor(model: GGUFModel, name: str) -> TensorEntry:
    return next(t for t in model.tensors if t.name == name.encode())


def string_value(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def assert_refused(path: Path, field: str, mmproj: Path | None = None, text: Path | None = None) -> None:
    """Loading fails with ModelFormatError naming ``path`` and ``field``."""
    with pytest.raises(ModelFormatError) as caught:
        if text is not None:
            load_model(text, path)
        else:
            load_model(path, mmproj)
    assert str(path) in str(caught.value) and field in str(caught.value), str(caught.value)


# --- the header ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("offset", "value", "field"), [
    (0, b"X", "not a GGUF file"),
    (4, b"\x07", "GGUF.version"),
    (4, b"\x00\x00\x00\x03", "big-endian"),
    (15, b"\x40", "GGUF.tensor_count"),  # the count's top byte: 2^62 tensors
    (23, b"\x40", "GGUF.kv_count"),
])
def test_a_flipped_header_byte_is_refused(tmp_path, offset, value, field):
    data = bytearray(LLAVA_TEXT.read_bytes())
    data[offset : offset + len(value)] = value
    assert_refused(write(tmp_path, bytes(data)), field, LLAVA_MMPROJ)


def test_a_file_shorter_than_the_header_is_refused(tmp_path):
    assert_refused(write(tmp_path, LLAVA_TEXT.read_bytes()[:20]), "not a GGUF file")


# --- keys: lengths, counts, types --------------------------------------------------------------------

def test_an_absurd_string_length_is_refused_before_any_allocation(tmp_path):
    """The length prefix of general.name claims 2^62 bytes (once a MemoryError)."""
    model = structure(LLAVA_TEXT)
    key(model, "general.name").payload = struct.pack("<Q", 2**62) + b"tiny"
    assert_refused(write(tmp_path, model.to_bytes()), "key general.name")


def test_an_absurd_key_name_length_is_refused(tmp_path):
    data = bytearray(LLAVA_TEXT.read_bytes())
    data[24:32] = struct.pack("<Q", 2**63)  # the first key's name length
    assert_refused(write(tmp_path, bytes(data)), "key #0")


def test_an_absurd_array_count_is_refused(tmp_path):
    model = structure(LLAVA_TEXT)
    tokens = key(model, "tokenizer.ggml.tokens")
    tokens.payload = struct.pack("<IQ", STRING, 2**60) + tokens.payload[12:]
    assert_refused(write(tmp_path, model.to_bytes()), "key tokenizer.ggml.tokens")


def test_a_count_of_scalars_past_the_end_is_refused(tmp_path):
    model = structure(LLAVA_TEXT)
    scores = key(model, "tokenizer.ggml.scores")
    scores.payload = struct.pack("<IQ", 6, 2**40) + scores.payload[12:]
    assert_refused(write(tmp_path, model.to_bytes()), "key tokenizer.ggml.scores")


def test_nested_arrays_and_unknown_types_are_refused(tmp_path):
    model = structure(LLAVA_TEXT)
    key(model, "general.name").kind, key(model, "general.name").payload = ARRAY, struct.pack("<IQ", ARRAY, 1)
    assert_refused(write(tmp_path, model.to_bytes()), "arrays of arrays")
    model = structure(LLAVA_TEXT)
    key(model, "general.name").kind = 13
    assert_refused(write(tmp_path, model.to_bytes(), "other.gguf"), "unknown value type 13")


def set_scalar(name: str, fmt: str, value) -> Callable[[GGUFModel], None]:
    def edit(model: GGUFModel) -> None:
        key(model, name).payload = struct.pack(fmt, value)
    return edit


def add_key(name: bytes, fmt: str, value) -> Callable[[GGUFModel], None]:
    return lambda model: model.keys.append(KeyValue(name, UINT32, struct.pack(fmt, value)))


def retype_as_string(name: str) -> Callable[[GGUFModel], None]:
    def edit(model: GGUFModel) -> None:
        key(model, name).kind, key(model, name).payload = STRING, string_value("64")
    return edit


@pytest.mark.parametrize(("edit", "field"), [
    (add_key(b"llama.block_count", "<I", 2), "key llama.block_count: the key appears twice"),
    (retype_as_string("llama.embedding_length"), "key llama.embedding_length should be an integer"),
    (set_scalar("llama.block_count", "<I", 2**31), "key llama.block_count"),  # before any per-layer table
    (set_scalar("llama.attention.layer_norm_rms_epsilon", "<f", math.nan), "key llama.attention.layer_norm_rms_epsilon"),
    (add_key(b"general.alignment", "<I", 48), "key general.alignment"),
])
def test_a_bad_key_value_is_refused(tmp_path, edit, field):
    model = structure(LLAVA_TEXT)
    edit(model)
    assert_refused(write(tmp_path, model.to_bytes()), field)


def test_context_length_is_read_and_validated(tmp_path):
    model = structure(LLAVA_TEXT)
    key(model, "llama.context_length").payload = struct.pack("<I", 64)
    assert load_text_model_file(write(tmp_path, model.to_bytes())).config.max_position_embeddings == 64
    key(model, "llama.context_length").payload = struct.pack("<I", 0)
    assert_refused(write(tmp_path, model.to_bytes(), "zero.gguf"), "max_position_embeddings must be positive")


# --- embedded JSON, tokenizer, template, preprocessing -----------------------------------------

@pytest.mark.parametrize("document", ["[" * 100_000, "{not json", "[1, 2]"])
def test_a_malformed_json_key_is_refused(tmp_path, document):
    model = structure(LLAVA_TEXT)
    key(model, "conduit.source_config").payload = string_value(document)
    assert_refused(write(tmp_path, model.to_bytes()), "key conduit.source_config")


def test_a_broken_tokenizer_is_refused(tmp_path):
    model = structure(LLAVA_TEXT)
    key(model, "tokenizer.huggingface.json").payload = string_value('{"model": {"type": "BPE"}}')
    assert_refused(write(tmp_path, model.to_bytes()), "key tokenizer.huggingface.json")


def test_a_chat_template_that_does_not_compile_is_refused(tmp_path):
    model = structure(LLAVA_TEXT)
    key(model, "tokenizer.chat_template").payload = string_value("{% for %}")
    assert_refused(write(tmp_path, model.to_bytes()), "key tokenizer.chat_template")


def edited_preprocessor(tmp_path: Path, source: Path, **changes) -> Path:
    model = structure(source)
    field = key(model, "clip.vision.preprocessor_config")
    config = json.loads(field.payload[8:]) | changes
    field.payload = string_value(json.dumps(config))
    return write(tmp_path, model.to_bytes(), "mmproj.gguf")


@pytest.mark.parametrize(("source", "changes", "field"), [
    (LLAVA_MMPROJ, {"image_std": 7}, "image_std must be a list of numbers"),
    (LLAVA_MMPROJ, {"crop_size": {"height": 31, "width": 31}}, "the vision tower takes 30x30"),
    (LLAVA_MMPROJ, {"size": {"shortest_edge": 10**9}}, "resize target"),
    (LLAVA_MMPROJ, {"size": "x"}, "clip.vision.preprocessor_config"),
    (LLAVA_MMPROJ, {"resample": 99}, "resample 99"),
    (QWEN_MMPROJ, {"min_pixels": 10**12, "max_pixels": 10**13}, "min_pixels"),
    (QWEN_MMPROJ, {"patch_size": 7}, "patch, merge and temporal patch sizes"),
])
def test_preprocessing_a_request_cannot_run_is_refused(tmp_path, source, changes, field):
    text = LLAVA_TEXT if source == LLAVA_MMPROJ else QWEN_TEXT
    assert_refused(edited_preprocessor(tmp_path, source, **changes), field, text=text)


def test_an_unknown_activation_is_refused(tmp_path):
    model = structure(LLAVA_MMPROJ)
    key(model, "conduit.vision.hidden_act").payload = string_value("swish9")
    assert_refused(write(tmp_path, model.to_bytes(), "mmproj.gguf"), "key conduit.vision.hidden_act", text=LLAVA_TEXT)


def test_an_mmproj_of_another_architecture_is_refused(tmp_path):
    """A Qwen merger paired with a LLaVA decoder of the same width, no source fingerprints to tell."""
    text, vision = structure(LLAVA_TEXT), structure(QWEN_MMPROJ)
    for model in (text, vision):
        model.keys = [kv for kv in model.keys if kv.key != b"conduit.source_id"]
    text_path = write(tmp_path, text.to_bytes(), "model.gguf")
    assert_refused(write(tmp_path, vision.to_bytes(), "mmproj.gguf"), "clip.projector_type", text=text_path)


# --- the tensor table and the data --------------------------------------------------------------

def test_a_truncated_tensor_table_is_refused(tmp_path):
    model = structure(LLAVA_TEXT)
    head = len(model.to_bytes()) - len(model.data)
    assert_refused(write(tmp_path, LLAVA_TEXT.read_bytes()[: head - 100]), "tensor")


def test_truncated_tensor_data_is_refused(tmp_path):
    assert_refused(write(tmp_path, LLAVA_TEXT.read_bytes()[:-1000]), "past the end of the file")


@pytest.mark.parametrize(("edit", "field"), [
    (lambda t: setattr(t, "offset", t.offset + 1), "not a multiple of the alignment"),
    (lambda t: setattr(t, "offset", 2**63), "past the end of the file"),
    (lambda t: setattr(t, "kind", 1000), "unknown tensor type 1000"),
    (lambda t: setattr(t, "kind", GGMLQuantizationType.I32), "has type I32"),
    (lambda t: setattr(t, "dims", [32]), "has shape [32], expected [64]"),
    (lambda t: setattr(t, "dims", [64, 1, 1, 1, 1]), "5 dimensions"),
    (lambda t: setattr(t, "dims", [2**40, 2**40]), "past the end of the file"),
])
def test_a_bad_tensor_entry_is_refused(tmp_path, edit, field):
    model = structure(LLAVA_TEXT)
    edit(tensor(model, "output_norm.weight"))
    assert_refused(write(tmp_path, model.to_bytes()), field)


def test_q8_0_rows_must_hold_whole_blocks(tmp_path):
    model = structure(QWEN_TEXT)
    entry = next(t for t in model.tensors if t.kind == GGMLQuantizationType.Q8_0)
    entry.dims = [entry.dims[0] - 1, *entry.dims[1:]]
    assert_refused(write(tmp_path, model.to_bytes()), "block of 32")


def test_duplicate_and_overlapping_tensors_are_refused(tmp_path):
    model = structure(LLAVA_TEXT)
    tensor(model, "output_norm.weight").name = b"token_embd.weight"
    assert_refused(write(tmp_path, model.to_bytes()), "tensor token_embd.weight: the tensor name appears twice")
    model = structure(LLAVA_TEXT)
    tensor(model, "output_norm.weight").offset = tensor(model, "output.weight").offset
    assert_refused(write(tmp_path, model.to_bytes(), "overlap.gguf"), "overlaps")


def test_corrupted_tensor_data_loads_as_the_bytes_say(tmp_path):
    """Flipped bytes in the data section cannot be told from weights: loading is well-defined and
    gives exactly the values the bytes hold (an independent decode with numpy; attn_q/attn_k,
    which the loader un-permutes for RoPE, are left out)."""
    model = structure(LLAVA_TEXT)
    rng = np.random.default_rng(3)
    data = np.frombuffer(model.data, dtype=np.uint8).copy()
    flipped = rng.choice(data.size, size=64, replace=False)
    data[flipped] ^= 0xFF
    model.data = data.tobytes()
    path = write(tmp_path, model.to_bytes())
    loaded = load_text_model_file(path)
    for entry in model.tensors:
        name = entry.name.decode()
        if is_rope_permuted(name):
            continue
        n = int(np.prod(entry.dims))
        dtype = {GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2"}[GGMLQuantizationType(entry.kind)]
        raw = np.frombuffer(model.data, dtype=dtype, count=n, offset=entry.offset).reshape(entry.dims[::-1])
        torch.testing.assert_close(loaded.tensor(name), torch.from_numpy(raw.astype(np.float32)),
                                   rtol=0, atol=0, equal_nan=True)
    load_model(path, LLAVA_MMPROJ)


def test_the_committed_files_load():
    for text, mmproj in ((LLAVA_TEXT, LLAVA_MMPROJ), (QWEN_TEXT, QWEN_MMPROJ)):
        vision = load_mmproj_file(mmproj, load_text_model_file(text))
        assert vision.config.projection_dim == load_text_model_file(text).config.hidden_size
        assert load_model(text, mmproj).config.vocab > 0


# --- images and messages ------------------------------------------------------------------------

def test_a_lazily_opened_broken_image_is_a_request_error():
    data = bytearray((CORPUS / "images" / "rgb.png").read_bytes())
    data[60:70] = b"\xff" * 10  # inside the compressed pixels
    image = Image.open(io.BytesIO(bytes(data)))  # opens: the header is intact
    with pytest.raises(RequestError):
        to_rgb_array(image)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns as it opens the header
def test_an_image_just_over_the_pixel_limit_is_refused_before_decoding():
    """A 1 kB file can declare that many pixels (PIL itself only warns between 1x and 2x its own limit)."""
    side = math.isqrt(preprocess.MAX_IMAGE_PIXELS) + 100
    with pytest.raises(ImageTooLargeError):
        to_rgb_array(bomb_png(side))
    with pytest.raises(ImageTooLargeError):
        to_rgb_array(Image.open(io.BytesIO(bomb_png(side))))


@pytest.fixture(scope="module")
def bundled_chat():
    tokenizer, template = TextTokenizer.from_hf_folder(BUNDLED_MODEL)
    return tokenizer, ChatTemplate(template)


def test_text_with_a_lone_surrogate_is_a_request_error(bundled_chat):
    tokenizer, template = bundled_chat
    with pytest.raises(RequestError, match="not valid Unicode"):
        build_prompt([{"role": "user", "content": "a\ud800b"}], template, tokenizer, 451, 3)


def test_messages_that_contain_themselves_are_a_request_error(bundled_chat):
    tokenizer, template = bundled_chat
    message: dict = {"role": "user", "content": "hi"}
    message["metadata"] = message
    with pytest.raises(RequestError, match="cycle"):
        build_prompt([message], template, tokenizer, 451, 3)


# --- the harnesses -----------------------------------------------------------------------------

@pytest.mark.parametrize("harness", ["gguf_loader", "images", "messages"])
def test_the_fuzz_harness_finds_nothing(tmp_path, harness):
    pytest.importorskip("atheris")
    corpus = {"gguf_loader": "gguf"}.get(harness, harness)
    result = subprocess.run(
        [sys.executable, str(ROOT / "fuzz" / f"{harness}.py"), str(tmp_path), str(CORPUS / corpus),
         "-runs=20000", "-seed=1", "-timeout=60", "-rss_limit_mb=3000", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=1800,
    )
    tail = result.stderr[-3000:]
    assert result.returncode == 0, tail
    done = re.search(r"Done (\d+) runs", result.stderr)
    assert done and int(done.group(1)) >= 20000, tail
    # Coverage reached the package: an uninstrumented harness reports no "cov:" and keeps no corpus,
    # so it would only ever mutate one-byte inputs.
    coverage = re.search(r"DONE\s+cov: (\d+)", result.stderr)
    assert coverage and int(coverage.group(1)) > 0, tail
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-"))], tail
