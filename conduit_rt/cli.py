"""The ``conduit`` command: convert checkpoints, chat with a model, run the demo, show the build.

Also what every subcommand shares: ``reports_errors`` turns an expected error (a ``ConduitError``)
into the single line ``conduit: error: ...`` on stderr and a non-zero exit status, and the argparse
types below check option values before anything slow starts. Argparse's own usage errors keep its
format and exit status 2.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import ConduitError, RequestError

ERROR_STATUS = 1  # an expected error: bad input, a missing file, device or extra, an unwritable folder
INTERRUPTED_STATUS = 130  # Ctrl-C, as a shell reports SIGINT

Main = Callable[[list[str] | None], int]


def error_line(error: BaseException) -> str:
    """``conduit: error: MESSAGE``, a multi-line message joined onto one line."""
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"conduit: error: {message or type(error).__name__}"


def reports_errors(main: Main) -> Main:
    """Wraps a command's ``main(argv) -> status``: a ConduitError, or an OSError (a file or folder that
    cannot be read or written), prints ``error_line`` to stderr and returns 1; Ctrl-C prints
    ``conduit: interrupted`` and returns 130. Other exceptions are bugs and keep their traceback."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except (ConduitError, OSError) as error:
            print(error_line(error), file=sys.stderr)
            return ERROR_STATUS
        except KeyboardInterrupt:
            print("conduit: interrupted", file=sys.stderr)
            return INTERRUPTED_STATUS

    return wrapped


# -- argparse types: a bad value is a usage error naming the option -------------------------------------
def _number(text: str, kind: type, low: float | None, high: float | None, low_open: bool, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, None, False, "an integer >= 1")


def non_negative_int(text: str) -> int:
    return _number(text, int, 0, None, False, "an integer >= 0")


def non_negative_float(text: str) -> float:
    return _number(text, float, 0.0, None, False, "a number >= 0")


def fraction(text: str) -> float:
    """A number in [0, 1] (a refresh budget, a keep ratio)."""
    return _number(text, float, 0.0, 1.0, False, "a number between 0 and 1")


def open_fraction(text: str) -> float:
    """A number in (0, 1] (top-p)."""
    return _number(text, float, 0.0, 1.0, True, "a number in (0, 1]")


def fractions(text: str) -> list[float]:
    """Comma-separated numbers in [0, 1]; an empty string is an empty list."""
    return [fraction(part.strip()) for part in text.split(",") if part.strip()]


