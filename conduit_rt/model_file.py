"""Load converted model files: ``model.gguf`` (text decoder) and ``mmproj.gguf`` (vision + projector).

``load_text_model_file(path)`` and ``load_mmproj_file(path, text)`` memory-map and parse the file
with ``gguf_parser`` (every count, length and offset checked against the file's size), validate
every key (presence, type and range), every tensor (name, shape, dtype) and, for the pair, that both come from the same source checkpoint and fit
together (projector output == text embedding length). Anything wrong raises ``ModelFormatError``
naming the file and the key or tensor; an architecture conduit-rt cannot run raises
``UnsupportedArchitectureError``.

Tensors come out by GGUF name (see ``gguf_names`` for the list and the Hugging Face module each
name maps to) in Hugging Face layout: linear weights ``[out_features, in_features]``, Q8_0
dequantized, and the llama.cpp RoPE row permutation of ``blk.N.attn_q/attn_k`` undone.
"""
from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys
from gguf.quants import dequantize

from conduit_rt import gguf_names as names
from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.gguf_keys import KeyReader
from conduit_rt.gguf_parser import GGUFContents, GGUFTensorInfo, parse_gguf
from conduit_rt.model_config import (
    MAX_TILES,
    TEXT_ARCHITECTURES,
    InternVLVisionConfig,
    QwenVisionConfig,
    TextModelConfig,
    VisionModelConfig,
)
from conduit_rt.model_keys import (
    read_internvl_vision_config,
    read_qwen_vision_config,
    read_text_config,
    read_vision_config,
)

if TYPE_CHECKING:
    from conduit_rt.chat import ChatTemplate
    from conduit_rt.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

READABLE_TYPES = (
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0,
)
_ATTN_Q_BIAS = names.tensor_name(names.MODEL_TENSOR.ATTN_Q, "bias", 0)  # present iff attention_bias
# A resize target beyond this many times the tower's input side only crops most of the image away;
# no checkpoint does that, and the bound keeps a file from sizing each request's resize buffer.
MAX_RESIZE_FACTOR = 8
# Qwen2-VL's stock max_pixels (28 * 28 * 16384, for 14-pixel patches): min_pixels above it would
# upscale every image past the largest size the processor ever resizes to.
QWEN_MAX_PIXELS = 28 * 28 * 16384
RESAMPLING_FILTERS = frozenset(filter_.value for filter_ in Image.Resampling)
# text architecture -> the projectors its mmproj may have
_PROJECTORS = {names.LLAMA_ARCH: (names.PROJECTOR_MLP,), names.QWEN2VL_ARCH: names.QWEN_PROJECTORS,
               names.QWEN2_ARCH: (names.PROJECTOR_INTERNVL,), names.QWEN3VL_ARCH: (names.PROJECTOR_QWEN3VL,)}
# projector type -> the reader of its mmproj keys
_VISION_READERS = {names.PROJECTOR_MLP: read_vision_config, names.PROJECTOR_INTERNVL: read_internvl_vision_config,
                   names.PROJECTOR_QWEN3VL: read_qwen_vision_config,
                   **dict.fromkeys(names.QWEN_PROJECTORS, read_qwen_vision_config)}
