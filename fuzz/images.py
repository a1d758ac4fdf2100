#!/usr/bin/env python3
"""Fuzzes the image decoding path: encoded bytes -> RGB pixels -> the models' prepared input.

Pillow's Python format plugins are instrumented with the package, so that coverage guides the
mutations through their parsers. The input is one encoded image (any format Pillow opens: PNG, JPEG, GIF, BMP, WebP, TIFF, ...).
Its last byte picks how it reaches the decoder, as a request can send it: encoded bytes, a file
path, or a ``PIL.Image`` opened lazily by the caller. Each input goes through the request path's
steps (``request.py``): ``preprocess.to_rgb_array`` (decode, transparency onto white, RGB),
``preprocess.image_key`` (the cache identity), then ``prepare_image`` and the pixel values of both
committed models: LLaVA's fixed crop and Qwen2-VL's dynamic resolution (``fuzz/corpus/gguf``).

Property: RGB pixels ``[H, W, 3]`` uint8 with at least one pixel, finite pixel values of the
shape each model's preprocessing promises, or a ``RequestError`` (``ImageTooLargeError`` for a
decompression bomb). Anything else is a finding.

    python fuzz/images.py /tmp/image-corpus fuzz/corpus/images -runs=200000
"""
from __future__ import annotations

import io
import logging
import warnings

import common
import numpy as np
import torch

from PIL import Image

Image.init()  # every format plugin, imported (and instrumented below) now
from conduit_rt import preprocess  # noqa: E402
from conduit_rt.errors import RequestError  # noqa: E402
from conduit_rt.models import load_model  # noqa: E402
from conduit_rt.preprocess import image_key, to_rgb_array  # noqa: E402

common.instrument_packages("conduit_rt", "PIL")

REFERENCE = common.CORPUS / "gguf"
# The pixel limits (ours and PIL's bomb guard) at 1 Mpixel: the guards' logic is the same at any
# limit, and an image just under the stock one takes tens of seconds to decode and preprocess.
Image.MAX_IMAGE_PIXELS = preprocess.MAX_IMAGE_PIXELS = 1 << 20
logging.disable(logging.WARNING)
warnings.simplefilter("ignore")  # PIL warns on every odd TIFF tag and near-bomb: noise at this rate
torch.set_num_threads(1)
MODELS = [load_model(REFERENCE / f"{family}-model.gguf", REFERENCE / f"{family}-mmproj.gguf") for family in ("llava", "qwen25")]
INPUT = common.scratch_dir("images") / "input.img"


def payload_for(data: bytes) -> object | None:
    """The image as a request would send it; None when the caller could not even open it."""
    route = data[-1] % 3 if data else 0
    if route == 0:
        return data
    if route == 1:
        INPUT.write_bytes(data)
        return str(INPUT)
    try:
        return Image.open(io.BytesIO(data))  # lazily opened, as a caller hands it over
    except Exception:  # noqa: BLE001 - the caller's own open failed: not the runtime's input
        return None


def check_prepared(rgb: np.ndarray) -> None:
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.size > 0, (rgb.shape, rgb.dtype)
    for model in MODELS:
        image_key(rgb, model.assets.preprocess.as_dict(), model.assets.vision_model_id)
        prepared = model.prepare_image(rgb)
        pixels = prepared.pixel_values
        assert prepared.n_tokens > 0, prepared.n_tokens
        assert torch.isfinite(pixels).all(), "non-finite pixel values"
        if prepared.grid_thw is None:  # LLaVA: one fixed crop
            side = model.config.image_size
            assert tuple(pixels.shape) == (3, side, side), pixels.shape
        else:  # Qwen2-VL: t * h * w patches of 3 * 2 * p * p values
            t, h, w = prepared.grid_thw
            patch = model.assets.preprocess.patch_size
            assert tuple(pixels.shape) == (t * h * w, 3 * 2 * patch * patch), pixels.shape


def test_one_input(data: bytes) -> None:
    payload = payload_for(data)
    if payload is None:
        return
    try:
        rgb = to_rgb_array(payload)
    except RequestError:
        return
    try:
        check_prepared(rgb)
    except RequestError:
        return  # e.g. an aspect ratio the Qwen processor refuses


if __name__ == "__main__":
    common.run(test_one_input)
