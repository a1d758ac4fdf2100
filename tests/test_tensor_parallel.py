"""Tensor parallelism on the CPU: two gloo ranks against one process, on tiny random LLaVA-1.5 and
Qwen2.5-VL checkpoints in float32. Each rank holds half of the attention heads, KV heads, MLP
width and vocabulary; the answers, CONDUIT's refreshed tokens and VL-Cache's kept tokens must be
those of the whole model in one process. Each rank reads only its share: the memory its model
holds is the share counted from the checkpoint's config, and what it loads equals the same share
cut from the whole model."""
from __future__ import annotations

import math
import os
import signal
import socket
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conduit_rt import Runtime
from conduit_rt.errors import RuntimeClosedError, TensorParallelError, WorkerFailedError
from conduit_rt.gguf_names import is_rope_permuted
from conduit_rt.model_file import load_mmproj_file, load_text_model_file
from conduit_rt.models import load_model
from conduit_rt.parallel.driver import ParallelRuntime
from conduit_rt.parallel.group import TensorParallelGroup
from conduit_rt.parallel.sharding import DecoderShard, check_shardable
from conduit_rt.parallel.worker import WorkerSpec, open_runtime
from tests.fixtures.references import build_and_convert
from tests.fixtures.tiny_internvl import build_tiny_internvl
from tests.fixtures.tiny_llava import build_tiny_llava
from tests.fixtures.tiny_qwen2vl import build_tiny_qwen2vl
from tests.fixtures.tiny_qwen3vl import build_tiny_qwen3vl

RTOL = 1e-4  # of max |logits| of the single process
N_NEW = 16
KV_BYTES = 8 << 20  # each rank's arena; the single process gets as many blocks (twice the bytes)
SIZES = {"llava": [(30, 30)] * 3, "qwen2.5vl": [(41, 97), (90, 130), (13, 300)]}
# tiny checkpoint -> how it is built (the first two are the ones the Runtimes below run)
CHECKPOINTS = {
    "llava": lambda factory, name: build_and_convert(build_tiny_llava, factory, name, seed=11),
    "qwen2.5vl": lambda factory, name: build_and_convert(build_tiny_qwen2vl, factory, name, version="2.5", seed=3),
    # q/k rows permuted head by head at load
    "qwen3vl": lambda factory, name: build_and_convert(build_tiny_qwen3vl, factory, name, seed=5),
    "internvl": lambda factory, name: build_and_convert(build_tiny_internvl, factory, name, seed=7),  # tied embeddings
}


@pytest.fixture(scope="module", params=["llava", "qwen2.5vl"])
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(model_name, tmp_path_factory):
    """(source folder, converted folder) of the tiny checkpoint."""
    return CHECKPOINTS[model_name](tmp_path_factory, model_name.replace(".", ""))


@pytest.fixture(scope="module")
def converted(checkpoint):
    return checkpoint[1]


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


