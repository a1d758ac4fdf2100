"""The Runtime end to end on a converted tiny LLaVA-1.5, against transformers' generate."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from conduit_rt import Runtime
from conduit_rt.errors import RequestError
from conduit_rt.convert.cli import main as convert_main
from tests.fixtures.tiny_llava import build_tiny_llava

N_NEW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf_dir = build_tiny_llava(tmp_path_factory.mktemp("hf"), seed=3)
    out = tmp_path_factory.mktemp("gguf")
    assert convert_main([str(hf_dir), "--outdir", str(out), "--dtype", "f32"]) == 0
    return hf_dir, out


@pytest.fixture(scope="module")
def runtime(checkpoint):
    _, out = checkpoint
    return Runtime(out / "model.gguf", device="cpu", kv_cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf_dir, _ = checkpoint
    model = LlavaForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(hf_dir)


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(37, 53), (30, 30), (61, 17), (44, 44)]
    return [Image.fromarray(rng.integers(0, 255, (*sizes[i % 4], 3), dtype=np.uint8)) for i in range(n)]


def user(text: str, imgs: list[Image.Image]) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": im} for im in imgs] + [{"type": "text", "text": text}]}


def hf_generate(hf, messages: list[dict], n_new: int = N_NEW):
    """transformers' greedy generate: (new token ids without a final EOS, per-step logits [steps, vocab])."""
    model, processor = hf
    hf_messages = [{"role": m["role"], "content": [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})}
                                                  for p in m["content"]] if isinstance(m["content"], list) else
                    [{"type": "text", "text": m["content"]}]} for m in messages]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    imgs = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    # the template already wrote BOS (as apply_chat_template(tokenize=True) does, no second one)
    inputs = processor(text=text, images=imgs or None, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n_new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logits = torch.stack(out.logits)[:, 0]
    eos = model.generation_config.eos_token_id
    if new and new[-1] == eos:
        new = new[:-1]
    return new, logits


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_greedy_tokens_and_logits_equal_transformers(runtime, hf, n_images):
    messages = [user("What is in the picture and why?", images(n_images, seed=n_images))]
    expected, expected_logits = hf_generate(hf, messages)
    result = runtime.generate(messages, max_tokens=N_NEW, return_logits=True)
    assert result.tokens == expected
    steps = result.logits.shape[0]
    scale = expected_logits.abs().max()
    assert (result.logits - expected_logits[:steps]).abs().max() <= 1e-4 * scale
    assert result.stats.prompt_tokens == result.stats.prefill_tokens > n_images * 25
    assert result.stats.images == n_images and result.stats.kv_bytes > 0
    assert runtime.arena.stats().n_seqs == len(runtime.planner.prefix_cache)  # kept for exact-prefix reuse, nothing else


def test_stream_pieces_join_to_the_generated_text(runtime):
    messages = [user("Describe it.", images(1))]
    stream = runtime.stream(messages, max_tokens=12)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == runtime.generate(messages, max_tokens=12).text


def test_stop_string_ends_the_text_before_it(runtime):
    messages = [user("Describe it.", images(1))]
    full = runtime.generate(messages, max_tokens=16).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the random model produced whitespace where the stop string would go")
    result = runtime.generate(messages, max_tokens=16, stop=[stop])
    assert result.text == full[: full.find(stop)]
    assert result.stats.finish_reason == "stop"


def test_multi_turn_equals_one_request_with_the_whole_history(runtime):
    session = runtime.chat()
    first = session.send([{"type": "image", "image": images(1)[0]}, {"type": "text", "text": "What is this?"}],
                         max_tokens=8)
    second = session.send("And the colours?", max_tokens=8, return_logits=True)
    assert second.stats.reused_tokens > 25  # the image and the first turn stayed in the arena
    assert second.stats.prefill_tokens < second.stats.prompt_tokens
    whole = runtime.generate(session.history[:-1], max_tokens=8, return_logits=True)
    assert second.tokens == whole.tokens
    torch.testing.assert_close(second.logits, whole.logits, atol=1e-4, rtol=1e-4)
    assert first.text == session.history[1]["content"]
    session.close()
    runtime.planner.prefix_cache.clear()
    stats = runtime.arena.stats()
    assert stats.n_seqs == 0 and stats.n_blocks_used == stats.n_blocks_image  # nothing leaked


@pytest.mark.parametrize("finish", ["length", "stop", "eos"])
def test_a_session_keeps_what_it_decoded_however_the_answer_ends(runtime, monkeypatch, finish):
    """The decode loop runs each step before its token reaches the host; a token that ends the answer
    (EOS, a stop string) had a step it should not have had, which is undone: the session's sequence
    holds the prompt and the tokens fed back, and the next turn equals a fresh request."""
    import dataclasses

    question = [{"type": "image", "image": images(1, seed=2)[0]}, {"type": "text", "text": "What is this?"}]
    free = runtime.generate([{"role": "user", "content": question}], max_tokens=8)
    kwargs: dict = {"max_tokens": 8}
    if finish == "eos":  # the token at step 4 becomes an end-of-sequence token (not seen before it)
        if free.tokens[4] in free.tokens[:4]:
            pytest.skip("the random model repeated its fifth token earlier")
        eos = frozenset({free.tokens[4]})
        monkeypatch.setattr(runtime.model, "assets", dataclasses.replace(runtime.assets, eos_token_ids=eos))
    if finish == "stop":
        stop = runtime.assets.tokenizer.decode(free.tokens[4:5])
        if not stop.strip() or stop in runtime.assets.tokenizer.decode(free.tokens[:4]):
            pytest.skip("the random model's fifth token cannot be a stop string")
        kwargs["stop"] = [stop]
    session = runtime.chat()
    first = session.send(question, **kwargs)
    assert first.stats.finish_reason == finish
    fed_back = {"length": 7, "stop": 4, "eos": 4}[finish]  # tokens whose step ran (the last sampled one never)
    assert session.held.seq.n_tokens(0) == first.stats.prompt_tokens + fed_back
    second = session.send("And the colours?", max_tokens=6, return_logits=True)
    whole = runtime.generate(session.history[:-1], max_tokens=6, return_logits=True)
    assert second.tokens == whole.tokens
    torch.testing.assert_close(second.logits, whole.logits, atol=1e-4, rtol=1e-4)
    session.close()
    runtime.planner.prefix_cache.clear()
    stats = runtime.arena.stats()
    assert stats.n_seqs == 0 and stats.n_blocks_used == stats.n_blocks_image  # nothing leaked


def test_sampling_with_a_seed_is_repeatable(runtime):
    messages = [user("Tell me more.", images(1))]
    a = runtime.generate(messages, max_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    b = runtime.generate(messages, max_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("bad,match", [
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}], "image"),
    ([{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (0, 4))}]}], "pixel"),
    # several images are decoded on a thread pool: the bad one's error still reaches the caller
    ([{"role": "user", "content": [*({"type": "image", "image": im} for im in images(2)),
                                   {"type": "image", "image": b"not an image"}, {"type": "text", "text": "x"}]}],
     "image"),
    ([{"role": "user", "content": "x"}], "top_p"),
])
def test_bad_requests_raise_request_errors_and_the_runtime_stays_usable(runtime, bad, match):
    with pytest.raises(RequestError, match=match):
        runtime.generate(bad, max_tokens=4, top_p=0.0 if match == "top_p" else 1.0)
    assert runtime.arena.stats().n_seqs == len(runtime.planner.prefix_cache)
    assert runtime.generate([user("Hi", [])], max_tokens=2).stats.decode_tokens <= 2


