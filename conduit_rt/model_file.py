"""Load converted model files: ``model.gguf`` (text decoder) and ``mmproj.gguf`` (vision + projector).

``load_text_model_file(path)`` and ``load_mmproj_file(path, text)`` memory-map the file with
``gguf.GGUFReader``, validate every key (presence and type), every tensor (name, shape, dtype,
bytes inside the file) and, for the pair, that both come from the same source checkpoint and fit
together (projector output == text embedding length). Anything wrong raises ``ModelFormatError``
naming the file and the key or tensor; an architecture conduit-rt cannot run raises
``UnsupportedArchitectureError``.

Tensors come out by GGUF name (see ``gguf_names`` for the list and the Hugging Face module each
name maps to) in Hugging Face layout: linear weights ``[out_features, in_features]``, Q8_0
dequantized, and the llama.cpp RoPE row permutation of ``blk.N.attn_q/attn_k`` undone.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, Keys, ReaderTensor
from gguf.quants import dequantize

from conduit_rt import gguf_names as names
from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.gguf_keys import KeyReader
from conduit_rt.model_config import TEXT_ARCHITECTURES, QwenVisionConfig, TextModelConfig, VisionModelConfig

logger = logging.getLogger(__name__)

READABLE_TYPES = (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
)
_ATTN_Q_BIAS = names.tensor_name(names.MODEL_TENSOR.ATTN_Q, "bias", 0)  # present iff attention_bias
_HEADER_BYTES = 24  # magic, version, tensor count, kv count
_GGUF_MAGIC = b"GGUF"


class GGUFModelFile:
    """A validated, memory-mapped GGUF file; tensors by GGUF name, in Hugging Face layout."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self._tensors: dict[str, ReaderTensor] = {t.name: t for t in reader.tensors}

    @property
    def tensor_names(self) -> list[str]:
        """All tensor names in file order."""
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF-convention shape of ``name`` (GGUF stores dims innermost first; this is reversed)."""
        return tuple(int(dim) for dim in reversed(self._get(name).shape.tolist()))

    def ggml_type(self, name: str) -> str:
        """The stored type of ``name``: "F32", "F16", "BF16" or "Q8_0"."""
        return self._get(name).tensor_type.name

    def tensor(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        """A fresh tensor (a copy, never a view of the mapped file), shape ``self.shape(name)``."""
        return self._decode(self._get(name)).to(device=device, dtype=dtype)

    def state_dict(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor by GGUF name (see ``tensor``)."""
        return {name: self.tensor(name, dtype, device) for name in self._tensors}

    def _get(self, name: str) -> ReaderTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def _decode(self, tensor: ReaderTensor) -> torch.Tensor:
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        kind = tensor.tensor_type
        if kind == GGMLQuantizationType.BF16:
            raw = np.ascontiguousarray(tensor.data).view(np.int16).reshape(shape)
            return torch.from_numpy(raw.copy()).view(torch.bfloat16)
        if kind == GGMLQuantizationType.Q8_0:
            return torch.from_numpy(dequantize(np.asarray(tensor.data), kind).reshape(shape))
        return torch.from_numpy(np.array(tensor.data, copy=True).reshape(shape))


class TextModelFile(GGUFModelFile):
    """``model.gguf``: the text decoder. ``config`` holds every hyperparameter and the tokenizer.

    Tensor names: ``gguf_names.llama_text_tensor_shapes`` (with the HF module of each);
    ``output.weight`` is absent when ``config.tie_word_embeddings``, and ``blk.N.attn_{q,k,v,output}.bias``
    are present when ``attention_bias`` (a "qwen2vl" decoder always has ``attn_{q,k,v}.bias``, never
    ``attn_output.bias``). ``attn_q``/``attn_k`` come out in HF (rotate-half) row order: llama.cpp
    permutes them for "llama" only, which is undone here.
    """

    def __init__(self, path: Path, reader: GGUFReader, config: TextModelConfig) -> None:
        super().__init__(path, reader)
        self.config = config

    @property
    def attention_bias(self) -> bool:
        """Whether the attention projections have biases (``blk.N.attn_*.bias``)."""
        return _ATTN_Q_BIAS in self

    def _decode(self, tensor: ReaderTensor) -> torch.Tensor:
        # llama.cpp permutes attn_q/attn_k rows for interleaved RoPE; hand out HF's rotate-half order.
        decoded = super()._decode(tensor)
        if self.config.architecture == names.LLAMA_ARCH and names.is_rope_permuted(tensor.name):
            heads = names.rope_permute_heads(tensor.name, self.config.num_attention_heads, self.config.num_key_value_heads)
            decoded = names.llama_rope_unpermute(decoded, heads)
        return decoded


