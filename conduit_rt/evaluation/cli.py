"""``conduit eval`` / ``python -m conduit_rt.evaluation``: the policy quality table.

Replays document-QA sessions of the tagged-pages task (``evaluation/task/``) on a Runtime and measures every
refresh policy x budget, every compression policy x keep ratio and CONDUIT + VL-Cache together
against a cold full prefill (see ``replay`` and ``metrics``); with ``--kv-dtype fp8`` also that full
prefill on an fp8 KV cache. Writes ``OUT/results.json`` (every
number), ``OUT/table.md``, ``OUT/plot.png`` and ``OUT/quality.md`` (the docs page).
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import sys
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import BUNDLED_MODEL
from .task.families import FAMILIES
from ..cli import (DEVICE_HELP, fractions, names_from, non_negative_float, non_negative_int, positive_int,
                   reports_errors)
from ..errors import ModelFormatError
from ..extras import pyplot
from . import report, statistics
from .comparisons import kv_comparison, outcomes, paired_comparisons
from .replay import REFERENCE_KEY, TOGETHER_POLICIES, build_settings
from .shards import replay_all

logger = logging.getLogger("conduit_rt.evaluation")

DEFAULT_MODEL = BUNDLED_MODEL
FAMILY_NAMES = tuple(FAMILIES)
REFRESH_POLICIES, COMPRESS_POLICIES = report.REFRESH_ORDER, report.COMPRESS_ORDER  # every registered policy
GAP_POINTS = 5.0  # `none` must lose at least this many points against full prefill for the task to tell policies apart


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit eval", description="refresh and compression policies side by "
                                     "side on replayed document-QA sessions: accuracy, fidelity, cost; a progress "
                                     "bar over the requests goes to stderr")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="the task model: a Hugging Face folder (converted on the fly), a folder holding "
                             "model.gguf + mmproj.gguf, or a model.gguf (default: the bundled quality model)")
    parser.add_argument("--out", type=Path, default=Path("eval-out"), help="output folder (default: %(default)s)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights and KV (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--n", type=positive_int, default=None, help="test requests (default: 24 on CPU, 500 on CUDA)")
    parser.add_argument("--start", type=non_negative_int, default=0,
                        help="index of the first test request (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the task seed (the model was trained with it)")
    parser.add_argument("--pool-pages", type=positive_int, default=4000, help="test pages to draw from (task.train's "
                        "--eval-pages: the same seed and size give the same test requests as its metrics)")
    parser.add_argument("--min-pages", type=positive_int, default=1, help="fewest pages in a request (default: %(default)s)")
    parser.add_argument("--max-pages", type=positive_int, default=8, help="most pages in a request (default: %(default)s)")
    parser.add_argument("--families", type=names_from(FAMILY_NAMES), default=["lookup", "fields"], metavar="F,F,...",
                        help="task families, comma-separated, from " + ", ".join(FAMILY_NAMES) +
                             " (request i is of family i mod their count; default: %(default)s)")
    parser.add_argument("--seen", choices=("sessions", "retagged", "isolated"), default="sessions",
                        help="where the pages were seen before (see conduit_rt/evaluation/sessions.py)")
    parser.add_argument("--refresh-policies", type=names_from(REFRESH_POLICIES), default=list(REFRESH_POLICIES),
                        metavar="P,P,...", help="refresh policies to measure, comma-separated, from "
                        f"{', '.join(REFRESH_POLICIES)} (default: all)")
    parser.add_argument("--budgets", type=fractions, default=[0.0, 0.05, 0.1, 0.2], metavar="R,R,...",
                        help="refresh budgets r in [0, 1], comma-separated (default: 0,0.05,0.1,0.2)")
    parser.add_argument("--compress-policies", type=names_from(COMPRESS_POLICIES), default=list(COMPRESS_POLICIES),
                        metavar="P,P,...", help="compression policies to measure, comma-separated, from "
                        f"{', '.join(COMPRESS_POLICIES)} (default: all)")
    parser.add_argument("--keeps", type=fractions, default=[0.05, 0.1, 0.2, 0.4], metavar="A,A,...",
                        help="compression keep ratios α in [0, 1], comma-separated (default: 0.05,0.1,0.2,0.4)")
    parser.add_argument("--together", type=fractions, default=[0.1, 0.1], metavar="R,A",
                        help="refresh budget,keep ratio of the combined row, whose policies --together-policies names "
                             "(empty: no such row; default: 0.1,0.1)")
    parser.add_argument("--together-policies", type=policy_pair, default=TOGETHER_POLICIES, metavar="REFRESH,COMPRESS",
                        help="the combined row's refresh policy and compression policy (default: "
                             f"{','.join(TOGETHER_POLICIES)})")
    parser.add_argument("--kv-dtype", choices=("fp8",), default=None,
                        help="also answer every request with full prefill on a second Runtime over the same weights "
                             "whose KV cache is this dtype: its accuracy against the dense cache's and the first "
                             "answer token's KL (default: none)")
    parser.add_argument("--max-tokens", type=positive_int, default=8,
                        help="answer tokens (two codes are 6, then EOS; default: %(default)s)")
    parser.add_argument("--time-limit", type=non_negative_float, default=None,
                        help="seconds after which no new session starts (the table covers those replayed)")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="processes replaying requests side by side, each with its own Runtime on the device")
    parser.add_argument("--kv-cache-mib", type=positive_int, default=256, help="KV arena size (default: %(default)s)")
    parser.add_argument("--image-cache-mib", type=positive_int, default=64,
                        help="the image-KV store's share of it (default: %(default)s)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar, warnings only")
    return parser


def policy_pair(text: str) -> tuple[str, str]:
    """An argparse type: "REFRESH,COMPRESS", a refresh policy and a compression policy."""
    names = [part.strip() for part in text.split(",")]
    if len(names) != 2:
        raise argparse.ArgumentTypeError(f"give a refresh policy and a compression policy, got {text!r}")
    refresh, compress = names
    for name, known, kind in ((refresh, REFRESH_POLICIES, "refresh"), (compress, COMPRESS_POLICIES, "compression")):
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown {kind} policy {name!r}; choose from {', '.join(known)}")
    return refresh, compress


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors that involve two options (argparse's format, exit status 2)."""
    if args.min_pages > args.max_pages:
        parser.error(f"--min-pages {args.min_pages} is above --max-pages {args.max_pages}")
    if len(args.together) not in (0, 2):
        parser.error(f"--together takes two numbers (budget,keep) or none, got {len(args.together)}")
    if args.image_cache_mib > args.kv_cache_mib:
        parser.error(f"--image-cache-mib {args.image_cache_mib} is above --kv-cache-mib {args.kv_cache_mib}")


