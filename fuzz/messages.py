#!/usr/bin/env python3
"""Fuzzes the chat-message parser: messages -> ``chat.build_prompt`` with the bundled model's template.

An input that parses as JSON is the messages themselves (the corpus in ``fuzz/corpus/messages``);
any other input drives a builder (``atheris.FuzzedDataProvider``) that makes what a Python caller
can pass and JSON cannot: bytes and ``PIL.Image`` payloads, numbers and ``None`` where strings
belong, tuples, deep nesting, a message list that contains itself, strings with lone surrogates.
Each goes through ``chat.validate_messages`` and ``chat.build_prompt`` (template, tokenizer, image
placeholders expanded) with the bundled model's tokenizer and chat template.

Property: a ``Prompt`` whose segments tile its token ids, with one image slot per image part, or a
``RequestError``. Anything else is a finding.

    python fuzz/messages.py /tmp/message-corpus fuzz/corpus/messages -runs=200000
"""
from __future__ import annotations

import json
import sys

import common  # puts the repository on sys.path
import jinja2  # noqa: F401
import tokenizers  # noqa: F401
from PIL import Image

import atheris

from conduit_rt import BUNDLED_MODEL
from conduit_rt.chat import ChatTemplate, ImageSlot, TextRun, build_prompt
from conduit_rt.errors import RequestError
from conduit_rt.tokenizer import TextTokenizer

common.instrument_packages("conduit_rt")

TOKENIZER, TEMPLATE_SOURCE = TextTokenizer.from_hf_folder(BUNDLED_MODEL)
TEMPLATE = ChatTemplate(TEMPLATE_SOURCE)
_CONFIG = json.loads((BUNDLED_MODEL / "config.json").read_text())
IMAGE_TOKEN_ID = _CONFIG.get("image_token_id", _CONFIG.get("image_token_index"))  # Qwen2-VL's name, LLaVA's
TOKENS_PER_IMAGE = 3
ROLES = ("user", "assistant", "system", "tool", "", "USER")
PIXEL = Image.new("RGB", (1, 1))
sys.setrecursionlimit(1000)


def build_value(fdp: atheris.FuzzedDataProvider, depth: int) -> object:
    """Any value a caller might put in a message."""
    kind = fdp.ConsumeIntInRange(0, 11 if depth < 40 else 5)
    simple = (
        lambda: fdp.ConsumeUnicode(12), lambda: fdp.ConsumeInt(4), lambda: fdp.ConsumeFloat(), lambda: None,
        lambda: fdp.ConsumeBytes(4), lambda: PIXEL,
    )
    if kind < len(simple):
        return simple[kind]()
    if kind in (6, 7):
        return [build_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if kind == 8:
        return tuple(build_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3)))
    if kind == 9:
        return {fdp.ConsumeUnicode(6): build_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}
    return build_part(fdp, depth + 1)


def build_part(fdp: atheris.FuzzedDataProvider, depth: int) -> dict:
    kind = fdp.PickValueInList(["text", "image", "image", "video", None])
    part: dict = {"type": kind}
    if fdp.ConsumeBool():
        part["text" if kind == "text" else "image"] = (
            fdp.ConsumeUnicode(24) if fdp.ConsumeBool() else build_value(fdp, depth + 1)
        )
    if fdp.ConsumeIntInRange(0, 7) == 0:
        part[fdp.ConsumeUnicode(4)] = build_value(fdp, depth + 1)
    return part


def build_messages(fdp: atheris.FuzzedDataProvider) -> object:
    messages: list = []
    for _ in range(fdp.ConsumeIntInRange(0, 5)):
        message: dict = {"role": fdp.PickValueInList(list(ROLES)) if fdp.ConsumeIntInRange(0, 9) else build_value(fdp, 1)}
        if fdp.ConsumeIntInRange(0, 3) == 0:
            message["content"] = fdp.ConsumeUnicode(40)
        elif fdp.ConsumeIntInRange(0, 5):
            message["content"] = [build_part(fdp, 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
        else:
            message["content"] = build_value(fdp, 1)
        messages.append(message)
    if messages and fdp.ConsumeIntInRange(0, 15) == 0:
        messages[-1]["content"] = messages  # a cycle through the content
    if messages and fdp.ConsumeIntInRange(0, 15) == 0:
        messages[0]["metadata"] = messages[0]  # a cycle through a field only the template sees
    return messages if fdp.ConsumeIntInRange(0, 9) else build_value(fdp, 0)


def messages_for(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return build_messages(atheris.FuzzedDataProvider(data))


def check_prompt(prompt, n_image_parts: int) -> None:
    position = 0
    for segment in prompt.segments:
        assert segment.start == position, (segment, position)
        if isinstance(segment, TextRun):
            assert list(segment.token_ids) == prompt.token_ids[position : position + segment.n_tokens]
        else:
            assert isinstance(segment, ImageSlot) and segment.n_tokens == TOKENS_PER_IMAGE
        position += segment.n_tokens
    assert position == len(prompt.token_ids)
    assert len(prompt.image_slots) == len(prompt.images) == n_image_parts


def count_image_parts(messages: list) -> int:
    return sum(
        1 for message in messages if not isinstance(message["content"], str)
        for part in message["content"] if part["type"] == "image"
    )


def test_one_input(data: bytes) -> None:
    messages = messages_for(data)
    try:
        prompt = build_prompt(messages, TEMPLATE, TOKENIZER, IMAGE_TOKEN_ID, TOKENS_PER_IMAGE)
    except RequestError:
        return
    check_prompt(prompt, count_image_parts(messages))


if __name__ == "__main__":
    common.run(test_one_input)
