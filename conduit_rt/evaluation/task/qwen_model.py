"""The Qwen2-VL task model (M-RoPE decoder, dynamic-resolution ViT, 2x2 patch merger) and its folder.

The vision tower cuts a page into 4x4-pixel patches over 2 frames (a still page is repeated, as
Qwen2-VL does for images) and the merger joins each 2x2 block of patches into one visual token,
so one token covers one 8x8-pixel glyph cell and a page of ``grid`` x ``grid`` cells gives
``grid**2`` tokens whose M-RoPE (t, h, w) positions are the cell's (0, row, column) after the
text before it. Widths and depths come from ``model_config.MODEL_SIZES`` (``default`` about 15M
parameters, about 30 MB in bfloat16; ``tiny`` for CPU tests); the decoder's RoPE is split over
(t, h, w) as Qwen2-VL splits it (a quarter of the frequencies for t, the rest halved for h and w).

``patchify`` turns uint8 pages into the ``pixel_values`` and ``image_grid_thw`` that the folder's
``Qwen2VLImageProcessor`` returns for them, on the pages' device (pages sit on the GPU during
training). ``write_qwen_model_folder`` writes what a Qwen2-VL hub repo holds, so that
``Qwen2VLForConditionalGeneration.from_pretrained`` and ``conduit convert`` load it.

transformers' Qwen2-VL builds M-RoPE positions only when given ``mm_token_type_ids``
(``image_token_types``) with ``image_grid_thw``, or takes ``position_ids`` [3, B, T] as they are:
``mrope_position_ids`` (the model's ``get_rope_index``) and ``mrope_positions`` (the same without
a model, for collate functions) compute them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from .generator import CELL_SIZE
from .model_config import CLIP_MEAN, CLIP_STD, ModelSize
from .tokenizer import (
    IM_END, IMAGE_PAD, QWEN_PAD, VISION_END, VISION_START, write_qwen_tokenizer_files,
)

PATCH_SIZE = 4
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
assert PATCH_SIZE * MERGE_SIZE == CELL_SIZE  # one merged visual token per glyph cell
PATCH_VALUES = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE**2  # one row of pixel_values
MAX_POSITIONS = 8192  # 8 pages of 576 tokens and the text fit
MIN_PIXELS = 32 * 32  # smart_resize leaves pages of 32..256 px per side (multiples of 8) at their size
MAX_PIXELS = 256 * 256
RESCALE_FACTOR = 1 / 255


def mrope_section(head_dim: int) -> list[int]:
    """(t, h, w) split of the head's ``head_dim / 2`` rotary frequencies: a quarter for t, the rest
    halved between h and w (Qwen2-VL's [16, 24, 24] at head_dim 128)."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def qwen2vl_config(tokenizer: Tokenizer, size: ModelSize):
    """The ``transformers.Qwen2VLConfig`` of the task model, token ids taken from ``tokenizer``
    (``tokenizer.build_qwen_tokenizer``)."""
    from transformers import Qwen2VLConfig

    head_dim = size.text_hidden // size.text_heads
    text = {
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": size.text_hidden,
        "intermediate_size": size.text_intermediate, "num_hidden_layers": size.text_layers,
        "num_attention_heads": size.text_heads, "num_key_value_heads": size.text_kv_heads,
        "max_position_embeddings": max(size.max_positions, MAX_POSITIONS), "rms_norm_eps": 1e-6,
        # no BOS is ever added; its id is <|endoftext|>, as in Qwen2-VL's own config
        "bos_token_id": tokenizer.token_to_id(QWEN_PAD), "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(QWEN_PAD), "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)},
    }
    vision = {
        "depth": size.vision_layers, "embed_dim": size.vision_hidden, "num_heads": size.vision_heads,
        "mlp_ratio": 4, "hidden_act": "quick_gelu", "hidden_size": size.text_hidden, "in_channels": 3,
        "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }
    return Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=tokenizer.token_to_id(IMAGE_PAD),
        vision_start_token_id=tokenizer.token_to_id(VISION_START),
        vision_end_token_id=tokenizer.token_to_id(VISION_END), tie_word_embeddings=False,
    )


