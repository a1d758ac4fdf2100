"""A request as the rest of the path reads it: messages -> chat template -> token ids and segments,
images -> pixels -> identity and prepared tower input, RoPE positions, one identity per token
(``Request``, made by ``RequestReader.read``); and the input embeddings of any of its positions."""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from .chat import ImageSlot, Prompt, TextRun, build_prompt, validate_messages
from .errors import RequestError
from .image_cache import DecodedImages, EmbeddingCache
from .models.base import PreparedImage
from .parallel.group import model_group
from .preprocess import encoded_bytes, image_key, to_rgb_array

# VL-Cache's P for a prompt without images: its last tokens (docs/methods.md §2 step 1)
TEXT_ONLY_POST_VISION = 32


@dataclass(frozen=True, slots=True)
class Request:
    """One request after tokenization: what every later step of the path reads."""

    prompt: Prompt
    payloads: list                 # the images as the caller gave them
    images: list[PreparedImage]
    keys: list[bytes]              # 32-byte identity of each image
    rope: torch.Tensor             # int32 [n] or [3, n], CPU
    identity: list                 # one hashable entry per prompt token (exact-prefix matching)
    token_ids: np.ndarray = field(init=False)  # int64 [n]: prompt.token_ids, indexed by position arrays

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", np.asarray(self.prompt.token_ids, dtype=np.int64))

    @property
    def n_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def n_image_tokens(self) -> int:
        return sum(slot.n_tokens for slot in self.prompt.image_slots)

    @property
    def image_spans(self) -> list[tuple[int, int]]:
        """Per image (message order), the prompt positions [start, stop) of its visual tokens."""
        spans = [(0, 0)] * len(self.images)
        for slot in self.prompt.image_slots:
            spans[slot.image_index] = (slot.start, slot.start + slot.n_tokens)
        return spans

    @property
    def next_rope(self) -> int:
        """RoPE position of the first generated token."""
        return int(self.rope.max()) + 1 if self.rope.numel() else 0

    def post_vision_positions(self) -> list[int]:
        """VL-Cache's P: the tokens after the last image (no image: the last 32 tokens)."""
        n = self.n_tokens
        slots = self.prompt.image_slots
        start = slots[-1].start + slots[-1].n_tokens if slots else max(0, n - TEXT_ONLY_POST_VISION)
        return list(range(start, n))

    def query_positions(self, query_tokens: int | None) -> list[int]:
        """The query rows of scoring: the trailing text segment, or the last ``query_tokens`` tokens."""
        n = self.n_tokens
        if query_tokens is not None:
            return list(range(max(0, n - query_tokens), n))
        tail = self.prompt.segments[-1]
        return list(range(tail.start, n)) if isinstance(tail, TextRun) else [n - 1]

    def text_after_first_image(self) -> list[int]:
        """Every text token from the first image on: the template text between images and the
        trailing segment (no image: VL-Cache's P, the last 32 tokens)."""
        slots = sorted(self.prompt.image_slots, key=lambda slot: slot.start)
        if not slots:
            return self.post_vision_positions()
        is_text = np.ones(self.n_tokens, dtype=bool)
        for slot in slots:
            is_text[slot.start: slot.start + slot.n_tokens] = False
        is_text[: slots[0].start] = False
        return np.flatnonzero(is_text).tolist()


