"""Chat template, tokenizer and prompt building against Hugging Face transformers (LlavaProcessor)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

transformers = pytest.importorskip("transformers")

from conduit_rt.chat import ChatTemplate, ImageSlot, TextRun, build_prompt, validate_messages  # noqa: E402
from conduit_rt.errors import ModelFormatError, RequestError  # noqa: E402
from conduit_rt.preprocess import ClipPreprocessParams  # noqa: E402
from conduit_rt.tokenizer import SpecialTokens, TextTokenizer  # noqa: E402
from tests.fixtures.tiny_tokenizer import CHAT_TEMPLATE, IMAGE_TOKEN, write_tiny_tokenizer  # noqa: E402

PATCH_SIZE = 5
CROP = 30
TOKENS_PER_IMAGE = (CROP // PATCH_SIZE) ** 2  # LLaVA-1.5: CLS dropped

# llava-hf's LLaVA-1.5 template: no BOS (the tokenizer adds it), images first, {% generation %}
LLAVA_HF_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _random_image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _write_processor_folder(folder: Path, chat_template: str) -> None:
    write_tiny_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(chat_template)
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "size": {"shortest_edge": CROP},
        "crop_size": {"height": CROP, "width": CROP},
        "do_resize": True,
        "do_center_crop": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    }
    (folder / "processor_config.json").write_text(json.dumps(processor))


@pytest.fixture(scope="module", params=["bos_in_template", "llava_hf_template"])
def setup(request, tmp_path_factory):
    """(HF processor, our tokenizer, our template, preprocessing params) over the same folder."""
    folder = tmp_path_factory.mktemp(request.param)
    _write_processor_folder(
        folder, CHAT_TEMPLATE if request.param == "bos_in_template" else LLAVA_HF_TEMPLATE
    )
    processor = transformers.AutoProcessor.from_pretrained(folder)
    tokenizer, template_source = TextTokenizer.from_hf_folder(folder)
    params = ClipPreprocessParams.from_hf_config(
        json.loads((folder / "preprocessor_config.json").read_text())
    )
    return processor, tokenizer, ChatTemplate(template_source), params


def _conversation(num_images: int, multi_turn: bool) -> list[dict]:
    images = [_random_image(seed, 37 + 11 * seed, 53 - 7 * seed) for seed in range(num_images)]
    first = [{"type": "image", "image": image} for image in images[:2]]
    first.insert(1 if images else 0, {"type": "text", "text": "What is shown in this image?"})
    messages = [{"role": "user", "content": first}]
    if multi_turn:
        messages = [
            {"role": "system", "content": [{"type": "text", "text": "A chat with an assistant."}]},
            *messages,
            {"role": "assistant", "content": [{"type": "text", "text": "A red car, 3.5 m long."}]},
            {
                "role": "user",
                "content": [
                    *({"type": "image", "image": image} for image in images[2:]),
                    {"type": "text", "text": "And how many dogs? 日本 🙂"},
                ],
            },
        ]
    elif images[2:]:
        first.extend({"type": "image", "image": image} for image in images[2:])
    return messages


CONVERSATIONS = [(0, False), (1, False), (3, False), (0, True), (1, True), (3, True)]


@pytest.mark.parametrize("num_images,multi_turn", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_text_matches_hf_apply_chat_template(setup, num_images, multi_turn, add_generation_prompt):
    processor, tokenizer, template, _ = setup
    messages = _conversation(num_images, multi_turn)
    expected = processor.tokenizer.apply_chat_template(
        messages,
        chat_template=processor.chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    prompt = build_prompt(
        messages,
        template,
        tokenizer,
        tokenizer.token_to_id(IMAGE_TOKEN),
        TOKENS_PER_IMAGE,
        add_generation_prompt=add_generation_prompt,
    )
    assert prompt.text == expected


@pytest.mark.parametrize("num_images,multi_turn", CONVERSATIONS)
def test_token_ids_match_hf_processor_with_image_tokens_expanded(setup, num_images, multi_turn):
    processor, tokenizer, template, params = setup
    messages = _conversation(num_images, multi_turn)
    expected = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt = build_prompt(messages, template, tokenizer, tokenizer.token_to_id(IMAGE_TOKEN), TOKENS_PER_IMAGE)
    assert prompt.token_ids == list(expected["input_ids"][0])
    assert len(prompt.images) == num_images
    for index, image in enumerate(prompt.images):
        np.testing.assert_array_equal(params.preprocess(image), np.asarray(expected["pixel_values"][index]))


@pytest.mark.parametrize("num_images,multi_turn", CONVERSATIONS)
def test_token_ids_match_hf_processor_called_on_rendered_text(setup, num_images, multi_turn):
    """The other HF path: render, then ``processor(text=..., images=...)`` with its default special tokens."""
    processor, tokenizer, template, _ = setup
    messages = _conversation(num_images, multi_turn)
    prompt = build_prompt(messages, template, tokenizer, tokenizer.token_to_id(IMAGE_TOKEN), TOKENS_PER_IMAGE)
    adds_bos_itself = prompt.text.startswith(tokenizer.special_tokens.bos_token)
    expected = processor(
        text=prompt.text, images=list(prompt.images) or None, add_special_tokens=not adds_bos_itself
    )["input_ids"][0]
    assert prompt.token_ids == list(expected)
    assert prompt.token_ids.count(tokenizer.bos_token_id) == 1


def test_segments_tile_the_prompt_in_order(setup):
    _, tokenizer, template, _ = setup
    image_token_id = tokenizer.token_to_id(IMAGE_TOKEN)
    counts = [4, 9, 16]
    prompt = build_prompt(_conversation(3, True), template, tokenizer, image_token_id, counts)
    position = 0
    slots = []
    for segment in prompt.segments:
        assert segment.start == position
        if isinstance(segment, TextRun):
            assert list(segment.token_ids) == prompt.token_ids[position : position + segment.n_tokens]
            assert image_token_id not in segment.token_ids
            position += segment.n_tokens
        else:
            assert (
                prompt.token_ids[position : position + segment.n_tokens]
                == [image_token_id] * segment.n_tokens
            )
            slots.append(segment)
            position += segment.n_tokens
    assert position == len(prompt.token_ids)
    assert [(slot.image_index, slot.n_tokens) for slot in slots] == [(0, 4), (1, 9), (2, 16)]
    assert prompt.image_slots == tuple(slots) and all(isinstance(s, ImageSlot) for s in slots)


BAD_MESSAGES = [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "hi"}], "role"),
    (["hi"], "must be a dict"),
    ([{"role": "user", "content": 5}], "string or a list"),
    ([{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}], "'video'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "'text'"),
    ([{"role": "user", "content": [{"type": "image"}]}], "path, bytes or a PIL.Image"),
    ([{"role": "user", "content": [{"type": "image", "image": 3}]}], "path, bytes or a PIL.Image"),
    ([{"role": "user", "content": ["just text"]}], "must be a dict"),
]


@pytest.mark.parametrize("messages,fragment", BAD_MESSAGES)
def test_invalid_messages_raise_request_error(messages, fragment):
    with pytest.raises(RequestError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        validate_messages(messages)


def test_image_token_written_in_text_is_rejected(setup):
    _, tokenizer, template, _ = setup
    messages = [{"role": "user", "content": [{"type": "text", "text": "look: <image> here"}]}]
    with pytest.raises(RequestError, match="image placeholders"):
        build_prompt(messages, template, tokenizer, tokenizer.token_to_id(IMAGE_TOKEN), TOKENS_PER_IMAGE)


def test_template_raise_exception_becomes_request_error(tmp_path):
    write_tiny_tokenizer(tmp_path)
    tokenizer, source = TextTokenizer.from_hf_folder(tmp_path)
    with pytest.raises(RequestError, match="Only system, user and assistant"):
        build_prompt([{"role": "tool", "content": "42"}], ChatTemplate(source), tokenizer, 0, 1)


def test_broken_template_is_a_model_format_error():
    with pytest.raises(ModelFormatError):
        ChatTemplate("{% for m in messages %}")


def test_template_helpers_render_like_hf(setup):
    processor, tokenizer, _, _ = setup
    source = (
        "{% for m in messages %}{{ m | tojson }}|{{ m['content'] | tojson(indent=2) }}"
        "{% generation %}<{{ loop.index }}>{% endgeneration %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% endfor %}{{ strftime_now('%Y') | length }}{{ bos_token }}{{ pad_token }}"
    )
    messages = [
        {"role": "user", "content": 'é <b> "q"'},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "never rendered"},
    ]
    expected = processor.tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert ChatTemplate(source).render(messages, tokenizer.special_tokens.as_template_vars()) == expected


def test_encode_and_decode_match_hf(setup):
    processor, tokenizer, _, _ = setup
    for text in [
        "Hello world",
        "USER: <image>\nWhat is it? ASSISTANT:",
        "  two  spaces\n\n",
        "héllo 日本 🙂",
    ]:
        for add_special_tokens in (True, False):
            expected = processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert tokenizer.encode(text, add_special_tokens) == expected
        ids = tokenizer.encode(text, True)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == processor.tokenizer.decode(ids, skip_special_tokens=skip)


def _stream(tokenizer: TextTokenizer, ids: list[int], skip: bool) -> list[str]:
    detokenizer = tokenizer.detokenizer(skip)
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


MULTILINGUAL = [
    "The cat sat.",
    "日本語のテキスト🙂🙂 and ümlauts — “quotes”",
    " leading space",
    "a\n\n b  c",
    "ASSISTANT: 3.14 × 2 = 6.28 ✓",
]


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_stream_pieces_join_to_decode_and_hold_split_characters(setup, text):
    _, tokenizer, _, _ = setup
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(token_id in tokenizer.byte_fallback_ids for token_id in ids) or text.isascii()
    pieces = _stream(tokenizer, ids, skip=True)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert tokenizer.decode(ids) == text.removeprefix(" ")  # Llama's decoder strips one leading space
    assert not any("\ufffd" in piece for piece in pieces)


def test_stream_matches_decode_on_random_ids_with_bytes_and_specials(setup):
    _, tokenizer, _, _ = setup
    rng = random.Random(0)
    byte_ids = sorted(tokenizer.byte_fallback_ids)
    for trial in range(300):
        ids = [
            rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size)
            for _ in range(rng.randrange(1, 25))
        ]
        for skip in (True, False):
            assert "".join(_stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip), (trial, ids)


def test_stream_with_byte_level_tokenizer():
    """A GPT-2/Qwen-style byte-level BPE (no byte-fallback tokens, no leading-space strip)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(MULTILINGUAL * 3, trainer=trainer)
    tokenizer = TextTokenizer(backend, SpecialTokens(eos_token="<|endoftext|>"))
    rng = random.Random(1)
    for text in MULTILINGUAL:
        ids = tokenizer.encode(text)
        pieces = _stream(tokenizer, ids, skip=True)
        assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert "".join(_stream(tokenizer, ids, skip=True)) == tokenizer.decode(ids)