def new_qwen_model(tokenizer: Tokenizer, size: ModelSize, seed: int = 0):
    """A freshly initialised ``Qwen2VLForConditionalGeneration`` (float32, on the CPU, SDPA attention)."""
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    config = qwen2vl_config(tokenizer, size)
    config._attn_implementation = "sdpa"
    return Qwen2VLForConditionalGeneration(config)


def batch_vision_attention(model) -> None:
    """Make the vision blocks of ``model`` run attention as one SDPA call over all images when they
    have the same number of patches (transformers' SDPA path makes one call per image, hundreds per
    training batch of small pages); mixed sizes take the per-image path. Same values; training only
    (the saved folder is a plain model)."""
    import types

    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if bool((lengths != lengths[0]).any()):
            return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings, **kwargs)
        total = hidden_states.shape[0]
        query, key, value = self.qkv(hidden_states).reshape(total, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        query, key = apply_rotary_pos_emb_vision(query, key, *position_embeddings)
        images = lengths.numel()
        query, key, value = (t.reshape(images, total // images, self.num_heads, -1).transpose(1, 2)
                             for t in (query, key, value))  # [images, heads, patches, d]
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=self.scaling)
        return self.proj(out.transpose(1, 2).reshape(total, -1))

    for block in model.model.visual.blocks:
        block.attn.forward = types.MethodType(forward, block.attn)


def normalization_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [3, 256]: the processor's value for each channel and uint8 level, computed as it
    computes it (level x 1/255 in float64, then float32, then (x - mean) / std in float32)."""
    levels = (np.arange(256, dtype=np.float64) * RESCALE_FACTOR).astype(np.float32)
    mean = np.asarray(CLIP_MEAN, dtype=np.float32)[:, None]
    std = np.asarray(CLIP_STD, dtype=np.float32)[:, None]
    return torch.from_numpy((levels[None] - mean) / std).to(device)


def _patchify_batch(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> float32 [n * (H/4) * (W/4), 96], each page's patches in merge-block
    order (each 2x2 block of patches consecutive), a row being (channel, frame, y, x) in C order."""
    count, height, width, _ = pages.shape
    p, m = PATCH_SIZE, MERGE_SIZE
    channel_offsets = torch.arange(3, device=pages.device) * 256
    values = table.flatten()[pages.long() + channel_offsets].permute(0, 3, 1, 2)  # [n, 3, H, W]
    blocks = values.reshape(count, 3, height // (p * m), m, p, width // (p * m), m, p)
    blocks = blocks.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [n, H/8, W/8, m, m, 3, p, p]
    frames = blocks.unsqueeze(6).expand(*blocks.shape[:6], TEMPORAL_PATCH_SIZE, p, p)
    return frames.reshape(count * (height // p) * (width // p), PATCH_VALUES)


def patchify(pages: Sequence[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages (uint8 [H, W, 3] each, H and W multiples of 8, sizes may differ; or one uint8
    [n, H, W, 3] tensor) -> ``pixel_values`` float32 [sum of (H/4)(W/4), 96] and ``image_grid_thw``
    int64 [n, 3] (1, H/4, W/4), on the pages' device: what the folder's ``Qwen2VLImageProcessor``
    returns for them (its resize leaves such pages as they are). Runs of equal-size pages are
    processed as one batch."""
    if isinstance(pages, torch.Tensor) and pages.ndim == 4:
        pages = list(pages.unbind(0)) if len(pages) else []
    if not pages:
        raise ValueError("patchify needs at least one page")
    device = pages[0].device
    table = normalization_table(device)
    for page in pages:
        if page.dtype != torch.uint8 or page.ndim != 3 or page.shape[2] != 3 or page.shape[0] % CELL_SIZE or page.shape[1] % CELL_SIZE:
            raise ValueError(f"pages must be uint8 [H, W, 3] with H, W multiples of {CELL_SIZE}, got {page.dtype} {tuple(page.shape)}")
    parts, start = [], 0
    for index in range(1, len(pages) + 1):
        if index == len(pages) or pages[index].shape != pages[start].shape:
            parts.append(_patchify_batch(torch.stack(pages[start:index]), table))
            start = index
    grid = torch.tensor([[1, page.shape[0] // PATCH_SIZE, page.shape[1] // PATCH_SIZE] for page in pages],
                        dtype=torch.int64, device=device)
    return torch.cat(parts), grid


def preprocessor_config() -> dict:
    """preprocessor_config.json: a ``Qwen2VLImageProcessor`` with the task's patch sizes and CLIP's
    normalization; ``min_pixels``/``max_pixels`` leave task pages at their size."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "rescale_factor": RESCALE_FACTOR,
        "resample": 3, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }


def write_qwen_model_folder(model, tokenizer: Tokenizer, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save ``model`` (cast to ``dtype`` on the way, the live model is untouched) as a Qwen2-VL hub
    folder: config.json, model.safetensors, generation_config.json, the tokenizer files with the
    chat template (also as chat_template.json), preprocessor_config.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to("cpu", dtype).save_pretrained(folder)
    write_qwen_tokenizer_files(folder, tokenizer)
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))
    return folder


def image_token_types(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` int32 [B, T]: 1 at image tokens, 0 elsewhere. transformers' Qwen2-VL
    forward and generate need it (with ``image_grid_thw``) to build M-RoPE positions."""
    return (input_ids == model.config.image_token_id).int()


def mrope_position_ids(model, input_ids: torch.Tensor, image_grid_thw: torch.Tensor,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """M-RoPE positions int64 [3, B, T] (t, h, w) of a batch, as the model computes them
    (``get_rope_index``): text tokens count up on all three rows, an image's tokens take
    (start, start + row, start + column) and the text after it resumes at start + max(rows, columns).
    ``input_ids`` [B, T] int64, ``image_grid_thw`` [num_images, 3] in the order the images appear
    (row by row), ``attention_mask`` [B, T] (padding gets position 0). Reads only the config."""
    positions, _ = model.model.get_rope_index(
        input_ids, mm_token_type_ids=image_token_types(model, input_ids), image_grid_thw=image_grid_thw,
        attention_mask=attention_mask,
    )
    return positions


def mrope_positions(input_ids: np.ndarray | torch.Tensor, image_grid_thw: np.ndarray | torch.Tensor,
                    image_token_id: int) -> torch.Tensor:
    """``mrope_position_ids`` without a model, on the CPU (for a collate function in DataLoader
    workers): int64 [3, B, T] for ``input_ids`` [B, T] whose runs of ``image_token_id`` are the
    images of ``image_grid_thw`` [num_images, 3] (t = 1, merged 2x2) in order, row by row. Padding
    counts as text (right padding leaves every real token's position as without it)."""
    ids = np.asarray(input_ids.cpu() if isinstance(input_ids, torch.Tensor) else input_ids)
    grids = iter(np.asarray(image_grid_thw.cpu() if isinstance(image_grid_thw, torch.Tensor) else image_grid_thw).tolist())
    positions = np.empty((3, *ids.shape), dtype=np.int64)
    for row, row_ids in enumerate(ids):
        is_image = row_ids == image_token_id
        starts = np.flatnonzero(is_image & ~np.r_[False, is_image[:-1]])
        token, position = 0, 0  # next token index, next text position
        for start in (*starts.tolist(), len(row_ids)):
            positions[:, row, token:start] = position + np.arange(start - token)
            position += start - token
            if start == len(row_ids):
                break
            frames, height, width = next(grids)
            rows, columns = height // MERGE_SIZE, width // MERGE_SIZE
            if frames != 1 or not is_image[start:start + rows * columns].all():
                raise ValueError(f"image at token {start} of row {row} does not match its grid {(frames, height, width)}")
            stop = start + rows * columns
            positions[0, row, start:stop] = position
            positions[1, row, start:stop] = position + np.repeat(np.arange(rows), columns)
            positions[2, row, start:stop] = position + np.tile(np.arange(columns), rows)
            token, position = stop, position + max(rows, columns)
    return torch.from_numpy(positions)
