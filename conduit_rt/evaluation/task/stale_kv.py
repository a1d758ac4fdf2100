"""Reference "stale KV" answers in plain transformers: the `none` refresh policy, without the runtime.

For a request, each page's K (before RoPE) and V are taken, per decoder layer, from a *source*
context in which the same page was prefilled earlier; the request is then prefilled text run by
text run with those KV spliced in at the page's positions (K rotated by RoPE at the *new*
positions, docs/methods.md §1 step 3), so every text token is fresh and every image token is stale,
and the answer is decoded greedily. Sources:

- ``fresh``: the request itself (sanity check: equals full prefill),
- ``isolated``: each page alone in a one-image chat wrapper, ``<s>USER: <image>\\n`` (the reference
  code's default fill mode),
- ``retagged``: the request's pages seen in another session, in another order under other tags
  (``generator.retagged_request``; the in-context fill mode).

``stale_kv_report`` gives exact match for each source next to full prefill through
``generate``, i.e. the gap the `none` policy must show (`conduit eval` tells policies apart only when
`none` loses at least 5 points against full prefill).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence

import numpy as np
import torch

from .data import PagePool, PromptEncoder
from .evaluate import MAX_ANSWER_TOKENS, accuracy_by_pages, exact_match, greedy_answers, model_device_dtype, pool_pixels
from .generator import Request, retagged_request
from .model_config import NUM_IMAGE_TOKENS
from .tokenizer import BOS, IMAGE_TOKEN

logger = logging.getLogger(__name__)

SOURCES = ("fresh", "isolated", "retagged")
ISOLATED_WRAPPER = f"{BOS}USER: {IMAGE_TOKEN}\n ASSISTANT:"
PageKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K before RoPE, V), each [H_kv, 64, d]


def _language_model(model):
    return model.model.language_model


def _cache_keyword(module) -> str:
    """transformers 5.2x names the KV-cache argument ``cache``; earlier versions ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(model, keys: torch.Tensor, start: int) -> torch.Tensor:
    """Rotate K before RoPE ``keys`` [H_kv, n, d] to positions start..start+n-1 (Llama RoPE)."""
    positions = torch.arange(start, start + keys.shape[1], device=keys.device)[None]
    cos, sin = _language_model(model).rotary_emb(keys, position_ids=positions)  # [1, n, d] each
    return keys * cos + _rotate_half(keys) * sin


