"""The limits a Runtime and a request must fit in, checked before any work: a Runtime's sizes and
cache folder, and whether a read request (its prompt's tokens, images included, plus
``max_tokens``) fits the model's context length and the KV arena, with options that name real
layers. A request refused here has allocated nothing."""
from __future__ import annotations

import torch

from .arena import DTYPES, KVArena
from .disk_cache import DEFAULT_CACHE_DIR_BYTES, prepare_directory
from .errors import ContextOverflowError, InvalidArgumentError, RequestError
from .models.base import ModelConfig
from .options import GenerationOptions
from .request import Request
from .validation import flag, integer


def check_runtime_arguments(dtype, kv_cache_bytes, image_cache_bytes, prefix_cache_entries, cuda_graphs,
                            cache_dir=None, cache_dir_bytes=DEFAULT_CACHE_DIR_BYTES, kv_dtype=None) -> None:
    """The Runtime's arguments, before a model is loaded: ``dtype`` None or a dtype the arena
    stores, ``kv_cache_bytes`` a positive integer (or None for the default), ``image_cache_bytes``
    an integer >= 0 (or None), at most ``kv_cache_bytes``, ``prefix_cache_entries`` an integer
    >= 0, ``cuda_graphs`` a bool, ``cache_dir`` None or a folder this process can write (created
    if missing), ``cache_dir_bytes`` a positive integer, ``kv_dtype`` None or "fp8".
    InvalidArgumentError names the argument at fault."""
    if kv_dtype is not None and kv_dtype != "fp8":
        raise InvalidArgumentError(f"kv_dtype must be None (the KV cache in the runtime's dtype) or 'fp8', got {kv_dtype!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in DTYPES):
        raise InvalidArgumentError(f"dtype must be None or one of {', '.join(map(str, DTYPES))}, got {dtype!r}")
    if kv_cache_bytes is not None:
        integer(kv_cache_bytes, "kv_cache_bytes", 1, error=InvalidArgumentError)
    if image_cache_bytes is not None:
        high = int(kv_cache_bytes) if kv_cache_bytes is not None else None
        integer(image_cache_bytes, "image_cache_bytes (the image-KV store's share of kv_cache_bytes)", 0, high,
                error=InvalidArgumentError)
    integer(prefix_cache_entries, "prefix_cache_entries", 0, error=InvalidArgumentError)
    flag(cuda_graphs, "cuda_graphs", error=InvalidArgumentError)
    integer(cache_dir_bytes, "cache_dir_bytes (the cache folder's byte budget)", 1, error=InvalidArgumentError)
    if cache_dir is not None:
        prepare_directory(cache_dir)


def sequence_capacity(arena: KVArena, n_layers: int) -> int:
    """The most tokens one sequence can ever hold in ``arena``: every block of the pool, spread over
    the layers (a block holds ``block_size`` tokens of one layer)."""
    return arena.stats().n_blocks_total // n_layers * arena.block_size


def check_request_fits(request: Request, options: GenerationOptions, config: ModelConfig, arena: KVArena) -> None:
    """Refuses a request the runtime cannot answer, before anything is allocated for it.

    ContextOverflowError: the prompt alone, or the prompt and ``max_tokens`` together, exceed the
    model's context length; or the sequence (the prompt and the ``max_tokens - 1`` tokens decoding
    appends: the last sampled token is never fed back) needs more KV than the whole arena holds.
    RequestError: ``refresh_options.layers`` names a layer the model does not have.
    """
    prompt, answer = request.n_tokens, options.max_tokens
    limit = config.context_length
    if prompt > limit:
        images = f" ({request.n_image_tokens} of them for {len(request.images)} images)" if request.images else ""
        raise ContextOverflowError(f"the prompt has {prompt} tokens{images}, more than the model's context length "
                                   f"of {limit}: send fewer images or less text", prompt, limit)
    if prompt + answer > limit:
        raise ContextOverflowError(
            f"the prompt's {prompt} tokens and max_tokens={answer} exceed the model's context length of {limit}: "
            f"lower max_tokens to at most {limit - prompt}", prompt + answer, limit)
    needed, capacity = prompt + max(answer - 1, 0), sequence_capacity(arena, config.n_layers)
    if needed > capacity:
        raise ContextOverflowError(
            f"the request needs KV for {needed} tokens, more than the KV arena can ever hold for one sequence "
            f"({capacity} tokens in {arena.kv_bytes} bytes): create the Runtime with a larger kv_cache_bytes, "
            "or send a shorter request", needed, capacity)
    layers = options.refresh_options.layers
    if layers is not None and any(not 0 <= layer < config.n_layers for layer in layers):
        raise RequestError(f"refresh layers must be in [0, {config.n_layers}), got {list(layers)}")