def names_from(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``choices``."""

    def names(text: str) -> list[str]:
        found = [part.strip() for part in text.split(",") if part.strip()]
        unknown = sorted(set(found) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
        return found

    return names


DEVICE_HELP = "auto (CUDA when torch and the native library can use it, else the CPU), cpu, cuda or cuda:N"


# -- subcommands -------------------------------------------------------------------------------------
def _cmd_convert(args: argparse.Namespace, rest: list[str]) -> int:
    from conduit_rt.convert.cli import main as convert_main

    return convert_main(rest)


def _cmd_run(args: argparse.Namespace, rest: list[str]) -> int:
    missing = [path for path in args.image if not Path(path).is_file()]
    if missing:  # before the model loads
        raise RequestError(f"image file not found: {missing[0]}")
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


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from .serve.server import serve

    return serve(args)


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


def version_text() -> str:
    """``conduit-rt X`` and the native library's version, or why it did not load."""
    from . import __version__, native

    try:
        library = f"native library {native.version()} ({native.find_library()})"
    except ConduitError as error:
        library = "native library not loaded: " + error_line(error).removeprefix("conduit: error: ")
    return f"conduit-rt {__version__}\n{library}"


class _VersionAction(argparse.Action):
    """``--version``: prints ``version_text()`` and exits 0 (the library is looked up only here)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def _add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="answer a prompt about images, streaming the text",
                         description="Answer a prompt about images with a converted model, streaming the text; "
                         "a summary line (tokens, TTFT, tokens/s, KV size) goes to stderr.")
    run.add_argument("--model", required=True, help="model.gguf, a folder holding it, or a Hugging Face "
                     "checkpoint folder (converted to GGUF once and cached)")
    run.add_argument("--mmproj", default=None, help="path of mmproj.gguf (default: beside the model)")
    run.add_argument("--image", action="append", default=[], metavar="PATH", help="an image file (repeatable)")
    run.add_argument("-p", "--prompt", required=True, help="the question")
    run.add_argument("--max-tokens", type=non_negative_int, default=256,
                     help="most tokens to generate (default: %(default)s)")
    run.add_argument("--temperature", type=non_negative_float, default=0.0,
                     help="sampling temperature; 0 is greedy (default: %(default)s)")
    run.add_argument("--top-p", type=open_fraction, default=1.0,
                     help="nucleus sampling: keep the smallest set of tokens with this much probability (default: %(default)s)")
    run.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    run.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: %(default)s)")
    run.add_argument("--kv-cache-bytes", type=positive_int, default=None,
                     help="size of the KV arena in bytes (default: 32768 tokens' worth, at most half the free GPU memory)")
    run.set_defaults(func=_cmd_run)


def _add_serve_parser(sub) -> None:
    from . import BUNDLED_MODEL

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat completions, streaming, metrics)",
                           description="Serve a model over an OpenAI-compatible HTTP API: POST /v1/chat/completions "
                           "(streamed or not), GET /v1/models, /health and /metrics. Concurrent requests decode "
                           "together; requests the KV cache cannot hold yet wait in a bounded queue. Needs the serve "
                           "extra: pip install 'conduit-rt[serve]'.")
    serve.add_argument("--model", default=str(BUNDLED_MODEL), help="model.gguf, a folder holding it, or a Hugging Face "
                       "checkpoint folder (default: the bundled quality-task model)")
    serve.add_argument("--mmproj", default=None, help="path of mmproj.gguf (default: beside the model)")
    serve.add_argument("--model-name", default=None, help="the model's id in the API (default: from --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=positive_int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="keep the image-KV store in DIR, so that it outlives the server; at start the "
                       "server loads DIR's most recent entries into memory before it takes requests")
    serve.add_argument("--no-preload", dest="preload", action="store_false",
                       help="with --cache-dir: load entries from DIR only when a request needs them")
    serve.add_argument("--max-batch", type=positive_int, default=16,
                       help="most requests decoding together (default: %(default)s)")
    serve.add_argument("--max-queue", type=non_negative_int, default=64,
                       help="most requests waiting for room; past it a request gets 503 (default: %(default)s)")
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on the /v1 routes")
    serve.add_argument("--allow-local-files", action="store_true",
                       help="let requests name image files on this machine (file:// URLs and paths)")
    serve.add_argument("--device", default="auto", help=DEVICE_HELP + " (default: %(default)s)")
    serve.add_argument("--kv-cache-bytes", type=positive_int, default=None,
                       help="size of the KV arena in bytes (default: 32768 tokens' worth, at most half the free GPU memory)")
    serve.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit", description="conduit-rt: a runtime for vision-language models "
                                     "that see the same images again and again",
                                     epilog="`conduit COMMAND --help` shows a command's options.")
    parser.add_argument("--version", action=_VersionAction, help="print the package's and the native library's "
                        "versions and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # convert, demo, bench and eval parse their own options (their parsers live beside their code)
    sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF (model.gguf + mmproj.gguf)",
                   add_help=False).set_defaults(func=_cmd_convert)
    _add_run_parser(sub)
    sub.add_parser("demo", help="the bundled demo: ask about images, again under a changed prefix",
                   add_help=False).set_defaults(func=_cmd_demo)
    sub.add_parser("bench", help="the benchmark suite: kernels and end-to-end runs vs torch SDPA and transformers",
                   add_help=False).set_defaults(func=_cmd_bench)
    sub.add_parser("eval", help="the quality table: refresh and compression policies on replayed document-QA sessions",
                   add_help=False).set_defaults(func=_cmd_eval)
    _add_serve_parser(sub)
    sub.add_parser("info", help="the native library's version, path and backends",
                   description="Print the native library's version, path and backends as JSON.").set_defaults(func=_cmd_info)
    return parser


@reports_errors
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("convert", "demo", "bench", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args, rest)


if __name__ == "__main__":
    raise SystemExit(main())
