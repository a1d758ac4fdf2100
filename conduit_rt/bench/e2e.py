"""End-to-end benchmarks: the Runtime on a LLaVA-1.5-7B-shaped model with random weights, built
on the device (``models.random_init``), against Hugging Face transformers running the same decoder
tensors (``synthetic.transformers_twin``). ``EndToEnd`` also runs the families section's models
(``families``: Qwen3-VL-8B and InternVL3-8B shapes), given as a ``workload.Workload``, and
``ttft_row`` / ``transformers_row`` make their rows as they make LLaVA's.

Requests (``synthetic``): ``first`` shows ``n_images`` random images after a system prefix, with a
question; ``second`` shows the same images in another order under another prefix and question
(~100 text tokens in all). Every timed request starts with the exact-prefix cache cleared, so a
repeat never reuses its predecessor's sequence. The model never stops at EOS (the weights are
random): every run generates the length asked for.

  cold          fresh embedding and image-KV caches: vision tower + prefill (refresh None, and
                refresh "conduit" with its isolated image fills)
  warm          ``second`` after the images were seen: refresh "conduit" at ``refresh`` vs a full
                prefill (refresh None); image embeddings come from the cache in both
  breakdown     the warm requests again under ``breakdown.PhaseClock``
  transformers  ``LlamaForCausalLM`` (SDPA) prefill of the same input embeddings (``twins``); greedy generate
  decode        a text prompt of ``decode_context`` tokens, ``decode_tokens`` generated
  vlcache       a ``long_context`` prompt (document, images, question) with and without VL-Cache
  long_fp8      that prompt without VL-Cache again on a Runtime with an fp8 KV cache, the last
                stage: it replaces the dense Runtime (both pools would not fit beside the weights)
"""
from __future__ import annotations

import logging

import torch

from conduit_rt.image_cache import DecodedImages, EmbeddingCache
from conduit_rt.models.base import ForwardBatch
from conduit_rt.preprocess import image_key, to_rgb_array
from conduit_rt.reuse import CHUNK
from conduit_rt.runtime import Runtime

from . import synthetic, twins, workload
from .breakdown import PhaseClock
from .config import E2ESizes, FamilySizes
from .decode import decode_runs, fp8_cache, vlcache
from .stages import run_stages
from .targets import Target, at_least, at_most
from .timing import PeakMemory, Timer

logger = logging.getLogger(__name__)


