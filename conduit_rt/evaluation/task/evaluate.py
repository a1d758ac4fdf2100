"""Exact-match accuracy of the task model with full prefill (greedy decoding through transformers)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from .data import PagePool, PromptEncoder, normalize_pixels
from .generator import Request

logger = logging.getLogger(__name__)

MAX_ANSWER_TOKENS = 8  # two codes ("▁K", "7", "Q", "▁4", "Z", "B") or five colours, then the end of turn


def model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    parameter = next(model.parameters())
    return parameter.device, parameter.dtype


def pool_pixels(pool: PagePool, page_ids: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Normalized ``pixel_values`` [len(page_ids), 3, S, S] of pool pages, in order (LLaVA's input)."""
    pixels = torch.from_numpy(pool.pixels[np.asarray(page_ids, dtype=np.int64)])
    return normalize_pixels(pixels.to(device), dtype)


def llava_image_inputs(model, input_ids: torch.Tensor, pixels: torch.Tensor, dtype: torch.dtype,
                       generate: bool = False) -> dict[str, torch.Tensor]:
    """LLaVA's image inputs of uint8 pages [n, S, S, 3]: ``pixel_values`` [n, 3, S, S] in ``dtype``
    (the signature of ``architectures.TaskArchitecture.image_inputs``)."""
    return {"pixel_values": normalize_pixels(pixels, dtype)}


@torch.no_grad()
def greedy_answers(model, encoder: PromptEncoder, requests: Sequence[Request], pool: PagePool,
                   batch_size: int = 64, pool_pixels_on_device: torch.Tensor | None = None,
                   image_inputs=llava_image_inputs) -> list[str]:
    """Greedy answers (decoded, stripped) to ``requests`` over ``pool``'s pages, full prefill.

    Batches are left-padded with an attention mask; ``pool_pixels_on_device`` (uint8
    [size, S, S, 3], optional) avoids copying pages to the device for every batch;
    ``image_inputs`` gives the model's image keyword arguments (``TaskArchitecture.image_inputs``).
    """
    device, dtype = model_device_dtype(model)
    answers: list[str] = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start : start + batch_size]
        encoded = encoder.encode(chunk, with_answer=False)
        length = max(len(item.ids) for item in encoded)
        input_ids = torch.full((len(chunk), length), encoder.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(chunk), length), dtype=torch.int64)
        for row, item in enumerate(encoded):
            input_ids[row, length - len(item.ids) :] = torch.from_numpy(item.ids)
            attention_mask[row, length - len(item.ids) :] = 1
        page_ids = [page_id for request in chunk for page_id in request.page_ids]
        if pool_pixels_on_device is not None:
            pixels = pool_pixels_on_device[torch.tensor(page_ids, device=device)]
        else:
            pixels = torch.from_numpy(pool.pixels[np.asarray(page_ids, dtype=np.int64)]).to(device)
        input_ids = input_ids.to(device)
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask.to(device),
            **image_inputs(model, input_ids, pixels, dtype, generate=True),
            max_new_tokens=MAX_ANSWER_TOKENS, do_sample=False, pad_token_id=encoder.pad_token_id,
            eos_token_id=encoder.eos_token_id,
        )
        answers.extend(encoder.decode(row[length:].tolist()) for row in output)
    return answers


def exact_match(answers: Sequence[str], requests: Sequence[Request]) -> float:
    """Fraction of answers equal to the reference answers (both stripped)."""
    if not requests:
        return 0.0
    return sum(a.strip() == r.answer for a, r in zip(answers, requests)) / len(requests)


def accuracy_by_pages(answers: Sequence[str], requests: Sequence[Request]) -> dict[int, float]:
    """Exact match per number of pages in the request."""
    table: dict[int, list[bool]] = {}
    for answer, request in zip(answers, requests):
        table.setdefault(request.num_pages, []).append(answer.strip() == request.answer)
    return {pages: sum(hits) / len(hits) for pages, hits in sorted(table.items())}
