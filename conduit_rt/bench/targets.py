"""Target rows: what was measured, against which reference, the ratio and whether it meets its target.

Every row compares a ratio with a threshold, ``>=`` or ``<=``; ``ratio`` is spelled out per row
(for example "reference time / our time"), so that a row reads without the code.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# every row a full run produces, in report order, with what it measures
ROWS: dict[str, str] = {
    "decode.bandwidth": "decode attention over the arena (one query at the last position) at batch 1 x 32K: "
                        "K+V bytes read / kernel time, against the copy bandwidth",
    "decode.vs_sdpa": "the same kernel time against the fastest torch SDPA backend (flash, cuDNN, efficient, math) "
                      "on the same K/V laid out [B, H_kv, n, d] (enable_gqa, or K/V expanded where a backend needs it)",
    "decode_long.bandwidth": "as decode.bandwidth at batch 1 x 128K",
    "decode_long.vs_sdpa": "as decode.vs_sdpa at batch 1 x 128K",
    "decode_batch.bandwidth": "as decode.bandwidth at batch 16 x 8K: one decode-step launch over the 16 sequences",
    "decode_batch.vs_sdpa": "as decode.vs_sdpa at batch 16 x 8K (SDPA takes the batch in one call)",
    "decode_fp8.vs_cudnn": "the same decode attention at batch 1 x 32K over an fp8 arena (K and V stored as e4m3 "
                           "with a float32 power-of-two scale per token and KV head) against cuDNN SDPA on bf16 K/V "
                           "of the same problem; our output is checked against the float32 reference over the K/V "
                           "the arena holds (the rounding's own error against the unrounded K/V is in the detail)",
    "decode_long_fp8.vs_cudnn": "as decode_fp8.vs_cudnn at batch 1 x 128K",
    "decode_batch_fp8.vs_cudnn": "as decode_fp8.vs_cudnn at batch 16 x 8K: one decode-step launch over the 16 "
                                 "sequences (cuDNN takes the batch in one call)",
    "compressed.vs_full": "decode over the 32K sequence compacted to a random 10% of its slots, against the same "
                          "sequence uncompacted",
    "recompute.vs_sdpa": "CONDUIT's recompute queries (10% of 8K visual tokens + 64 text queries over ~8.5K keys, "
                         "causal by position): useful TFLOP/s (visible pairs only) against SDPA (flash or cuDNN, "
                         "the faster) on a dense causal problem of the same size (884 queries, the last of 8.5K keys)",
    "prefill.vs_sdpa": "a 4K-query prefill chunk (positions 0..4095): the same comparison, on identical problems",
    "scoring.vs_prefill": "CONDUIT scoring over 32 layers (64 query rows, 8K visual tokens: native attention "
                          "statistics, value norms, amplification) + global top-k, against a decoder-only full "
                          "prefill of as many tokens on the 7B-shaped model",
    "topk.vs_torch": "the selection's top-k (selection.top_k_indices) of 100K scores, k = 10K, against torch.topk",
    "ttft.vs_full_prefill": "TTFT of 8 seen images shown again under a changed prefix and order (~100 text tokens), "
                            "refresh conduit at 10%, against our full prefill of the same request (image embeddings "
                            "cached in both); the cold TTFTs (vision tower) are in the detail",
    "prefill.vs_transformers": "our full prefill (decoder) against transformers' LlamaForCausalLM (SDPA) on the same "
                               "input embeddings and the same weight tensors",
    "scoring_e2e.vs_prefill": "scoring + selection inside the TTFT request (instrumented) against its full prefill",
    "decode.vs_bound": "decode tokens/s at batch 1 with a 4K context against copy bandwidth / (decoder weight bytes "
                       "+ mean context KV bytes)",
    "decode.vs_transformers": "the same tokens/s against transformers' greedy generate, "
                              "(generate(N) - generate(1)) / (N - 1)",
    "decode.graph_captured": "CUDA graph replays per decode step during our decode",
    "vlcache.speed": "decode tokens/s with VL-Cache at 10% keep against the uncompressed cache, 32K context",
    "vlcache.kv_bytes": "the prompt's KV bytes after VL-Cache compression over before",
    "long_fp8.vs_bf16": "decode tokens/s of the same 32K-context request, uncompressed, on a Runtime with an fp8 KV "
                        "cache (``Runtime.from_model(..., kv_dtype='fp8')``, built after the bf16 one is closed, one "
                        "untimed request first) against vlcache.speed's uncompressed bf16-cache run",
    "qwen3vl.ttft.vs_full_prefill": "as ttft.vs_full_prefill on the Qwen3-VL-8B-shaped model: 8 seen images of "
                                    "1024 x 1024 pixels (1024 tokens each, ~8.3K prompt tokens), refresh conduit at "
                                    "10%, against our full prefill; the cold TTFTs are in the detail",
    "qwen3vl.prefill.vs_transformers": "our full prefill (decoder) of that request against transformers' "
                                       "Qwen3VLTextModel (SDPA) on the same input embeddings, M-RoPE positions, "
                                       "DeepStack features and weight tensors (q/k in transformers' order)",
    "qwen3vl.vision.vs_transformers": "the Qwen3-VL-8B-shaped vision tower, merger and DeepStack mergers on the "
                                      "8 images of a cold request, one image a call, against transformers' "
                                      "Qwen3VLVisionModel (SDPA) on the same pixels and weight tensors; the "
                                      "embeddings' max abs and relative errors are in the detail",
    "internvl3.ttft.vs_full_prefill": "as ttft.vs_full_prefill on the InternVL3-8B-shaped model: 8 seen images of "
                                      "448 x 448 pixels (one tile each, 256 tokens), refresh conduit at 10%, against "
                                      "our full prefill; the cold TTFTs are in the detail",
    "internvl3.prefill.vs_transformers": "our full prefill (decoder) of that request against transformers' "
                                         "Qwen2ForCausalLM (SDPA) on the same input embeddings and weight tensors",
    "internvl3.vision.vs_transformers": "the InternVL3-8B-shaped InternViT, pixel shuffle and projector on the 8 "
                                        "tiles of a cold request, one image a call, against transformers' "
                                        "InternVLModel image features (SDPA) on the same pixels and weight tensors; "
                                        "the embeddings' errors are in the detail",
    "qwen25vl.ttft.vs_full_prefill": "as ttft.vs_full_prefill on the Qwen2.5-VL-7B-shaped model: 8 seen images of "
                                     "896 x 896 pixels (1024 tokens each, ~8.3K prompt tokens), refresh conduit at "
                                     "10%, against our full prefill; the cold TTFTs are in the detail",
    "qwen25vl.prefill.vs_transformers": "our full prefill (decoder) of that request against transformers' "
                                        "Qwen2_5_VLTextModel (SDPA) on the same input embeddings, M-RoPE positions "
                                        "and weight tensors",
    "qwen25vl.vision.vs_transformers": "the Qwen2.5-VL-7B-shaped vision tower (window attention, full attention in "
                                       "blocks 7/15/23/31) and merger on the 8 images of a cold request, one image a "
                                       "call, against transformers' Qwen2_5_VisionTransformerPretrainedModel (SDPA) "
                                       "on the same pixels and weight tensors; the embeddings' errors are in the "
                                       "detail",
    "serve.throughput": "the server's scheduler driven in-process (no HTTP) by concurrent clients, each request "
                        "showing 2 seen images under a new prefix (refresh conduit at 10%) and generating 128 "
                        "tokens: tokens generated / wall time of the run at 16 clients against 1 client",
    "serve.no_loss": "the same at 64 clients: requests answered whole (every token asked for, no error) over "
                     "requests sent",
    "serve.batch_step.vs_bound": "the engine's batched decode step over 16 prefilled requests: tokens/s against "
                                 "16 x copy bandwidth / (decoder weight bytes + the 16 mean contexts' KV bytes)",
    "serve.restart_ttft": "TTFT of a request whose images a Runtime with a cache folder computed before it closed, "
                          "on a Runtime started again over the folder that loaded the folder's recent entries "
                          "before its first request (``Runtime.preload_images``, as conduit serve --cache-dir "
                          "does), against the same request on the first Runtime (a warm in-memory hit)",
}
ROW_KEYS = tuple(ROWS)
ROW_FIELDS = ("key", "name", "measured", "reference", "unit", "ratio", "ratio_is", "target", "passed", "detail")


@dataclass(frozen=True, slots=True)
class Target:
    key: str           # stable id of the row (the same at every size), e.g. "decode.vs_sdpa"
    name: str          # what the row checks, with its sizes
    measured: float    # our number, in ``unit``
    reference: float   # what it is compared with, in ``unit``
    unit: str
    ratio: float
    ratio_is: str      # how the ratio is formed, e.g. "SDPA time / our time"
    target: str        # ">= 1.5" or "<= 0.15"
    passed: bool
    detail: str = ""   # sizes, backends, caveats

    def as_dict(self) -> dict:
        return asdict(self)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ratio(a: float, b: float) -> float:
    return a / b if _finite(a) and _finite(b) and b != 0 else float("nan")


def at_least(key: str, name: str, measured: float, reference: float, unit: str, threshold: float, ratio_is: str,
             detail: str = "", invert: bool = False, valid: bool = True) -> Target:
    """Passes when ratio >= threshold; ratio = measured / reference, or reference / measured with
    ``invert`` (times: faster is smaller). ``valid`` False (a wrong result) fails the row."""
    ratio = _ratio(reference, measured) if invert else _ratio(measured, reference)
    passed = valid and _finite(ratio) and ratio >= threshold
    return Target(key, name, measured, reference, unit, ratio, ratio_is, f">= {threshold:g}", passed, detail)


def at_most(key: str, name: str, measured: float, reference: float, unit: str, threshold: float, ratio_is: str,
            detail: str = "", valid: bool = True) -> Target:
    """Passes when ratio = measured / reference <= threshold."""
    ratio = _ratio(measured, reference)
    passed = valid and _finite(ratio) and ratio <= threshold
    return Target(key, name, measured, reference, unit, ratio, ratio_is, f"<= {threshold:g}", passed, detail)


def with_missing(rows: list[Target], errors: dict[str, str], absent: str = "its section was skipped") -> list[Target]:
    """``rows`` in ``ROW_KEYS`` order, a failing placeholder for each key no section produced: its
    detail names the sections' ``errors`` or, with none, ``absent``."""
    by_key = {r.key: r for r in rows}
    why = "; ".join(f"{section}: {error}" for section, error in errors.items()) or absent
    nan = float("nan")
    return [by_key.get(key) or Target(key, key, nan, nan, "", nan, "", "", False, f"not measured ({why})")
            for key in ROW_KEYS] + [r for r in rows if r.key not in ROW_KEYS]
