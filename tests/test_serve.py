"""``conduit serve`` end to end: the real ``openai`` client against servers started in subprocesses
on the bundled model (CPU), their answers checked against ``Runtime.generate`` on the same messages
in this process, and every error path checked for its status and OpenAI error object."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import conduit_rt  # noqa: E402
from conduit_rt.evaluation.task.data import build_pool  # noqa: E402
from conduit_rt.evaluation.task.generator import retagged_request  # noqa: E402
from conduit_rt.runtime import Runtime  # noqa: E402

from .test_readme import readme_block  # noqa: E402

MODEL = "quality_model"
N_CLIENTS = 8
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``conduit serve`` in a subprocess on a free port, with ``options``."""

    def __init__(self, cache: Path, *options: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "CONDUIT_CACHE": str(cache)}
        self.process = subprocess.Popen([sys.executable, "-m", "conduit_rt.cli", "serve", "--device", "cpu",
                                         "--port", str(self.port), *options],
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"conduit serve exited: {self.process.stderr.read()}")
            try:
                httpx.get(self.base + "/health", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("conduit serve did not start")

    def client(self, api_key: str = "none") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()

    def metric(self, name: str) -> float:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{"))

    def idle(self) -> dict:
        """/health once no request runs or waits."""
        for _ in range(400):
            health = self.health()
            if health["running"] == 0 and health["waiting"] == 0:
                return health
            time.sleep(0.05)
        raise AssertionError(f"the server never went idle: {health}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("conduit-cache")
    before = os.environ.get("CONDUIT_CACHE")
    os.environ["CONDUIT_CACHE"] = str(path)  # the in-process reference runtimes convert into it too
    yield path
    if before is None:
        os.environ.pop("CONDUIT_CACHE", None)
    else:
        os.environ["CONDUIT_CACHE"] = before


@pytest.fixture(scope="module")
def server(cache):
    server = Server(cache, "--max-batch", "8")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded(server, cache):
    """A server with an API key that decodes one request at a time and queues one more."""
    guarded = Server(cache, "--api-key", "sesame", "--max-batch", "1", "--max-queue", "1")
    yield guarded
    guarded.stop()


@pytest.fixture(scope="module")
def task_requests():
    return build_pool(seed=0, split="test", size=64).requests(N_CLIENTS, min_pages=1, max_pages=2)


def png_data_uri(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def openai_messages(request, url=png_data_uri) -> list[dict]:
    """A task request's messages with each page as an image_url part (``url`` of the PIL image)."""
    parts = []
    for part in request.messages()[0]["content"]:
        parts.append({"type": "image_url", "image_url": {"url": url(part["image"])}} if part["type"] == "image"
                     else part)
    return [{"role": "user", "content": parts}]


def reference(messages_list: list[list[dict]], **options) -> list:
    """Serial answers of a fresh in-process Runtime, one request after another."""
    with Runtime(conduit_rt.BUNDLED_MODEL, device="cpu") as runtime:
        return [runtime.generate(m, **options) for m in messages_list]


# -- answers -----------------------------------------------------------------------------------------

def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    health = server.health()
    assert health["status"] == "ok" and health["kv"]["bytes_total"] > 0


def test_chat_with_an_image_answers_as_the_runtime(server, task_requests):
    request = task_requests[0]
    reply = server.client().chat.completions.create(model=MODEL, messages=openai_messages(request), max_tokens=8)
    (expected,) = reference([request.messages()], max_tokens=8)
    assert reply.choices[0].message.content == expected.text
    assert expected.text.strip() == request.answer  # the bundled model reads its pages
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == expected.stats.prompt_tokens
    assert reply.usage.completion_tokens == expected.stats.decode_tokens


def test_streaming_gives_the_same_text_and_usage(server, task_requests):
    client, messages = server.client(), openai_messages(task_requests[1])
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_refresh_options_through_extra_body_reuse_the_images(server, task_requests):
    request = task_requests[2]
    earlier = retagged_request(request, salt=5)
    options = {"refresh": "conduit", "refresh_budget": 0.1}
    client = server.client()
    client.chat.completions.create(model=MODEL, messages=openai_messages(earlier), max_tokens=8, extra_body=options)
    again = client.chat.completions.create(model=MODEL, messages=openai_messages(request), max_tokens=8,
                                           extra_body=options)
    first, expected = reference([earlier.messages(), request.messages()], max_tokens=8, **options)
    stats = expected.stats
    assert again.choices[0].message.content == expected.text
    assert again.model_extra["conduit"]["image_hits"] == stats.images > 0
    assert again.model_extra["conduit"]["refreshed_tokens"] == stats.refreshed_tokens
    cached = stats.reused_tokens + stats.visual_tokens - stats.refreshed_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == cached > 0
    assert server.metric("conduit_image_kv_hits_total") >= stats.images


def test_concurrent_clients_decode_together_and_answer_as_serial(server, task_requests):
    client = server.client()
    steps, tokens = server.metric("conduit_decode_steps_total"), server.metric("conduit_generated_tokens_total")

    def ask(request) -> str:
        reply = client.chat.completions.create(model=MODEL, messages=openai_messages(request), max_tokens=8)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(N_CLIENTS) as pool:
        answers = list(pool.map(ask, task_requests))
    expected = reference([r.messages() for r in task_requests], max_tokens=8)
    assert answers == [e.text for e in expected]
    steps = server.metric("conduit_decode_steps_total") - steps
    tokens = server.metric("conduit_generated_tokens_total") - tokens
    assert tokens == sum(e.stats.decode_tokens + (e.stats.finish_reason == "eos") for e in expected)
    assert steps < tokens  # some steps decoded several requests at once
    assert server.idle()["kv"]["sequences_in_flight"] == 0


def test_a_restart_with_the_same_cache_dir_turns_image_misses_into_hits(cache, task_requests, tmp_path):
    """The first server stores the images' KV under --cache-dir; a new server on that folder loads
    them from the files before its first request (in-memory hits), one started with --no-preload
    loads them on the request's path (disk hits); for the same request (with a refresh policy: a
    plain request prefills in full) both answer with the first one's text."""
    request = task_requests[3]
    options = {"refresh": "conduit", "refresh_budget": 0.1}
    answers = []
    for extra in ((), (), ("--no-preload",)):
        server = Server(cache, "--cache-dir", str(tmp_path / "image-kv"), *extra)
        try:
            reply = server.client().chat.completions.create(model=MODEL, messages=openai_messages(request),
                                                            max_tokens=8, extra_body=options)
        finally:
            server.stop()  # SIGTERM: the Runtime closes and writes the queued entries
        answers.append(reply)
    first, preloaded, on_demand = answers
    images = len(request.pages)
    assert first.model_extra["conduit"]["image_hits"] == 0 and first.model_extra["conduit"]["image_misses"] == images
    assert preloaded.model_extra["conduit"]["image_hits"] == images
    assert preloaded.model_extra["conduit"]["image_disk_hits"] == 0  # in memory before the request came
    assert on_demand.model_extra["conduit"]["image_disk_hits"] == images
    for reply in (preloaded, on_demand):
        assert reply.choices[0].message.content == first.choices[0].message.content
    assert first.choices[0].message.content.strip() == request.answer


def test_image_from_an_http_url(server, task_requests, tmp_path):
    request = task_requests[3]
    pages = [part["image"] for part in request.messages()[0]["content"] if part["type"] == "image"]
    for i, page in enumerate(pages):
        page.save(tmp_path / f"page{i}.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as files:
        threading.Thread(target=files.serve_forever, daemon=True).start()
        host, port = files.server_address[:2]
        names = iter(range(len(pages)))
        messages = openai_messages(request, url=lambda image: f"http://{host}:{port}/page{next(names)}.png")
        reply = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        files.shutdown()
    assert reply.choices[0].message.content.strip() == request.answer


def test_a_disconnect_mid_stream_frees_its_kv_and_the_server_goes_on(server):
    messages = [{"role": "user", "content": "Say something long about the pages you read today."}]
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    baseline = server.idle()["kv"]
    cancelled = server.metric('conduit_requests_total{outcome="cancelled"}')
    body = {"model": MODEL, "messages": messages, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        contents = 0
        while contents < 3:  # the answer is decoding
            line = next(lines)
            contents += line.startswith("data:") and '"content"' in line
    after = server.idle()["kv"]
    assert server.metric('conduit_requests_total{outcome="cancelled"}') == cancelled + 1
    for key in ("bytes_used", "sequences", "blocks_used", "kept_sequences"):
        assert after[key] == baseline[key], key
    assert after["sequences_in_flight"] == 0
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert again.choices[0].message.content == first.choices[0].message.content


# -- errors -----------------------------------------------------------------------------------------

def post(server, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.base + "/v1/chat/completions", content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["param"] == param, error


HELLO = [{"role": "user", "content": "hello"}]
GARBAGE_PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot an image at all").decode()


@pytest.mark.parametrize("body, status, code, param", [
    (b"{not json", 400, "invalid_json", None),
    ([1, 2], 400, "invalid_json", None),
    ({"model": "gpt-4o", "messages": HELLO}, 404, "model_not_found", "model"),
    ({"messages": HELLO}, 400, "missing_required_parameter", "model"),
    ({"model": MODEL, "messages": []}, 400, "invalid_value", "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_value", "messages[0].role"),
    ({"model": MODEL, "messages": HELLO, "temperature": -1}, 400, "invalid_value", "temperature"),
    ({"model": MODEL, "messages": HELLO, "top_p": 0}, 400, "invalid_value", "top_p"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": "many"}, 400, "invalid_value", "max_tokens"),
    ({"model": MODEL, "messages": HELLO, "refresh": "sometimes"}, 400, "invalid_value", "refresh"),
    ({"model": MODEL, "messages": HELLO, "refresh_budget": 2}, 400, "invalid_value", "refresh_budget"),
    ({"model": MODEL, "messages": HELLO, "compress": "vlcache", "keep": 0}, 400, "invalid_value", "keep"),
    ({"model": MODEL, "messages": HELLO, "n": 2}, 400, "unsupported_value", "n"),
    ({"model": MODEL, "messages": HELLO, "frobnicate": True}, 400, "unknown_parameter", "frobnicate"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 100000}, 400, "context_length_exceeded", "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": GARBAGE_PNG}}]}]},
     400, "invalid_image", "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
     400, "invalid_image_url", "messages[0].content[0].image_url"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}]},
     400, "invalid_image_url", "messages[0].content[0].image_url"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]},
     400, "invalid_image_url", "messages[0].content[0].image_url"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, code, param):
    assert_error(post(server, body), status, code, param)
    reply = server.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert reply.usage.completion_tokens + (reply.choices[0].finish_reason == "stop") >= 1