def test_an_options_object_answers_as_its_keywords_and_bad_options_are_request_errors(runtime):
    from conduit_rt.options import GenerationOptions

    def answer(*args, **kwargs):  # no exact prefix of an earlier request: every answer computed alike
        runtime.planner.prefix_cache.clear()
        return runtime.generate(messages, *args, **kwargs)

    messages = [user("Tell me more.", images(1, seed=6))]
    options = GenerationOptions(max_tokens=6, temperature=0.8, top_p=0.9, seed=2, stop="zz", return_logits=True)
    by_object = answer(options)
    by_keywords = answer(max_tokens=6, temperature=0.8, top_p=0.9, seed=2, stop=["zz"], return_logits=True)
    overridden = answer(options, max_tokens=3)
    assert by_object.tokens == by_keywords.tokens and torch.equal(by_object.logits, by_keywords.logits)
    assert overridden.tokens == by_object.tokens[:3] and options.max_tokens == 6 and options.stop == ("zz",)
    with pytest.raises(RequestError, match="max_tokens") as unknown:
        runtime.generate(messages, max_token=4)
    assert "max_token" in str(unknown.value) and "refresh_budget" in str(unknown.value)
    for bad in ({"refresh": "sideways"}, {"compress": "zip"}, {"refresh_budget": 1.5}, {"keep": -0.1},
                {"max_tokens": "many"}, {"refresh_options": {"lamda": 1.0}}, {"compress_options": 3}, {"stop": [""]}):
        with pytest.raises(RequestError):
            GenerationOptions(**bad)
    assert runtime.arena.stats().n_seqs == len(runtime.planner.prefix_cache)


