"""`conduit demo`: the bundled model reads rendered pages, then reads them again under a changed prefix.

The bundled default is the small LLaVA-architecture model trained on the quality task
(``quality/``): pages of coloured codes, each page named by a tag written before it, questions like
"elk purple?". The demo converts the model to GGUF once (cached), then for a few test requests:
  1. shows the pages in an earlier session, under other tags and in another order (cache misses:
     the image KV is computed and stored);
  2. asks the real question with the pages back under their own tags, order and companions, twice:
     with a full prefill, and with CONDUIT refreshing 10% of the cached image tokens;
and prints the answers, the expected answer, cache hits, refreshed tokens and time to first token.
Runs on the GPU when there is one, else on the CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch

BUNDLED_MODEL = Path(__file__).resolve().parent / "data" / "quality_model"


def cache_dir() -> Path:
    root = Path(os.environ.get("CONDUIT_CACHE", Path.home() / ".cache" / "conduit-rt"))
    return root / "demo"


def converted_model(hf_dir: Path) -> Path:
    """GGUF files of the bundled model, converted on first use and cached by content."""
    from convert.cli import main as convert_main

    digest = hashlib.sha256()
    for name in sorted(p.name for p in hf_dir.iterdir()):
        digest.update(name.encode())
        digest.update((hf_dir / name).read_bytes())
    out = cache_dir() / digest.hexdigest()[:16]
    if not (out / "model.gguf").is_file():
        print(f"converting the bundled model to GGUF in {out} ...", flush=True)
        if convert_main([str(hf_dir), "--outdir", str(out), "--dtype", "bf16"]) != 0:
            raise SystemExit("conduit demo: converting the bundled model failed")
    return out / "model.gguf"


def load_runtime(model_dir: Path, device: str):
    """The Runtime of the trained quality model; without one, a tiny random-weight LLaVA (the cache
    mechanics are the same, the answers are noise) with a notice saying so."""
    from .runtime import Runtime, resolve_device

    if (model_dir / "config.json").is_file():
        return Runtime(converted_model(model_dir), device=device, prefix_cache_entries=0)
    from .bench.synthetic import llava_configs
    from .models.random_init import random_llava

    print(f"NOTE: no trained model at {model_dir} (issue 8 has not shipped one yet): this run uses a tiny\n"
          "LLaVA with random weights. Its answers are noise; cache hits, refreshed tokens and TTFT are real.\n")
    target = resolve_device(device)
    model = random_llava(*llava_configs("tiny"), target, torch.bfloat16 if target.type == "cuda" else torch.float32)
    return Runtime.from_model(model, kv_cache_bytes=64 << 20, prefix_cache_entries=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conduit demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="a Hugging Face folder of a quality model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--budget", type=float, default=0.1, help="CONDUIT refresh budget")
    args = parser.parse_args(argv)

    from quality.data import build_pool
    from quality.generator import retagged_request

    runtime = load_runtime(args.model, args.device)
    print(f"model on {runtime.device} ({runtime.dtype}); {runtime.model.config.tokens_per_image} tokens per page\n")
    pool = build_pool(seed=0, split="test", size=64)
    requests = pool.requests(args.requests, min_pages=3, max_pages=6)
    correct = {"full": 0, "conduit": 0}
    for number, request in enumerate(requests, 1):
        earlier = retagged_request(request, salt=number)
        first = runtime.generate(earlier.messages(), max_tokens=8, refresh="conduit", refresh_budget=args.budget,
                                 refresh_options={"fill": "in_context"})
        print(f"request {number}: {request.num_pages} pages")
        print(f"  earlier session   Q: {earlier.question:<28} A: {first.text.strip():<8} "
              f"(expected {earlier.answer}; misses {first.stats.image_misses}, TTFT {first.stats.ttft_s * 1e3:.0f} ms)")
        for label, kwargs in (("full", {}), ("conduit", {"refresh": "conduit", "refresh_budget": args.budget})):
            result = runtime.generate(request.messages(), max_tokens=8, **kwargs)
            answer = result.text.strip()
            correct[label] += answer == request.answer
            s = result.stats
            print(f"  {label:<8} prefill  Q: {request.question:<28} A: {answer:<8} {'ok ' if answer == request.answer else 'BAD'}"
                  f" hits {s.image_hits}/{s.images}, refreshed {s.refreshed_tokens}/{s.visual_tokens} image tokens, "
                  f"prefill FLOPs {s.prefill_flops_ratio:.0%}, TTFT {s.ttft_s * 1e3:.0f} ms")
    print(f"\nexact answers: full prefill {correct['full']}/{len(requests)}, "
          f"CONDUIT at {args.budget:.0%} {correct['conduit']}/{len(requests)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
