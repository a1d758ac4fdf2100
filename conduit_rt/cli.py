"""The ``conduit`` command: convert checkpoints, chat with a model, run the demo, show the build."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .errors import ConduitError


def _cmd_convert(args: argparse.Namespace, rest: list[str]) -> int:
    from conduit_rt.convert.cli import main as convert_main

    return convert_main(rest)


def _cmd_run(args: argparse.Namespace, rest: list[str]) -> int:
    from .runtime import Runtime

    runtime = Runtime(args.model, mmproj=args.mmproj, device=args.device, kv_cache_bytes=args.kv_cache_bytes)
    content: list[dict] = [{"type": "image", "image": path} for path in args.image]
    content.append({"type": "text", "text": args.prompt})
    stream = runtime.stream([{"role": "user", "content": content}], max_tokens=args.max_tokens,
                            temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    s = stream.result.stats
    print(f"[{s.prompt_tokens} prompt tokens, {s.decode_tokens} generated, TTFT {s.ttft_s * 1000:.0f} ms, "
          f"{s.decode_tokens_per_s:.1f} tok/s, KV {s.kv_bytes / 2**20:.1f} MiB]", file=sys.stderr)
    return 0


def _cmd_info(args: argparse.Namespace, rest: list[str]) -> int:
    from . import native

    print(json.dumps({"version": native.version(), "library": str(native.find_library()),
                      "backends": native.backends()}, indent=2))
    return 0


def _cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from .demo import main as demo_main

    return demo_main(rest)


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from .bench.cli import main as bench_main

    return bench_main(rest)


def _cmd_eval(args: argparse.Namespace, rest: list[str]) -> int:
    from .evaluation.cli import main as eval_main

    return eval_main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit", description="conduit-rt: a runtime for vision-language models "
                                     "that see the same images again and again")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF (model.gguf + mmproj.gguf)",
                   add_help=False).set_defaults(func=_cmd_convert)

    run = sub.add_parser("run", help="answer a prompt about images, streaming the text")
    run.add_argument("--model", required=True, help="path of model.gguf")
    run.add_argument("--mmproj", default=None, help="path of mmproj.gguf (default: beside the model)")
    run.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    run.add_argument("-p", "--prompt", required=True, help="the question")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--device", default="auto")
    run.add_argument("--kv-cache-bytes", type=int, default=None)
    run.set_defaults(func=_cmd_run)

    sub.add_parser("demo", help="the bundled demo: ask about images, again under a changed prefix",
                   add_help=False).set_defaults(func=_cmd_demo)
    sub.add_parser("bench", help="the benchmark suite: kernels and end-to-end runs vs torch SDPA and transformers",
                   add_help=False).set_defaults(func=_cmd_bench)
    sub.add_parser("eval", help="the quality table: refresh and compression policies on replayed document-QA sessions",
                   add_help=False).set_defaults(func=_cmd_eval)
    sub.add_parser("info", help="the native library's version and backends").set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("convert", "demo", "bench", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args, rest)
    except ConduitError as error:
        print(f"conduit: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