class VisionModelFile(GGUFModelFile):
    """``mmproj.gguf``: vision tower + projector. ``config`` holds the hyperparameters and preprocessing.

    Tensor names: ``gguf_names.clip_mlp_mmproj_tensor_shapes`` (projector "mlp", a ``VisionModelConfig``)
    or ``gguf_names.qwen_vision_mmproj_tensor_shapes`` (Qwen mergers, a ``QwenVisionConfig``).
    """

    def __init__(self, path: Path, reader: GGUFReader, config: VisionModelConfig | QwenVisionConfig) -> None:
        super().__init__(path, reader)
        self.config = config


def load_text_model_file(path: str | Path) -> TextModelFile:
    """Open and validate a text ``model.gguf``. Raises ``ModelFormatError`` / ``UnsupportedArchitectureError``."""
    path = Path(path)
    reader = open_gguf(path)
    keys = KeyReader(reader, path)
    kind = keys.str(Keys.General.TYPE, default=names.TYPE_MODEL)
    if kind != names.TYPE_MODEL:
        raise ModelFormatError(f"{path}: general.type is {kind!r}, not a text model (an mmproj file goes second)")
    arch = keys.str(Keys.General.ARCHITECTURE)
    if arch not in TEXT_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: text architecture {arch!r} is not supported; supported: {', '.join(TEXT_ARCHITECTURES)}"
        )
    config = _build_config(path, lambda: read_text_config(keys, reader, arch))
    attention_bias = _ATTN_Q_BIAS in _names(reader)
    validate_tensors(path, reader, config.tensor_shapes(attention_bias=attention_bias))
    logger.info("loaded %s: %s, %d layers, hidden %d", path, arch, config.num_hidden_layers, config.hidden_size)
    return TextModelFile(path, reader, config)


def load_mmproj_file(path: str | Path, text: TextModelFile | None = None) -> VisionModelFile:
    """Open and validate ``mmproj.gguf``; with ``text``, also check that the two files belong together."""
    path = Path(path)
    reader = open_gguf(path)
    keys = KeyReader(reader, path)
    kind = keys.str(Keys.General.TYPE, default="")
    if kind != names.TYPE_MMPROJ or keys.str(Keys.General.ARCHITECTURE) != names.CLIP_ARCH:
        raise ModelFormatError(f"{path}: not an mmproj file (general.type {kind!r}, expected {names.TYPE_MMPROJ!r})")
    if not keys.bool(Keys.Clip.HAS_VISION_ENCODER, default=True):
        raise ModelFormatError(f"{path}: {Keys.Clip.HAS_VISION_ENCODER} is false; this mmproj has no vision encoder")
    projector = keys.str(Keys.Clip.PROJECTOR_TYPE)
    supported = (names.PROJECTOR_MLP, *names.QWEN_PROJECTORS)
    if projector not in supported:
        raise UnsupportedArchitectureError(
            f"{path}: projector type {projector!r} is not supported; supported: {', '.join(supported)}"
        )
    read = read_vision_config if projector == names.PROJECTOR_MLP else read_qwen_vision_config
    config = _build_config(path, lambda: read(keys))
    validate_tensors(path, reader, config.tensor_shapes())
    if text is not None:
        check_pair(text, path, config)
    logger.info("loaded %s: %s projector, %d vision blocks", path, projector, config.num_hidden_layers)
    return VisionModelFile(path, reader, config)


