"""Rotary position embedding: the inverse frequencies (as transformers computes them) and q rotation.

K is rotated by the native kernel as it is written into the arena (``Sequence.write_kv(...,
rope_pos=...)``, parameters set once with ``KVArena.set_rope``); Q is rotated here, in torch, with
the same ``inv_freq`` and ``attention_scaling`` so that the two sides agree.

Layout: rotate-half ("neox"): within a head, dims ``[0, n_freq)`` and ``[n_freq, 2 n_freq)`` form the
rotation pairs; dims past ``2 n_freq`` (partial rotary) pass through. M-RoPE (Qwen2-VL) takes the
angle of frequency block ``i`` (``sections`` t, h, w) from position row ``i % 3``.

Interleaved M-RoPE (Qwen3-VL) gives frequency j the h row when j % 3 == 1 and j < 3 h, the w row
when j % 3 == 2 and j < 3 w, else the t row. A dot product q.k does not change when both sides'
head dimensions are permuted alike, so ``frequency_order`` sorts the frequencies by row (t, then h,
then w, each ascending): with the q/k projection rows permuted at load time (``head_permutation``)
and ``inverse_frequencies`` returning the sorted frequencies, the interleaved rotation becomes the
sectioned one, on the same sections, and the arena's M-RoPE kernel rotates K unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import fused

ROPE_SCALING_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE hyperparameters of a decoder, with transformers' names.

    ``scaling_type`` "default" (none), "linear" (inverse frequencies divided by ``factor``) or
    "llama3" (Llama 3.1's smooth wavelength-dependent division, which also uses
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``).
    ``sections`` non-empty means M-RoPE (t, h, w frequency counts summing to ``rotary_dim // 2``).
    """

    theta: float
    rotary_dim: int  # 2 * n_freq; head_dim unless partial rotary
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    sections: tuple[int, ...] = ()
    interleaved: bool = False  # M-RoPE sections interleaved (Qwen3-VL): see the module docstring

    def __post_init__(self) -> None:
        if self.scaling_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"RoPE scaling {self.scaling_type!r} is not supported; supported: {ROPE_SCALING_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"RoPE theta {self.theta} and factor {self.factor} must be positive")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"RoPE rotary_dim {self.rotary_dim} must be positive and even")
        if self.sections and (len(self.sections) != 3 or sum(self.sections) != self.rotary_dim // 2):
            raise ValueError(f"M-RoPE sections {self.sections} must be 3 counts summing to {self.rotary_dim // 2}")
        if self.interleaved and not self.sections:
            raise ValueError("interleaved RoPE needs M-RoPE sections")
        if self.scaling_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 RoPE needs high_freq_factor > low_freq_factor")

    @property
    def kind(self) -> str:
        """The arena's RoPE kind: "mrope" with sections, else "neox" (rotate-half)."""
        return "mrope" if self.sections else "neox"


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [rotary_dim // 2], attention_scaling) exactly as transformers computes them."""
    exponents = torch.arange(0, rope.rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rope.rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    if rope.interleaved:
        inv_freq = inv_freq[frequency_order(rope)]
    return inv_freq, 1.0


def frequency_order(rope: RopeConfig) -> torch.Tensor:
    """long [rotary_dim // 2]: the frequencies of interleaved M-RoPE sorted by the position row that
    turns them (t, h, w; ascending within each), so that they form ``rope.sections`` blocks."""
    j = torch.arange(rope.rotary_dim // 2)
    _, h, w = rope.sections
    row = torch.zeros_like(j)
    row[(j % 3 == 1) & (j < 3 * h)] = 1
    row[(j % 3 == 2) & (j < 3 * w)] = 2
    return torch.argsort(row, stable=True)


def head_permutation(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """long [head_dim]: the order of one head's dimensions that matches ``frequency_order`` (both
    rotation halves permuted alike, dimensions past the rotary part kept)."""
    order = frequency_order(rope)
    n_freq = order.numel()
    return torch.cat([order, order + n_freq, torch.arange(2 * n_freq, head_dim)])


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, ...] = ()) -> torch.Tensor:
    """Angles float32 [n, n_freq] of int positions [n] (or [3, n] with M-RoPE ``sections``)."""
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    if not sections:
        return positions.to(torch.float32)[:, None] * inv_freq[None, :]
    per_row = positions.to(torch.float32)[:, :, None] * inv_freq[None, None, :]  # [3, n, n_freq]
    blocks = per_row.split(list(sections), dim=-1)
    return torch.cat([block[i % 3] for i, block in enumerate(blocks)], dim=-1)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, sections: tuple[int, ...],
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, n_freq] in ``dtype``: computed in float32 and scaled, then cast (as transformers)."""
    angles = rope_angles(positions, inv_freq, sections)
    return (angles.cos() * attention_scaling).to(dtype), (angles.sin() * attention_scaling).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` over the first 2 n_freq elements of each head of x [n, heads,
    head_dim], with cos, sin [n, n_freq] in x's dtype; the rest of each head passes through."""
    n_freq = cos.shape[-1]
    cos, sin = cos.repeat(1, 2)[:, None, :], sin.repeat(1, 2)[:, None, :]
    rotary, rest = x[..., : 2 * n_freq], x[..., 2 * n_freq :]
    first, second = rotary[..., :n_freq], rotary[..., n_freq:]
    rotated = rotary * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    sections: tuple[int, ...] = (),
) -> torch.Tensor:
    """Rotate-half RoPE of x [n, heads, head_dim] at positions int [n] (or [3, n]); same shape and dtype.

    As transformers does it: cos/sin in float32, cast to x's dtype, then ``x cos + rotate_half(x) sin``.
    """
    return rotate(x, *rope_tables(positions, inv_freq, attention_scaling, sections, x.dtype))


class RotaryEmbedding:
    """One model's RoPE on its device: rotates q and configures the arena to rotate K alike.

    A forward pass computes its cos/sin tables once (``tables``) and hands them to every layer;
    ``apply`` rotates on its own.
    """

    def __init__(self, rope: RopeConfig, device: torch.device | str) -> None:
        self.config = rope
        inv_freq, self.attention_scaling = inverse_frequencies(rope)
        self.inv_freq = inv_freq.to(device)  # float32 [rotary_dim // 2]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, n_freq] in ``dtype`` of positions int32 [n] (or [3, n] with M-RoPE): what
        ``fused.rotate`` takes. A forward pass computes them once for all its layers."""
        return rope_tables(positions, self.inv_freq, self.attention_scaling, self.config.sections, dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] rotated at positions int32 [n] (or [3, n] with M-RoPE); one kernel
        on CUDA (``fused.rotate``). The tables are computed for this call: a forward pass takes
        ``tables`` once and hands them to every layer instead."""
        return fused.rotate(x, *self.tables(positions, x.dtype))

    def configure(self, arena) -> None:
        """Sets the arena's RoPE (``KVArena.set_rope``) to this one, so that written K match rotated q."""
        sections = self.config.sections or (0, 0, 0)
        arena.set_rope(
            self.inv_freq.cpu(), self.config.kind, sections=sections, attention_scaling=self.attention_scaling
        )
