"""The bad-input table: malformed model files, images, messages, options and requests longer than the
model or the arena holds, each through the public API (``Runtime``, ``conduit run``, ``conduit
convert``). Every case asserts its typed error and a fragment of its message, that the arena's
statistics are what they were before it, and that the same Runtime then answers a normal request
exactly as it did before (text and tokens). ``docs/reliability.md`` lists the cases and the contract.

Then what the table cannot show in one line: exotic images that are accepted (16-bit, CMYK, palette
transparency, EXIF orientation) against an independent reference, weights that give NaN or infinite
logits, and requests that fail half-way (an exception in a pass, the arena full after eviction).

Longer than most test files: the table is one case per line, and it is meant to be read whole.
"""
from __future__ import annotations

import io
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from conduit_rt import Runtime
from conduit_rt.cli import main as conduit
from conduit_rt.errors import (ArenaFullError, ContextOverflowError, DeviceUnavailableError, ImageTooLargeError,
                               InvalidArgumentError, InvalidImageError, ModelFormatError, NonFiniteLogitsError,
                               RequestError)
from conduit_rt.preprocess import to_rgb_array
from tests.fixtures import bad_images
from tests.fixtures.tiny_llava import build_tiny_llava
from tests.fixtures.tiny_qwen2vl import build_tiny_qwen2vl

CONTEXT = 512  # the tiny LLaVA's max_position_embeddings
IMAGE_TOKENS = 25
N_NEW = 8


@dataclass(frozen=True)
class Models:
    """The converted tiny models and the bad files made from them."""

    llava_hf: Path   # the LLaVA checkpoint folder
    llava: Path      # its model.gguf and mmproj.gguf
    qwen: Path       # a converted tiny Qwen2-VL (its mmproj does not pair with LLaVA's model)
    bad: Path        # broken files and folders

    @property
    def model(self) -> Path:
        return self.llava / "model.gguf"


def convert(hf_dir: Path, out: Path) -> Path:
    assert conduit(["convert", str(hf_dir), "--outdir", str(out), "--dtype", "f32", "--quiet"]) == 0
    return out