def test_the_openai_client_raises_its_own_error_types(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=-1)
    assert error.value.code == "invalid_value" and error.value.param == "temperature"
    assert_error(httpx.get(server.base + "/v1/nothing-here", timeout=10), 404, "not_found")


def test_the_api_key_is_required(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    assert_error(post(guarded, {"model": MODEL, "messages": HELLO}), 401, "invalid_api_key")
    reply = guarded.client("sesame").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert reply.choices[0].message.role == "assistant"
    assert httpx.get(guarded.base + "/health", timeout=10).status_code == 200  # probes need no key


def test_a_full_queue_gets_503_with_retry_after_and_nothing_is_lost(guarded):
    headers = {"authorization": "Bearer sesame"}
    client = guarded.client("sesame")
    expected = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4).choices[0].message.content
    long = {"model": MODEL, "messages": HELLO, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", guarded.base + "/v1/chat/completions", json=long, headers=headers, timeout=60) as running:
        lines = running.iter_lines()  # kept: closing the iterator would close the response
        while '"content"' not in next(lines):  # the batch of one is full
            pass
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.chat.completions.create, model=MODEL, messages=HELLO, max_tokens=4)
            while guarded.health()["waiting"] < 1:
                time.sleep(0.02)
            refused = post(guarded, {"model": MODEL, "messages": HELLO}, headers=headers)
            assert_error(refused, 503, "server_overloaded")
            assert int(refused.headers["retry-after"]) >= 1
            with pytest.raises(openai.InternalServerError):  # the client's class for a 503
                client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
            running.close()  # the long answer's client leaves: the queued request runs
            assert queued.result(timeout=120).choices[0].message.content == expected
    assert guarded.idle()["kv"]["sequences_in_flight"] == 0


# -- the README ---------------------------------------------------------------------------------------

def test_readme_serve_example_runs_as_written(server, capsys):
    code = readme_block("serve-example").replace("http://127.0.0.1:8000", server.base)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    reply = namespace["reply"]
    assert reply.model == MODEL
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert capsys.readouterr().out == f"{reply.choices[0].message.content} {cached}\n"