class EndToEnd:
    """The runs of one model under its Runtime: ``work`` (default: ``workload.build(sizes)``, the
    LLaVA model) with the sizes' caches, repeats and refresh budget."""

    def __init__(self, sizes: E2ESizes | FamilySizes, timer: Timer, dtype: torch.dtype,
                 work: workload.Workload | None = None) -> None:
        self.s, self.timer, self.device = sizes, timer, timer.device
        work = work if work is not None else workload.build(sizes, self.device, dtype)
        self.model, self.fillers = work.model, work.fillers
        self.runtime = self._new_runtime()
        self.images, self.first, self.second = work.images, work.first, work.second
        self.memory: dict[str, dict] = {}

    def _new_runtime(self, kv_dtype: str | None = None) -> Runtime:
        return Runtime.from_model(self.model, kv_cache_bytes=self.s.kv_cache_bytes,
                                  image_cache_bytes=self.s.image_cache_bytes, kv_dtype=kv_dtype)

    def replace_runtime(self, kv_dtype: str | None) -> None:
        """Closes the Runtime (its KV arena, caches and CUDA graphs), then builds another on the same
        model with the sizes' caches and KV cache ``kv_dtype``: one pool of ``kv_cache_bytes`` at a
        time beside the weights."""
        self.runtime.close()
        self.runtime = self._new_runtime(kv_dtype)

    # -- plumbing -------------------------------------------------------------------------------
    def request(self, label: str, messages: list[dict], **kwargs):
        """One request with the exact-prefix cache cleared; records its peak memory under ``label``."""
        self.runtime.planner.prefix_cache.clear()
        with PeakMemory(self.device, self.runtime.arena.kv_bytes) as peak:
            result = self.runtime.generate(messages, **kwargs)
        self.memory[label] = peak.as_dict() | {"request_kv_bytes": result.stats.kv_bytes}
        return result

    def forget_images(self) -> None:
        """Empties the embedding and decoded-image caches and evicts the images' KV: the next request
        sees them cold."""
        a = self.runtime.assets
        for image in self.images:
            key = image_key(to_rgb_array(image), a.preprocess.as_dict(), a.vision_model_id)
            if self.runtime.arena.has_image(key):
                self.runtime.arena.evict_image(key)
        requests = self.runtime.requests
        requests.embeddings = EmbeddingCache(requests.embeddings.max_bytes)
        requests.decoded_images = DecodedImages(requests.decoded_images.max_bytes)

    def ttft(self, label: str, messages: list[dict], repeats: int, cold: bool = False, **kwargs) -> dict:
        samples, result = [], None
        for _ in range(repeats):
            if cold:
                self.forget_images()
            result = self.request(label, messages, max_tokens=1, **kwargs)
            samples.append(result.stats.ttft_s)
        samples.sort()
        s = result.stats
        return {"ttft_s": samples[len(samples) // 2], "samples_s": samples, "prompt_tokens": s.prompt_tokens,
                "visual_tokens": s.visual_tokens, "refreshed_tokens": s.refreshed_tokens,
                "prefill_flops_ratio": s.prefill_flops_ratio, "image_hits": s.image_hits}

    def phases(self, label: str, messages: list[dict], repeats: int, **kwargs) -> dict:
        runs = []
        for _ in range(repeats):
            with PhaseClock(self.device) as clock:
                result = self.request(label, messages, max_tokens=1, **kwargs)
            runs.append(clock.phases(result.stats.ttft_s))
        return {phase: sorted(r[phase] for r in runs)[len(runs) // 2] for phase in runs[0]}

    def decoder_inputs(self, messages: list[dict]) -> twins.DecoderInputs:
        """What our decoder takes for the messages' prompt (read as the runtime reads it), through
        the model's public calls: the token embeddings with each image's features (its vision tower)
        at its slot, the RoPE positions and the visual tokens."""
        m = self.model
        request = self.runtime.requests.read(messages)
        prompt = request.prompt
        embeds = m.embed_tokens(torch.tensor(prompt.token_ids, device=self.device))
        visual = torch.zeros(len(prompt.token_ids), dtype=torch.bool, device=self.device)
        for slot in prompt.image_slots:
            (features,) = m.encode_images([request.images[slot.image_index]])
            embeds[slot.start: slot.start + slot.n_tokens] = features
            visual[slot.start: slot.start + slot.n_tokens] = True
        return twins.DecoderInputs(embeds, request.rope.to(self.device, torch.long), visual)

    # -- the runs -------------------------------------------------------------------------------
    def reuse(self) -> dict:
        s, cold_repeats = self.s, max(1, min(3, self.s.repeats))
        out = {"cold_full": self.ttft("cold_full", self.first, cold_repeats, cold=True),
               "cold_conduit": self.ttft("cold_conduit", self.first, cold_repeats, cold=True, refresh="conduit",
                                         refresh_budget=s.refresh)}
        out["warm_conduit"] = self.ttft("warm_conduit", self.second, s.repeats, refresh="conduit",
                                        refresh_budget=s.refresh)
        out["warm_full"] = self.ttft("warm_full", self.second, s.repeats)
        out["breakdown_conduit"] = self.phases("warm_conduit_timed", self.second, s.repeats, refresh="conduit",
                                               refresh_budget=s.refresh)
        out["breakdown_full"] = self.phases("warm_full_timed", self.second, s.repeats)
        return out

    def transformers_prefill(self, prefill: twins.Prefill) -> dict:
        """A twin's prefill of ``second``'s decoder inputs (last-token logits only), and logits parity."""
        inputs = self.decoder_inputs(self.second)
        run = prefill(inputs)
        with torch.no_grad(), PeakMemory(self.device) as peak:
            timing = self.timer.wall_time(run, repeat=self.s.repeats, warmup=1)
            reference = run()
        self.memory["transformers_prefill"] = peak.as_dict()
        ours = self.request("full_prefill_logits", self.second, max_tokens=1, return_logits=True).logits[0]
        rel = float((ours.to(reference.device) - reference).norm() / reference.norm())
        return {"seconds": timing.median_s, "time": timing.as_dict(), "tokens": int(inputs.embeds.shape[0]),
                "logits_rel_err_vs_ours": rel}

    def decoder_prefill(self, n_tokens: int) -> dict:
        """Decoder-only prefill of n random embeddings in the runtime's chunks (the scoring reference)."""
        m = self.model
        embeds = torch.randn(n_tokens, m.config.hidden, dtype=m.dtype, device=self.device) * 0.02

        def prefill() -> None:
            seq = self.runtime.arena.new_sequence()
            try:
                for lo in range(0, n_tokens, CHUNK):
                    hi = min(n_tokens, lo + CHUNK)
                    seq.append(torch.arange(lo, hi, dtype=torch.int32))
                    hidden = m.forward(seq, embeds[lo:hi], ForwardBatch.contiguous(lo, hi, self.device))
                m.logits(hidden[-1:])
            finally:
                seq.free()

        self.runtime.planner.prefix_cache.clear()
        timing = self.timer.wall_time(prefill, repeat=max(1, min(3, self.s.repeats)), warmup=1)
        return {"tokens": n_tokens, "seconds": timing.median_s, "time": timing.as_dict()}


def weight_bytes_per_token(model) -> int:
    """Bytes of decoder weights one decode step reads: every decoder parameter except the embedding
    table (one row of it is read)."""
    lm = model.language_model
    total = sum(p.numel() * p.element_size() for p in lm.parameters())
    table = lm.embed_tokens.weight
    return total - table.numel() * table.element_size() + table.shape[1] * table.element_size()


def kv_bytes_per_token(model) -> int:
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.tensor([], dtype=model.dtype).element_size()


def run(sizes: E2ESizes, timer: Timer, dtype: torch.dtype, copy_bytes_per_s: float,
        scoring_prefill_tokens: int) -> tuple[dict, list[Target], dict, dict[str, str]]:
    """Every end-to-end run; returns (raw numbers, target rows, peak memory per run, errors). A stage
    that raises is recorded in the errors and the later stages still run."""
    e2e = EndToEnd(sizes, timer, dtype)
    twin = synthetic.transformers_twin(e2e.model)
    raw: dict = {"model": {"shape": sizes.shape, "dtype": str(e2e.model.dtype).replace("torch.", ""),
                           "weight_bytes_per_token": weight_bytes_per_token(e2e.model),
                           "kv_bytes_per_token": kv_bytes_per_token(e2e.model)}}
    stages = [("reuse", e2e.reuse),
              ("transformers_prefill", lambda: e2e.transformers_prefill(twins.causal_lm_prefill(twin))),
              ("scoring_prefill", lambda: e2e.decoder_prefill(scoring_prefill_tokens)),
              ("decode", lambda: decode_runs(e2e, twin)), ("long", lambda: vlcache(e2e)),
              ("long_fp8", lambda: fp8_cache(e2e))]  # last: it replaces the dense Runtime
    try:
        found, errors = run_stages("e2e", stages, before_next=lambda: e2e.runtime.planner.prefix_cache.clear())
    finally:
        e2e.runtime.close()  # the arena, caches and CUDA graphs: the next section builds its own model
    raw.update(found)
    if "decode" in raw:
        raw["decode"]["bound_tokens_per_s"] = decode_bound(raw, copy_bytes_per_s)
    return raw, rows(raw), dict(e2e.memory), errors


def decode_bound(raw: dict, copy_bytes_per_s: float) -> float:
    """Tokens/s if every step read the weights and the mean context's KV at the copy bandwidth."""
    d, m = raw["decode"]["ours"], raw["model"]
    mean_context = d["prompt_tokens"] + d["tokens"] / 2
    return step_bound(copy_bytes_per_s, m["weight_bytes_per_token"], m["kv_bytes_per_token"], mean_context)


def step_bound(copy_bytes_per_s: float, weight_bytes: int, kv_bytes_per_token: int, mean_context: float,
               batch: int = 1) -> float:
    """Tokens/s of decode steps over ``batch`` sequences of ``mean_context`` tokens if each step read
    the weights once and every sequence's KV at the copy bandwidth (one token per sequence a step)."""
    return batch * copy_bytes_per_s / (weight_bytes + batch * mean_context * kv_bytes_per_token)


def rows(raw: dict) -> list[Target]:
    """The end-to-end target rows whose stages ran."""
    out = []
    for build in (_reuse_rows, _decode_rows, _long_rows, _fp8_rows):
        try:
            out += build(raw)
        except KeyError:  # a stage it reads did not run (recorded in the errors)
            continue
    return out


def _reuse_rows(raw: dict) -> list[Target]:
    r, hf = raw["reuse"], raw.get("transformers_prefill")
    bc, bf = r["breakdown_conduit"], r["breakdown_full"]
    rows = [
        ttft_row("ttft.vs_full_prefill", r),
        at_most("scoring_e2e.vs_prefill", "CONDUIT scoring + selection in the request vs its full prefill",
                (bc["scoring"] + bc["selection"]) * 1e3, bf["prefill"] * 1e3, "ms", 0.05,
                "(scoring + selection) / full prefill (decoder)", "from the instrumented requests"),
    ]
    if hf is not None:
        rows.append(transformers_row("prefill.vs_transformers", r, hf))
    return rows


def ttft_row(key: str, reuse: dict, model: str = "") -> Target:
    """TTFT of the warm conduit request against the warm full prefill (``EndToEnd.reuse``'s runs);
    ``model`` (e.g. "qwen3-vl-8b") starts the row's name when given."""
    conduit, full = reuse["warm_conduit"], reuse["warm_full"]
    return at_least(key, f"{model + ': ' if model else ''}TTFT, {conduit['image_hits']} seen images under a changed "
                    f"prefix and order, conduit r={r_of(conduit)}", conduit["ttft_s"] * 1e3, full["ttft_s"] * 1e3,
                    "ms", 4.0, "full-prefill TTFT / conduit TTFT",
                    f"{conduit['prompt_tokens']} prompt tokens, {conduit['refreshed_tokens']} of "
                    f"{conduit['visual_tokens']} visual refreshed, prefill FLOPs {conduit['prefill_flops_ratio']:.3f} "
                    f"of full; cold (vision tower): full {reuse['cold_full']['ttft_s'] * 1e3:.0f} ms, conduit "
                    f"{reuse['cold_conduit']['ttft_s'] * 1e3:.0f} ms", invert=True)


def transformers_row(key: str, reuse: dict, hf: dict, model: str = "", twin: str = "transformers SDPA") -> Target:
    """Our full prefill (the decoder, from the instrumented full request) against ``twin``'s
    (``EndToEnd.transformers_prefill``); ``model`` starts the row's name when given."""
    return at_least(key, f"{model + ': ' if model else ''}full prefill (decoder) vs {twin}, same embeddings",
                    reuse["breakdown_full"]["prefill"] * 1e3, hf["seconds"] * 1e3, "ms", 1.0,
                    "transformers time / our time",
                    f"{hf['tokens']} tokens; logits rel err vs ours {hf['logits_rel_err_vs_ours']:.1e}", invert=True)


def _decode_rows(raw: dict) -> list[Target]:
    d, ours = raw["decode"], raw["decode"]["ours"]
    return [
        at_least("decode.vs_bound", f"decode batch 1, {ours['prompt_tokens']}-token context: tokens/s vs bound",
                 ours["tokens_per_s"], d["bound_tokens_per_s"], "tok/s", 0.85,
                 "our tokens/s / (copy bandwidth / bytes read per token)", "bytes: decoder weights + mean context KV"),
        at_least("decode.vs_transformers", "decode batch 1 vs transformers generate", ours["tokens_per_s"],
                 d["transformers"]["tokens_per_s"], "tok/s", 2.0, "our tokens/s / transformers'",
                 f"{ours['tokens']} tokens generated"),
        at_least("decode.graph_captured", "decode step graph-captured (CUDA graph replays per step)",
                 float(ours["graph_replays"]), float(ours["steps"]), "replays", 1.0, "graph replays / decode steps",
                 "counts torch.cuda.CUDAGraph.replay during our decode"),
    ]


def _long_rows(raw: dict) -> list[Target]:
    long = raw["long"]
    full, vl = long["full"], long["vlcache"]
    return [
        at_least("vlcache.speed", f"VL-Cache keep {long['keep']:g}, {full['prompt_tokens']}-token context: "
                 "decode tokens/s", vl["tokens_per_s"], full["tokens_per_s"], "tok/s", 2.0,
                 "compressed tokens/s / uncompressed"),
        at_most("vlcache.kv_bytes", "VL-Cache: prompt KV bytes kept", vl["kv_bytes_after_compress"] / 2**20,
                vl["kv_bytes_before_compress"] / 2**20, "MiB", 0.12, "bytes after / before compression"),
    ]


def _fp8_rows(raw: dict) -> list[Target]:
    full, fp8 = raw["long"]["full"], raw["long_fp8"]
    return [
        at_least("long_fp8.vs_bf16", f"decode tokens/s, {fp8['prompt_tokens']}-token context: fp8 KV cache vs "
                 f"{raw['model']['dtype']} cache", fp8["tokens_per_s"], full["tokens_per_s"], "tok/s", 1.5,
                 "fp8-cache tokens/s / dense-cache tokens/s",
                 f"the request's KV at its end: {fp8['kv_bytes_end'] / 2**20:.0f} MiB fp8, "
                 f"{full['kv_bytes_end'] / 2**20:.0f} MiB dense"),
    ]


def r_of(run: dict) -> str:
    return f"{run['refreshed_tokens'] / run['visual_tokens']:.2f}" if run["visual_tokens"] else "n/a"