def embed_prompt(model, ids: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
    """Input embeddings [B, T, D] of ``ids`` [B, T] with image features written at image tokens."""
    embeds = model.get_input_embeddings()(ids)
    if pixel_values is None:
        return embeds
    features = model.model.get_image_features(
        pixel_values=pixel_values, vision_feature_layer=model.config.vision_feature_layer,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
    )
    features = getattr(features, "pooler_output", features)
    features = torch.cat(list(features), dim=0) if isinstance(features, (list, tuple)) else features.flatten(0, 1)
    mask = (ids == model.config.image_token_id)[..., None].expand_as(embeds)
    return embeds.masked_scatter(mask, features.to(embeds.dtype))


@torch.no_grad()
def prefill_kv(model, embeds: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K before RoPE and V [B, H_kv, T, d] of a plain prefill of ``embeds`` [B, T, D].

    Read by forward hooks on k_proj/v_proj (the projections' outputs are exactly K before RoPE
    and V in Llama, which has no q/k norm).
    """
    language_model = _language_model(model)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    store: dict[str, torch.Tensor] = {}
    heads, head_dim = language_model.config.num_key_value_heads, language_model.config.head_dim

    def keep(name: str):
        def hook(_module, _inputs, output):
            store[name] = output.view(*output.shape[:2], heads, head_dim).transpose(1, 2)
        return hook

    handles = []
    for layer in language_model.layers:
        handles.append(layer.self_attn.k_proj.register_forward_hook(keep("k")))
        handles.append(layer.self_attn.v_proj.register_forward_hook(keep("v")))
        handles.append(layer.self_attn.register_forward_hook(lambda *_: captured.append((store["k"], store["v"]))))
    try:
        language_model(inputs_embeds=embeds, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _image_starts(ids: np.ndarray, image_token_id: int) -> list[int]:
    is_image = ids == image_token_id
    return [int(i) for i in np.flatnonzero(is_image & ~np.r_[False, is_image[:-1]])]


@torch.no_grad()
def prefill_with_page_kv(model, encoder: PromptEncoder, request: Request, pages_kv: Sequence[PageKV]):
    """Prefill ``request``'s prompt with page i's KV taken from ``pages_kv[i]`` (text tokens fresh).

    Returns (cache, last_hidden [1, D], num_tokens): a ``DynamicCache`` holding the whole prompt,
    the final norm's output at the last prompt token, and the prompt length.
    """
    from transformers import DynamicCache

    device, _ = model_device_dtype(model)
    language_model = _language_model(model)
    ids = encoder.encode([request], with_answer=False)[0].ids
    embeds = embed_prompt(model, torch.from_numpy(ids).to(device)[None], None)
    cache = DynamicCache()
    bounds = _image_starts(ids, encoder.image_token_id) + [len(ids)]
    position, hidden = 0, None
    for page, image_start in enumerate(bounds):
        if image_start > position:  # the text run before this page (or the tail)
            hidden = _forward_text(language_model, embeds[:, position:image_start], position, cache)
        if page == request.num_pages:
            break
        for layer, (keys, values) in enumerate(pages_kv[page]):
            cache.update(apply_rope(model, keys, image_start)[None], values[None], layer)
        position = image_start + NUM_IMAGE_TOKENS
    return cache, hidden, len(ids)


def _forward_text(language_model, embeds: torch.Tensor, start: int, cache) -> torch.Tensor:
    """Forward ``embeds`` [1, n, D] at positions start.. through the decoder with ``cache``; last hidden [1, D]."""
    positions = torch.arange(start, start + embeds.shape[1], device=embeds.device)[None]
    out = language_model(inputs_embeds=embeds, position_ids=positions, use_cache=True,
                         **{_cache_keyword(language_model): cache})
    return out.last_hidden_state[:, -1]


@torch.no_grad()
def answer_with_page_kv(model, encoder: PromptEncoder, request: Request, pages_kv: Sequence[PageKV]) -> str:
    """Greedy answer to ``request`` with page i's KV taken from ``pages_kv[i]``."""
    device, _ = model_device_dtype(model)
    cache, hidden, num_tokens = prefill_with_page_kv(model, encoder, request, pages_kv)
    generated: list[int] = []
    for step in range(MAX_ANSWER_TOKENS):
        token = int(model.lm_head(hidden).argmax(-1))
        if token == encoder.eos_token_id:
            break
        generated.append(token)
        token_embeds = model.get_input_embeddings()(torch.tensor([[token]], device=device))
        hidden = _forward_text(_language_model(model), token_embeds, num_tokens + step, cache)
    return encoder.decode(generated)


def _slice_pages(layers_kv, row: int, starts: Sequence[int]) -> list[PageKV]:
    return [[(k[row, :, s : s + NUM_IMAGE_TOKENS], v[row, :, s : s + NUM_IMAGE_TOKENS]) for k, v in layers_kv]
            for s in starts]


@torch.no_grad()
def source_page_kv(model, encoder: PromptEncoder, request: Request, pool: PagePool, source: str, salt: int = 1) -> list[PageKV]:
    """The KV of each page of ``request`` as computed in ``source`` (see the module docstring)."""
    device, dtype = model_device_dtype(model)
    if source == "isolated":
        ids = encoder.tokenizer.encode(ISOLATED_WRAPPER, add_special_tokens=False).ids
        ids = np.repeat(ids, np.where(np.asarray(ids) == encoder.image_token_id, NUM_IMAGE_TOKENS, 1))
        batch = torch.from_numpy(ids).to(device)[None].expand(request.num_pages, -1)
        embeds = embed_prompt(model, batch, pool_pixels(pool, request.page_ids, device, dtype))
        start = _image_starts(ids, encoder.image_token_id)[0]
        layers_kv = prefill_kv(model, embeds)
        return [_slice_pages(layers_kv, row, [start])[0] for row in range(request.num_pages)]
    if source not in ("fresh", "retagged"):
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    seen = request if source == "fresh" else retagged_request(request, salt)
    ids = encoder.encode([seen], with_answer=False)[0].ids
    embeds = embed_prompt(model, torch.from_numpy(ids).to(device)[None], pool_pixels(pool, seen.page_ids, device, dtype))
    by_page_id = dict(zip(seen.page_ids, _slice_pages(prefill_kv(model, embeds), 0, _image_starts(ids, encoder.image_token_id))))
    return [by_page_id[page_id] for page_id in request.page_ids]


def stale_answers(model, encoder: PromptEncoder, requests: Sequence[Request], pool: PagePool, source: str) -> list[str]:
    """Greedy answers with every page's KV from ``source`` (one request at a time)."""
    return [answer_with_page_kv(model, encoder, r, source_page_kv(model, encoder, r, pool, source)) for r in requests]


def stale_kv_report(model, encoder: PromptEncoder, requests: Sequence[Request], pool: PagePool,
                    sources: Sequence[str] = SOURCES) -> dict:
    """Exact match of full prefill (``generate``) and of each stale source, overall and by page count."""
    full = greedy_answers(model, encoder, requests, pool)
    report = {"requests": len(requests), "full_exact_match": round(exact_match(full, requests), 4)}
    for source in sources:
        answers = stale_answers(model, encoder, requests, pool, source)
        report[f"{source}_exact_match"] = round(exact_match(answers, requests), 4)
        report[f"{source}_by_pages"] = {k: round(v, 4) for k, v in accuracy_by_pages(answers, requests).items()}
        report[f"{source}_agrees_with_full"] = round(sum(a == b for a, b in zip(answers, full)) / max(1, len(full)), 4)
        logger.info("stale KV %s: %s", source, report[f"{source}_exact_match"])
    return report
