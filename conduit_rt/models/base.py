"""What every architecture offers the Runtime: the batch description, the layer observer, the model
protocol, and the hyperparameters and assets a loaded model carries.

A forward pass works on one ``Sequence`` of the native arena. The caller appends the new tokens'
positions to the sequence (``seq.append``) and then calls ``forward`` with their input embeddings
and a ``ForwardBatch``; each decoder layer writes the tokens' K (pre-RoPE, rotated by the kernel at
``rope_positions``) and V into the arena and attends over the sequence's stored tokens, causally by
position. There is no KV cache in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

import torch

from .rope import RopeConfig

if TYPE_CHECKING:
    from conduit_rt.arena import KVArena, Sequence
    from conduit_rt.chat import ChatTemplate, Prompt
    from conduit_rt.preprocess import ClipPreprocessParams
    from conduit_rt.tokenizer import TextTokenizer


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The tokens of one forward pass over one sequence.

    positions: int32 [n], model device: causal positions (a query at p sees stored keys at <= p).
    rope_positions: int32 [n] (rotate-half RoPE) or [3, n] (M-RoPE), model device.
    slots: KV destination slot of each token, the same in every layer (ints, or an int32 numpy array:
        what the arena reads, converted once for every layer); None = the layers' last n slots (the
        tokens were just appended with ``seq.append``).
    """

    positions: torch.Tensor
    rope_positions: torch.Tensor
    slots: list[int] | np.ndarray | None = None

    @classmethod
    def contiguous(cls, start: int, end: int, device: torch.device | str) -> ForwardBatch:
        """Tokens at positions [start, end), RoPE positions equal to the causal ones (LLaVA, Llama)."""
        positions = torch.arange(start, end, dtype=torch.int32, device=device)
        return cls(positions=positions, rope_positions=positions)

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])


class PreparedImage:
    """One image, ready for the prompt and, on demand, for the vision tower.

    n_tokens: embeddings the tower + projector give for it (= image placeholder tokens in the prompt).
    grid_thw: the (t, h, w) patch grid before merging (Qwen2-VL, for M-RoPE positions), else None.
    pixel_values: float32, CPU, in the architecture's layout ([3, H, W] for CLIP towers; flattened
        patches [n_patches, C * T * P * P] for Qwen2-VL). Computed from the RGB pixels on first
        access: a request whose image embeddings are cached never pays for resizing and
        normalising (~3 ms an image on a CPU core).
    """

    __slots__ = ("n_tokens", "grid_thw", "_rgb", "_preprocess", "_pixels")

    def __init__(self, n_tokens: int, preprocess: Callable[[np.ndarray], np.ndarray] | None = None,
                 rgb: np.ndarray | None = None, grid_thw: tuple[int, int, int] | None = None,
                 pixel_values: torch.Tensor | None = None) -> None:
        """Either ``preprocess`` and ``rgb`` ([H, W, 3] uint8, copied unless nothing can change it:
        the caller may reuse its array), or ready ``pixel_values``."""
        if pixel_values is None and (preprocess is None or rgb is None):
            raise ValueError("PreparedImage needs pixel_values, or preprocess and rgb")
        self.n_tokens, self.grid_thw = n_tokens, grid_thw
        self._rgb = None if pixel_values is not None else _frozen_pixels(rgb)
        self._preprocess, self._pixels = preprocess, pixel_values

    @property
    def pixel_values(self) -> torch.Tensor:
        if self._pixels is None:
            self._pixels = torch.from_numpy(self._preprocess(self._rgb))
            self._rgb = None  # the pixels are all the tower needs from now on
        return self._pixels

    def __repr__(self) -> str:
        state = "prepared" if self._pixels is not None else "lazy"
        return f"PreparedImage(n_tokens={self.n_tokens}, grid_thw={self.grid_thw}, pixels {state})"


def _frozen_pixels(rgb: np.ndarray) -> np.ndarray:
    """rgb as uint8 that nobody can change: as it is when its memory is an immutable ``bytes``
    (the pixels of a PIL image, ``to_rgb_array``), else a copy (~70 us for 336 x 336 on a CPU core)."""
    base = rgb
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.flags.c_contiguous and isinstance(base, bytes):
        return rgb
    return np.array(rgb, dtype=np.uint8, copy=True)