# little-endian element type of each unquantized readable type
_PLAIN_DTYPES = {GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2", GGMLQuantizationType.BF16: "<i2"}


class GGUFModelFile:
    """A validated, memory-mapped GGUF file; tensors by GGUF name, in Hugging Face layout."""

    def __init__(self, path: Path, contents: GGUFContents) -> None:
        self.path = path
        self._contents = contents
        self._tensors: dict[str, GGUFTensorInfo] = {t.name: t for t in contents.tensors}

    @property
    def tensor_names(self) -> list[str]:
        """All tensor names in file order."""
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF-convention shape of ``name`` (GGUF stores dims innermost first; this is reversed)."""
        return self._get(name).shape

    def ggml_type(self, name: str) -> str:
        """The stored type of ``name``: "F32", "F16", "BF16" or "Q8_0"."""
        return self._get(name).tensor_type.name

    def tensor(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> torch.Tensor:
        """A fresh tensor (a copy, never a view of the mapped file), shape ``self.shape(name)``; or
        only its rows [rows[0], rows[1]) and, of a 2-D tensor, its columns [columns[0], columns[1])
        (the entries of a 1-D tensor are its rows). Only the bytes of that block are copied out of
        the mapped file, so a block costs its own size in memory, never the whole tensor's.
        ModelFormatError naming the file and the tensor when it holds a NaN or an infinity: no
        healthy checkpoint does, and such a model would only ever answer with non-finite logits."""
        values = self._decode(self._get(name), rows, columns)
        if not bool(torch.isfinite(values).all()):
            raise ModelFormatError(f"{self.path}: tensor {name} holds NaN or infinite values: the file is corrupted; "
                                   "convert the checkpoint again")
        return values.to(device=device, dtype=dtype)

    def state_dict(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor by GGUF name (see ``tensor``)."""
        return {name: self.tensor(name, dtype, device) for name in self._tensors}

    def _get(self, name: str) -> GGUFTensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def _decode(self, tensor: GGUFTensorInfo, rows: tuple[int, int] | None = None,
                columns: tuple[int, int] | None = None) -> torch.Tensor:
        """The values of the tensor's block (see ``tensor``), a fresh CPU tensor (float32, float16
        or bfloat16). The stored bytes are read as a matrix with one row per leading index (a
        vector: one row), whose row and column ranges are byte ranges of the mapped file (Q8_0:
        the 32-value blocks holding the columns, trimmed once dequantized)."""
        shape, kind = tensor.shape, tensor.tensor_type
        if kind != GGMLQuantizationType.Q8_0 and kind not in _PLAIN_DTYPES:
            raise ModelFormatError(f"{self.path}: tensor {tensor.name} has type {kind.name}, which cannot be read")
        if columns is not None and len(shape) != 2:
            raise ValueError(f"{self.path}: tensor {tensor.name} is {len(shape)}-D: columns are selected in 2-D ones")
        if len(shape) <= 1:
            n_rows, row_range = 1, (0, 1)
            column_range = _checked_range(rows, math.prod(shape), self.path, tensor.name)
            block_shape: tuple[int, ...] = (column_range[1] - column_range[0],) if shape else ()
        else:
            n_rows, row_range = shape[0], _checked_range(rows, shape[0], self.path, tensor.name)
            column_range = _checked_range(columns, math.prod(shape[1:]), self.path, tensor.name)
            inner = shape[1:] if columns is None else (column_range[1] - column_range[0],)
            block_shape = (row_range[1] - row_range[0], *inner)
        matrix = self._contents.tensor_bytes(tensor).reshape(n_rows, -1)[row_range[0]: row_range[1]]
        start, stop = column_range
        if kind == GGMLQuantizationType.Q8_0:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            first, last = start // block_size, -(-stop // block_size)
            quantized = np.ascontiguousarray(matrix[:, first * type_size: last * type_size])
            values = dequantize(quantized, kind)[:, start - first * block_size: stop - first * block_size]
            return torch.from_numpy(np.ascontiguousarray(values).reshape(block_shape))
        element = np.dtype(_PLAIN_DTYPES[kind])
        block = np.array(matrix[:, start * element.itemsize: stop * element.itemsize])  # the only copy
        values = torch.from_numpy(block.view(element).astype(element.newbyteorder("="), copy=False))
        values = values.reshape(block_shape)
        return values.view(torch.bfloat16) if kind == GGMLQuantizationType.BF16 else values


def _checked_range(bounds: tuple[int, int] | None, size: int, path: Path, name: str) -> tuple[int, int]:
    """``bounds`` (start, stop), or the whole (0, ``size``); ValueError unless 0 <= start <= stop <= size."""
    if bounds is None:
        return 0, size
    start, stop = bounds
    if not 0 <= start <= stop <= size:
        raise ValueError(f"{path}: tensor {name}: range [{start}, {stop}) is outside [0, {size})")
    return start, stop


class TextModelFile(GGUFModelFile):
    """``model.gguf``: the text decoder. ``config`` holds every hyperparameter and the tokenizer.

    Tensor names: ``gguf_names.llama_text_tensor_shapes`` (with the HF module of each);
    ``output.weight`` is absent when ``config.tie_word_embeddings``, and ``blk.N.attn_{q,k,v,output}.bias``
    are present when ``attention_bias`` (a "qwen2vl" decoder always has ``attn_{q,k,v}.bias``, never
    ``attn_output.bias``). ``attn_q``/``attn_k`` come out in HF (rotate-half) row order: llama.cpp
    permutes them for "llama" only, which is undone here.
    """

    def __init__(self, path: Path, contents: GGUFContents, config: TextModelConfig) -> None:
        super().__init__(path, contents)
        self.config = config

    @property
    def attention_bias(self) -> bool:
        """Whether the attention projections have biases (``blk.N.attn_*.bias``)."""
        return _ATTN_Q_BIAS in self

    def _decode(self, tensor: GGUFTensorInfo, rows: tuple[int, int] | None = None,
                columns: tuple[int, int] | None = None) -> torch.Tensor:
        # llama.cpp permutes attn_q/attn_k rows within each head for interleaved RoPE; hand out HF's
        # rotate-half order. The permutation never crosses a head, so a block of whole heads is
        # unpermuted on its own.
        decoded = super()._decode(tensor, rows, columns)
        if self.config.architecture == names.LLAMA_ARCH and names.is_rope_permuted(tensor.name):
            heads = names.rope_permute_heads(tensor.name, self.config.num_attention_heads, self.config.num_key_value_heads)
            head_rows = tensor.shape[0] // heads
            start, stop = rows or (0, tensor.shape[0])
            if start % head_rows or stop % head_rows:
                raise ValueError(f"{self.path}: tensor {tensor.name}: rows [{start}, {stop}) split a head of "
                                 f"{head_rows} rows")
            if stop > start:
                decoded = names.llama_rope_unpermute(decoded, (stop - start) // head_rows)
        return decoded


class VisionModelFile(GGUFModelFile):
    """``mmproj.gguf``: vision tower + projector. ``config`` holds the hyperparameters and preprocessing.

    Tensor names: ``gguf_names.clip_mlp_mmproj_tensor_shapes`` (projector "mlp", a ``VisionModelConfig``),
    ``gguf_names.qwen_vision_mmproj_tensor_shapes`` (Qwen mergers, a ``QwenVisionConfig``) or
    ``gguf_names.internvl_mmproj_tensor_shapes`` (projector "internvl", an ``InternVLVisionConfig``).
    """

    def __init__(self, path: Path, contents: GGUFContents, config: VisionModelConfig | QwenVisionConfig | InternVLVisionConfig) -> None:
        super().__init__(path, contents)
        self.config = config


def load_text_model_file(path: str | Path) -> TextModelFile:
    """Open and validate a text ``model.gguf``, its tokenizer and chat template included.
    Raises ``ModelFormatError`` / ``UnsupportedArchitectureError``."""
    path = Path(path)
    contents = parse_gguf(path)
    keys = KeyReader(contents.fields, path)
    kind = keys.str(Keys.General.TYPE, default=names.TYPE_MODEL)
    if kind != names.TYPE_MODEL:
        raise ModelFormatError(f"{path}: general.type is {kind!r}, not a text model (an mmproj file goes second)")
    arch = keys.str(Keys.General.ARCHITECTURE)
    if arch not in TEXT_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: text architecture {arch!r} is not supported; supported: {', '.join(TEXT_ARCHITECTURES)}"
        )
    tensor_names = {tensor.name for tensor in contents.tensors}
    config = _build_config(path, lambda: read_text_config(keys, tensor_names, arch))
    validate_tensors(path, contents, config.tensor_shapes(attention_bias=_ATTN_Q_BIAS in tensor_names))
    check_text_assets(path, config)
    logger.info("loaded %s: %s, %d layers, hidden %d", path, arch, config.num_hidden_layers, config.hidden_size)
    return TextModelFile(path, contents, config)


def load_mmproj_file(path: str | Path, text: TextModelFile | None = None) -> VisionModelFile:
    """Open and validate ``mmproj.gguf``; with ``text``, also check that the two files belong together."""
    path = Path(path)
    contents = parse_gguf(path)
    keys = KeyReader(contents.fields, path)
    kind = keys.str(Keys.General.TYPE, default="")
    if kind != names.TYPE_MMPROJ or keys.str(Keys.General.ARCHITECTURE) != names.CLIP_ARCH:
        raise ModelFormatError(f"{path}: not an mmproj file (general.type {kind!r}, expected {names.TYPE_MMPROJ!r})")
    if not keys.bool(Keys.Clip.HAS_VISION_ENCODER, default=True):
        raise ModelFormatError(f"{path}: {Keys.Clip.HAS_VISION_ENCODER} is false; this mmproj has no vision encoder")
    projector = keys.str(Keys.Clip.PROJECTOR_TYPE)
    if projector not in _VISION_READERS:
        raise UnsupportedArchitectureError(
            f"{path}: projector type {projector!r} is not supported; supported: {', '.join(_VISION_READERS)}"
        )
    read = _VISION_READERS[projector]
    config = _build_config(path, lambda: read(keys, len(contents.tensors)))
    validate_tensors(path, contents, config.tensor_shapes())
    check_activations(path, config)
    check_preprocessing(path, config)
    if text is not None:
        check_pair(text, path, config)
    logger.info("loaded %s: %s projector, %d vision blocks", path, projector, config.num_hidden_layers)
    return VisionModelFile(path, contents, config)


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
    projectors = _PROJECTORS[text.config.architecture]
    if vision.projector_type not in projectors:
        raise ModelFormatError(
            f"{mmproj_path}: key {Keys.Clip.PROJECTOR_TYPE} {vision.projector_type!r} does not fit the "
            f"{text.config.architecture!r} text model {text.path} (expected {', '.join(projectors)})"
        )
    if vision.projection_dim != text.config.hidden_size:
        raise ModelFormatError(
            f"{mmproj_path}: projector output {vision.projection_dim} != text embedding length "
            f"{text.config.hidden_size} of {text.path}; the mmproj belongs to another model"
        )
    deepstack = len(getattr(vision, "deepstack_visual_indexes", ()))
    if deepstack != text.config.num_deepstack_layers:
        raise ModelFormatError(
            f"{mmproj_path}: {deepstack} DeepStack blocks ({Keys.ClipVision.IS_DEEPSTACK_LAYERS}) but "
            f"{text.path} takes {text.config.num_deepstack_layers} ({Keys.LLM.NUM_DEEPSTACK_LAYERS}); "
            "the mmproj belongs to another model"
        )


def validate_tensors(path: Path, contents: GGUFContents, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected tensor present with its shape and a readable type; nothing else present."""
    found = {tensor.name: tensor for tensor in contents.tensors}
    for name, shape in expected.items():
        tensor = found.get(name)
        if tensor is None:
            raise ModelFormatError(f"{path}: missing tensor {name}")
        if tensor.shape != shape:
            raise ModelFormatError(f"{path}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
        if tensor.tensor_type not in READABLE_TYPES:
            raise ModelFormatError(
                f"{path}: tensor {name} has type {tensor.tensor_type.name}; readable: "
                f"{', '.join(t.name for t in READABLE_TYPES)} (reconvert with --dtype)"
            )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ModelFormatError(f"{path}: unexpected tensor(s) {', '.join(unexpected[:5])} for this architecture")


def text_tokenizer(text: TextModelConfig) -> TextTokenizer:
    """The tokenizer stored in the text file, with its special ids."""
    from conduit_rt.tokenizer import TextTokenizer

    return TextTokenizer.from_json_and_ids(
        text.tokenizer_json,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        unk_token_id=text.unk_token_id,
        pad_token_id=text.pad_token_id,
        add_bos_token=text.add_bos_token,
        add_eos_token=text.add_eos_token,
    )


def check_activations(path: Path, config: VisionModelConfig | QwenVisionConfig) -> None:
    """The tower's (and the LLaVA projector's) activation functions are ones conduit-rt has."""
    from conduit_rt.models.clip import ACTIVATIONS

    named = [(names.ConduitKeys.VISION_HIDDEN_ACT, config.hidden_act)]
    if isinstance(config, (VisionModelConfig, InternVLVisionConfig)):
        named.append((names.ConduitKeys.PROJECTOR_HIDDEN_ACT, config.projector_hidden_act))
    for key, name in named:
        if name not in ACTIVATIONS:
            raise ModelFormatError(f"{path}: key {key}: activation {name!r} is not one of {', '.join(ACTIVATIONS)}")


@functools.lru_cache(maxsize=8)
def compiled_chat_template(source: str) -> ChatTemplate:
    """The compiled chat template of ``source`` (compiling costs tens of ms; a loaded template is
    immutable, so every model with the same template shares one)."""
    from conduit_rt.chat import ChatTemplate

    return ChatTemplate(source)


def check_text_assets(path: Path, config: TextModelConfig) -> None:
    """The embedded tokenizer builds with the file's special ids and the chat template compiles;
    a failure names the file and the key."""
    checks = (
        (Keys.Tokenizer.HF_JSON, lambda: text_tokenizer(config)),
        (Keys.Tokenizer.CHAT_TEMPLATE, lambda: config.chat_template is None or compiled_chat_template(config.chat_template)),
    )
    for key, build in checks:
        try:
            build()
        except (ModelFormatError, RecursionError, SyntaxError, MemoryError) as error:
            # jinja compiles a template to Python: nesting too deep for the compiler surfaces as these
            raise ModelFormatError(f"{path}: key {key}: {error}") from None


def check_preprocessing(path: Path, config: VisionModelConfig | QwenVisionConfig | InternVLVisionConfig) -> None:
    """The image preprocessing stored in the mmproj (``conduit.preprocessor_config``) builds and
    feeds the tower what it takes; a file cannot make each request resize to an arbitrary size."""
    from conduit_rt.preprocess import ClipPreprocessParams, QwenVLPreprocessParams
    from conduit_rt.preprocess_tiles import TilePreprocessParams

    if not config.preprocessor_config:
        return  # the loader builds the preprocessing from the checked clip.vision.* keys
    key = f"key {names.ConduitKeys.PREPROCESSOR_CONFIG}"
    params_class, size_problem = {
        VisionModelConfig: (ClipPreprocessParams, _clip_size_problem),
        QwenVisionConfig: (QwenVLPreprocessParams, _qwen_size_problem),
        InternVLVisionConfig: (TilePreprocessParams, _tile_size_problem),
    }[type(config)]
    try:
        params = params_class.from_hf_config(config.preprocessor_config)
    except (ModelFormatError, TypeError, ValueError, KeyError, AttributeError, OverflowError) as error:
        raise ModelFormatError(f"{path}: {key}: {error}") from None
    problem = _pixel_problem(params) or size_problem(params, config)
    if problem:
        raise ModelFormatError(f"{path}: {key}: {problem}")


def _pixel_problem(params) -> str | None:
    """Normalization and resampling a request can run: 3 means in [0, 1] (LLaVA pads with the mean
    colour), 3 non-zero stds, finite values, a PIL resampling filter."""
    values = (*params.image_mean, *params.image_std, params.rescale_factor)
    if len(params.image_mean) != 3 or len(params.image_std) != 3 or not all(map(math.isfinite, values)):
        return "image_mean, image_std and rescale_factor must be 3, 3 and 1 finite numbers"
    if not all(0 <= mean <= 1 for mean in params.image_mean) or 0 in params.image_std:
        return f"image_mean {params.image_mean} must lie in [0, 1] and image_std {params.image_std} be non-zero"
    if params.resample not in RESAMPLING_FILTERS:
        return f"resample {params.resample} is not a PIL resampling filter {sorted(RESAMPLING_FILTERS)}"
    return None


def _clip_size_problem(params, config: VisionModelConfig) -> str | None:
    side = config.image_size
    if params.do_center_crop:
        output = (params.crop_height, params.crop_width)
    else:
        output = tuple(params.resize_to[1:]) if params.do_resize and params.resize_to[0] == "exact" else None
    if output != (side, side):
        return f"the preprocessing makes {output or 'variable'}-pixel images; the vision tower takes {side}x{side}"
    if params.do_resize and max(params.resize_to[1:]) > MAX_RESIZE_FACTOR * side:
        return f"resize target {params.resize_to[1:]} is more than {MAX_RESIZE_FACTOR}x the tower's {side}-pixel input"
    return None


def _qwen_size_problem(params, config: QwenVisionConfig) -> str | None:
    tower = (config.patch_size, config.spatial_merge_size, config.temporal_patch_size)
    if (params.patch_size, params.merge_size, params.temporal_patch_size) != tower:
        return (f"patch, merge and temporal patch sizes {params.patch_size, params.merge_size, params.temporal_patch_size} "
                f"differ from the vision tower's {tower}")
    largest = QWEN_MAX_PIXELS * config.patch_size**2 // 14**2
    if params.min_pixels > largest:
        return f"min_pixels {params.min_pixels} would upscale every image past {largest} pixels"
    return None


def _tile_size_problem(params, config: InternVLVisionConfig) -> str | None:
    if params.tile != config.image_size:
        return f"the preprocessing makes {params.tile}-pixel tiles; the vision tower takes {config.image_size}"
    if params.max_patches > MAX_TILES:
        return f"max_patches {params.max_patches} is more than {MAX_TILES} tiles an image"
    return None


def _build_config(path: Path, build):
    """Calls a config constructor; its validation errors become ``ModelFormatError`` naming ``path``."""
    try:
        return build()
    except ModelFormatError:
        raise
    except (ValueError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: {exc}") from exc
