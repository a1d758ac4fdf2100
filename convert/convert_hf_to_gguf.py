#!/usr/bin/env python3
"""Convert a Hugging Face vision-language checkpoint to GGUF: ``DIR/model.gguf`` + ``DIR/mmproj.gguf``.

    python convert/convert_hf_to_gguf.py SRC --outdir DIR [--dtype f32|f16|bf16|q8_0]

The same as ``conduit convert``; the converter itself is the installed package ``conduit_rt.convert``.
"""
import sys

from conduit_rt.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