def load_model_dir(dirpath: str | Path) -> tuple[TextModelFile, VisionModelFile]:
    """Load ``DIR/model.gguf`` and ``DIR/mmproj.gguf`` (what ``conduit convert`` writes) as a checked pair."""
    dirpath = Path(dirpath)
    text = load_text_model_file(dirpath / names.TEXT_FILE_NAME)
    return text, load_mmproj_file(dirpath / names.MMPROJ_FILE_NAME, text)


def check_pair(text: TextModelFile, mmproj_path: Path, vision: VisionModelConfig | QwenVisionConfig) -> None:
    """The mmproj must come from the same checkpoint as the text model and project to its width."""
    text_id, vision_id = text.config.source_id, vision.source_id
    if text_id and vision_id and text_id != vision_id:
        raise ModelFormatError(
            f"{mmproj_path} comes from a different model than {text.path} "
            f"({names.ConduitKeys.SOURCE_ID} {vision_id[:16]}... vs {text_id[:16]}...); "
            "convert both files from the same checkpoint"
        )
    if not (text_id and vision_id):
        logger.warning("%s or %s has no %s; only dimensions are checked", mmproj_path, text.path, names.ConduitKeys.SOURCE_ID)
    if vision.projection_dim != text.config.hidden_size:
        raise ModelFormatError(
            f"{mmproj_path}: projector output {vision.projection_dim} != text embedding length "
            f"{text.config.hidden_size} of {text.path}; the mmproj belongs to another model"
        )


def open_gguf(path: Path) -> GGUFReader:
    """Memory-map ``path`` with ``GGUFReader`` after checking it is a whole GGUF file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file (convert a checkpoint with `conduit convert`)")
    with path.open("rb") as handle:
        header = handle.read(_HEADER_BYTES)
    if header[:4] != _GGUF_MAGIC:
        raise ModelFormatError(f"{path}: not a GGUF file (magic {header[:4]!r}, expected {_GGUF_MAGIC!r})")
    if len(header) < _HEADER_BYTES:
        raise ModelFormatError(f"{path}: truncated GGUF file ({len(header)} bytes)")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path}: truncated or corrupt GGUF file ({exc})") from exc
    file_size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise ModelFormatError(f"{path}: truncated file: tensor {tensor.name} ends past the end of the file")
    return reader


def validate_tensors(path: Path, reader: GGUFReader, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected tensor present with its shape and a readable type; nothing else present."""
    found = {tensor.name: tensor for tensor in reader.tensors}
    for name, shape in expected.items():
        tensor = found.get(name)
        if tensor is None:
            raise ModelFormatError(f"{path}: missing tensor {name}")
        actual = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        if actual != shape:
            raise ModelFormatError(f"{path}: tensor {name} has shape {list(actual)}, expected {list(shape)}")
        if tensor.tensor_type not in READABLE_TYPES:
            raise ModelFormatError(
                f"{path}: tensor {name} has type {tensor.tensor_type.name}; readable: "
                f"{', '.join(t.name for t in READABLE_TYPES)} (reconvert with --dtype)"
            )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ModelFormatError(f"{path}: unexpected tensor(s) {', '.join(unexpected[:5])} for this architecture")


