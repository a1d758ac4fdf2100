"""Decode speed: our runtime at batch 1 against the bytes-per-token bound and transformers' generate,
and, on a long context, VL-Cache against the uncompressed cache and an fp8 cache against the dense one.

Tokens/s is the runtime's own ``decode_tokens_per_s`` (first token sampled -> last, host clock, one
host sync per token for sampling: what a caller streaming tokens sees). Transformers' rate is
(generate(N) - generate(1)) / (N - 1) on the same prompt ids, so its prefill cancels out. Whether
the decode step is graph-captured is read, not assumed: ``torch.cuda.CUDAGraph.replay`` calls are
counted while our decode runs.
"""
from __future__ import annotations

import torch

from conduit_rt.chat import build_prompt

from . import synthetic
from .timing import PeakMemory


class GraphReplays:
    """Counts ``torch.cuda.CUDAGraph.replay`` calls inside the block."""

    def __init__(self) -> None:
        self.count = 0
        self._cls = getattr(torch.cuda, "CUDAGraph", None)
        self._original = None

    def __enter__(self) -> "GraphReplays":
        if self._cls is not None and hasattr(self._cls, "replay"):
            self._original = self._cls.replay
            original = self._original

            def counted(graph, *args, **kwargs):
                self.count += 1
                return original(graph, *args, **kwargs)

            self._cls.replay = counted
        return self

    def __exit__(self, *exc) -> None:
        if self._original is not None:
            self._cls.replay = self._original


def prompt_tokens(e2e, messages: list[dict]) -> int:
    a = e2e.runtime.assets
    return len(build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id,
                            e2e.model.config.tokens_per_image).token_ids)


def ours(e2e) -> dict:
    s = e2e.s
    messages = synthetic.text_request(s.decode_context - prompt_tokens(e2e, synthetic.text_request(0, e2e.fillers, 5)),
                                      e2e.fillers, 5)
    rates = []
    with GraphReplays() as replays:
        for _ in range(s.decode_repeats):
            result = e2e.request("decode", messages, max_tokens=s.decode_tokens)
            rates.append(result.stats.decode_tokens_per_s)
    steps = s.decode_repeats * (s.decode_tokens - 1)  # forward steps: every token after the first
    return {"messages": messages, "prompt_tokens": result.stats.prompt_tokens, "tokens": s.decode_tokens,
            "tokens_per_s": sorted(rates)[len(rates) // 2], "samples": rates, "graph_replays": replays.count,
            "steps": steps}


def transformers_generate(e2e, twin, messages: list[dict]) -> dict:
    s = e2e.s
    a = e2e.runtime.assets
    ids = build_prompt(messages, a.chat_template, a.tokenizer, a.image_token_id, 0).token_ids
    ids = torch.tensor([ids], device=e2e.device)
    mask = torch.ones_like(ids)

    def generate(n: int):
        return twin.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.no_grad(), PeakMemory(e2e.device) as peak:
        long = e2e.timer.wall_time(lambda: generate(s.decode_tokens), repeat=s.decode_repeats, warmup=1)
        short = e2e.timer.wall_time(lambda: generate(1), repeat=max(2, s.decode_repeats), warmup=0)
    e2e.memory["transformers_generate"] = peak.as_dict()
    seconds = max(long.median_s - short.median_s, 1e-9)
    return {"tokens": s.decode_tokens, "generate_s": long.median_s, "generate_one_s": short.median_s,
            "tokens_per_s": (s.decode_tokens - 1) / seconds}


def long_request(e2e) -> list[dict]:
    """The ``long_context``-token prompt: a system document, the images, a question."""
    s = e2e.s

    def request(document_words: int) -> list[dict]:
        return synthetic.image_request(e2e.images, s.prefix_words, s.question_words, e2e.fillers, 6, document_words)

    return request(max(0, s.long_context - prompt_tokens(e2e, request(0))))


def long_decode(e2e, label: str, messages: list[dict], **kwargs) -> dict:
    """``decode_repeats`` requests of ``long_decode_tokens`` tokens (``kwargs`` to generate): the
    median tokens/s, and the last request's TTFT and KV bytes."""
    s = e2e.s
    rates, result = [], None
    for _ in range(s.decode_repeats):
        result = e2e.request(label, messages, max_tokens=s.long_decode_tokens, **kwargs)
        rates.append(result.stats.decode_tokens_per_s)
    st = result.stats
    return {"tokens_per_s": sorted(rates)[len(rates) // 2], "samples": rates, "ttft_s": st.ttft_s,
            "prompt_tokens": st.prompt_tokens, "kv_bytes_end": st.kv_bytes,
            "kv_bytes_before_compress": st.kv_bytes_before_compress,
            "kv_bytes_after_compress": st.kv_bytes_after_compress}


def vlcache(e2e) -> dict:
    """The long prompt: 10% kept vs all."""
    messages = long_request(e2e)
    out: dict = {"keep": e2e.s.keep}
    for label, kwargs in (("full", {}), ("vlcache", {"compress": "vlcache", "keep": e2e.s.keep})):
        out[label] = long_decode(e2e, f"long_{label}", messages, **kwargs)
    return out


def fp8_cache(e2e) -> dict:
    """The long prompt, all kept, on a Runtime with an fp8 KV cache that replaces ``e2e``'s (see
    ``EndToEnd.replace_runtime``). One untimed request first: the dense Runtime met the prompt's
    images and context sizes in the stages before (cached image embeddings and KV, captured CUDA
    graphs), the new one starts empty."""
    e2e.replace_runtime(kv_dtype="fp8")
    messages = long_request(e2e)
    e2e.request("long_fp8", messages, max_tokens=e2e.s.long_decode_tokens)
    return long_decode(e2e, "long_fp8", messages)


def decode_runs(e2e, twin) -> dict:
    mine = ours(e2e)
    return {"ours": mine, "transformers": transformers_generate(e2e, twin, mine.pop("messages"))}
