"""Writes the committed seed corpus of the harnesses into ``fuzz/corpus`` (run from the repository root).

- ``gguf/``: the tiny LLaVA-1.5 and Qwen2.5-VL test checkpoints (``tests/fixtures``) converted by
  ``conduit convert``: LLaVA's text file in F16, the other three in Q8_0, so both decoders run.
- ``images/``: a few pixels in each format and mode Pillow decodes (PNG RGB/RGBA/palette with
  transparency/16-bit/1-bit, JPEG with an EXIF orientation, animated GIF, BMP, WebP, TIFF), plus a
  PNG whose header claims 30000 x 30000 pixels (a decompression bomb).
- ``messages/``: chat messages as JSON, the input format of ``fuzz/messages.py``.

    python fuzz/make_corpus.py [gguf] [images] [messages]
"""
from __future__ import annotations

import io
import json
import shutil
import struct
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
sys.path.insert(0, str(ROOT))


def write_gguf() -> None:
    from conduit_rt.convert.cli import main as convert
    from tests.fixtures.tiny_llava import build_tiny_llava
    from tests.fixtures.tiny_qwen2vl import build_tiny_qwen2vl

    out = CORPUS / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        builds = {"llava": build_tiny_llava, "qwen25": lambda path: build_tiny_qwen2vl(path, version="2.5")}
        for family, build in builds.items():
            source = build(scratch / family)
            for dtype in ("f16", "q8_0"):
                convert([str(source), "--outdir", str(scratch / f"{family}-{dtype}"), "--dtype", dtype, "--quiet"])
        shutil.copy(scratch / "llava-f16" / "model.gguf", out / "llava-model.gguf")
        shutil.copy(scratch / "llava-q8_0" / "mmproj.gguf", out / "llava-mmproj.gguf")
        shutil.copy(scratch / "qwen25-q8_0" / "model.gguf", out / "qwen25-model.gguf")
        shutil.copy(scratch / "qwen25-q8_0" / "mmproj.gguf", out / "qwen25-mmproj.gguf")


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(side: int = 30000) -> bytes:
    """A valid PNG header for a ``side`` x ``side`` RGB image, with one row of data."""
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(b"\0" * (1 + 3 * side))) + _png_chunk(b"IEND", b""))


def write_images() -> None:
    import numpy as np
    from PIL import Image

    out = CORPUS / "images"
    out.mkdir(parents=True, exist_ok=True)
    rgb = Image.fromarray(np.arange(7 * 5 * 3, dtype=np.uint8).reshape(5, 7, 3) * 2)

    def save(name: str, image: Image.Image, **options) -> None:
        buffer = io.BytesIO()
        image.save(buffer, **options)
        (out / name).write_bytes(buffer.getvalue())

    save("rgb.png", rgb, format="PNG")
    save("rgba.png", rgb.convert("RGBA"), format="PNG")
    palette = rgb.convert("P")
    palette.info["transparency"] = 0
    save("palette-transparent.png", palette, format="PNG", transparency=0)
    save("gray16.png", Image.fromarray((np.arange(35, dtype=np.uint16).reshape(5, 7) * 1800)), format="PNG")
    save("bilevel.png", rgb.convert("1"), format="PNG")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    save("oriented.jpg", rgb, format="JPEG", quality=80, exif=exif)
    frames = [rgb, rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    save("animated.gif", frames[0], format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    save("rgb.bmp", rgb, format="BMP")
    save("rgb.webp", rgb, format="WEBP", lossless=True)
    save("cmyk.tiff", rgb.convert("CMYK"), format="TIFF")
    (out / "bomb.png").write_bytes(bomb_png())


MESSAGES = {
    "text.json": [{"role": "user", "content": "Describe the picture in one word."}],
    "image-and-text.json": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "image", "image": "image.png"}, {"type": "text", "text": "What colour?"}]},
    ],
    "turns.json": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "image": "a.png"},
                                     {"type": "image", "image": "b.png"}]},
        {"role": "assistant", "content": "Two images."},
        {"role": "user", "content": [{"type": "text", "text": "<image> and \u00e9\u6f22\u5b57 \U0001f600", "extra": {"x": [1]}}]},
    ],
}


def write_messages() -> None:
    out = CORPUS / "messages"
    out.mkdir(parents=True, exist_ok=True)
    for name, messages in MESSAGES.items():
        (out / name).write_text(json.dumps(messages, ensure_ascii=False))


if __name__ == "__main__":
    writers = {"gguf": write_gguf, "images": write_images, "messages": write_messages}
    for name in sys.argv[1:] or list(writers):
        writers[name]()
