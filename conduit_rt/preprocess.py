"""Images: load, preprocess for the vision tower, and identify.

Loading decodes a path, bytes or a PIL image to upright RGB pixels within the limits of
``MAX_IMAGE_PIXELS`` (checked before the pixels are decoded) and refuses animated images. The file
is longer than most (~500 lines) because the limits, the decoding and the two preprocessing
families that must respect them are one path from bytes to tower input, read and tested together.

Preprocessing reproduces Hugging Face's PIL-backend CLIP/LLaVA image processor
(``CLIPImageProcessorPil`` / ``LlavaImageProcessorPil`` in transformers 5, the slow
``CLIPImageProcessor`` of transformers 4): alpha composited onto white, optional pad to square
with the mean colour, shortest-edge resize through ``PIL.Image.resize`` (bicubic), center crop,
rescale in float64 then float32, normalize in float32. The output is bit-identical to it.
transformers 5 picks its torchvision backend instead when torchvision is installed; that one
resizes with torch's antialiased bicubic and differs from PIL by up to a few 1e-2.

Identity (docs/methods.md §1 step 1): ``image_key`` is sha256 over the decoded RGB pixels and their
size, the canonical JSON of the preprocessing parameters and the vision-model id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from conduit_rt.errors import ImageTooLargeError, InvalidImageError, ModelFormatError

logger = logging.getLogger(__name__)

ImageInput = str | os.PathLike | bytes | Image.Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_KEY_DOMAIN = b"conduit-rt image key v1\0"


MAX_IMAGE_PIXELS = 8192 * 8192
"""The most pixels conduit-rt decodes in one image, and lets preprocessing make from one (the square
padded around it, its resized copy): 64 megapixels, 192 MiB as RGB. A larger image is refused with
ImageTooLargeError before its pixels are decoded (the size comes from the file's header, or from a
PIL image's ``size``): the guard against decompression bombs, small files that decode to gigabytes.
Vision towers see a few megapixels at most (LLaVA-1.5: 336 x 336; Qwen2-VL: its ``max_pixels``), so
the limit takes nothing from what a model can see."""

# A JPEG holding extra pictures after the photo (a camera's previews, a depth map): the first is the photo.
FIRST_FRAME_FORMATS = ("MPO",)
_EXIF_ORIENTATION = 0x0112
# what PIL raises for malformed EXIF data (then the image is used as stored, as viewers do)
_EXIF_ERRORS = (SyntaxError, ValueError, TypeError, KeyError, IndexError, OSError, struct.error)
# what PIL's format plugins raise for malformed files, as they open, count frames, decode or convert
# (a truncated GIF's frame count: IndexError; "not a TIFF file": SyntaxError)
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, TypeError, KeyError, IndexError, struct.error)


def load_image(image: ImageInput, name: str | None = None) -> Image.Image:
    """Decode a path, encoded bytes or a PIL image into a loaded, upright PIL image (mode unchanged).

    Before the pixels are decoded, the image's size and frames are checked (``check_decodable``).
    EXIF orientation is applied, as transformers' ``load_image`` does and as a viewer shows a photo.
    Raises ``InvalidImageError`` when the input cannot be read or decoded, ``ImageTooLargeError``
    past ``MAX_IMAGE_PIXELS``; ``name`` says in them what the bytes are (the path they were read from).
    """
    if isinstance(image, Image.Image):
        name = name or f"<PIL.Image {image.mode} {image.width}x{image.height}>"
        source: Any = None
    elif isinstance(image, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(image))
        name = name or f"<{len(image)} bytes>"
    elif isinstance(image, (str, os.PathLike)):
        source = name = os.fspath(image)
    else:
        raise InvalidImageError(f"an image must be a path, bytes or a PIL.Image, not {type(image).__name__}")
    try:
        if source is None:
            check_decodable(image, name)
            image.load()  # a lazily opened image decodes here
            return _upright(image)
        with Image.open(source) as opened:
            check_decodable(opened, name)
            opened.load()  # decode now, so the file can close and errors surface here
        return _upright(opened)
    except InvalidImageError:  # the checks' own errors (a ValueError, like PIL's)
        raise
    except FileNotFoundError as error:
        raise InvalidImageError(f"image file not found: {name}") from error
    except Image.DecompressionBombError as error:
        raise ImageTooLargeError(f"image {name} has more pixels than PIL decodes safely ({str(error).rstrip('.')}); "
                                 "downscale it first") from error
    except UnidentifiedImageError as error:
        raise InvalidImageError(f"cannot decode image {name}: not an image format PIL reads "
                                "(PNG, JPEG, GIF, WebP, BMP, TIFF, ...)") from error
    except _DECODE_ERRORS as error:
        raise InvalidImageError(f"cannot decode image {name}: {type(error).__name__}: {error}") from error


def check_decodable(image: Image.Image, name: str) -> None:
    """Refuses, before its pixels are decoded, an image over ``MAX_IMAGE_PIXELS``
    (ImageTooLargeError) or one of several frames (InvalidImageError), except a JPEG whose extra
    frames are previews (``FIRST_FRAME_FORMATS``: its first frame is the photo).

    An animated image is refused rather than cut to its first frame: OpenAI's chat API takes
    non-animated GIFs only, and a request about an animation answered from one still would be
    silently wrong. The caller sends the frame it means."""
    check_pixel_count(image.width, image.height, name)
    frames = getattr(image, "n_frames", 1)
    if frames > 1 and image.format not in FIRST_FRAME_FORMATS:
        raise InvalidImageError(f"image {name} has {frames} frames ({image.format or 'an animation'}); send one "
                                "frame as its own image (for a PIL image: image.seek(i); image.convert('RGB'))")


def check_pixel_count(width: int, height: int, name: str) -> None:
    """ImageTooLargeError when an image of ``width`` x ``height`` exceeds ``MAX_IMAGE_PIXELS``."""
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageTooLargeError(f"image {name} is {width}x{height} = {width * height} pixels, more than the "
                                 f"{MAX_IMAGE_PIXELS} conduit-rt decodes (preprocess.MAX_IMAGE_PIXELS); "
                                 "downscale or crop it first")


def _upright(image: Image.Image) -> Image.Image:
    """``image`` turned as its EXIF orientation says (a copy), or itself when there is nothing to turn."""
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    except _EXIF_ERRORS:
        return image
    if orientation not in range(2, 9):
        return image
    return ImageOps.exif_transpose(image)


def encoded_bytes(image: ImageInput | np.ndarray) -> bytes | None:
    """The encoded file of a path or bytes payload (a file is read once, here, whole: its digest is
    the decoded-image cache's key), or None for a PIL image or a pixel array. Raises
    ``InvalidImageError`` when the file cannot be read."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError as error:
            raise InvalidImageError(f"image file not found: {path}") from error
        except OSError as error:
            raise InvalidImageError(f"cannot read image {path}: {error}") from error
    return None


def to_rgb_array(image: ImageInput | np.ndarray, name: str | None = None) -> np.ndarray:
    """The image's RGB pixels, shape: [height, width, 3], dtype: uint8.

    Transparency (an alpha band or a palette transparency entry) is composited onto white, as
    Hugging Face's ``convert_to_rgb`` does. 16-bit grayscale (PIL modes "I;16*") keeps each value's
    high byte, as PIL itself reads 16-bit RGB PNGs (and torchvision's ``to_dtype(uint8, scale=True)``
    converts): ``convert`` would clip every value above 255 to white. Every other mode goes through
    ``convert("RGB")`` (CMYK, palette, 1-bit, 32-bit "I" and "F", which clip to [0, 255]).
    An array must already be [height, width, 3] uint8. An image without pixels is an
    InvalidImageError; ``name`` names encoded bytes in errors (see ``load_image``).
    """
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or image.size == 0:
            raise InvalidImageError(
                f"a pixel array must be [height, width, 3] uint8 with at least one pixel, got {image.shape} "
                f"{image.dtype}"
            )
        check_pixel_count(image.shape[1], image.shape[0], name or "<pixel array>")
        return np.ascontiguousarray(image)
    pil = load_image(image, name)
    if pil.width == 0 or pil.height == 0:
        raise InvalidImageError(f"an image must have at least one pixel, got {pil.width} x {pil.height}")
    try:
        return np.asarray(_to_rgb(pil), dtype=np.uint8)
    except _DECODE_ERRORS as error:  # a malformed file can fail as it converts
        raise InvalidImageError(f"cannot decode image {name or '<PIL.Image>'}: {error}") from error


def _to_rgb(pil: Image.Image) -> Image.Image:
    """``pil`` in mode RGB (see ``to_rgb_array``)."""
    if pil.mode.startswith("I;16"):
        pil = _high_bytes(pil)
    if "A" in pil.getbands() or pil.info.get("transparency") is not None:
        rgba = pil.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        pil = Image.alpha_composite(white, rgba)
    if pil.mode != "RGB":  # convert copies even within a mode: only when it changes something
        pil = pil.convert("RGB")
    return pil


def _high_bytes(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image ("I;16", "I;16B", ...) as 8 bits ("L"): each value's high byte. Its
    transparent value, if any, becomes an alpha band ("LA"), found on the 16-bit values."""
    values = np.asarray(image)  # uint16 [H, W], in the mode's byte order
    gray = Image.fromarray((values >> 8).astype(np.uint8), "L")
    transparent = image.info.get("transparency")
    if not isinstance(transparent, int):
        return gray
    alpha = Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8), "L")
    return Image.merge("LA", (gray, alpha))


@dataclass(frozen=True, slots=True)
class ClipPreprocessParams:
    """Preprocessing of CLIP-style vision towers (LLaVA-1.5): one fixed-size crop per image.

    ``resize_to`` is ``("shortest_edge", n)`` or ``("exact", height, width)``; ``resample`` is a
    PIL filter code (3 = bicubic).
    """

    resize_to: tuple
    crop_height: int
    crop_width: int
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC.value
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_pad_to_square: bool = False
    kind: str = "clip"

    def __post_init__(self) -> None:
        if self.resize_to[0] not in ("shortest_edge", "exact") or min(self.resize_to[1:]) < 1:
            raise ModelFormatError(f"unsupported image resize target {self.resize_to!r}")
        if min(self.crop_height, self.crop_width) < 1:
            raise ModelFormatError(
                f"image crop size must be positive, got {self.crop_height}x{self.crop_width}"
            )

    @classmethod
    def from_hf_config(cls, config: dict) -> ClipPreprocessParams:
        """From a Hugging Face ``preprocessor_config.json`` (CLIPImageProcessor or LlavaImageProcessor)."""
        size = config.get("size", {"shortest_edge": 224})
        if isinstance(size, int):  # old configs: an int means the shortest edge (default_to_square=False)
            size = {"shortest_edge": size}
        if "shortest_edge" in size:
            resize_to: tuple = ("shortest_edge", int(size["shortest_edge"]))
        elif "height" in size and "width" in size:
            resize_to = ("exact", int(size["height"]), int(size["width"]))
        else:
            raise ModelFormatError(f"preprocessor_config.json: unsupported size {size!r}")
        crop = config.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            resize_to=resize_to,
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            image_mean=tuple(float(x) for x in config.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(x) for x in config.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            resample=int(config.get("resample", Image.Resampling.BICUBIC.value)),
            do_resize=bool(config.get("do_resize", True)),
            do_center_crop=bool(config.get("do_center_crop", True)),
            do_rescale=bool(config.get("do_rescale", True)),
            do_normalize=bool(config.get("do_normalize", True)),
            do_pad_to_square=bool(config.get("do_pad", False)),
        )

    def as_dict(self) -> dict:
        """Plain JSON-able dict of every field (what ``image_key`` hashes)."""
        return dataclasses.asdict(self)

    def preprocess(self, image: ImageInput | np.ndarray) -> np.ndarray:
        """Pixel values for the vision tower, shape: [3, crop_height, crop_width], dtype: float32."""
        return preprocess_clip(to_rgb_array(image), self)

    def check_size(self, height: int, width: int) -> None:
        """ImageTooLargeError when preprocessing an image of this size would make one of more than
        ``MAX_IMAGE_PIXELS`` pixels: the square padded around a long image, or the resized copy of a
        thin one (its short side goes to the target size, its long side in proportion)."""
        if self.do_pad_to_square:
            height = width = max(height, width)
            check_pixel_count(width, height, "padded to a square")
        if self.do_resize:
            resized_height, resized_width = _resized_size(height, width, self)
            check_pixel_count(resized_width, resized_height, f"{width}x{height} resized")


def _resized_size(height: int, width: int, params: ClipPreprocessParams) -> tuple[int, int]:
    """(height, width) after the resize; the shortest-edge rule truncates the long side like HF."""
    if params.resize_to[0] == "exact":
        return params.resize_to[1], params.resize_to[2]
    short_target = params.resize_to[1]
    if width <= height:
        return int(short_target * height / width), short_target
    return short_target, int(short_target * width / height)


def _pad_to_square(rgb: np.ndarray, mean: tuple[float, ...]) -> np.ndarray:
    """Center the image on a square of the mean colour (int(m * 255) per channel), as LLaVA does."""
    height, width, _ = rgb.shape
    if height == width:
        return rgb
    side = max(height, width)
    square = np.empty((side, side, 3), dtype=np.uint8)
    square[:] = [int(m * 255) for m in mean]
    top, left = (side - height) // 2, (side - width) // 2
    square[top : top + height, left : left + width] = rgb
    return square


def _center_crop(chw: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """Center crop of a [C, H, W] array; zero-pads first when the image is smaller than the crop."""
    _, height, width = chw.shape
    if height < crop_height or width < crop_width:
        padded = np.zeros((chw.shape[0], max(height, crop_height), max(width, crop_width)), dtype=chw.dtype)
        pad_top = math.ceil((padded.shape[1] - height) / 2)
        pad_left = math.ceil((padded.shape[2] - width) / 2)
        padded[:, pad_top : pad_top + height, pad_left : pad_left + width] = chw
        chw, height, width = padded, padded.shape[1], padded.shape[2]
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    return chw[:, top : top + crop_height, left : left + crop_width]


def preprocess_clip(rgb: np.ndarray, params: ClipPreprocessParams) -> np.ndarray:
    """rgb: [H, W, 3] uint8 -> pixel values [3, crop_height, crop_width] float32."""
    params.check_size(rgb.shape[0], rgb.shape[1])
    if params.do_pad_to_square:
        rgb = _pad_to_square(rgb, params.image_mean)
    if params.do_resize:
        height, width = _resized_size(rgb.shape[0], rgb.shape[1], params)
        resized = Image.fromarray(rgb).resize((width, height), resample=params.resample)
        rgb = np.asarray(resized, dtype=np.uint8)
    pixels = np.ascontiguousarray(rgb.transpose(2, 0, 1))
    if params.do_center_crop:
        pixels = _center_crop(pixels, params.crop_height, params.crop_width)
    return _rescale_and_normalize(pixels, params)


def _rescale_and_normalize(chw: np.ndarray, params: Any) -> np.ndarray:
    """uint8 [C, H, W] -> float32 [C, H, W]: rescale (float64 product, then float32) and normalize in float32."""
    if params.do_rescale:
        # float64 product then float32, the order HF uses (it changes the last bit)
        pixels = (chw.astype(np.float64) * params.rescale_factor).astype(np.float32)
    else:
        pixels = chw.astype(np.float32)
    if params.do_normalize:
        mean = np.asarray(params.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(params.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class QwenVLPreprocessParams:
    """Preprocessing of Qwen2-VL / Qwen2.5-VL: dynamic resolution, flattened patches.

    As Hugging Face's ``Qwen2VLImageProcessorPil``: ``smart_resize`` to multiples of
    ``patch_size * merge_size`` with min_pixels <= H * W <= max_pixels (aspect ratio kept as closely
    as possible), PIL resize, rescale and normalize as CLIP, then patches in merge-block order with
    the frame repeated ``temporal_patch_size`` times.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC.value
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    kind: str = "qwen2vl"

    def __post_init__(self) -> None:
        if min(self.patch_size, self.merge_size, self.temporal_patch_size, self.min_pixels) < 1:
            raise ModelFormatError(f"invalid Qwen2-VL preprocessing parameters: {self}")
        if self.max_pixels < self.min_pixels:
            raise ModelFormatError(f"max_pixels {self.max_pixels} < min_pixels {self.min_pixels}")

    @classmethod
    def from_hf_config(cls, config: dict) -> QwenVLPreprocessParams:
        """From a ``preprocessor_config.json`` of a Qwen2VLImageProcessor; ``min_pixels``/``max_pixels``
        override ``size`` (``shortest_edge``/``longest_edge``), as the processor's constructor does."""
        size = config.get("size") or {}
        defaults = cls()
        return cls(
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or defaults.min_pixels),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or defaults.max_pixels),
            patch_size=int(config.get("patch_size", defaults.patch_size)),
            merge_size=int(config.get("merge_size", defaults.merge_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", defaults.temporal_patch_size)),
            image_mean=tuple(float(x) for x in config.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(x) for x in config.get("image_std", OPENAI_CLIP_STD)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            resample=int(config.get("resample", Image.Resampling.BICUBIC.value)),
            do_resize=bool(config.get("do_resize", True)),
            do_rescale=bool(config.get("do_rescale", True)),
            do_normalize=bool(config.get("do_normalize", True)),
        )

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: patch_size * merge_size (28)."""
        return self.patch_size * self.merge_size

    def as_dict(self) -> dict:
        """Plain JSON-able dict of every field (what ``image_key`` hashes)."""
        return dataclasses.asdict(self)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image is resized to; raises ``InvalidImageError`` for unusable sizes."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise InvalidImageError(f"with do_resize off, image sides must be multiples of {self.factor}, "
                                        f"got {height}x{width}")
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def check_size(self, height: int, width: int) -> None:
        """InvalidImageError for a size Qwen2-VL's resize refuses (the resized image itself is
        bounded by ``max_pixels``)."""
        self.resized_size(height, width)

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of an image of ``height`` x ``width`` pixels (before merging)."""
        resized_height, resized_width = self.resized_size(height, width)
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def preprocess(self, image: ImageInput | np.ndarray) -> np.ndarray:
        """Flattened patches, shape: [t * h * w, 3 * temporal_patch_size * patch_size^2], dtype: float32.

        Rows are patches in merge-block order (each ``merge_size`` x ``merge_size`` block of the
        grid consecutive); a row is (channel, frame, y, x) in C order.
        """
        rgb = to_rgb_array(image)
        height, width = self.resized_size(rgb.shape[0], rgb.shape[1])
        if self.do_resize:
            rgb = np.asarray(Image.fromarray(rgb).resize((width, height), resample=self.resample), dtype=np.uint8)
        pixels = _rescale_and_normalize(np.ascontiguousarray(rgb.transpose(2, 0, 1)), self)
        return self._patchify(pixels)

    def _patchify(self, chw: np.ndarray) -> np.ndarray:
        channels, height, width = chw.shape
        p, m = self.patch_size, self.merge_size
        grid_h, grid_w = height // p, width // p
        blocks = chw.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], self.temporal_patch_size, p, p))
        return np.ascontiguousarray(frames.reshape(grid_h * grid_w, channels * self.temporal_patch_size * p * p))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize target: sides multiples of ``factor``, area within [min_pixels, max_pixels].

    Each side is rounded to the nearest multiple of ``factor``; when the area then falls outside the
    range, both sides are scaled by the same ratio (floored when too large, ceiled when too small).
    Raises ``InvalidImageError`` for an aspect ratio above 200, which the Qwen processor refuses.
    """
    if max(height, width) / min(height, width) > 200:
        raise InvalidImageError(f"image aspect ratio must be at most 200, got {height}x{width}")
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        resized_height = max(factor, math.floor(height / beta / factor) * factor)
        resized_width = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_height * resized_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * beta / factor) * factor
        resized_width = math.ceil(width * beta / factor) * factor
    return resized_height, resized_width


def preprocess_params_from_hf_config(config: dict) -> "ClipPreprocessParams | QwenVLPreprocessParams":
    """Pick the preprocessing for a Hugging Face ``preprocessor_config.json``: CLIP-style fixed crops
    (LLaVA) or Qwen2-VL's dynamic resolution; both offer ``preprocess`` and ``as_dict``."""
    processor_type = config.get("image_processor_type", "CLIPImageProcessor")
    base = processor_type.removesuffix("Pil").removesuffix("Fast")
    if base in ("CLIPImageProcessor", "LlavaImageProcessor"):
        return ClipPreprocessParams.from_hf_config(config)
    if base in ("Qwen2VLImageProcessor", "Qwen2_5_VLImageProcessor"):
        return QwenVLPreprocessParams.from_hf_config(config)
    raise ModelFormatError(f"unsupported image processor {processor_type!r} in preprocessor_config.json")


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no spaces, ASCII only, tuples as lists."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def image_key(pixels: ImageInput | np.ndarray, preprocess_params: dict, vision_model_id: str) -> bytes:
    """The image's cache identity: 32 bytes of sha256.

    Hashes, each length-prefixed: the decoded RGB pixels' shape and bytes ([H, W, 3] uint8, as
    ``to_rgb_array`` gives), the canonical JSON of ``preprocess_params`` and ``vision_model_id``.
    Two encodings of the same pixels (PNG vs BMP) share a key; any changed pixel, size, parameter
    or model gives another.
    """
    rgb = to_rgb_array(pixels)
    digest = hashlib.sha256(_KEY_DOMAIN)
    for part in (
        canonical_json(list(rgb.shape)),
        memoryview(rgb).cast("B"),  # the pixels' bytes without copying them (rgb is C-contiguous)
        canonical_json(preprocess_params),
        vision_model_id.encode("utf-8"),
    ):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()
