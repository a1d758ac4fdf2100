"""Tensor parallelism on the CPU: two gloo ranks against one process, on tiny random LLaVA-1.5 and
Qwen2.5-VL checkpoints in float32. Each rank holds half of the attention heads, KV heads, MLP
width and vocabulary; the answers, CONDUIT's refreshed tokens and VL-Cache's kept tokens must be
those of the whole model in one process."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conduit_rt import Runtime
from conduit_rt.errors import RuntimeClosedError, TensorParallelError, WorkerFailedError
from conduit_rt.models import load_model
from conduit_rt.parallel.driver import ParallelRuntime
from conduit_rt.parallel.sharding import check_shardable
from tests.fixtures.references import build_and_convert
from tests.fixtures.tiny_llava import build_tiny_llava
from tests.fixtures.tiny_qwen2vl import build_tiny_qwen2vl

RTOL = 1e-4  # of max |logits| of the single process
N_NEW = 16
KV_BYTES = 8 << 20  # each rank's arena; the single process gets as many blocks (twice the bytes)
SIZES = {"llava": [(30, 30)] * 3, "qwen2.5vl": [(41, 97), (90, 130), (13, 300)]}


@pytest.fixture(scope="module", params=["llava", "qwen2.5vl"])
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def converted(model_name, tmp_path_factory):
    if model_name == "llava":
        return build_and_convert(build_tiny_llava, tmp_path_factory, "llava", seed=11)[1]
    return build_and_convert(build_tiny_qwen2vl, tmp_path_factory, "qwen25", version="2.5", seed=3)[1]


@pytest.fixture(scope="module")
def pair(converted):
    """(one process, two ranks) over the same model, with arenas of the same number of blocks."""
    one = Runtime(converted / "model.gguf", device="cpu", kv_cache_bytes=2 * KV_BYTES, prefix_cache_entries=0)
    two = Runtime(converted / "model.gguf", device="cpu", kv_cache_bytes=KV_BYTES, prefix_cache_entries=0,
                  tensor_parallel=2)
    yield one, two
    two.close()
    one.close()


def pictures(model_name: str, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)) for size in SIZES[model_name]]


def request(images: list[Image.Image], question: str = "Which one is brightest?") -> list[dict]:
    content = [{"type": "text", "text": "Look:"}] + [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def assert_same_answer(expected, got) -> None:
    assert got.tokens == expected.tokens
    scale = expected.logits.abs().max()
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=RTOL * scale)


def test_a_tensor_parallel_runtime_is_the_parallel_driver(pair):
    assert isinstance(pair[1], ParallelRuntime) and len(pair[1].worker_pids) == 2


def test_logits_and_greedy_tokens_equal_one_process(pair, model_name):
    one, two = pair
    messages = request(pictures(model_name, seed=5))
    expected = one.generate(messages, max_tokens=N_NEW, return_logits=True)
    got = two.generate(messages, max_tokens=N_NEW, return_logits=True)
    assert len(got.tokens) == N_NEW
    assert_same_answer(expected, got)


def test_conduit_refreshes_the_same_tokens_as_one_process(pair, model_name):
    one, two = pair
    images = pictures(model_name, seed=7)
    for runtime in pair:  # every image's KV stored (filled alone), then restored in a new order
        runtime.generate(request(images), max_tokens=1, refresh="conduit")
    messages = request(images[::-1], "Describe the second one.")
    kw = dict(max_tokens=4, return_logits=True, refresh="conduit", refresh_budget=0.3, trace_selection=True,
              refresh_options={"lam": 1.0})
    expected, got = one.generate(messages, **kw), two.generate(messages, **kw)
    assert expected.stats.refreshed_tokens > 0
    assert got.stats.restored_positions == expected.stats.restored_positions
    assert got.stats.refreshed_positions == expected.stats.refreshed_positions
    assert_same_answer(expected, got)


@pytest.mark.parametrize("name", ["vlcache", "snapkv"])
def test_compression_keeps_the_same_tokens_as_one_process(pair, model_name, name):
    one, two = pair
    messages = request(pictures(model_name, seed=9))
    kw = dict(max_tokens=6, return_logits=True, compress=name, keep=0.3, trace_selection=True)
    expected, got = one.generate(messages, **kw), two.generate(messages, **kw)
    assert got.stats.kept_positions == expected.stats.kept_positions
    assert got.stats.kept_tokens_per_layer == expected.stats.kept_tokens_per_layer
    assert_same_answer(expected, got)


def test_streams_and_chat_turns_equal_one_process(pair, model_name):
    one, two = pair
    messages = request(pictures(model_name, seed=11)[:1])
    stream = two.stream(messages, max_tokens=8)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == one.generate(messages, max_tokens=8).text
    turns = [[{"type": "image", "image": pictures(model_name, seed=12)[0]}, {"type": "text", "text": "What?"}],
             "And then?"]
    chat_one, chat_two = one.chat(), two.chat()
    for content in turns:
        expected, got = chat_one.send(content, max_tokens=5), chat_two.send(content, max_tokens=5)
        assert got.tokens == expected.tokens and got.stats.reused_tokens == expected.stats.reused_tokens
    assert chat_two.history == chat_one.history
    chat_two.close()


def test_an_early_closed_stream_leaves_the_ranks_in_step(pair, model_name):
    one, two = pair
    stream = two.stream(request(pictures(model_name, seed=13)[:1]), max_tokens=12)
    next(stream)
    stream.close()
    messages = request(pictures(model_name, seed=14)[:2])
    expected = one.generate(messages, max_tokens=N_NEW, return_logits=True)
    assert_same_answer(expected, two.generate(messages, max_tokens=N_NEW, return_logits=True))


def test_request_errors_reach_the_caller_and_the_runtime_keeps_answering(pair, model_name):
    _, two = pair
    with pytest.raises(TensorParallelError, match="cacheblend"):
        two.generate(request([]), max_tokens=1, refresh="cacheblend")
    with pytest.raises(Exception) as raised:
        two.generate([{"role": "wizard", "content": "hi"}], max_tokens=1)
    assert type(raised.value).__module__ == "conduit_rt.errors"
    assert len(two.generate(request([]), max_tokens=3).tokens) == 3


def test_a_model_that_cannot_be_split_evenly_is_refused(converted):
    config = load_model(converted / "model.gguf", None, "cpu", torch.float32).config
    check_shardable(config, 2)
    with pytest.raises(TensorParallelError, match="4 attention heads"):
        check_shardable(config, 3)
    with pytest.raises(TensorParallelError, match="cache_dir"):
        Runtime(converted / "model.gguf", device="cpu", tensor_parallel=2, cache_dir=converted / "cache")


def test_a_killed_worker_is_a_typed_error_in_the_caller(converted, model_name):
    if model_name != "llava":
        pytest.skip("one model suffices")
    runtime = Runtime(converted / "model.gguf", device="cpu", kv_cache_bytes=KV_BYTES, tensor_parallel=2)
    os.kill(runtime.worker_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1"):
        runtime.generate(request(pictures(model_name)), max_tokens=4)
    assert time.monotonic() - start < 5.0
    with pytest.raises(RuntimeClosedError):
        runtime.generate(request([]), max_tokens=1)
    runtime.close()
