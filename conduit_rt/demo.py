"""`conduit demo`: the bundled model reads rendered pages, then reads them again under a changed prefix.

The model is the small Qwen2-VL-architecture model (M-RoPE) trained on the quality task (``evaluation/task/``),
shipped in the package (``conduit_rt/data/quality_model``, a Hugging Face folder converted to GGUF on
first use and cached): pages of coloured codes, each page named by a tag written before it, questions
like "elk purple?" answered with the code. For each of a few test requests (``--requests``) the demo
  1. shows the pages in an earlier session, under other tags and in another order (cache misses:
     the image KV is computed and stored);
  2. asks the real question with the pages back under their own tags, order and companions, twice:
     with a full prefill, and with CONDUIT restoring the cached image KV and recomputing ``--budget``
     (10%) of its tokens;
and prints each answer beside the expected one, the image-cache hits, the refreshed tokens, the
prefill FLOPs against a full prefill and the time to first token, then how many answers were exact.
Runs on the GPU when there is one, else on the CPU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from . import BUNDLED_MODEL
from .cli import DEVICE_HELP, fraction, positive_int, reports_errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit demo", description=__doc__.splitlines()[0].partition(": ")[2])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL,
                        help="a quality-task model: a Hugging Face folder (converted to GGUF once, cached) or GGUF "
                        "files (default: the bundled model)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: %(default)s)")
    parser.add_argument("--requests", type=positive_int, default=4,
                        help="test requests to ask (default: %(default)s)")
    parser.add_argument("--budget", type=fraction, default=0.1,
                        help="CONDUIT refresh budget: the share of cached image tokens recomputed (default: %(default)s)")
    return parser


def ask(runtime, request, number: int, budget: float) -> dict[str, bool]:
    """Shows ``request``'s pages in an earlier session, then asks it with a full prefill and with
    CONDUIT; prints a line for each and returns whether each of the two answers was exact."""
    from conduit_rt.evaluation.task.generator import retagged_request

    earlier = retagged_request(request, salt=number)
    first = runtime.generate(earlier.messages(), max_tokens=8, refresh="conduit", refresh_budget=budget,
                             refresh_options={"fill": "in_context"})
    print(f"request {number}: {request.num_pages} pages")
    print(f"  earlier session   Q: {earlier.question:<28} A: {first.text.strip():<8} "
          f"(expected {earlier.answer}; misses {first.stats.image_misses}, TTFT {first.stats.ttft_s * 1e3:.0f} ms)")
    exact = {}
    for label, kwargs in (("full", {}), ("conduit", {"refresh": "conduit", "refresh_budget": budget})):
        result = runtime.generate(request.messages(), max_tokens=8, **kwargs)
        answer = result.text.strip()
        exact[label] = answer == request.answer
        s = result.stats
        print(f"  {label:<8} prefill  Q: {request.question:<28} A: {answer:<8} {'ok ' if exact[label] else 'BAD'}"
              f" hits {s.image_hits}/{s.images}, refreshed {s.refreshed_tokens}/{s.visual_tokens} image tokens, "
              f"prefill FLOPs {s.prefill_flops_ratio:.0%}, TTFT {s.ttft_s * 1e3:.0f} ms", flush=True)
    return exact


@reports_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from conduit_rt.evaluation.task.data import build_pool

    from .runtime import Runtime

    runtime = Runtime(args.model, device=args.device, prefix_cache_entries=0)  # a checkpoint folder: converted once
    print(f"model on {runtime.device} ({runtime.dtype})\n", flush=True)
    pool = build_pool(seed=0, split="test", size=64)
    requests = pool.requests(args.requests, min_pages=3, max_pages=6)
    correct = {"full": 0, "conduit": 0}
    for number, request in enumerate(requests, 1):
        for label, exact in ask(runtime, request, number, args.budget).items():
            correct[label] += exact
    print(f"\nexact answers: full prefill {correct['full']}/{len(requests)}, "
          f"CONDUIT at {args.budget:.0%} {correct['conduit']}/{len(requests)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
