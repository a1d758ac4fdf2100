"""Image preprocessing and identity against Hugging Face's image processors."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")

from conduit_rt.errors import ModelFormatError, RequestError  # noqa: E402
from conduit_rt.preprocess import (  # noqa: E402
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    image_key,
    load_image,
    preprocess_params_from_hf_config,
    to_rgb_array,
)

CONFIGS = {
    "clip_square": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": 30},
        "crop_size": {"height": 30, "width": 30},
    },
    # shortest edge below the crop: HF zero-pads inside the center crop
    "clip_small_resize": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": 24},
        "crop_size": {"height": 30, "width": 28},
    },
    "clip_exact_size": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"height": 26, "width": 34},
        "crop_size": {"height": 20, "width": 30},
    },
    "llava_pad": {
        "image_processor_type": "LlavaImageProcessor",
        "do_pad": True,
        "size": {"shortest_edge": 30},
        "crop_size": {"height": 30, "width": 30},
    },
}


def _full_config(name: str) -> dict:
    return {
        "do_resize": True,
        "do_center_crop": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        **CONFIGS[name],
    }


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def processors(request, tmp_path_factory):
    """(HF AutoImageProcessor, our params) from the same preprocessor_config.json."""
    folder = tmp_path_factory.mktemp(request.param)
    config = _full_config(request.param)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return transformers.AutoImageProcessor.from_pretrained(folder), preprocess_params_from_hf_config(config)


def _make_image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    rgba = np.random.default_rng(seed).integers(0, 256, size=(height, width, 4), dtype=np.uint8)
    image = Image.fromarray(rgba, "RGBA")
    if mode == "P_transparent":
        image = image.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        return image
    return image if mode == "RGBA" else image.convert(mode)


IMAGES = [
    (37, 53, "RGB"),
    (300, 17, "RGB"),
    (17, 300, "RGB"),
    (1, 1, "RGB"),
    (1, 40, "RGB"),
    (40, 1, "RGB"),
    (2, 3, "RGB"),
    (64, 64, "RGBA"),
    (20, 33, "L"),
    (45, 31, "LA"),
    (31, 45, "P_transparent"),
    (29, 30, "CMYK"),
    (30, 30, "1"),
]


@pytest.mark.parametrize("width,height,mode", IMAGES)
def test_pixel_values_equal_hf_image_processor(processors, width, height, mode):
    hf_processor, params = processors
    image = _make_image(width, height, mode)
    expected = hf_processor(images=image, return_tensors="np")["pixel_values"][0]
    ours = params.preprocess(image)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5)


def test_path_bytes_and_pil_inputs_agree(tmp_path, processors):
    _, params = processors
    image = _make_image(41, 23, "RGB", seed=3)
    path = tmp_path / "image.png"
    image.save(path)
    from_pil = params.preprocess(image)
    np.testing.assert_array_equal(params.preprocess(str(path)), from_pil)
    np.testing.assert_array_equal(params.preprocess(path), from_pil)
    np.testing.assert_array_equal(params.preprocess(path.read_bytes()), from_pil)
    np.testing.assert_array_equal(params.preprocess(to_rgb_array(image)), from_pil)


def test_exif_orientation_is_applied_like_transformers_load_image(processors):
    """A photo is used upright, as transformers' ``load_image`` (ImageOps.exif_transpose) gives it."""
    from PIL import ImageOps

    hf_processor, params = processors
    image = _make_image(40, 20, "RGB", seed=5)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW" orientation
    encoded = io.BytesIO()
    image.save(encoded, format="JPEG", exif=exif)
    loaded = load_image(encoded.getvalue())
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(encoded.getvalue())))
    assert loaded.size == upright.size == (20, 40)
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(upright))
    expected = hf_processor(images=upright, return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(params.preprocess(encoded.getvalue()), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "bad,fragment",
    [
        (b"not an image", "cannot decode"),
        ("/no/such/file.png", "not found"),
        (3.5, "path, bytes or a PIL.Image"),
    ],
)
def test_unreadable_images_raise_request_error(bad, fragment):
    with pytest.raises(RequestError, match=fragment):
        load_image(bad)


@pytest.mark.parametrize("empty", [np.zeros((0, 5, 3), dtype=np.uint8), np.zeros((4, 0, 3), dtype=np.uint8),
                                   Image.new("RGB", (0, 3)), Image.new("L", (3, 0))])
def test_images_without_pixels_raise_request_error(empty):
    with pytest.raises(RequestError, match="at least one pixel"):
        to_rgb_array(empty)


def test_unsupported_processor_is_a_model_format_error():
    with pytest.raises(ModelFormatError, match="SiglipImageProcessor"):
        preprocess_params_from_hf_config({"image_processor_type": "SiglipImageProcessor"})


PARAMS = preprocess_params_from_hf_config(_full_config("clip_square")).as_dict()
MODEL_ID = "openai/clip-vit-large-patch14-336"


def test_image_key_is_32_bytes_and_depends_on_pixels_not_encoding(tmp_path):
    image = _make_image(37, 53, "RGB", seed=7)
    key = image_key(image, PARAMS, MODEL_ID)
    assert isinstance(key, bytes) and len(key) == 32
    image.save(tmp_path / "a.png")
    image.save(tmp_path / "a.bmp")
    assert image_key(load_image(tmp_path / "a.png"), PARAMS, MODEL_ID) == key
    assert image_key(load_image(tmp_path / "a.bmp"), PARAMS, MODEL_ID) == key
    assert image_key(np.asarray(image), PARAMS, MODEL_ID) == key


def test_image_key_changes_with_one_pixel_size_params_or_model():
    pixels = np.asarray(_make_image(37, 53, "RGB", seed=7)).copy()
    key = image_key(pixels, PARAMS, MODEL_ID)
    one_pixel = pixels.copy()
    one_pixel[52, 36, 2] ^= 1
    assert image_key(one_pixel, PARAMS, MODEL_ID) != key
    same_bytes_other_shape = pixels.reshape(37, 53, 3)
    assert image_key(same_bytes_other_shape, PARAMS, MODEL_ID) != key
    assert image_key(pixels, {**PARAMS, "do_pad_to_square": True}, MODEL_ID) != key
    assert image_key(pixels, {**PARAMS, "image_mean": [0.5, 0.5, 0.5]}, MODEL_ID) != key
    assert image_key(pixels, PARAMS, MODEL_ID + "-v2") != key
    reordered = dict(reversed(list(PARAMS.items())))
    assert image_key(pixels, reordered, MODEL_ID) == key


def test_prepared_image_preprocesses_a_copy_of_its_pixels_on_first_use():
    from conduit_rt.models.base import PreparedImage

    rgb = np.random.default_rng(0).integers(0, 256, (4, 5, 3), dtype=np.uint8)
    calls = []

    def preprocess(pixels: np.ndarray) -> np.ndarray:
        calls.append(pixels.copy())
        return pixels.astype(np.float32) / 255

    image = PreparedImage(7, preprocess, rgb)
    want = rgb.astype(np.float32) / 255
    rgb[:] = 0  # the caller reuses its array: the image keeps what it was given
    assert not calls and "lazy" in repr(image)
    np.testing.assert_array_equal(image.pixel_values.numpy(), want)
    np.testing.assert_array_equal(image.pixel_values.numpy(), want)
    assert len(calls) == 1 and image.n_tokens == 7
    ready = PreparedImage(3, pixel_values=torch.ones(3, 2, 2))
    assert torch.equal(ready.pixel_values, torch.ones(3, 2, 2))
    with pytest.raises(ValueError):
        PreparedImage(3)