def test_a_stream_closed_early_gives_its_sequence_back(runtime):
    messages = [user("Describe it at length.", images(1, seed=8))]
    stream = runtime.stream(messages, max_tokens=12)
    next(stream)
    stream.close()
    with pytest.raises(RuntimeError, match="not finished"):
        stream.result
    assert runtime.arena.stats().n_seqs == len(runtime.planner.prefix_cache)
    runtime.planner.prefix_cache.clear()
    assert runtime.arena.stats().n_seqs == 0


def test_one_lazily_opened_image_shown_twice(runtime):
    """The same not-yet-loaded PIL image in two parts is decoded once (two threads loading it at once
    would share its file pointer), and the answer is the one for two loaded copies."""
    encoded = io.BytesIO()
    images(1, seed=4)[0].save(encoded, format="PNG")
    lazy = Image.open(io.BytesIO(encoded.getvalue()))  # not loaded yet
    loaded = [Image.open(io.BytesIO(encoded.getvalue())) for _ in range(2)]
    for image in loaded:
        image.load()
    got = runtime.generate([user("Same?", [lazy, lazy])], max_tokens=4)
    want = runtime.generate([user("Same?", loaded)], max_tokens=4)
    assert got.tokens == want.tokens and got.stats.images == 2


def test_recurring_image_files_are_decoded_once_and_answer_as_their_pixels(runtime, tmp_path, monkeypatch):
    """An image sent again as a file (a path, or the same bytes) comes from the decoded-image cache:
    not decoded again; the answer equals the one for its decoded pixels (a PIL image); a file
    rewritten at the same path is decoded anew; an unreadable path is a RequestError."""
    import conduit_rt.preprocess as preprocess

    pictures = images(2, seed=9)
    paths = []
    for i, picture in enumerate(pictures):
        paths.append(tmp_path / f"{i}.png")
        picture.save(paths[-1])
    decodes = []
    real_load = preprocess.load_image
    monkeypatch.setattr(preprocess, "load_image", lambda image, name=None: decodes.append(name) or real_load(image, name))
    requests = runtime.requests  # reads the messages, with the decoded-image cache
    requests.decoded_images = type(requests.decoded_images)(requests.decoded_images.max_bytes)

    def answer(parts):  # no exact prefix of an earlier request: every answer computed alike
        runtime.planner.prefix_cache.clear()
        return runtime.generate([user("Which?", parts)], max_tokens=4, return_logits=True)

    want = answer(pictures)
    decodes.clear()
    first = answer(paths)
    assert sorted(decodes) == sorted(str(p) for p in paths)  # decoded from the files, named by them
    decodes.clear()
    again = answer([paths[0], paths[1].read_bytes()])
    assert decodes == [] and len(requests.decoded_images) == 2
    for got in (first, again):
        assert got.tokens == want.tokens and torch.equal(got.logits, want.logits)
    pictures[1].transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(paths[1])  # new content, same path
    changed = answer(paths)
    assert decodes == [str(paths[1])] and len(requests.decoded_images) == 3
    assert not torch.equal(changed.logits, want.logits)
    # one file as three distinct objects of one request (decoded by pool threads at once): one answer
    decodes.clear()
    requests.decoded_images = type(requests.decoded_images)(requests.decoded_images.max_bytes)
    trio = answer([str(paths[0]), paths[0], paths[0].read_bytes()])
    assert len(requests.decoded_images) == 1 and 1 <= len(decodes) <= 3
    assert trio.tokens == answer([pictures[0]] * 3).tokens
    with pytest.raises(RequestError, match="not found"):
        runtime.generate([user("Which?", [tmp_path / "gone.png"])], max_tokens=2)
    assert runtime.generate([user("Which?", paths)], max_tokens=2).stats.images == 2


