"""``conduit bench`` / ``python3 -m conduit_rt.bench``: measure, compare, write the report.

Order: ceilings (copy bandwidth, matmul rate), kernels, scoring and top-k, end to end (LLaVA), the
other families end to end (families: Qwen3-VL and InternVL3 shapes, one model at a time), the
server's scheduler under concurrent clients (serve). A section
that raises is recorded in the JSON (``errors``) and its rows are reported as not measured; the
other sections still run. The exit status is 0 whether targets pass or not (this is a measurement,
not a test); it is 2 when a section could not run, and 1 when the run cannot start (no such device,
a missing extra), which prints one ``conduit: error:`` line.
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
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..cli import DEVICE_HELP, reports_errors
from ..extras import pyplot, require
from . import ceilings, e2e, families, kernels, report, scoring, synthetic
from .config import BenchConfig, make_config
from .targets import Target, with_missing
from .timing import Timer

logger = logging.getLogger("conduit_rt.bench")

SECTIONS = ("kernels", "scoring", "e2e", "families", "serve")  # after the ceilings, which always run
# what a missing serve extra says (checked before the run starts)
SERVE_EXTRA = {"extra": "serve", "command": "conduit bench", "purpose": "for its serve section",
               "otherwise": "leave that section out with --skip serve"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit bench", description="conduit-rt's benchmark suite: kernels and "
                                     "end-to-end runs against torch SDPA and transformers; a progress bar over the "
                                     "sections goes to stderr")
    parser.add_argument("--out", type=Path, default=Path("bench-out"),
                        help="folder for benchmarks.json, benchmarks.md and benchmarks/*.png (default: bench-out)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds, not the full sizes")
    parser.add_argument("--skip", action="append", default=[], choices=SECTIONS,
                        help="leave a section out (repeatable)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar, warnings only")
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


def _serve(config: BenchConfig, timer: Timer, copy_bw: float):
    """The serve section, imported here: it needs the serve extra (checked before the run)."""
    from . import serve

    return serve.run(config.serve, config.e2e, timer, config.dtype, copy_bw)


def run(config: BenchConfig, skip: list[str], command: str, progress: bool = False) -> tuple[dict, list[Target]]:
    """Every section; returns the result dict (what the JSON holds) and the target rows. ``progress``:
    a bar over the sections on stderr."""
    start = time.perf_counter()
    torch.manual_seed(0)
    timer = Timer(config.device, config.warmup, config.repeat)
    result: dict = {"command": command, "environment": environment(config), "config": config.as_dict(),
                    "kernels": {}, "e2e": {}, "families": {}, "serve": {}, "memory": {}, "errors": {},
                    "skipped": list(skip)}
    errors, rows = result["errors"], []
    sections = [name for name in SECTIONS if name not in skip]
    with tqdm(total=1 + len(sections), desc="bench", unit="section", disable=not progress) as bar:
        bar.set_postfix_str("ceilings")
        result["ceilings"] = ceilings.measure(timer, config.ceiling_copy_bytes, config.ceiling_matmul_n, config.dtype)
        bar.update()
        copy_bw = result["ceilings"]["copy"]["bytes_per_s"]
        n_keys = config.kernels.n_text_before + config.kernels.n_visual + config.kernels.n_text_queries
        measure = {"kernels": lambda: kernels.run(timer, config.kernels, config.dtype, copy_bw),
                   "scoring": lambda: scoring.run(timer, config.kernels, config.dtype),
                   "e2e": lambda: e2e.run(config.e2e, timer, config.dtype, copy_bw, n_keys),
                   "families": lambda: families.run(config.families, timer, config.dtype),
                   "serve": lambda: _serve(config, timer, copy_bw)}
        for name in sections:
            bar.set_postfix_str(name)
            found = _section(name, errors, measure[name])
            bar.update()
            if not found:
                continue
            if name in ("e2e", "families"):  # (raw numbers, rows, peak memory per run, stage errors)
                result[name], section_rows, memory, section_errors = found
                result["memory"].update(memory)
            elif name == "serve":  # (raw numbers, rows, stage errors)
                result["serve"], section_rows, section_errors = found
            else:  # (numbers by kernel, rows, errors)
                numbers, section_rows, section_errors = found
                result["kernels"].update(numbers)
            rows += section_rows
            errors.update(section_errors)
    if "scoring" in result["kernels"] and "scoring_prefill" in result["e2e"]:
        prefill = result["e2e"]["scoring_prefill"]
        rows.append(scoring.scoring_row(result["kernels"], prefill["seconds"], prefill["tokens"]))
    rows = with_missing(rows, errors)
    result["targets"] = [r.as_dict() for r in rows]
    result["summary"] = {"passed": sum(r.passed for r in rows), "total": len(rows)}
    result["wall_s"] = time.perf_counter() - start
    return result, rows


@reports_errors
def main(argv: list[str] | None = None) -> int:
    from ..runtime import resolve_device

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # no-op under `conduit`
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)  # progress of this long run
    device = resolve_device(args.device)
    pyplot(**report.PLOTTING)  # the extras, before the run rather than after it
    if "e2e" not in args.skip or "families" not in args.skip:
        require("transformers", **synthetic.TWIN)
    if "serve" not in args.skip:
        require("prometheus_client", **SERVE_EXTRA)
    config = make_config(str(device), args.quick)
    command = "python3 -m conduit_rt.bench " + " ".join(shlex.quote(a) for a in argv)
    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        result, rows = run(config, args.skip, command.strip(), progress=not args.quiet)
    written = report.write(args.out, result, rows)
    print(report.table(rows))
    print("wrote " + ", ".join(str(p) for p in written))
    for section, error in result["errors"].items():
        print(f"section {section} failed: {error}", file=sys.stderr)
    return 2 if result["errors"] else 0
