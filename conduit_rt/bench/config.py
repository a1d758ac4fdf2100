"""The sizes of every benchmark: the full ones, and a shrunken set for smoke runs (``quick``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KernelSizes:
    """Attention kernels over the arena (one layer unless said), bf16 on CUDA."""

    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    decode_length: int = 32768                          # batch-1 decode ...
    long_decode_length: int = 131072                    # ... and a long one
    batch: int = 16                                     # batched decode: this many sequences ...
    batch_length: int = 8192                            # ... of this many tokens each
    compressed_length: int = 32768                      # VL-Cache-compressed decode: the full length ...
    compressed_keep: float = 0.1                        # ... and the fraction kept
    n_text_before: int = 128                            # scattered recompute / scoring layout: text,
    n_visual: int = 8192                                # visual tokens,
    n_text_after: int = 192                             # trailing text (the last n_text_queries of it query)
    n_text_queries: int = 64
    refresh: float = 0.1                                # visual tokens recomputed
    prefill_chunk: int = 4096                           # queries of a prefill chunk (positions 0..chunk-1)
    scoring_layers: int = 32
    tokens_per_image: int = 576                         # images of the scoring layout (amplification)
    topk_n: int = 100_000
    topk_k: int = 10_000


@dataclass(frozen=True, slots=True)
class E2ESizes:
    """End-to-end runs with the Runtime on a random-weight model (``synthetic.SHAPES``)."""

    shape: str = "llava-1.5-7b"
    n_images: int = 8
    prefix_words: int = 16          # system text before the images (changed between requests)
    question_words: int = 80        # the question after them
    refresh: float = 0.1
    decode_context: int = 4096      # prompt tokens of the decode run
    decode_tokens: int = 128
    long_context: int = 32768       # prompt tokens of the VL-Cache run
    long_decode_tokens: int = 64
    keep: float = 0.1
    repeats: int = 5                # timed requests per measurement (median)
    decode_repeats: int = 2
    kv_cache_bytes: int = 40 << 30
    image_cache_bytes: int = 6 << 30


@dataclass(frozen=True, slots=True)
class FamilySizes:
    """The families section: the reuse runs and the transformers prefill of the end-to-end section
    on each of ``shapes`` (``family_models.SHAPES``: their images' sides and token counts are the
    shapes'), one model at a time."""

    shapes: tuple[str, ...] = ("qwen3-vl-8b", "internvl3-8b", "qwen2.5-vl-7b")
    n_images: int = 8
    prefix_words: int = 16          # as the end-to-end section's requests
    question_words: int = 80
    refresh: float = 0.1
    repeats: int = 5
    kv_cache_bytes: int = 16 << 30  # Qwen3-VL-8B: 144 KiB a token, ~8.3K tokens a request
    image_cache_bytes: int = 6 << 30  # its embedding cache (1/16 of it) holds the 8 images' 256 MiB


@dataclass(frozen=True, slots=True)
class ServeSizes:
    """The serve section: the server's scheduler (``serve.engine.Engine``) on the end-to-end model,
    with ``n_images`` images per request (the end-to-end section's text lengths)."""

    clients: tuple[int, ...] = (1, 4, 16, 64)  # concurrent clients of each run
    scaling_clients: int = 16        # decode throughput here vs one client; the batched step's batch
    requests_per_client: int = 4     # requests each client sends, one after another
    max_tokens: int = 128            # tokens generated per request
    n_images: int = 2
    max_batch: int = 64              # requests the engine decodes together
    kv_cache_bytes: int = 40 << 30   # beside the 7B weights on an 80 GB card; past it requests queue
    image_cache_bytes: int = 4 << 30
    restarts: int = 3                # Runtimes started again over the cache folder (median TTFT)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    device: torch.device
    dtype: torch.dtype
    kernels: KernelSizes
    e2e: E2ESizes
    families: FamilySizes = FamilySizes()
    serve: ServeSizes = ServeSizes()
    warmup: int = 3
    repeat: int = 20
    ceiling_copy_bytes: int = 2 << 30
    ceiling_matmul_n: int = 8192
    quick: bool = False

    def as_dict(self) -> dict:
        return {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "quick": self.quick,
                "warmup": self.warmup, "repeat": self.repeat, "ceiling_copy_bytes": self.ceiling_copy_bytes,
                "ceiling_matmul_n": self.ceiling_matmul_n, "kernels": dataclasses.asdict(self.kernels),
                "e2e": dataclasses.asdict(self.e2e), "families": dataclasses.asdict(self.families),
                "serve": dataclasses.asdict(self.serve)}


QUICK_KERNELS = KernelSizes(n_heads=8, n_kv_heads=2, head_dim=64, decode_length=256, long_decode_length=512, batch=2,
                            batch_length=256, compressed_length=256, n_text_before=16, n_visual=200,
                            n_text_after=24, n_text_queries=8, prefill_chunk=128, scoring_layers=2,
                            tokens_per_image=50, topk_n=2000, topk_k=200)
QUICK_E2E = E2ESizes(shape="tiny", n_images=3, prefix_words=4, question_words=8, decode_context=96, decode_tokens=4,
                     long_context=192, long_decode_tokens=4, repeats=1, decode_repeats=1,
                     kv_cache_bytes=32 << 20, image_cache_bytes=8 << 20)
QUICK_FAMILIES = FamilySizes(shapes=("qwen3-vl-tiny", "internvl3-tiny", "qwen2.5-vl-tiny"), n_images=3, prefix_words=4,
                             question_words=8, repeats=1, kv_cache_bytes=32 << 20, image_cache_bytes=8 << 20)
QUICK_SERVE = ServeSizes(clients=(1, 2, 4), scaling_clients=4, requests_per_client=2, max_tokens=4, max_batch=4,
                         kv_cache_bytes=32 << 20, image_cache_bytes=8 << 20, restarts=1)


def make_config(device: str, quick: bool) -> BenchConfig:
    """The full sizes on a GPU (bf16); ``quick`` shrinks everything (float32 on the CPU)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if not quick:
        return BenchConfig(dev, dtype, KernelSizes(), E2ESizes())
    return BenchConfig(dev, dtype, QUICK_KERNELS, QUICK_E2E, QUICK_FAMILIES, QUICK_SERVE, warmup=1, repeat=3,
                       ceiling_copy_bytes=16 << 20, ceiling_matmul_n=256, quick=True)