class RequestReader:
    """Turns messages into ``Request`` objects for one model, and gives their input embeddings.

    ``decoded_images`` keeps the pixels of recurring image files, ``embeddings`` the projected vision
    features of recurring images (both LRU under their byte budgets)."""

    def __init__(self, model, decoded_images: DecodedImages, embeddings: EmbeddingCache) -> None:
        self.model, self.decoded_images, self.embeddings = model, decoded_images, embeddings
        preprocess = model.assets.preprocess
        # what every image key hashes besides the pixels (computed once: asdict is slow per request)
        self._image_params = preprocess.as_dict() if preprocess is not None else {}

    def read(self, messages: list[dict]) -> Request:
        """Messages -> prompt tokens and segments, prepared images, their identities, RoPE positions."""
        a = self.model.assets
        _, payloads = validate_messages(messages)
        if payloads and not self.model.has_vision:
            raise RequestError("this model has no vision tower: load it with its mmproj.gguf to send images")
        pixels, keys = self._decode_images(payloads)
        for rgb in pixels:  # what preprocessing will make of each image stays within the pixel limit
            a.preprocess.check_size(rgb.shape[0], rgb.shape[1])
        images = [self.model.prepare_image(rgb) for rgb in pixels]
        prompt = build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id,
                              [image.n_tokens for image in images], image_wrap=a.image_wrap)
        rope = self.model.rope_positions(prompt, images)
        return Request(prompt, payloads, images, keys, rope, _identity(prompt, keys))

    def alone(self, request: Request, slot: ImageSlot) -> Request:
        """The image at ``slot`` of ``request`` alone in a one-image chat wrapper (isolated fill)."""
        a = self.model.assets
        payload, image = request.payloads[slot.image_index], request.images[slot.image_index]
        messages = [{"role": "user", "content": [{"type": "image", "image": payload}]}]
        prompt = build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id, [image.n_tokens],
                              image_wrap=a.image_wrap)
        key = request.keys[slot.image_index]
        return Request(prompt, [payload], [image], [key], self.model.rope_positions(prompt, [image]), [])

    def embed(self, request: Request, positions: list[int]) -> torch.Tensor:
        """Input embeddings of prompt positions: [len(positions), hidden], model dtype; image tokens
        take their image's features (from the embedding cache, or the vision tower on a miss).

        The index arithmetic runs in numpy and reaches the device in one non-blocking upload (a
        blocking one waits for every kernel queued before it); per image, one gather and one
        scatter. The recompute pass calls this right after the selection's host sync, with the device
        idle until its first launch."""
        pos = np.asarray(positions, dtype=np.int64)
        pieces, spans = [request.token_ids[pos]], []  # spans: (image index, length) per image shown
        for slot in request.prompt.image_slots:
            rows = np.flatnonzero((pos >= slot.start) & (pos < slot.start + slot.n_tokens))
            if rows.size:
                pieces += [rows, pos[rows] - slot.start]
                spans.append((slot.image_index, rows.size))
        index = torch.from_numpy(np.concatenate(pieces)).to(self.model.device, non_blocking=True)
        embeds = self.model.embed_tokens(index[: pos.size])
        offset = pos.size
        for image_index, n in spans:
            rows, features_rows = index[offset: offset + n], index[offset + n: offset + 2 * n]
            embeds[rows] = self._image_features(request, image_index)[features_rows]
            offset += 2 * n
        return embeds

    def _image_features(self, request: Request, image_index: int) -> torch.Tensor:
        key = request.keys[image_index]
        features = self.embeddings.get(key)
        if features is None:
            parallel = model_group(self.model)
            if parallel is None:
                (features,) = self.model.encode_images([request.images[image_index]])
            else:  # tensor parallel: the tower runs on rank 0, the others receive its features
                features = parallel.encoded_on_first_rank(self.model, request.images[image_index])
            self.embeddings.put(key, features)
        return features

    def _decode_images(self, payloads: list) -> tuple[list[np.ndarray], list[bytes]]:
        """Each image's RGB pixels ([H, W, 3] uint8) and cache key, in order.

        An image sent as a file (a path or bytes) that this reader decoded before comes from
        ``decoded_images`` by the sha256 of the file: no decoding, no hash of its pixels. The rest
        go through a thread pool (hashing releases the GIL), since no GPU work of the request can
        start before they are known. Each distinct payload object is decoded once, by one thread: a
        lazily opened PIL image shown twice must not be loaded by two threads at once (they would
        share its file pointer)."""
        vision_model_id = self.model.assets.vision_model_id

        def decoded(payload) -> tuple[np.ndarray, bytes]:
            encoded = encoded_bytes(payload)
            if encoded is None:  # a PIL image or an array: its pixels are the only identity
                rgb = to_rgb_array(payload)
                return rgb, image_key(rgb, self._image_params, vision_model_id)
            digest = self.decoded_images.digest(encoded)
            known = self.decoded_images.get(digest)
            if known is not None:
                return known
            name = os.fspath(payload) if isinstance(payload, (str, os.PathLike)) else None
            rgb = to_rgb_array(encoded, name)
            key = image_key(rgb, self._image_params, vision_model_id)
            self.decoded_images.put(digest, rgb, key)
            return rgb, key

        distinct = list({id(payload): payload for payload in payloads}.values())
        results = list(_image_pool().map(decoded, distinct)) if len(distinct) > 1 else [decoded(p) for p in distinct]
        by_object = {id(payload): result for payload, result in zip(distinct, results)}
        return [by_object[id(p)][0] for p in payloads], [by_object[id(p)][1] for p in payloads]


@functools.cache
def _image_pool() -> ThreadPoolExecutor:
    """The threads that decode and hash a request's images (one pool per process)."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="conduit-images")


# A forked child inherits the cached pool without its threads: it makes its own.
os.register_at_fork(after_in_child=_image_pool.cache_clear)


def _identity(prompt: Prompt, keys: list[bytes]) -> list:
    """One hashable entry per prompt token: ("t", id) for text, ("i", image key, index) for image tokens."""
    ids, out, cursor = prompt.token_ids, [], 0
    for slot in sorted(prompt.image_slots, key=lambda s: s.start):
        out += [("t", t) for t in ids[cursor: slot.start]]
        out += _image_identity(keys[slot.image_index], slot.n_tokens)
        cursor = slot.start + slot.n_tokens
    return out + [("t", t) for t in ids[cursor:]]


@functools.lru_cache(maxsize=256)
def _image_identity(key: bytes, n_tokens: int) -> tuple:
    """An image's identity entries, made once per image: a request of several images would
    otherwise build thousands of tuples before its first kernel."""
    return tuple(("i", key, j) for j in range(n_tokens))