class LayerCapture(Protocol):
    """Observes each decoder layer (CONDUIT scoring, image-KV storing)."""

    def on_layer(self, layer: int, q: torch.Tensor, k_pre_rope: torch.Tensor, v: torch.Tensor) -> None:
        """q [n, n_heads, head_dim] after RoPE; k_pre_rope, v [n, n_kv_heads, head_dim]; model dtype."""

    def on_attention(self, layer: int, lse: torch.Tensor) -> None:
        """After the layer's attention of the same n rows: lse float32 [n, n_heads], the natural-log
        log-sum-exp of each row's scaled scores (a fresh tensor: it may be kept as is)."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The hyperparameters the Runtime needs, whatever the architecture.

    ``tokens_per_image`` is the number of embeddings ``encode_images`` returns per image (and of
    image-placeholder tokens in the prompt); 0 when the model was loaded without a vision file.
    ``context_length`` is the model's ``max_position_embeddings`` (GGUF ``{arch}.context_length``):
    a request's prompt and answer together never exceed it. ``deepstack_layers`` (Qwen3-VL) is the
    number of first decoder layers whose outputs take DeepStack features: an input embedding then
    carries them after its ``hidden`` values (``embedding_width``), zeros for text tokens.
    """

    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    rms_norm_eps: float
    rope: RopeConfig
    bos_token_id: int
    eos_token_id: int
    image_token_id: int | None
    tokens_per_image: int
    image_size: int  # square input side of the vision tower (0 without vision)
    vision_hidden: int  # 0 without vision
    context_length: int  # most tokens a sequence may hold: the text file's context length
    deepstack_layers: int = 0

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def embedding_width(self) -> int:
        """Width of an input embedding: hidden, plus hidden per DeepStack layer."""
        return self.hidden * (1 + self.deepstack_layers)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the decoder's attention: head_dim^-1/2."""
        return self.head_dim**-0.5


@dataclass(frozen=True, slots=True)
class ModelAssets:
    """What a request needs besides the weights, read from the same model files."""

    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None  # compiled; None when the file has no template
    image_token_id: int | None
    tokens_per_image: int
    preprocess: ClipPreprocessParams | None  # None without a vision file
    vision_model_id: str  # identity of the vision weights (part of every image cache key)
    eos_token_ids: frozenset[int]
    bos_token_id: int
    image_wrap: tuple[int, int] | None = None  # text tokens around each image's run (InternVL's <img>, </img>)


class VisionLanguageModel(Protocol):
    """A loaded model: text decoder over the native arena, plus vision tower and projector."""

    config: ModelConfig
    assets: ModelAssets
    device: torch.device
    dtype: torch.dtype

    @property
    def has_vision(self) -> bool: ...

    def new_arena(self, kv_bytes: int, image_cache_bytes: int = 0, block_size: int = 16,
                  kv_format: str = "dense") -> KVArena:
        """A KV arena shaped for this model, on its device and dtype (K and V stored as ``kv_format``
        says: ``arena.KV_FORMATS``), with its RoPE set."""

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [n] (model device) -> embeddings [n, hidden], model dtype."""

    def prepare_image(self, rgb: np.ndarray) -> PreparedImage:
        """Decoded pixels uint8 [H, W, 3] -> the tower's input and its token count."""

    def encode_images(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """-> one [image.n_tokens, hidden] tensor per image (model dtype, model device)."""

    def rope_positions(self, prompt: Prompt, images: list[PreparedImage]) -> torch.Tensor:
        """RoPE positions of the prompt's tokens: int32 [n] (rotate-half) or [3, n] (M-RoPE), CPU.
        Tokens generated after the prompt continue from the largest position + 1, on every row."""

    def forward(
        self, seq: Sequence, embeds: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """embeds [n, hidden] -> hidden states [n, hidden] (final norm NOT applied); writes KV."""

    def forward_layer(
        self, layer: int, seq: Sequence, x: torch.Tensor, batch: ForwardBatch, capture: LayerCapture | None = None
    ) -> torch.Tensor:
        """One decoder layer (layer-wise recompute): x [n, hidden] -> [n, hidden]; writes that layer's KV."""

    def kv_projection(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K before RoPE and V [n, n_kv_heads, head_dim] of decoder ``layer`` from its input x [n, hidden],
        nothing written (a refresh policy's probe)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> final norm + LM head, float32 [n, vocab]."""


def describe(model: Any) -> str:
    """One line naming a model's architecture and size, for logs."""
    c = model.config
    return (
        f"{c.architecture}: {c.n_layers} layers, hidden {c.hidden}, {c.n_heads}/{c.n_kv_heads} heads, "
        f"vocab {c.vocab}, {c.tokens_per_image} tokens/image, {model.dtype} on {model.device}"
    )
