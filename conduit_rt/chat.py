"""Chat messages -> prompt: validation, chat template, tokens, and the segments the planner reads.

Messages are OpenAI-style dicts: ``{"role": str, "content": str | [part, ...]}`` with parts
``{"type": "text", "text": str}`` and ``{"type": "image", "image": path | bytes | PIL.Image}``.
The template is rendered as transformers renders it (jinja2 sandbox, trim_blocks, lstrip_blocks,
``raise_exception``, ``tojson``, ``strftime_now``, ``{% generation %}``) over plain copies of the
messages (image payloads become inert placeholders). The text is tokenized as Hugging Face's
processor does after ``apply_chat_template``: without adding BOS when the template already wrote
it. Each image placeholder token is then expanded to the image's number of tokens.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image

from conduit_rt.errors import ModelFormatError, RequestError
from conduit_rt.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

ImagePayload = str | os.PathLike | bytes | Image.Image


@dataclass(frozen=True, slots=True)
class TextRun:
    """Consecutive text tokens of the prompt, positions [start, start + len(token_ids))."""

    token_ids: tuple[int, ...]
    start: int

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ImageSlot:
    """The tokens of image ``image_index``, positions [start, start + n_tokens)."""

    image_index: int
    start: int
    n_tokens: int


Segment = TextRun | ImageSlot


@dataclass(frozen=True, slots=True)
class Prompt:
    """A tokenized request: ids with image tokens expanded, its segments in order, its images.

    ``segments`` tile ``token_ids`` exactly, in order; ``images[i]`` is the payload of the slot
    whose ``image_index`` is i (path, bytes or PIL image, as the caller gave it).
    """

    token_ids: list[int]
    segments: tuple[Segment, ...]
    images: tuple[ImagePayload, ...]
    text: str

    @property
    def image_slots(self) -> tuple[ImageSlot, ...]:
        return tuple(segment for segment in self.segments if isinstance(segment, ImageSlot))


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (used by some HF templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, unlike jinja's own filter
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


class ChatTemplate:
    """A compiled Hugging Face chat template."""

    def __init__(self, source: str) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ModelFormatError(
                f"chat template does not compile (line {error.lineno}): {error}"
            ) from error
        self.source = source

    def render(
        self,
        messages: list[dict],
        special_tokens: Mapping[str, str],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render plain messages; ``special_tokens`` gives ``bos_token``, ``eos_token``, ...

        A template's ``raise_exception`` becomes a ``RequestError``.
        """
        variables = {"tools": None, "documents": None, **special_tokens, **_plain(template_kwargs)}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as error:
            raise RequestError(f"the chat template rejected the messages: {error}") from error
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
            # a template that assumes a shape these (valid) messages do not have, e.g. text in every part
            raise RequestError(f"the chat template cannot render these messages ({type(error).__name__}: "
                               f"{error}); send them in the shape the model's template expects") from error


MAX_NESTING = 32  # levels of dicts and lists a message may nest (a cycle would nest forever)
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles; the template may refuse some