def corrupted_copy(hf_dir: Path, out: Path, tensor: str, edit: Callable[[torch.Tensor], None]) -> Path:
    """The checkpoint converted with ``edit`` applied in place to its tensor named ``tensor``."""
    from safetensors.torch import load_file, save_file

    copy = out.with_name(out.name + "_hf")
    shutil.copytree(hf_dir, copy)
    weights = load_file(copy / "model.safetensors")
    edit(weights[tensor])
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return convert(copy, out)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("models")
    llava_hf = build_tiny_llava(root / "llava_hf", seed=7)
    m = Models(llava_hf, convert(llava_hf, root / "llava"),
               convert(build_tiny_qwen2vl(root / "qwen_hf", version="2", seed=1), root / "qwen"), root / "bad")
    bad = m.bad
    (bad / "empty_dir").mkdir(parents=True)
    (bad / "empty.gguf").write_bytes(b"")
    data = m.model.read_bytes()
    (bad / "half.gguf").write_bytes(data[: len(data) // 2])
    (bad / "png.gguf").write_bytes(bad_images.encoded(Image.new("RGB", (4, 4)), "PNG"))
    mmproj = (m.llava / "mmproj.gguf").read_bytes()
    (bad / "half_mmproj.gguf").write_bytes(mmproj[: len(mmproj) // 2])
    (bad / "text_only").mkdir()
    shutil.copy(m.model, bad / "text_only" / "model.gguf")
    (bad / "image_dir").mkdir()
    (bad / "animated.gif").write_bytes(bad_images.animated("GIF"))
    (bad / "truncated.png").write_bytes(TRUNCATED_PNG)
    for name, files in (("no_config", {}), ("bad_json", {"config.json": "{not json"})):
        (bad / name).mkdir()
        for file, text in files.items():
            (bad / name / file).write_text(text)
    shutil.copytree(llava_hf, bad / "truncated_weights")
    weights = (llava_hf / "model.safetensors").read_bytes()
    (bad / "truncated_weights" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    norm = "language_model.model.norm.weight"
    corrupted_copy(llava_hf, bad / "nan", norm, lambda t: t.fill_(float("nan")))
    return m


@pytest.fixture(scope="module")
def runtime(models) -> Runtime:
    return Runtime(models.model, device="cpu", kv_cache_bytes=8 << 20)


PICTURE = Image.fromarray(bad_images.noise(40, 52, 3, seed=1))
NORMAL = [{"role": "user", "content": [{"type": "image", "image": PICTURE},
                                       {"type": "text", "text": "What is shown in this image?"}]}]
TRUNCATED_PNG = bad_images.encoded(PICTURE, "PNG")[:300]


@pytest.fixture(scope="module")
def normal(runtime):
    """The normal request's answer: computed whole, then again from the prefix cache (the path every
    later normal request takes); both must agree."""
    first = runtime.generate(NORMAL, max_tokens=N_NEW)
    again = runtime.generate(NORMAL, max_tokens=N_NEW)
    assert (again.text, again.tokens) == (first.text, first.tokens) and len(first.tokens) == N_NEW
    return first


def assert_answers_as_before(runtime: Runtime, normal) -> None:
    answer = runtime.generate(NORMAL, max_tokens=N_NEW)
    assert (answer.text, answer.tokens) == (normal.text, normal.tokens)


# -- the table -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Runtime, Models], object]
    error: type[Exception]
    fragment: str


def ask(content, **options) -> Callable[[Runtime, Models], object]:
    """A case that sends one user message with ``content`` (and ``max_tokens=4`` unless given)."""
    return lambda rt, m: rt.generate([{"role": "user", "content": content}], **{"max_tokens": 4, **options})


def send(messages, **options) -> Callable[[Runtime, Models], object]:
    return lambda rt, m: rt.generate(messages, **{"max_tokens": 4, **options})


def with_image(image) -> Callable[[Runtime, Models], object]:
    """A case that sends ``image`` (or, when callable, what it makes of the Models) with a question."""
    def run(rt, m):
        payload = image(m) if callable(image) else image
        return rt.generate([{"role": "user", "content": [{"type": "image", "image": payload},
                                                         {"type": "text", "text": "What is it?"}]}], max_tokens=4)
    return run


def load(path: Callable[[Models], Path], mmproj: Callable[[Models], Path] | None = None,
         **arguments) -> Callable[[Runtime, Models], object]:
    """A case that creates a Runtime on ``path`` (and ``mmproj``) with ``arguments``."""
    def run(rt, m):
        return Runtime(path(m), mmproj=mmproj(m) if mmproj else None,
                       **{"device": "cpu", "kv_cache_bytes": 1 << 20, **arguments})
    return run


def model_of(m: Models) -> Path:
    return m.model


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def cyclic() -> dict:
    value: dict = {}
    value["self"] = value
    return value


def overlong_chat_turn(rt, m):
    """A chat session whose history outgrows the context on its second turn (closed either way)."""
    chat = rt.chat()
    try:
        chat.send(NORMAL[0]["content"], max_tokens=2)
        chat.send("word " * CONTEXT, max_tokens=2)
    finally:
        chat.close()


def too_small_arena(rt, m):
    return Runtime(m.model, device="cpu", kv_cache_bytes=64 << 10).generate(NORMAL, max_tokens=200)


T, I = "text", "image"
CASES = [
    # model files and Runtime arguments
    Case("missing-model-file", load(lambda m: m.bad / "missing.gguf"), ModelFormatError, "no such model file"),
    Case("folder-without-model", load(lambda m: m.bad / "empty_dir"), ModelFormatError, "neither model.gguf"),
    Case("empty-gguf", load(lambda m: m.bad / "empty.gguf"), ModelFormatError, "empty.gguf"),
    Case("truncated-gguf", load(lambda m: m.bad / "half.gguf"), ModelFormatError, "half.gguf"),
    Case("png-renamed-gguf", load(lambda m: m.bad / "png.gguf"), ModelFormatError, "png.gguf"),
    Case("mmproj-as-model", load(lambda m: m.llava / "mmproj.gguf"), ModelFormatError, "mmproj"),
    Case("model-as-mmproj", load(model_of, mmproj=model_of), ModelFormatError, "not an mmproj"),
    Case("wrong-mmproj", load(lambda m: m.qwen / "model.gguf", mmproj=lambda m: m.llava / "mmproj.gguf"),
         ModelFormatError, "different model"),
    Case("missing-mmproj", load(model_of, mmproj=lambda m: m.bad / "none.gguf"), ModelFormatError,
         "no such mmproj file"),
    Case("truncated-mmproj", load(model_of, mmproj=lambda m: m.bad / "half_mmproj.gguf"), ModelFormatError,
         "half_mmproj.gguf"),
    Case("kv-cache-bytes-negative", load(model_of, kv_cache_bytes=-1), InvalidArgumentError, "kv_cache_bytes"),
    Case("kv-cache-bytes-fraction", load(model_of, kv_cache_bytes=2.5), InvalidArgumentError,
         "kv_cache_bytes"),
    Case("image-cache-over-kv-cache", load(model_of, image_cache_bytes=2 << 20), InvalidArgumentError,
         "image_cache_bytes"),
    Case("prefix-cache-entries-negative", load(model_of, prefix_cache_entries=-1), InvalidArgumentError,
         "prefix_cache_entries"),
    Case("dtype-unsupported", load(model_of, dtype=torch.int8), InvalidArgumentError, "dtype"),
    Case("cache-dir-is-a-file", lambda rt, m: load(model_of, cache_dir=m.bad / "empty.gguf")(rt, m),
         InvalidArgumentError, "is a file"),
    Case("cache-dir-bytes-negative", load(model_of, cache_dir_bytes=-1), InvalidArgumentError, "cache_dir_bytes"),
    Case("device-unknown", load(model_of, device="tpu"), DeviceUnavailableError, "unknown device"),
    # images
    Case("image-random-bytes", with_image(b"not an image at all"), InvalidImageError, "not an image format"),
    Case("image-truncated-png", with_image(TRUNCATED_PNG), InvalidImageError, "cannot decode image"),
    Case("image-empty-bytes", with_image(b""), RequestError, "not a path, bytes or a PIL.Image"),
    Case("image-zero-size", with_image(Image.new("RGB", (0, 5))), InvalidImageError, "at least one pixel"),
    Case("image-missing-file", with_image(lambda m: m.bad / "missing.png"), InvalidImageError, "not found"),
    Case("image-folder", with_image(lambda m: m.bad / "image_dir"), InvalidImageError, "cannot read image"),
    Case("image-animated-gif", with_image(bad_images.animated("GIF")), InvalidImageError, "3 frames"),
    Case("image-animated-png", with_image(bad_images.animated("PNG")), InvalidImageError, "3 frames"),
    Case("image-multipage-tiff", with_image(bad_images.multipage_tiff()), InvalidImageError, "2 frames"),
    Case("image-decompression-bomb", with_image(bad_images.header_only_png(20000, 20000)), ImageTooLargeError,
         "pixels"),
    Case("image-over-pixel-limit", with_image(bad_images.header_only_png(9000, 8000)), ImageTooLargeError,
         "MAX_IMAGE_PIXELS"),
    Case("image-huge-pil-image", with_image(lambda m: Image.new("1", (20000, 20000))), ImageTooLargeError,
         "MAX_IMAGE_PIXELS"),
    Case("image-thin-resized-past-limit", with_image(Image.new("L", (100000, 1))), ImageTooLargeError, "resized"),
    Case("image-pixel-array", with_image(np.zeros((8, 8, 3), np.uint8)), RequestError, "PIL.Image"),
    Case("image-to-text-only-model", lambda rt, m: with_image(PICTURE)(Runtime(m.bad / "text_only", device="cpu"), m),
         RequestError, "no vision tower"),
    # messages
    Case("messages-empty", send([]), RequestError, "non-empty list"),
    Case("messages-string", send("hello"), RequestError, "non-empty list"),
    Case("messages-one-dict", send({"role": "user", "content": "hi"}), RequestError, "non-empty list"),
    Case("message-not-a-dict", send(["hello"]), RequestError, "must be a dict"),
    Case("role-missing", send([{"content": "hi"}]), RequestError, "'role'"),
    Case("role-unknown", send([{"role": "robot", "content": "hi"}]), RequestError, "'role'"),
    Case("role-not-a-string", send([{"role": 5, "content": "hi"}]), RequestError, "'role'"),
    Case("role-the-template-refuses", send([{"role": "tool", "content": "42"}]), RequestError, "chat template"),
    Case("content-missing", send([{"role": "user"}]), RequestError, "'content'"),
    Case("content-a-number", ask(5), RequestError, "'content'"),
    Case("content-bytes", ask(b"hello"), RequestError, "'content'"),
    Case("content-empty-list", ask([]), RequestError, "empty list"),
    Case("part-unknown-type", ask([{"type": "video", "video": "clip.mp4"}]), RequestError, "'video'"),
    Case("part-image-url", ask([{"type": "image_url", "image_url": {"url": "data:,"}}]), RequestError, "'image_url'"),
    Case("part-image-without-image", ask([{"type": I}]), RequestError, "not a path, bytes or a PIL.Image"),
    Case("part-text-without-text", ask([{"type": T}]), RequestError, "without a string 'text'"),
    Case("part-text-not-a-string", ask([{"type": T, "text": ["hi"]}]), RequestError, "without a string 'text'"),
    Case("part-a-string", ask(["hello"]), RequestError, "must be a dict"),
    Case("part-a-nested-list", ask([[{"type": T, "text": "hi"}]]), RequestError, "must be a dict"),
    Case("message-nested-too-deep", send([{"role": "user", "content": "hi", "meta": nested(100)}]), RequestError,
         "levels deep"),
    Case("message-cyclic", send([{"role": "user", "content": "hi", "meta": cyclic()}]), RequestError, "levels deep"),
    Case("image-token-in-text", ask("look: <image> here"), RequestError, "image placeholders"),
    # options
    Case("max-tokens-fraction", ask("hi", max_tokens=2.7), RequestError, "max_tokens must be an integer"),
    Case("max-tokens-negative", ask("hi", max_tokens=-1), RequestError, "max_tokens"),
    Case("max-tokens-string", ask("hi", max_tokens="many"), RequestError, "max_tokens"),
    Case("max-tokens-bool", ask("hi", max_tokens=True), RequestError, "max_tokens"),
    Case("temperature-negative", ask("hi", temperature=-0.5), RequestError, "temperature"),
    Case("temperature-nan", ask("hi", temperature=float("nan")), RequestError, "temperature"),
    Case("top-p-zero", ask("hi", top_p=0.0), RequestError, "top_p"),
    Case("top-p-above-one", ask("hi", top_p=1.5), RequestError, "top_p"),
    Case("seed-string", ask("hi", temperature=0.8, seed="abc"), RequestError, "seed"),
    Case("seed-too-large", ask("hi", seed=2**70), RequestError, "seed"),
    Case("stop-empty-string", ask("hi", stop=[""]), RequestError, "stop"),
    Case("stop-a-number", ask("hi", stop=5), RequestError, "stop"),
    Case("return-logits-string", ask("hi", return_logits="yes"), RequestError, "return_logits"),
    Case("trace-selection-number", ask("hi", trace_selection=1), RequestError, "trace_selection"),
    Case("refresh-unknown", ask("hi", refresh="sideways"), RequestError, "refresh policy"),
    Case("refresh-not-a-string", ask("hi", refresh=["conduit"]), RequestError, "refresh must be"),
    Case("refresh-budget-above-one-exact-prefix", send(NORMAL, refresh="conduit", refresh_budget=1.5), RequestError,
         "refresh_budget"),
    Case("refresh-budget-nan", ask("hi", refresh_budget=float("nan")), RequestError, "refresh_budget"),
    Case("refresh-options-unknown", ask("hi", refresh_options={"nope": 1}), RequestError, "unknown refresh_options"),
    Case("refresh-options-lam-string", ask("hi", refresh_options={"lam": "x"}), RequestError, "lam"),
    Case("refresh-options-query-tokens-zero", ask("hi", refresh_options={"query_tokens": 0}), RequestError,
         "query_tokens"),
    Case("refresh-options-wrong-type", ask("hi", refresh_options="fast"), RequestError, "refresh_options"),
    Case("refresh-layer-out-of-range", send(NORMAL, refresh="conduit", refresh_options={"layers": [99]}),
         RequestError, "refresh layers"),
    Case("refresh-layer-out-of-range-unused", send(NORMAL, refresh_options={"layers": [99]}), RequestError,
         "refresh layers"),
    Case("compress-unknown", ask("hi", compress="zip"), RequestError, "compression policy"),
    Case("keep-zero", ask("hi", compress="vlcache", keep=0), RequestError, "keep"),
    Case("keep-zero-unused", ask("hi", keep=0.0), RequestError, "keep"),
    Case("keep-above-one", ask("hi", keep=1.5), RequestError, "keep"),
    Case("compress-options-even-pool-kernel", ask("hi", compress_options={"pool_kernel": 4}), RequestError,
         "pool_kernel"),
    Case("compress-options-window-zero", ask("hi", compress_options={"window": 0}), RequestError, "window"),
    Case("compress-options-draft-steps-zero", ask("hi", compress="vlcache_draft", compress_options={"draft_steps": 0}),
         RequestError, "draft_steps"),
    Case("compress-options-pyramid-beta-zero", ask("hi", compress_options={"pyramid_beta": 0}), RequestError,
         "pyramid_beta"),
    Case("option-unknown-name", ask("hi", max_token=4), RequestError, "unknown option"),
    Case("options-a-dict", lambda rt, m: rt.generate(NORMAL, {"max_tokens": 4}), RequestError, "GenerationOptions"),
    # requests longer than the model or the arena holds
    Case("context-text-too-long", ask("word " * CONTEXT), ContextOverflowError, f"context length of {CONTEXT}"),
    Case("context-too-many-images", ask([{"type": I, "image": PICTURE}] * (CONTEXT // IMAGE_TOKENS + 1)),
         ContextOverflowError, f"{CONTEXT // IMAGE_TOKENS + 1} images"),
    Case("context-prompt-plus-max-tokens", send(NORMAL, max_tokens=CONTEXT), ContextOverflowError,
         "lower max_tokens"),
    Case("context-chat-history", overlong_chat_turn, ContextOverflowError, "context length"),
    Case("arena-smaller-than-request", too_small_arena, ContextOverflowError, "kv_cache_bytes"),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_gets_its_typed_error_and_changes_nothing(runtime, normal, models, case):
    before = runtime.arena.stats()
    with pytest.raises(case.error, match=re.escape(case.fragment)):
        case.run(runtime, models)
    assert runtime.arena.stats() == before
    assert_answers_as_before(runtime, normal)


CLI_CASES = [  # (name, argv from the Models, exit status, fragment of stderr)
    ("run-missing-model", lambda m: ["run", "--model", str(m.bad / "missing.gguf"), "-p", "hi"], 1,
     "no such model file"),
    ("run-foreign-model", lambda m: ["run", "--model", str(m.bad / "png.gguf"), "-p", "hi"], 1, "png.gguf"),
    ("run-truncated-model", lambda m: ["run", "--model", str(m.bad / "half.gguf"), "-p", "hi"], 1, "half.gguf"),
    ("run-missing-image", lambda m: ["run", "--model", str(m.model), "--image", str(m.bad / "missing.png"), "-p", "hi"],
     1, "image file not found"),
    ("run-truncated-image", lambda m: ["run", "--model", str(m.model), "--image", str(m.bad / "truncated.png"),
                                       "-p", "hi"], 1, "cannot decode image"),
    ("run-animated-image", lambda m: ["run", "--model", str(m.model), "--image", str(m.bad / "animated.gif"),
                                      "-p", "hi"], 1, "frames"),
    ("run-max-tokens-past-context", lambda m: ["run", "--model", str(m.model), "-p", "hi", "--max-tokens", "100000"],
     1, "context length"),
    ("run-nan-weights", lambda m: ["run", "--model", str(m.bad / "nan" / "model.gguf"), "-p", "hi"], 1, "NaN"),
    ("run-kv-cache-bytes-negative", lambda m: ["run", "--model", str(m.model), "-p", "hi", "--kv-cache-bytes", "-1"],
     2, "--kv-cache-bytes"),
    ("convert-missing-source", lambda m: ["convert", str(m.bad / "missing"), "--outdir", str(m.bad / "out")], 1,
     "no such folder"),
    ("convert-folder-without-config", lambda m: ["convert", str(m.bad / "no_config"), "--outdir", str(m.bad / "out")],
     1, "config.json"),
    ("convert-config-not-json", lambda m: ["convert", str(m.bad / "bad_json"), "--outdir", str(m.bad / "out")], 1,
     "not valid JSON"),
    ("convert-truncated-weights", lambda m: ["convert", str(m.bad / "truncated_weights"), "--outdir",
                                             str(m.bad / "out")], 1, "safetensors"),
    ("convert-unknown-dtype", lambda m: ["convert", str(m.llava_hf), "--outdir", str(m.bad / "out"), "--dtype", "q4"],
     2, "--dtype"),
]


@pytest.mark.parametrize("name,argv,status,fragment", CLI_CASES, ids=[case[0] for case in CLI_CASES])
def test_bad_command_line_input_is_one_error_line(runtime, normal, models, capsys, name, argv, status, fragment):
    args = argv(models) + (["--device", "cpu"] if name.startswith("run") else [])
    try:
        got = conduit(args)
    except SystemExit as usage:  # argparse's usage errors
        got = usage.code
    err = capsys.readouterr().err
    assert got == status and fragment in err
    assert ("conduit: error:" in err) if status == 1 else ("usage:" in err)
    assert_answers_as_before(runtime, normal)


# -- exotic images that are accepted, against an independent reference ---------------------------------------
def answers_as(runtime: Runtime, image, reference: np.ndarray) -> None:
    """``image`` decodes to ``reference`` ([H, W, 3] uint8) and is answered as those pixels are."""
    np.testing.assert_array_equal(to_rgb_array(image), reference)
    got = runtime.generate([{"role": "user", "content": [{"type": "image", "image": image}]}], max_tokens=4)
    want = runtime.generate([{"role": "user", "content": [{"type": "image", "image": Image.fromarray(reference)}]}],
                            max_tokens=4)
    assert got.tokens == want.tokens and got.stats.images == 1


@pytest.mark.parametrize("channels", [1, 3])
def test_a_16_bit_png_keeps_each_values_high_byte(runtime, channels):
    """Scaled to 8 bits as torchvision's to_dtype(uint8, scale=True) does (v >> 8), never clipped."""
    values = bad_images.noise(12, 20, channels, seed=8, dtype=np.uint16)
    values = values[..., 0] if channels == 1 else values
    expected = (values >> 8).astype(np.uint8)
    answers_as(runtime, bad_images.png16(values), np.repeat(expected[..., None], 3, 2) if channels == 1 else expected)


def test_a_cmyk_jpeg_answers_as_its_rgb_pixels(runtime):
    data = bad_images.cmyk_jpeg()
    cmyk = np.asarray(Image.open(io.BytesIO(data))).astype(np.int64)  # as the JPEG decodes: [H, W, 4]
    rgb = (255 - cmyk[..., :3]) * (255 - cmyk[..., 3:]) / 255  # the naive CMYK -> RGB transform
    got = to_rgb_array(data).astype(np.int64)
    assert np.abs(got - rgb).max() <= 1  # integer rounding
    answers_as(runtime, data, to_rgb_array(data))


def test_a_palette_with_a_transparent_entry_is_composited_onto_white(runtime):
    data, indices, palette = bad_images.palette_with_transparency(transparent_index=1)
    expected = np.where((indices == 1)[..., None], 255, palette[indices]).astype(np.uint8)
    assert (indices == 1).any() and (indices != 1).any()
    answers_as(runtime, data, expected)


@pytest.mark.parametrize("orientation", range(2, 9))
def test_an_exif_rotated_jpeg_is_used_upright(runtime, orientation):
    data = bad_images.exif_rotated_jpeg(orientation)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert upright.size == ((20, 36) if orientation >= 5 else (36, 20))
    answers_as(runtime, data, np.asarray(upright))


# -- weights that give NaN or infinite logits ---------------------------------------------------------------
def test_weights_with_nan_are_refused_at_load_naming_the_file_and_tensor(models):
    path = models.bad / "nan" / "model.gguf"
    with pytest.raises(ModelFormatError, match=re.escape(str(path)) + ".*output_norm.weight.*NaN or infinite"):
        Runtime(path, device="cpu", kv_cache_bytes=1 << 20)


def test_nan_logits_raise_an_error_naming_the_model_file(models):
    """Weights that turn non-finite after loading (the load check cannot see them) still never give
    an empty answer: the step's logits are checked."""
    path = models.model
    broken = Runtime(path, device="cpu", kv_cache_bytes=1 << 20)
    with torch.no_grad():
        broken.model.language_model.norm.weight.fill_(float("nan"))
    for max_tokens in (4, 0):  # 0: the prompt's logits are checked without sampling
        with pytest.raises(NonFiniteLogitsError, match=re.escape(str(path))):
            broken.generate(NORMAL, max_tokens=max_tokens)
        with pytest.raises(NonFiniteLogitsError, match="NaN or infinite"):
            broken.generate(NORMAL, max_tokens=max_tokens, temperature=0.9, seed=1)
    stats = broken.arena.stats()
    assert stats.n_seqs == 0 and stats.n_blocks_used == stats.n_blocks_image


def test_an_infinite_embedding_met_while_decoding_stops_the_answer_there(runtime, models):
    """The k-th generated token's embedding row is infinite: the first k tokens stream, then the step
    that consumes that token raises; the same Runtime answers requests that stop before it as the
    healthy model does."""
    prompt = [{"role": "user", "content": "Describe the chart."}]
    healthy = runtime.generate(prompt, max_tokens=N_NEW)
    prompt_ids = runtime.requests.read(prompt).prompt.token_ids
    k = next(i for i, t in enumerate(healthy.tokens) if t not in prompt_ids and t not in healthy.tokens[:i])
    token = healthy.tokens[k]

    broken = Runtime(models.model, device="cpu", kv_cache_bytes=1 << 20)
    with torch.no_grad():  # after loading: the load check refuses such a file
        broken.model.language_model.embed_tokens.weight[token] = float("inf")
    stream = broken.stream(prompt, max_tokens=N_NEW)
    pieces = []
    with pytest.raises(NonFiniteLogitsError, match=f"after {len(prompt_ids) + k + 1} tokens"):
        for piece in stream:
            pieces.append(piece)
    assert healthy.text.startswith("".join(pieces))
    assert broken.arena.stats().n_seqs == len(broken.planner.prefix_cache) == 0
    before_it = broken.generate(prompt, max_tokens=k + 1)  # its last token is sampled, never fed back
    assert before_it.tokens == healthy.tokens[: k + 1]


# -- requests that fail half-way give every block back --------------------------------------------------------
class Injected(Exception):
    """The failure a test injects into a pass."""


def fail_on_call(n: int, real: Callable) -> Callable:
    """``real``, except that its ``n``-th call (1-based) raises Injected."""
    calls = []

    def call(*args, **kwargs):
        calls.append(None)
        if len(calls) == n:
            raise Injected(f"call {n}")
        return real(*args, **kwargs)
    return call


@pytest.mark.parametrize("where,options", [
    ("prefill", {}),                                  # the first pass of a new prompt
    ("refresh", {"refresh": "conduit"}),              # the recompute pass after a restore
    ("compress", {"compress": "vlcache", "keep": 0.5}),
    ("decode", {}),                                   # a decode step, after the first token
])
def test_a_request_failing_half_way_returns_every_block(runtime, normal, monkeypatch, where, options):
    import conduit_rt.runtime as runtime_module

    fresh_question = [{"role": "user", "content": [{"type": "image", "image": PICTURE},
                                                   {"type": "text", "text": f"Failing in {where}?"}]}]
    runtime.planner.prefix_cache.clear()
    runtime.generate(NORMAL, max_tokens=1, refresh="conduit")  # the picture's KV is in the image store
    runtime.planner.prefix_cache.clear()
    before = runtime.arena.stats()
    if where == "compress":
        monkeypatch.setattr(runtime_module, "compress_prompt", fail_on_call(1, runtime_module.compress_prompt))
    else:
        nth = {"prefill": 1, "refresh": 2, "decode": 3}[where]  # decode: call 2 is the first token's step
        monkeypatch.setattr(runtime.model, "forward", fail_on_call(nth, runtime.model.forward))
    with pytest.raises(Injected):
        runtime.generate(fresh_question, max_tokens=N_NEW, **options)
    monkeypatch.undo()
    assert runtime.arena.stats() == before
    assert_answers_as_before(runtime, normal)


def test_an_arena_full_after_eviction_returns_every_block(models, normal):
    small = Runtime(models.model, device="cpu", kv_cache_bytes=64 << 10, image_cache_bytes=0)
    block_tokens = small.arena.block_size
    hog = small.arena.new_sequence()  # leaves one block per layer: the request needs three
    hog.append(range((small.arena.stats().n_blocks_free // 2 - 1) * block_tokens))
    before = small.arena.stats()
    with pytest.raises(ArenaFullError):
        small.generate(NORMAL, max_tokens=N_NEW)
    assert small.arena.stats() == before
    hog.free()
    assert_answers_as_before(small, normal)


def test_a_chat_turn_that_fails_leaves_the_session_answering(runtime, monkeypatch):
    """The failed turn's sequence is freed (its KV may be half written) and the turn never joins the
    history; the next turn answers as it does in a session that never failed."""
    def converse(fail: bool) -> list[int]:
        chat = runtime.chat()
        chat.send(NORMAL[0]["content"], max_tokens=3)
        if fail:
            monkeypatch.setattr(runtime.model, "forward", fail_on_call(1, runtime.model.forward))
            with pytest.raises(Injected):
                chat.send("And the colours?", max_tokens=3)
            monkeypatch.undo()
            assert len(chat.history) == 2 and chat.held.seq is None
        tokens = chat.send("Tell me more.", max_tokens=4).tokens
        chat.close()
        return tokens

    assert converse(fail=True) == converse(fail=False)
    assert runtime.arena.stats().n_seqs == len(runtime.planner.prefix_cache)


def test_the_reliability_page_lists_every_case():
    page = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text()
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", page, flags=re.MULTILINE)
    assert sorted(listed) == sorted([case.name for case in CASES] + [case[0] for case in CLI_CASES])
