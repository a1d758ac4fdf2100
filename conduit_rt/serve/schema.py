"""The chat-completions API's bodies: a request body -> ``ChatRequest`` (messages in conduit-rt's
form, validated ``GenerationOptions``), and the response and stream-chunk bodies of an answer.

The request takes OpenAI's fields (``model``, ``messages``, ``stream``, ``stream_options``,
``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``n`` = 1,
``user``; penalties, ``logprobs`` and ``response_format`` only at their defaults) and conduit-rt's
own (``refresh``, ``refresh_budget``, ``compress``, ``keep``, and ``ignore_eos``, which decodes
through end-of-sequence tokens up to ``max_tokens``). Any other field is an error that names it.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..errors import RequestError
from ..options import GenerationOptions
from ..results import GenerationResult, GenerationStats
from .api_errors import ApiError

# request fields passed to GenerationOptions under the same name
OPTION_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "refresh", "refresh_budget", "compress", "keep")
# OpenAI fields accepted only at their default value (the server implements none of them)
DEFAULT_ONLY = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "top_logprobs": None,
                "response_format": {"type": "text"}}
KNOWN_FIELDS = {"model", "messages", "stream", "stream_options", "max_completion_tokens", "user", "ignore_eos",
                *OPTION_FIELDS, *DEFAULT_ONLY}
ROLES = ("system", "developer", "user", "assistant")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A parsed request. ``messages``: conduit-rt's form, images still as ``image_url`` parts
    (``images.resolve`` turns them into payloads)."""

    model: str
    messages: list[dict]
    options: GenerationOptions
    stream: bool
    include_usage: bool
    ignore_eos: bool


def parse_request(body: bytes, model_id: str) -> ChatRequest:
    """Checks a request body. Raises ApiError: 400 for malformed JSON, a missing or unknown field, a
    bad message or option value (``param`` names it); 404 for a model other than ``model_id``."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON ({error}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(data) - KNOWN_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}; the fields are {', '.join(sorted(KNOWN_FIELDS))}",
                       param=unknown[0], code="unknown_parameter")
    model = data.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required: a string (GET /v1/models lists the model)", param="model",
                       code="missing_required_parameter" if model is None else "invalid_type")
    if model != model_id:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves {model_id!r}",
                       param="model", code="model_not_found")
    for name, default in DEFAULT_ONLY.items():
        if name in data and data[name] is not None and data[name] != default:
            raise ApiError(400, f"{name} must be {json.dumps(default)} (the server supports no other value)",
                           param=name, code="unsupported_value")
    stream, include_usage, ignore_eos = _flag(data, "stream"), _include_usage(data), _flag(data, "ignore_eos")
    return ChatRequest(model, _messages(data.get("messages")), _options(data), stream, include_usage, ignore_eos)


def _flag(data: dict, name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", param=name, code="invalid_type")
    return value


def _include_usage(data: dict) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options must be an object with the one field include_usage",
                       param="stream_options", code="invalid_value")
    return _flag(options, "include_usage")


def _options(data: dict) -> GenerationOptions:
    """The request's GenerationOptions; a bad value is a 400 naming the field."""
    fields = {name: data[name] for name in OPTION_FIELDS if data.get(name) is not None}
    if data.get("max_completion_tokens") is not None:
        fields["max_tokens"] = data["max_completion_tokens"]
    try:
        return GenerationOptions(**fields)
    except RequestError as error:
        raise ApiError(400, str(error), param=_field_at_fault(fields), code="invalid_value") from None


def _field_at_fault(fields: dict) -> str | None:
    """The first of ``fields`` that GenerationOptions refuses on its own."""
    for name, value in fields.items():
        try:
            GenerationOptions(**{name: value})
        except RequestError:
            return name
    return None


def _messages(messages) -> list[dict]:
    """OpenAI messages -> conduit-rt's: string content or parts ``text`` and ``image_url`` (kept as
    they are; resolved later). Raises ApiError naming the message or part at fault."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list of {role, content} objects", param="messages",
                       code="missing_required_parameter" if messages is None else "invalid_value")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"{where} must be an object whose role is one of {', '.join(ROLES)}",
                           param=f"{where}.role", code="invalid_value")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    return out


def _content(content, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of parts", param=where, code="invalid_value")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ApiError(400, f"{where}[{j}].image_url must be {{\"url\": \"...\"}}",
                               param=f"{where}[{j}].image_url", code="invalid_value")
            parts.append({"type": "image_url", "url": url, "param": f"{where}[{j}].image_url"})
        else:
            raise ApiError(400, f"{where}[{j}] must be a part of type text (with a string text) or image_url",
                           param=f"{where}[{j}]", code="invalid_value")
    return parts


# -- responses -----------------------------------------------------------------------------------------
def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(stats: GenerationStats) -> dict:
    """Token counts: ``cached_tokens`` are the prompt tokens whose KV came from the cache and was not
    recomputed (the exact prefix, and the restored image tokens that were not refreshed)."""
    cached = stats.reused_tokens + stats.visual_tokens - stats.refreshed_tokens
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.decode_tokens,
            "total_tokens": stats.prompt_tokens + stats.decode_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def conduit_stats(stats: GenerationStats) -> dict:
    """What the request did beyond OpenAI's usage: the image-KV cache, refresh and compression."""
    return {"ttft_s": stats.ttft_s, "images": stats.images, "image_hits": stats.image_hits,
            "image_disk_hits": stats.image_disk_hits, "image_misses": stats.image_misses,
            "visual_tokens": stats.visual_tokens, "refreshed_tokens": stats.refreshed_tokens,
            "prefill_flops_ratio": stats.prefill_flops_ratio, "kv_bytes": stats.kv_bytes}


def completion_body(request_id: str, model: str, result: GenerationResult) -> dict:
    """The non-streamed response."""
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": FINISH_REASONS[result.stats.finish_reason], "logprobs": None}],
            "usage": usage(result.stats), "conduit": conduit_stats(result.stats)}


def chunk_body(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    """One streamed chunk: ``delta`` is {"role": ...} first, then {"content": ...} pieces, then {}
    with the finish reason (``GenerationStats.finish_reason``)."""
    reason = FINISH_REASONS[finish_reason] if finish_reason else None
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}


def usage_chunk_body(request_id: str, model: str, stats: GenerationStats) -> dict:
    """The last streamed chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(stats), "conduit": conduit_stats(stats)}