def _plain(value: Any, depth: int = 0) -> Any:
    """What a template may see: JSON types only; anything else (images, arrays) a placeholder.
    Raises ``RequestError`` past ``MAX_NESTING`` levels."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    for json_type in (bool, int, float, str):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, json_type):
            return json_type(value) if json_type is not str else str.__str__(value)
    if isinstance(value, (Mapping, list, tuple)) and depth >= MAX_NESTING:
        raise RequestError(f"the messages nest dicts and lists more than {MAX_NESTING} levels deep, or contain "
                           "themselves (a cycle)")
    if isinstance(value, Mapping):
        return {str(key): _plain(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, depth + 1) for item in value]
    return f"<{type(value).__name__}>"


def _check_part(part: Any, where: str) -> None:
    if not isinstance(part, Mapping):
        raise RequestError(
            f"{where} must be a dict like {{'type': 'text', 'text': ...}}, got {type(part).__name__}"
        )
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where} is a text part without a string 'text'")
    elif kind == "image":
        payload = part.get("image")
        if not isinstance(payload, (str, os.PathLike, bytes, Image.Image)) or (
            isinstance(payload, (str, bytes)) and not payload
        ):
            raise RequestError(f"{where} is an image part whose 'image' is not a path, bytes or a PIL.Image")
    else:
        raise RequestError(f"{where} has type {kind!r}; supported part types are 'text' and 'image'")


def validate_messages(messages: Any) -> tuple[list[dict], list[ImagePayload]]:
    """Check OpenAI-style messages; returns plain copies for the template and the images in order.

    Raises ``RequestError`` naming the first offending message or part.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    images: list[ImagePayload] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise RequestError(f"{where} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise RequestError(f"{where} needs a 'role', one of {', '.join(ROLES)}; got {role!r}")
        content = message.get("content")
        if isinstance(content, str):  # "" too, as OpenAI's API takes it
            continue
        if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
            raise RequestError(f"{where}['content'] must be a string or a list of parts")
        if not content:  # as OpenAI's API, which refuses an empty array
            raise RequestError(f"{where}['content'] is an empty list: give it at least one part, or a string")
        for part_index, part in enumerate(content):
            _check_part(part, f"{where}['content'][{part_index}]")
            if part["type"] == "image":
                images.append(part["image"])
    return [_plain(message) for message in messages], images


def _check_unicode(text: str) -> None:
    """The tokenizer takes Unicode text only: a lone surrogate (from a bad decode) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(
            f"the messages hold text that is not valid Unicode ({error.reason}: {text[error.start:error.end]!r})"
        ) from None


def _per_image_counts(tokens_per_image: int | Sequence[int], num_images: int) -> list[int]:
    if isinstance(tokens_per_image, int):
        counts = [tokens_per_image] * num_images
    else:
        counts = [int(count) for count in tokens_per_image]
    if len(counts) != num_images or any(count < 1 for count in counts):
        raise RequestError(
            f"need one positive token count per image ({num_images} images), got {tokens_per_image!r}"
        )
    return counts


def expand_image_tokens(
    token_ids: list[int], image_token_id: int, counts: Sequence[int], image_wrap: tuple[int, int] | None = None
) -> tuple[list[int], tuple[Segment, ...]]:
    """Replace the i-th ``image_token_id`` by ``counts[i]`` copies; segments tile the result.

    ``image_wrap`` (start id, end id): each image's copies are written between these two text
    tokens, as InternVL's processor writes ``<img>`` and ``</img>`` around its ``<IMG_CONTEXT>`` run.
    """
    expanded: list[int] = []
    segments: list[Segment] = []
    run: list[int] = []
    image_index = 0
    for token_id in token_ids:
        if token_id != image_token_id:
            run.append(token_id)
            continue
        if image_wrap is not None:
            run.append(image_wrap[0])
        if run:
            segments.append(TextRun(tuple(run), len(expanded)))
            expanded.extend(run)
            run = []
        segments.append(ImageSlot(image_index, len(expanded), counts[image_index]))
        expanded.extend([image_token_id] * counts[image_index])
        image_index += 1
        if image_wrap is not None:
            run.append(image_wrap[1])
    if run:
        segments.append(TextRun(tuple(run), len(expanded)))
        expanded.extend(run)
    return expanded, tuple(segments)


def build_prompt(
    messages: Any,
    template: ChatTemplate,
    tokenizer: TextTokenizer,
    image_token_id: int,
    tokens_per_image: int | Sequence[int],
    add_generation_prompt: bool = True,
    image_wrap: tuple[int, int] | None = None,
    **template_kwargs: Any,
) -> Prompt:
    """messages -> ``Prompt`` (ids with each image placeholder expanded, segments, images).

    ``tokens_per_image``: one count for every image (LLaVA-1.5: (image_size / patch_size)^2) or
    one per image in order (dynamic-resolution models). ``image_wrap``: the text tokens written
    before and after each image's run (``expand_image_tokens``).
    """
    plain_messages, images = validate_messages(messages)
    text = template.render(
        plain_messages, tokenizer.special_tokens.as_template_vars(), add_generation_prompt, **template_kwargs
    )
    _check_unicode(text)
    bos = tokenizer.special_tokens.bos_token
    # as HF's processor after apply_chat_template: no second BOS when the template wrote one
    token_ids = tokenizer.encode(text, add_special_tokens=not (bos is not None and text.startswith(bos)))
    num_placeholders = token_ids.count(image_token_id)
    if num_placeholders != len(images):
        raise RequestError(
            f"the prompt has {num_placeholders} image placeholders for {len(images)} image parts; "
            f"do not write the image token ({tokenizer.id_to_token(image_token_id)!r}) in message text, "
            "and use a chat template that renders image parts"
        )
    expanded, segments = expand_image_tokens(
        token_ids, image_token_id, _per_image_counts(tokens_per_image, len(images)), image_wrap
    )
    return Prompt(token_ids=expanded, segments=segments, images=tuple(images), text=text)