def read_text_config(keys: KeyReader, reader: GGUFReader, arch: str = names.LLAMA_ARCH) -> TextModelConfig:
    """The text hyperparameters and tokenizer from a ``model.gguf``'s keys (``{arch}.*``)."""

    def key(template: str) -> str:
        return names.llm_key(template, arch)

    tokens = keys.str_list(Keys.Tokenizer.LIST)
    num_heads = keys.int(key(Keys.Attention.HEAD_COUNT))
    hidden = keys.int(key(Keys.LLM.EMBEDDING_LENGTH))
    rope_dims = keys.int(key(Keys.Rope.DIMENSION_COUNT), default=hidden // max(num_heads, 1))
    head_dim = keys.int(key(Keys.Attention.KEY_LENGTH), default=rope_dims)
    scaling = keys.str(key(Keys.Rope.SCALING_TYPE), default="none")
    output = names.tensor_name(names.MODEL_TENSOR.OUTPUT)
    return TextModelConfig(
        architecture=arch,
        vocab_size=keys.int(key(Keys.LLM.VOCAB_SIZE), default=len(tokens)),
        hidden_size=hidden,
        intermediate_size=keys.int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=keys.int(key(Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=num_heads,
        num_key_value_heads=keys.int(key(Keys.Attention.HEAD_COUNT_KV), default=num_heads),
        head_dim=head_dim,
        rms_norm_eps=keys.float(key(Keys.Attention.LAYERNORM_RMS_EPS)),
        rope_theta=keys.float(key(Keys.Rope.FREQ_BASE), default=10000.0),
        rope_scaling_type=None if scaling == "none" else scaling,
        rope_scaling_factor=keys.float(key(Keys.Rope.SCALING_FACTOR), default=1.0),
        max_position_embeddings=keys.int(key(Keys.LLM.CONTEXT_LENGTH)),
        tie_word_embeddings=output not in _names(reader),
        bos_token_id=keys.int(Keys.Tokenizer.BOS_ID),
        eos_token_id=keys.int(Keys.Tokenizer.EOS_ID),
        pad_token_id=keys.int(Keys.Tokenizer.PAD_ID, default=None),
        unk_token_id=keys.int(Keys.Tokenizer.UNK_ID, default=None),
        image_token_id=keys.int(names.ConduitKeys.IMAGE_TOKEN_ID, default=None),
        add_bos_token=keys.bool(Keys.Tokenizer.ADD_BOS, default=True),
        add_eos_token=keys.bool(Keys.Tokenizer.ADD_EOS, default=False),
        tokens=tuple(tokens),
        chat_template=keys.str(Keys.Tokenizer.CHAT_TEMPLATE, default=None),
        tokenizer_json=keys.str(Keys.Tokenizer.HF_JSON),
        source_id=keys.str(names.ConduitKeys.SOURCE_ID, default=""),
        source_config=keys.json(names.ConduitKeys.SOURCE_CONFIG, default={}),
        rope_sections=_rope_sections(keys, key(Keys.Rope.DIMENSION_SECTIONS)) if arch == names.QWEN2VL_ARCH else (),
    )


def _rope_sections(keys: KeyReader, key: str) -> tuple[int, ...]:
    """M-RoPE (t, h, w) from ``{arch}.rope.dimension_sections`` (llama.cpp pads it with zeros to 4)."""
    sections = keys.int_list(key)
    if len(sections) < 3 or any(sections[3:]):
        raise ValueError(f"key {key} = {sections}: expected (t, h, w) sections followed by zeros")
    return tuple(sections[:3])


def read_vision_config(keys: KeyReader) -> VisionModelConfig:
    """The vision/projector hyperparameters and preprocessing from an ``mmproj.gguf``'s keys."""
    vision = Keys.ClipVision
    use_gelu = keys.bool(vision.USE_GELU, default=False)
    preprocessor = keys.json(names.ConduitKeys.PREPROCESSOR_CONFIG, default={})
    # the float32 arrays are what llama.cpp reads; the JSON keeps the exact values
    image_mean = preprocessor.get("image_mean", keys.float_list(vision.IMAGE_MEAN))
    image_std = preprocessor.get("image_std", keys.float_list(vision.IMAGE_STD))
    return VisionModelConfig(
        projector_type=keys.str(Keys.Clip.PROJECTOR_TYPE),
        image_size=keys.int(vision.IMAGE_SIZE),
        patch_size=keys.int(vision.PATCH_SIZE),
        num_channels=3,
        hidden_size=keys.int(vision.EMBEDDING_LENGTH),
        intermediate_size=keys.int(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=keys.int(vision.BLOCK_COUNT),
        num_attention_heads=keys.int(vision.Attention.HEAD_COUNT),
        layer_norm_eps=keys.float(vision.Attention.LAYERNORM_EPS),
        hidden_act=keys.str(names.ConduitKeys.VISION_HIDDEN_ACT, default="gelu" if use_gelu else "quick_gelu"),
        projector_hidden_act=keys.str(names.ConduitKeys.PROJECTOR_HIDDEN_ACT, default="gelu"),
        projection_dim=keys.int(vision.PROJECTION_DIM),
        feature_layer=keys.int(names.ConduitKeys.FEATURE_LAYER, default=-2),
        feature_select_strategy=keys.str(names.ConduitKeys.FEATURE_SELECT, default="default"),
        image_mean=tuple(float(value) for value in image_mean),
        image_std=tuple(float(value) for value in image_std),
        preprocessor_config=preprocessor,
        processor_config=keys.json(names.ConduitKeys.PROCESSOR_CONFIG, default={}),
        source_id=keys.str(names.ConduitKeys.SOURCE_ID, default=""),
        source_config=keys.json(names.ConduitKeys.SOURCE_CONFIG, default={}),
    )


def read_qwen_vision_config(keys: KeyReader) -> QwenVisionConfig:
    """The Qwen2-VL / Qwen2.5-VL tower, merger and preprocessing from an ``mmproj.gguf``'s keys."""
    vision = Keys.ClipVision
    projector = keys.str(Keys.Clip.PROJECTOR_TYPE)
    preprocessor = keys.json(names.ConduitKeys.PREPROCESSOR_CONFIG, default={})
    is_qwen25 = projector == names.PROJECTOR_QWEN25VL
    return QwenVisionConfig(
        projector_type=projector,
        patch_size=keys.int(vision.PATCH_SIZE),
        temporal_patch_size=2,
        spatial_merge_size=keys.int(vision.SPATIAL_MERGE_SIZE, default=2),
        num_channels=3,
        hidden_size=keys.int(vision.EMBEDDING_LENGTH),
        intermediate_size=keys.int(vision.FEED_FORWARD_LENGTH),
        num_hidden_layers=keys.int(vision.BLOCK_COUNT),
        num_attention_heads=keys.int(vision.Attention.HEAD_COUNT),
        layer_norm_eps=keys.float(vision.Attention.LAYERNORM_EPS, default=1e-6),
        hidden_act=keys.str(names.ConduitKeys.VISION_HIDDEN_ACT, default="silu" if is_qwen25 else "quick_gelu"),
        projection_dim=keys.int(vision.PROJECTION_DIM),
        window_size=keys.int(vision.WINDOW_SIZE, default=112 if is_qwen25 else 0),
        fullatt_block_indexes=_full_attention_blocks(keys) if is_qwen25 else (),
        rope_theta=keys.float(names.ConduitKeys.VISION_ROPE_THETA, default=10000.0),
        image_mean=tuple(float(v) for v in preprocessor.get("image_mean", keys.float_list(vision.IMAGE_MEAN))),
        image_std=tuple(float(v) for v in preprocessor.get("image_std", keys.float_list(vision.IMAGE_STD))),
        preprocessor_config=preprocessor,
        processor_config=keys.json(names.ConduitKeys.PROCESSOR_CONFIG, default={}),
        source_id=keys.str(names.ConduitKeys.SOURCE_ID, default=""),
        source_config=keys.json(names.ConduitKeys.SOURCE_CONFIG, default={}),
    )


def _full_attention_blocks(keys: KeyReader) -> tuple[int, ...]:
    """``conduit.vision.fullatt_block_indexes``, else llama.cpp's ``clip.vision.n_wa_pattern`` n: blocks
    n-1, 2n-1, ... attend to the whole image, the others within windows."""
    listed = keys.int_list(names.ConduitKeys.FULLATT_BLOCKS, default=None)
    if listed is not None:
        return tuple(listed)
    pattern = keys.int(Keys.ClipVision.N_WA_PATTERN)
    blocks = keys.int(Keys.ClipVision.BLOCK_COUNT)
    if pattern < 1:
        raise ValueError(f"key {Keys.ClipVision.N_WA_PATTERN} must be positive, got {pattern}")
    return tuple(range(pattern - 1, blocks, pattern))


def _build_config(path: Path, build):
    """Calls a config constructor; its validation errors become ``ModelFormatError`` naming ``path``."""
    try:
        return build()
    except ModelFormatError:
        raise
    except (ValueError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: {exc}") from exc


def _names(reader: GGUFReader) -> set[str]:
    return {tensor.name for tensor in reader.tensors}

