"""The HTTP routes (FastAPI): ``POST /v1/chat/completions`` (a JSON answer, or server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``.

Every error is an OpenAI error object (``api_errors``). With an API key, the ``/v1`` routes need
``Authorization: Bearer KEY`` (401 without it); ``/health`` and ``/metrics`` stay open for probes
and scrapers. A request's errors before its first token (a bad body or image, a prompt too long,
a full queue) are its response's status; a stream that fails later ends with an error event.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .api_errors import ApiError, api_error
from .engine import Engine, Job
from .images import ImageSource
from .schema import ChatRequest, chunk_body, completion_body, completion_id, parse_request, usage_chunk_body

DISCONNECT_POLL_S = 0.25  # how often a request waiting for its answer checks that its client is still there


def create_app(engine: Engine, model_id: str, images: ImageSource, api_key: str | None = None) -> FastAPI:
    """The server's app over a started ``engine``; ``model_id`` is the one model it serves."""
    app = FastAPI(title="conduit-rt", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        wrapped = ApiError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404 else None)
        return JSONResponse(wrapped.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        wrapped = api_error(error)
        return JSONResponse(wrapped.body(), status_code=wrapped.status, headers=wrapped.headers)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        state = engine.state
        arena = state.arena
        kv = {} if arena is None else {
            "bytes_used": arena.bytes_used, "bytes_total": arena.bytes_total, "image_bytes": arena.image_bytes,
            "blocks_used": arena.n_blocks_used, "blocks_free": arena.n_blocks_free, "sequences": arena.n_seqs,
            "kept_sequences": state.kept_sequences, "sequences_in_flight": state.sequences_in_flight,
            "image_entries": arena.n_image_entries, "image_evictions": arena.n_image_evictions}
        return {"status": "ok", "model": model_id, "running": state.running, "waiting": state.waiting, "kv": kv}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "conduit-rt"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.perf_counter()
        authorize(request)
        chat = parse_request(await request.body(), model_id)
        messages = await run_in_threadpool(images.resolve, chat.messages)
        job = Job(messages, chat.options, asyncio.get_running_loop(), chat.ignore_eos, arrived=arrived)
        engine.submit(job)
        event = await _next_event(engine, job, request)
        if event is None:  # the client left before its first token
            return Response(status_code=499)
        kind, value = event
        if kind == "error":
            raise value
        request_id = completion_id()
        if chat.stream:
            return EventSourceResponse(_chunks(engine, job, chat, request_id), sep="\n", ping=15)
        while True:
            event = await _next_event(engine, job, request)
            if event is None:
                return Response(status_code=499)
            kind, value = event
            if kind == "error":
                raise value
            if kind == "done":
                return JSONResponse(completion_body(request_id, chat.model, value))

    return app


async def _next_event(engine: Engine, job: Job, request: Request) -> tuple | None:
    """The job's next event; None (the job cancelled) once the client has disconnected."""
    try:
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(job)
                    return None
    except asyncio.CancelledError:
        engine.cancel(job)
        raise


async def _chunks(engine: Engine, job: Job, chat: ChatRequest, request_id: str) -> AsyncIterator[dict]:
    """The stream's events: the role, the text pieces, the finish reason (and the usage when asked),
    then ``[DONE]``; an error after the first token is an event with the error object. A client
    that disconnects cancels the generator, and with it the job."""
    def event(body: dict) -> dict:
        return {"data": json.dumps(body)}

    try:
        yield event(chunk_body(request_id, chat.model, {"role": "assistant", "content": ""}))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield event(chunk_body(request_id, chat.model, {"content": value}))
            elif kind == "error":
                yield event(value.body())
                return
            elif kind == "done":
                yield event(chunk_body(request_id, chat.model, {}, value.stats.finish_reason))
                if chat.include_usage:
                    yield event(usage_chunk_body(request_id, chat.model, value.stats))
                yield {"data": "[DONE]"}
                return
    finally:
        engine.cancel(job)  # nothing for a finished job
