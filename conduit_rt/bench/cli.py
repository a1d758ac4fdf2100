"""``conduit bench`` / ``python3 -m conduit_rt.bench``: measure, compare, write the report.

Order: ceilings (copy bandwidth, matmul rate), kernels, scoring and top-k, end to end. A section
that raises is recorded in the JSON (``errors``) and its rows are reported as not measured; the
other sections still run. The exit status is 0 whether targets pass or not (this is a measurement,
not a test); it is 2 when a section could not run.
"""
from __future__ import annotations

import argparse
import logging
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from . import ceilings, e2e, kernels, report, scoring
from .config import BenchConfig, make_config
from .targets import Target, with_missing
from .timing import Timer

logger = logging.getLogger("conduit_rt.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit bench", description="conduit-rt's benchmark suite (issue 7): "
                                     "kernels and end-to-end runs against torch SDPA and transformers")
    parser.add_argument("--out", type=Path, default=Path("bench-out"),
                        help="folder for benchmarks.json, benchmarks.md and benchmarks/*.png (default: bench-out)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cuda[:N] or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds, not the issue's")
    parser.add_argument("--skip", action="append", default=[], choices=["kernels", "scoring", "e2e"],
                        help="leave a section out (repeatable)")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    return parser


def environment(config: BenchConfig) -> dict:
    from conduit_rt import native

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device_name": torch.cuda.get_device_name(config.device) if config.device.type == "cuda"
           else platform.processor() or "cpu"}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    env["conduit"], env["library"], env["backends"] = native.version(), str(native.find_library()), native.backends()
    return env


def _cuda_backend() -> bool:
    from conduit_rt import native

    return native.backends()["cuda"]["available"]


def _section(name: str, errors: dict[str, str], fn: Callable[[], object]):
    """Runs one section; on an exception records it and returns None."""
    logger.info("section: %s", name)
    try:
        return fn()
    except Exception as exc:  # a failed section must not lose the others' results
        logger.error("section %s failed:\n%s", name, traceback.format_exc())
        errors[name] = f"{type(exc).__name__}: {exc}"[:300]
        return None
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run(config: BenchConfig, skip: list[str], command: str) -> tuple[dict, list[Target]]:
    """Every section; returns the result dict (what the JSON holds) and the target rows."""
    start = time.perf_counter()
    torch.manual_seed(0)
    timer = Timer(config.device, config.warmup, config.repeat)
    result: dict = {"command": command, "environment": environment(config), "config": config.as_dict(),
                    "kernels": {}, "e2e": {}, "memory": {}, "errors": {}, "skipped": list(skip)}
    errors, rows = result["errors"], []
    result["ceilings"] = ceilings.measure(timer, config.ceiling_copy_bytes, config.ceiling_matmul_n, config.dtype)
    copy_bw = result["ceilings"]["copy"]["bytes_per_s"]
    if "kernels" not in skip:
        found = _section("kernels", errors, lambda: kernels.run(timer, config.kernels, config.dtype, copy_bw))
        if found:
            result["kernels"].update(found[0])
            rows += found[1]
            errors.update(found[2])
    if "scoring" not in skip:
        found = _section("scoring", errors, lambda: scoring.run(timer, config.kernels, config.dtype))
        if found:
            result["kernels"].update(found[0])
            rows += found[1]
            errors.update(found[2])
    if "e2e" not in skip:
        n_keys = config.kernels.n_text_before + config.kernels.n_visual + config.kernels.n_text_queries
        found = _section("e2e", errors, lambda: e2e.run(config.e2e, timer, config.dtype, copy_bw, n_keys))
        if found:
            result["e2e"], e2e_rows, result["memory"], stage_errors = found
            rows += e2e_rows
            errors.update(stage_errors)
    if "scoring" in result["kernels"] and "scoring_prefill" in result["e2e"]:
        prefill = result["e2e"]["scoring_prefill"]
        rows.append(scoring.scoring_row(result["kernels"], prefill["seconds"], prefill["tokens"]))
    rows = with_missing(rows, errors)
    result["targets"] = [r.as_dict() for r in rows]
    result["summary"] = {"passed": sum(r.passed for r in rows), "total": len(rows)}
    result["wall_s"] = time.perf_counter() - start
    return result, rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # no-op under `conduit`
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)  # progress of this long run
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("conduit bench: torch sees no CUDA device (run with --device cpu)", file=sys.stderr)
        return 2
    config = make_config(args.device, args.quick)
    if config.device.type == "cuda" and not _cuda_backend():
        print("conduit bench: the native library has no usable CUDA backend; set CONDUIT_LIB to the "
              "libconduit.so of a CUDA build (or run with --device cpu)", file=sys.stderr)
        return 2
    command = "python3 -m conduit_rt.bench " + " ".join(shlex.quote(a) for a in argv)
    result, rows = run(config, args.skip, command.strip())
    written = report.write(args.out, result, rows)
    print(report.table(rows))
    print("wrote " + ", ".join(str(p) for p in written))
    for section, error in result["errors"].items():
        print(f"section {section} failed: {error}", file=sys.stderr)
    return 2 if result["errors"] else 0
