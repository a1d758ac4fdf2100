"""What every architecture module shares: a Llama-style decoder over the native arena, and loading.

``ArenaVisionLanguageModel`` implements the decoder half of ``base.VisionLanguageModel`` (arena,
embeddings, forward, logits) on top of ``llama.LlamaDecoder``; a subclass adds its vision tower,
image preprocessing and RoPE positions. The functions below are the loading steps both LLaVA and
Qwen2-VL take: pick the dtype, open the GGUF files, build the config and assets from the text
file's keys, and fill the meta-device modules with the files' tensors.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

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

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ArenaVisionLanguageModel(nn.Module):
    """The decoder half of ``base.VisionLanguageModel``; subclasses supply the vision half.

    Built on the meta device (``device``/``dtype`` are placeholders until ``finish_loading``).
    """

    def __init__(self, config: ModelConfig, assets: ModelAssets, language_model: llama.LlamaDecoder) -> None:
        super().__init__()
        self.config, self.assets = config, assets
        self.language_model = language_model  # registered first: parameter order is part of random_init's draws
        self.device, self.dtype = torch.device("meta"), torch.float32
        self.parallel = None  # tensor parallel: this rank's group (``parallel.sharding.shard_model``)

    def vision_module(self) -> nn.Module | None:
        """The vision tower, or None when the model was loaded without its mmproj file."""
        raise NotImplementedError

    @property
    def has_vision(self) -> bool:
        return self.vision_module() is not None

    def finish_loading(self, device: torch.device, dtype: torch.dtype) -> None:
        """After the weights are assigned: record where they live, build RoPE tables, stack the
        decoder's projections, freeze."""
        self.device, self.dtype = device, dtype
        self.language_model.init_rotary(device)
        self.language_model.stack_projections()
        self.eval().requires_grad_(False)

    def new_arena(self, kv_bytes: int, image_cache_bytes: int = 0, block_size: int = 16) -> KVArena:
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
        if self.vision_module() is None:
            raise ModelFormatError("this model was loaded without its mmproj file: it cannot encode images")


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


def assign_weights(
    module: nn.Module, model_file: GGUFModelFile, mapping: dict[str, str], dtype: torch.dtype, device: torch.device
) -> None:
    """Fill ``module``'s (meta) parameters from the file's tensors, each read once onto ``device``.

    mapping: parameter name (as ``named_parameters(remove_duplicate=False)``) -> GGUF tensor name.
    """
    expected = dict(module.named_parameters(remove_duplicate=False))
    if set(mapping) != set(expected):
        missing, extra = sorted(set(expected) - set(mapping)), sorted(set(mapping) - set(expected))
        raise ModelFormatError(
            f"{model_file.path}: tensor map does not match the module (unmapped {missing[:3]}, unknown {extra[:3]})"
        )
    loaded: dict[str, torch.Tensor] = {}
    for param, gguf_name in mapping.items():
        if gguf_name not in model_file:
            raise ModelFormatError(f"{model_file.path}: missing tensor {gguf_name}")
        shape = model_file.shape(gguf_name)
        if shape != tuple(expected[param].shape):
            raise ModelFormatError(
                f"{model_file.path}: tensor {gguf_name} has shape {list(shape)}, expected {list(expected[param].shape)}"
            )
        if gguf_name not in loaded:  # tied tensors are read once and shared
            loaded[gguf_name] = model_file.tensor(gguf_name, dtype, device)
    module.load_state_dict({param: loaded[name] for param, name in mapping.items()}, strict=True, assign=True)