# -- loading shard by shard ------------------------------------------------------------------------
def parameter_bytes(module: torch.nn.Module) -> int:
    """The bytes of the storages that ``module``'s parameters live in, each storage once (stacked
    projections and tied weights share one): the memory the module holds, however it was loaded."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}
    return sum(storages.values())


def decoder_share_bytes(text_config, rank: int, size: int, qkv_bias: bool, output_bias: bool) -> int:
    """The float32 bytes of rank ``rank``'s share of an untied Llama-style decoder, counted from its
    transformers config: the q/k/v/o and gate/up/down matrices and the q/k/v biases split over
    ``size`` ranks, the norms and the token embeddings whole, the LM head's rows of the vocabulary
    padded to a multiple of ``size``, and o_proj's bias on rank 0 only."""
    c = text_config
    hidden, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    split = layers * ((2 * q + 2 * kv + 3 * c.intermediate_size) * hidden + (q + 2 * kv if qkv_bias else 0))
    whole = layers * 2 * hidden + hidden + vocab * hidden + (layers * hidden if output_bias and rank == 0 else 0)
    assert split % size == 0
    return 4 * (split // size + whole + math.ceil(vocab / size) * hidden)


def rank_parameter_bytes(rank: int, size: int, spec: WorkerSpec, port: int, results) -> None:
    """One rank started as the driver starts its workers: builds its Runtime (``worker.open_runtime``)
    and reports the bytes of its model's parameters, of its decoder's, and whether it has a tower."""
    group = TensorParallelGroup.join(rank, size, torch.device("cpu"), "127.0.0.1", port)
    runtime = open_runtime(spec, group)
    model = runtime.model
    results.put((rank, parameter_bytes(model), parameter_bytes(model.language_model),
                 model.vision_module() is not None, runtime.arena.stats().n_blocks_total))
    runtime.close()
    group.close()


def test_each_rank_holds_its_share_of_the_decoder_and_only_rank_0_the_vision_weights(checkpoint, model_name):
    from gguf import GGUFReader
    from transformers import AutoConfig

    source, converted = checkpoint
    text_config = AutoConfig.from_pretrained(source).get_text_config()
    qkv_bias, output_bias = (text_config.attention_bias,) * 2 if model_name == "llava" else (True, False)
    vision_bytes = 4 * sum(int(t.n_elements) for t in GGUFReader(converted / "mmproj.gguf").tensors)
    whole = load_model(converted / "model.gguf", converted / "mmproj.gguf", "cpu", torch.float32)
    assert parameter_bytes(whole) == decoder_share_bytes(text_config, 0, 1, qkv_bias, output_bias) + vision_bytes

    spec = WorkerSpec(str(converted / "model.gguf"), str(converted / "mmproj.gguf"), "cpu", torch.float32,
                      {"prefix_cache_entries": 0})  # the default arena, which the ranks agree on
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = torch.multiprocessing.get_context("spawn").SimpleQueue()
    torch.multiprocessing.spawn(rank_parameter_bytes, args=(2, spec, port, results), nprocs=2)
    reports = sorted(results.get() for _ in range(2))
    for rank, total, decoder, has_tower, _ in reports:
        assert decoder == decoder_share_bytes(text_config, rank, 2, qkv_bias, output_bias)
        assert total - decoder == (vision_bytes if rank == 0 else 0)
        assert has_tower == (rank == 0)
    assert reports[0][-1] == reports[1][-1] > 0


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def any_converted(request, tmp_path_factory):
    return request.param, CHECKPOINTS[request.param](tmp_path_factory, f"{request.param.replace('.', '')}_any")[1]


def megatron_share(whole: torch.nn.Module, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s parameters cut from a whole loaded decoder: the rank's equal chunk of the
    rows of q/k/v (its heads and KV heads, biases with them) and gate/up, of the columns of o_proj
    and down, of the LM head's rows after padding the vocabulary to a multiple of ``size``; o_proj's
    bias on rank 0 only; everything else whole."""
    share = {}
    for name, param in whole.named_parameters(remove_duplicate=False):
        module = name.rsplit(".", 2)[-2] if "." in name else name
        if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            share[name] = param.chunk(size, dim=0)[rank]
        elif module in ("o_proj", "down_proj") and name.endswith("weight"):
            share[name] = param.chunk(size, dim=1)[rank]
        elif module in ("o_proj", "down_proj"):
            if rank == 0:
                share[name] = param
        elif name == "lm_head.weight":
            padded = torch.cat([param, param.new_zeros(-param.shape[0] % size, param.shape[1])])
            share[name] = padded.chunk(size, dim=0)[rank]
        else:
            share[name] = param
    return share


def test_a_rank_loads_the_share_it_would_cut_from_the_whole_model(any_converted):
    name, converted = any_converted
    paths = converted / "model.gguf", converted / "mmproj.gguf"
    whole = load_model(*paths, "cpu", torch.float32)
    for rank in range(2):
        model = load_model(*paths, "cpu", torch.float32, shard=DecoderShard(rank, 2))
        expected = megatron_share(whole.language_model, rank, 2)
        loaded = dict(model.language_model.named_parameters(remove_duplicate=False))
        assert sorted(loaded) == sorted(expected)
        for param, tensor in expected.items():
            assert torch.equal(loaded[param], tensor), f"{name} rank {rank}: {param}"
        layers = model.language_model.layers
        assert all(layer.self_attn.stack_current() and layer.mlp.stack_current() for layer in layers)
        assert (model.config.n_heads, model.config.n_kv_heads, model.config.intermediate) == (
            whole.config.n_heads // 2, whole.config.n_kv_heads // 2, whole.config.intermediate // 2)
        assert model.has_vision and (model.vision_module() is not None) == (rank == 0)
        assert model.assets.vision_model_id == whole.assets.vision_model_id
    with pytest.raises(TensorParallelError, match="attention heads"):
        load_model(*paths, "cpu", torch.float32, shard=DecoderShard(0, 3))


@pytest.mark.parametrize("stored", ["f16", "bf16", "q8_0"])
def test_a_block_read_from_a_file_equals_that_block_of_the_whole_tensor(checkpoint, tmp_path, stored):
    from conduit_rt.convert.cli import main as convert_main

    source, _ = checkpoint
    assert convert_main([str(source), "--outdir", str(tmp_path), "--dtype", stored, "--quiet"]) == 0
    text = load_text_model_file(tmp_path / "model.gguf")
    head_dim = text.config.head_dim
    for model_file in (text, load_mmproj_file(tmp_path / "mmproj.gguf", text)):
        for name in model_file.tensor_names:
            whole = model_file.tensor(name)
            n = whole.shape[0]
            # llama.cpp's q/k rows are unpermuted head by head: a block of them holds whole heads
            rows = (head_dim, n) if model_file is text and is_rope_permuted(name) else (3, n - 2)
            assert torch.equal(model_file.tensor(name, rows=rows), whole[rows[0]: rows[1]]), name
            if whole.ndim == 2:
                columns = (5, whole.shape[1] - 3)  # inside Q8_0's 32-value blocks at both ends
                block = model_file.tensor(name, rows=rows, columns=columns)
                assert torch.equal(block, whole[rows[0]: rows[1], columns[0]: columns[1]]), name
    if text.config.architecture == "llama":
        with pytest.raises(ValueError, match="split a head"):
            text.tensor("blk.0.attn_q.weight", rows=(1, head_dim + 1))
