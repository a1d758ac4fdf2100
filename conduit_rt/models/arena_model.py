"""What every architecture module shares: a Llama-style decoder over the native arena, and loading.

``ArenaVisionLanguageModel`` implements the decoder half of ``base.VisionLanguageModel`` (arena,
embeddings, forward, logits) on top of ``llama.LlamaDecoder``; a subclass adds its vision tower,
image preprocessing and RoPE positions. The functions below are the loading steps both LLaVA and
Qwen2-VL take: pick the dtype, open the GGUF files, build the config and assets from the text
file's keys, build the modules on the meta device and fill them with the files' tensors. Given a
tensor-parallel rank's ``DecoderShard`` (``parallel.sharding``), ``build_model`` and
``assign_decoder`` make and fill the rank's share of the decoder instead of the whole.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from conduit_rt.arena import KVArena
from conduit_rt.errors import ModelFormatError
from conduit_rt.model_config import TextModelConfig
from conduit_rt.model_file import (
    GGUFModelFile,
    compiled_chat_template,
    load_mmproj_file,
    load_text_model_file,
    text_tokenizer,
)

from . import llama
from .base import ForwardBatch, LayerCapture, ModelAssets, ModelConfig
from .rope import RopeConfig

if TYPE_CHECKING:
    from conduit_rt.parallel.sharding import DecoderShard, TensorPart

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ArenaVisionLanguageModel(nn.Module):
    """The decoder half of ``base.VisionLanguageModel``; subclasses supply the vision half.

    Built on the meta device (``device``/``dtype`` are placeholders until ``finish_loading``).
    ``VISION_MODULES`` names the attributes holding the vision tower and projector.
    """

    VISION_MODULES: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, assets: ModelAssets, language_model: llama.LlamaDecoder) -> None:
        super().__init__()
        self.config, self.assets = config, assets
        self.language_model = language_model  # registered first: parameter order is part of random_init's draws
        self.device, self.dtype = torch.device("meta"), torch.float32
        self.parallel = None  # tensor parallel: this rank's group (``parallel.sharding.join_group``)

    def vision_module(self) -> nn.Module | None:
        """The vision tower, or None when the model was loaded without its mmproj file or without
        its vision weights (``release_vision``)."""
        raise NotImplementedError

    @property
    def has_vision(self) -> bool:
        """Whether the model takes images: it was loaded with its mmproj file, whose preprocessing
        it holds (its tower may be on another rank, ``release_vision``)."""
        return self.assets.preprocess is not None

    def release_vision(self) -> None:
        """Drops the vision tower and projector before their weights are loaded. The model still
        takes images (``prepare_image``, RoPE positions and image keys come from the vision file's
        keys) but cannot encode them: a tensor-parallel rank other than 0 receives rank 0's features."""
        for name in self.VISION_MODULES:
            setattr(self, name, None)

    def finish_loading(self, device: torch.device, dtype: torch.dtype) -> None:
        """After the weights are assigned: record where they live, build RoPE tables, stack the
        decoder's projections, freeze."""
        self.device, self.dtype = device, dtype
        self.language_model.init_rotary(device)
        self.language_model.stack_projections()
        self.eval().requires_grad_(False)

    def new_arena(self, kv_bytes: int, image_cache_bytes: int = 0, block_size: int = 16,
                  kv_format: str = "dense") -> KVArena:
        c = self.config
        arena = KVArena(
            n_layers=c.n_layers,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            dtype=self.dtype,
            device=self.device,
            block_size=block_size,
            kv_bytes=kv_bytes,
            image_cache_bytes=image_cache_bytes,
            kv_format=kv_format,
        )
        self.language_model.rotary.configure(arena)
        return arena

    @torch.no_grad()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(ids)

    @torch.no_grad()
    def forward(
        self, seq, embeds: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        return self.language_model(seq, embeds, batch, capture)

    @torch.no_grad()
    def forward_layer(
        self, layer: int, seq, x: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """One decoder layer: x [n, hidden] -> [n, hidden]; writes the layer's K, V of the n tokens."""
        return self.language_model.forward_layer(layer, seq, x, batch, capture)

    @torch.no_grad()
    def kv_projection(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K before RoPE and V of decoder layer ``layer`` from its input x [n, hidden], not written."""
        return self.language_model.kv_projection(layer, x)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.logits(hidden)

    def _require_vision(self) -> None:
        if not self.has_vision:
            raise ModelFormatError("this model was loaded without its mmproj file: it cannot take images")

    def _require_tower(self) -> None:
        self._require_vision()
        if self.vision_module() is None:
            raise RuntimeError("this model holds no vision weights (a tensor-parallel rank other than 0): "
                               "rank 0 encodes the images")


def check_dtype(dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless the decoder and towers can run in ``dtype``."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported model dtype {dtype}; use one of {SUPPORTED_DTYPES}")


def open_model_files(
    text_path: str | Path, mmproj_path: str | Path | None, device: torch.device | str, dtype: torch.dtype | None
) -> tuple[torch.device, torch.dtype, GGUFModelFile, GGUFModelFile | None]:
    """Resolve ``device`` and ``dtype`` (default: float32 on CPU, bfloat16 on CUDA) and open the files."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    check_dtype(dtype)
    text_file = load_text_model_file(text_path)
    vision_file = load_mmproj_file(mmproj_path, text_file) if mmproj_path is not None else None
    return device, dtype, text_file, vision_file


def decoder_config(
    text: TextModelConfig, architecture: str, rope: RopeConfig, vision_hidden: int,
    tokens_per_image: int = 0, image_size: int = 0,
) -> ModelConfig:
    """The Runtime's view of a model: the text file's decoder shape plus the vision facts given."""
    return ModelConfig(
        architecture=architecture,
        n_layers=text.num_hidden_layers,
        n_heads=text.num_attention_heads,
        n_kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        vocab=text.vocab_size,
        rms_norm_eps=text.rms_norm_eps,
        rope=rope,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        image_token_id=text.image_token_id,
        tokens_per_image=tokens_per_image,
        image_size=image_size,
        vision_hidden=vision_hidden,
        context_length=text.max_position_embeddings,
    )


def build_assets(
    text: TextModelConfig, vision: Any | None, mmproj_path: Path | None, preprocess: Any | None, tokens_per_image: int
) -> ModelAssets:
    """Tokenizer, chat template and image preprocessing stored in the model files.

    vision: the mmproj's config (any with ``source_id``), None without a vision file.
    """
    vision_id = ""
    if vision is not None:
        # Without a source fingerprint, the file itself identifies the vision weights.
        vision_id = (
            vision.source_id
            or hashlib.sha256(f"{mmproj_path.resolve()}:{mmproj_path.stat().st_size}".encode()).hexdigest()
        )
    return ModelAssets(
        tokenizer=text_tokenizer(text),
        chat_template=compiled_chat_template(text.chat_template) if text.chat_template else None,
        image_token_id=text.image_token_id,
        tokens_per_image=tokens_per_image,
        preprocess=preprocess,
        vision_model_id=vision_id,
        eos_token_ids=frozenset({text.eos_token_id, *text.eos_token_ids}),
        bos_token_id=text.bos_token_id,
    )


Model = TypeVar("Model", bound=ArenaVisionLanguageModel)


def build_model(build: Callable[[ModelConfig], Model], config: ModelConfig, shard: DecoderShard | None) -> Model:
    """``build(config)`` on the meta device, nothing allocated. With ``shard``, the tensor-parallel
    rank's model: built from its share of ``config`` and fitted to it (``DecoderShard.fit``: its
    rows of the LM head, the output biases on rank 0 only, the vision tower on rank 0 only)."""
    if shard is not None:
        config = shard.share_config(config)
    with torch.device("meta"):
        model = build(config)
        if shard is not None:
            shard.fit(model)
    return model


def assign_decoder(
    model: ArenaVisionLanguageModel, text_file: GGUFModelFile, mapping: dict[str, str], dtype: torch.dtype,
    device: torch.device, shard: DecoderShard | None,
) -> None:
    """Fill ``model.language_model`` from the text file (``mapping`` as ``assign_weights``'s): each
    tensor whole, or with ``shard`` only the rank's block of each split tensor."""
    decoder = model.language_model
    if shard is None:
        assign_weights(decoder, text_file, mapping, dtype, device)
    else:
        assign_weights(decoder, text_file, shard.tensor_map(mapping), dtype, device, shard.parts(decoder))


def assign_weights(
    module: nn.Module, model_file: GGUFModelFile, mapping: dict[str, str], dtype: torch.dtype, device: torch.device,
    parts: Mapping[str, TensorPart] | None = None,
) -> None:
    """Fill ``module``'s (meta) parameters from the file's tensors, each read once onto ``device``.

    mapping: parameter name (as ``named_parameters(remove_duplicate=False)``) -> GGUF tensor name.
    parts: parameter name -> the block of its tensor it takes (``TensorPart``, read alone from the
    mapped file); a parameter not named takes the whole tensor.
    """
    expected = dict(module.named_parameters(remove_duplicate=False))
    if set(mapping) != set(expected):
        missing, extra = sorted(set(expected) - set(mapping)), sorted(set(mapping) - set(expected))
        raise ModelFormatError(
            f"{model_file.path}: tensor map does not match the module (unmapped {missing[:3]}, unknown {extra[:3]})"
        )
    parts = parts or {}
    loaded: dict[tuple[str, TensorPart | None], torch.Tensor] = {}
    for param, gguf_name in mapping.items():
        if gguf_name not in model_file:
            raise ModelFormatError(f"{model_file.path}: missing tensor {gguf_name}")
        part = parts.get(param)
        shape = model_file.shape(gguf_name) if part is None else part.shape(model_file.shape(gguf_name))
        if shape != tuple(expected[param].shape):
            what = "has shape" if part is None else f"gives a block {part} of shape"
            raise ModelFormatError(
                f"{model_file.path}: tensor {gguf_name} {what} {list(shape)}, expected {list(expected[param].shape)}"
            )
        key = (gguf_name, part)
        if key not in loaded:  # tied tensors are read once and shared
            loaded[key] = (model_file.tensor(gguf_name, dtype, device) if part is None
                           else part.read(model_file, gguf_name, dtype, device))
    module.load_state_dict({param: loaded[(name, parts.get(param))] for param, name in mapping.items()},
                           strict=True, assign=True)
