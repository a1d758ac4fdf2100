"""``conduit convert`` / ``python -m conduit_rt.convert``: a Hugging Face checkpoint -> ``DIR/model.gguf`` + ``DIR/mmproj.gguf``."""
from __future__ import annotations

import argparse
import logging

from ..cli import reports_errors
from .checkpoint import convert_checkpoint
from .gguf_output import OutputDtype
from .registry import supported_architectures


def build_parser(prog: str = "conduit convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert a Hugging Face vision-language checkpoint into GGUF (llama.cpp conventions): "
        "DIR/model.gguf (text decoder + tokenizer) and DIR/mmproj.gguf (vision tower + projector).",
        epilog="supported architectures:\n" + supported_architectures(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help="a local checkpoint folder or a Hugging Face hub repo id (owner/name)")
    parser.add_argument("--outdir", required=True, metavar="DIR", help="where model.gguf and mmproj.gguf are written")
    parser.add_argument(
        "--dtype", default=OutputDtype.F16.value, choices=[dtype.value for dtype in OutputDtype],
        help="storage of weight matrices (norms and biases stay f32); q8_0 falls back to f16 where rows "
        "are not a multiple of 32 (default: %(default)s)",
    )
    parser.add_argument("--revision", default=None, help="hub branch, tag or commit (hub ids only)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, warnings only")
    return parser


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """Run the converter; returns the exit status (0 ok, 1 conversion refused or failed, 2 bad usage).
    A refusal (a ConduitError, or no such folder nor hub repo) prints one ``conduit: error:`` line."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return int(exc.code or 0)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its per-file INFO lines repeat ours
    files = convert_checkpoint(args.src, args.outdir, dtype=args.dtype, revision=args.revision, progress=not args.quiet)
    print(f"wrote {files.text_model}\nwrote {files.mmproj}")
    return 0