def test_decoded_images_evict_the_least_recently_used_under_their_budget():
    from conduit_rt.image_cache import DecodedImages

    pixels = [np.full((10, 10, 3), i, dtype=np.uint8) for i in range(4)]  # 300 bytes each
    cache = DecodedImages(max_bytes=700)
    for i in range(2):
        cache.put(bytes([i]), pixels[i], b"key%d" % i)
    assert cache.get(bytes([0]))[1] == b"key0"  # 0 is now the most recently used
    cache.put(bytes([2]), pixels[2], b"key2")
    assert cache.get(bytes([1])) is None and cache.get(bytes([0])) is not None and cache.bytes == 600
    rgb, _ = cache.get(bytes([2]))
    assert np.array_equal(rgb, pixels[2]) and not rgb.flags.writeable and pixels[2].flags.writeable
    cache.put(bytes([3]), np.zeros((20, 20, 3), dtype=np.uint8), b"big")  # over the whole budget: not kept
    assert cache.get(bytes([3])) is None and len(cache) == 2


def graphed_and_eager_agree(model_path, messages: list[dict], max_tokens: int, capacity: int | None = None) -> None:
    """Greedy decoding on CUDA in float32 replayed from a CUDA graph equals eager decoding: same tokens,
    logits within float32 noise (the graph's batch attention splits the keys differently), and every
    step is a replay. ``capacity`` (tokens) makes the step object grow mid-answer."""
    from conduit_rt.decode_graph import GraphedDecoder

    def runtime(graphs: bool) -> Runtime:
        return Runtime(model_path, device="cuda", dtype=torch.float32, kv_cache_bytes=16 << 20, cuda_graphs=graphs)

    eager, graphed = runtime(False), runtime(True)
    if capacity is not None:
        graphed.decoder.graphed.close()
        graphed.decoder.graphed = GraphedDecoder(graphed.model, graphed.arena, capacity=capacity)
    for _ in range(2):  # the second request reuses the captured graph with another sequence
        want = eager.generate(messages, max_tokens=max_tokens, return_logits=True)
        got = graphed.generate(messages, max_tokens=max_tokens, return_logits=True)
        assert got.tokens == want.tokens
        scale = want.logits.abs().max()
        assert (got.logits - want.logits).abs().max() <= 1e-4 * scale
        messages = messages + [{"role": "assistant", "content": want.text}, {"role": "user", "content": "Go on."}]
    decoder = graphed.decoder.graphed
    assert decoder.steps > 10 and decoder.replays == decoder.steps  # every step replayed the graph
    assert graphed.planner.prefill_graphs.replayed_passes >= 2  # the prompts' passes replayed their dense work
    assert eager.decoder.graphed is None


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [None, 40])
def test_graph_replayed_decode_equals_eager_decode(checkpoint, capacity):
    _, out = checkpoint
    graphed_and_eager_agree(out / "model.gguf", [user("Describe it, at length.", images(1, seed=9))], max_tokens=24,
                            capacity=capacity)