def resolve_model(path: Path, workdir: Path) -> Path:
    """The model.gguf to load; a Hugging Face folder is converted (float32) into ``workdir/gguf``."""
    if path.is_file():
        return path
    if (path / "model.gguf").is_file():
        return path / "model.gguf"
    if (path / "config.json").is_file():
        from conduit_rt.convert.checkpoint import convert_checkpoint

        return convert_checkpoint(path, workdir / "gguf", dtype="f32", progress=False).text_model
    raise ModelFormatError(f"{path} is neither a model.gguf, a folder holding one, nor a Hugging Face folder "
                           "(config.json); train one with `python -m conduit_rt.evaluation.task.train --out DIR` and pass DIR/model")


def collect(args: argparse.Namespace, settings, scores, seconds: float, device: torch.device, dtype: torch.dtype,
            model_path: Path, argv: list[str]) -> dict:
    """The results dict (results.json): configuration, one row per setting (with its confidence intervals),
    the checks, how the intervals were made, the paired comparisons and, with ``--kv-dtype``, the full prefill
    on that KV cache against the dense one (``comparisons``)."""
    reference = scores[REFERENCE_KEY]
    full_accuracy = reference.accuracy
    rows = []
    for setting in settings:
        row = {"key": setting.key, "kind": setting.kind, "refresh": setting.refresh, "budget": setting.budget,
               "compress": setting.compress, "keep": setting.keep}
        row.update(scores[setting.key].summary(reference))
        rows.append(row)
    none = scores.get("refresh:none@0")
    gap = 100 * (full_accuracy - none.accuracy) if none is not None and none.n else None
    gap_difference = statistics.paired_difference(reference.correct, none.correct) if gap is not None else None
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    config.update(model_name=args.model.name, model_gguf=str(model_path), device=str(device),
                  dtype=str(dtype).replace("torch.", ""),
                  command="conduit eval " + " ".join(shlex.quote(a) for a in argv))
    return {
        "config": config,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "device_name": torch.cuda.get_device_name(device)
                        if device.type == "cuda" else platform.processor() or "cpu"},
        "n_requests": reference.n,
        "seconds": seconds,
        "checks": {"full_accuracy": full_accuracy, "none_gap_points": gap,
                   "none_gap_points_ci": [100 * gap_difference.low, 100 * gap_difference.high]
                   if gap_difference is not None else None,
                   "tells_policies_apart": gap is not None and gap >= GAP_POINTS},
        "rows": rows,
        "statistics": {"confidence": statistics.CONFIDENCE, "resamples": statistics.RESAMPLES,
                       "seed": statistics.SEED, "accuracy_ci": "Wilson score interval",
                       "pct_of_full_ci": "percentile bootstrap over requests, paired with the full prefill",
                       "comparisons_ci": "percentile bootstrap over requests of the paired difference"},
        "comparisons": paired_comparisons(settings, scores),
        "kv_cache": kv_comparison(settings, scores),  # None without --kv-dtype
        # per request, in replay order: its family and page count, and each setting's exact match
        "requests": {"families": reference.families, "pages": reference.pages},
        "outcomes": outcomes({setting.key: scores[setting.key] for setting in settings}),
    }


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from ..runtime import resolve_device

    pyplot(**report.PLOTTING)  # before minutes of replay, not after
    device = resolve_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model, args.out)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = args.n if args.n is not None else (500 if device.type == "cuda" else 24)
    settings = build_settings(args.refresh_policies, args.budgets, args.compress_policies, args.keeps,
                              tuple(args.together) if args.together else None, args.kv_dtype,
                              args.together_policies)
    logger.info("%d settings x %d requests on %s (%s), %d worker(s)", len(settings), n, device, dtype, args.workers)
    indices = list(range(args.start, args.start + n))
    scores, seconds = replay_all(args, model_path, settings, indices, device, dtype, progress=not args.quiet)
    results = collect(args, settings, scores, seconds, device, dtype, model_path, argv)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report.write_report(results, args.out)
    return results


@reports_errors
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_options(parser, args)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)
    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        results = run(args, argv)
    print(report.tables_markdown(results).split("### Every setting")[0].rstrip())
    print("\n".join(report.headline(results)))
    print(f"wrote {args.out / 'results.json'}, table.md, plot.png, quality.md")
    return 0
