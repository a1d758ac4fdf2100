"""The Qwen2-VL task model: tokenizer and chat template, patches, M-RoPE attention hints, the folder
through ``conduit convert`` and the Runtime.

References: transformers' AutoTokenizer, Qwen2VLImageProcessor and Qwen2VLForConditionalGeneration
(eager attention for attention probabilities), the project's chat code, and a cold prefill for the
fully refreshed CONDUIT request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from conduit_rt.evaluation.task import data
from conduit_rt.evaluation.task.model_config import MODEL_SIZES, new_model
from conduit_rt.evaluation.task.qwen_model import (
    MAX_POSITIONS, image_token_types, mrope_position_ids, mrope_positions, new_qwen_model, patchify, write_qwen_model_folder,
)
from conduit_rt.evaluation.task.data import QWEN_FRAME, conversation_text, prompt_text
from conduit_rt.evaluation.task.families import FAMILIES
from conduit_rt.evaluation.task.generator import COLOURS, TAGS
from conduit_rt.evaluation.task.tokenizer import (
    IM_END, IM_START, IMAGE_PAD, QWEN_CHAT_TEMPLATE, build_qwen_tokenizer, qwen_task_words,
)

transformers = pytest.importorskip("transformers")

SEED = 7
MAX_NEW = 6


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen_tokenizer()


@pytest.fixture(scope="module")
def pools():
    """A test pool per family (dense 64 px, sparse 128 px, poster 192 px pages)."""
    return data.build_pools(SEED, "test", 16, FAMILIES)


@pytest.fixture(scope="module")
def pool(pools):
    return pools["lookup"]


def family_requests(pools, count: int, **options):
    """``count`` requests of every family."""
    return [r for family, pool in pools.items() for r in pool.requests(count, family=family, **options)]


def perturbed_qwen_model(tokenizer, seed: int = 3):
    """A tiny Qwen task model with perturbed weights (logits far from uniform), float32."""
    model = new_qwen_model(tokenizer, MODEL_SIZES["tiny"], seed=seed)
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=noise))
    return model.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    """The tiny model's folder in bfloat16, as shipped (converting it to bf16 GGUF loses nothing)."""
    return write_qwen_model_folder(perturbed_qwen_model(tokenizer), tokenizer, tmp_path_factory.mktemp("qwen_task"))


def task_messages(request, pools) -> tuple[list[dict], list[np.ndarray]]:
    """``request.messages()`` (a ``lookup`` request) with its second page replaced by a sparse one:
    pages of 64 and 128 px (8 x 8 and 16 x 16 cells)."""
    images = [pools["lookup"].pixels[page_id] for page_id in request.page_ids]
    images[1] = pools["fields"].pixels[request.page_ids[1]]
    return request.messages([Image.fromarray(image) for image in images]), images


@pytest.mark.parametrize("sizes", [[(64, 64)], [(128, 128)], [(192, 192)], [(64, 128), (192, 64), (64, 64), (64, 64)]])
def test_patchify_equals_the_folders_image_processor(folder, sizes):
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    rng = np.random.default_rng(sum(h * w for h, w in sizes))
    pages = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    expected = processor(images=[Image.fromarray(page) for page in pages], return_tensors="pt")
    pixel_values, grid = patchify([torch.from_numpy(page) for page in pages])
    assert pixel_values.dtype == torch.float32 and grid.dtype == torch.int64
    assert torch.equal(grid, expected["image_grid_thw"])
    assert torch.equal(pixel_values, expected["pixel_values"])
    if len(set(sizes)) == 1:  # one [n, H, W, 3] tensor gives the same
        batched, batched_grid = patchify(torch.from_numpy(np.stack(pages)))
        assert torch.equal(batched, pixel_values) and torch.equal(batched_grid, grid)


def test_patchify_refuses_pages_off_the_cell_grid():
    with pytest.raises(ValueError, match="multiples of 8"):
        patchify([torch.zeros((60, 64, 3), dtype=torch.uint8)])
    with pytest.raises(ValueError, match="uint8"):
        patchify([torch.zeros((64, 64, 3))])
    with pytest.raises(ValueError, match="does not match its grid"):
        mrope_positions(torch.tensor([[1, 5, 5, 5, 2]]), torch.tensor([[1, 4, 4]]), image_token_id=5)


def test_default_model_fits_the_budget_and_the_longest_requests(tokenizer):
    model = new_qwen_model(tokenizer, MODEL_SIZES["default"])
    parameters = sum(parameter.numel() for parameter in model.parameters())
    assert 10e6 < parameters and 2 * parameters <= 40e6
    text, vision = model.config.text_config, model.config.vision_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert text.max_position_embeddings >= MAX_POSITIONS >= 8 * 576
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (4, 2, 2)
    assert model.config.image_token_id == tokenizer.token_to_id(IMAGE_PAD)


def expected_pieces(answer: str) -> list[str]:
    """An answer's tokens: each tag or colour whole, each code one token per character ("▁" marks
    a word after a space)."""
    pieces = []
    for index, word in enumerate(answer.split(" ")):
        first = ("\u2581" if index else "") + word
        pieces += [first] if word in TAGS or word in COLOURS else [first[: len(first) - len(word) + 1], *word[1:]]
    return pieces


def test_tokenizer_agrees_with_transformers_and_keeps_task_words_whole(folder, tokenizer, pools):
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for request in family_requests(pools, 4, max_followups=2):
        text, spans = conversation_text(request, QWEN_FRAME)
        ours = tokenizer.encode(text, add_special_tokens=False)
        assert hf(text).input_ids == ours.ids and hf(text, add_special_tokens=False).input_ids == ours.ids
        for (start, stop), question in zip(spans, request.questions):  # each answer: its words, then <|im_end|>
            pieces = [token for token, (a, b) in zip(ours.tokens, ours.offsets) if a >= start and b <= stop]
            answer = request.answer_to(question)
            assert pieces == expected_pieces(answer) + [IM_END], (answer, pieces)
            assert hf.decode(tokenizer.encode(answer, add_special_tokens=False).ids) == answer
    for word in qwen_task_words():  # after a special token, as in a prompt
        assert len(tokenizer.encode(IM_START + word, add_special_tokens=False).ids) == 2, word
    assert tokenizer.encode(IM_START + "\nK7Q 4ZB", add_special_tokens=False).tokens[2:] == ["K", "7", "Q", "\u25814", "Z", "B"]


def test_prompt_text_equals_the_templates_rendering(folder, tokenizer, pools):
    from conduit_rt.chat import ChatTemplate, build_prompt
    from conduit_rt.tokenizer import TextTokenizer

    hf = transformers.AutoTokenizer.from_pretrained(folder)
    text_tokenizer, template = TextTokenizer.from_hf_folder(folder)
    assert template == QWEN_CHAT_TEMPLATE
    image_pad = tokenizer.token_to_id(IMAGE_PAD)
    for request in family_requests(pools, 2, max_followups=2):
        messages = request.messages()
        plain = [{"role": "user", "content": [
            {"type": part["type"], "text": part.get("text", "")} for part in messages[0]["content"]]}]
        expected = prompt_text(request, frame=QWEN_FRAME)
        assert hf.apply_chat_template(plain, add_generation_prompt=True, tokenize=False) == expected
        conversation = list(plain)
        for turn, question in enumerate(request.questions):
            if turn:
                conversation.append({"role": "user", "content": request.question_for(question)})
            conversation.append({"role": "assistant", "content": request.answer_to(question)})
        rendered = hf.apply_chat_template(conversation, tokenize=False)
        assert rendered == conversation_text(request, QWEN_FRAME)[0] + "\n"  # the template ends every turn with a newline
        counts = [64 + 16 * position for position in range(request.num_pages)]  # any per-image counts
        prompt = build_prompt(messages, ChatTemplate(template), text_tokenizer, image_pad, counts)
        ids = np.asarray(tokenizer.encode(expected, add_special_tokens=False).ids)
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[ids == image_pad] = counts
        assert prompt.token_ids == np.repeat(ids, repeats).tolist()


def prompt_inputs(tokenizer, request, images: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """transformers inputs of the prompt: ``<|image_pad|>`` expanded to each image's merged tokens."""
    pixel_values, grid = patchify([torch.from_numpy(image) for image in images])
    ids = np.asarray(tokenizer.encode(prompt_text(request, frame=QWEN_FRAME), add_special_tokens=False).ids)
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[ids == tokenizer.token_to_id(IMAGE_PAD)] = (grid.prod(-1) // 4).numpy()
    return {"input_ids": torch.from_numpy(np.repeat(ids, repeats))[None], "pixel_values": pixel_values,
            "image_grid_thw": grid}


@pytest.mark.parametrize("architecture", ["llava", "qwen2vl"])
@torch.no_grad()
def test_attention_log_probs_equal_eager_attention(tokenizer, pools, architecture):
    """Every head of every layer, at every query of a right-padded batch of two requests (Qwen2-VL:
    pages of 64 and 128 px, M-RoPE positions from ``mrope_position_ids``)."""
    from conduit_rt.evaluation.task.attention_hint import attention_log_probs
    from conduit_rt.evaluation.task.tokenizer import build_tokenizer

    pool = pools["lookup"]
    requests = pool.requests(2, min_pages=2, max_pages=3)
    if architecture == "llava":
        model = new_model(build_tokenizer(), MODEL_SIZES["tiny"], seed=1)
        noise = torch.Generator().manual_seed(2)
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=noise))
        encoded = data.PromptEncoder(build_tokenizer()).encode(requests, with_answer=False)
        rows = [torch.from_numpy(item.ids) for item in encoded]
        inputs = {"pixel_values": data.normalize_pixels(torch.from_numpy(pool.pixels[[i for r in requests for i in r.page_ids]]))}
    else:
        model = perturbed_qwen_model(tokenizer, seed=1)
        per_request = [prompt_inputs(tokenizer, request, task_messages(request, pools)[1]) for request in requests]
        rows = [item["input_ids"][0] for item in per_request]
        inputs = {"pixel_values": torch.cat([item["pixel_values"] for item in per_request]),
                  "image_grid_thw": torch.cat([item["image_grid_thw"] for item in per_request])}
    model.config._attn_implementation = "eager"
    model.model.language_model.config._attn_implementation = "eager"
    length = max(len(row) for row in rows)
    input_ids = torch.full((2, length), model.config.text_config.pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((2, length), dtype=torch.int64)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)], attention_mask[index, : len(row)] = row, 1
    position_ids = None
    if architecture == "qwen2vl":
        position_ids = mrope_position_ids(model, input_ids, inputs["image_grid_thw"], attention_mask)
        assert position_ids.shape == (3, 2, length) and (position_ids[1] != position_ids[2]).any()
        unmasked = mrope_position_ids(model, input_ids, inputs["image_grid_thw"])
        assert torch.equal(mrope_positions(input_ids, inputs["image_grid_thw"], model.config.image_token_id), unmasked)
        assert torch.equal(unmasked[:, attention_mask.bool()], position_ids[:, attention_mask.bool()])
        inputs["mm_token_type_ids"] = image_token_types(model, input_ids)
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                output_attentions=True, **inputs)
    query_rows = torch.cat([torch.full((len(row),), index) for index, row in enumerate(rows)])
    query_positions = torch.cat([torch.arange(len(row)) for row in rows])
    text = model.config.text_config
    for layer in range(text.num_hidden_layers):
        for head in range(text.num_attention_heads):
            ours = attention_log_probs(model, out.hidden_states, layer, head, query_rows, query_positions, position_ids)
            expected = out.attentions[layer][query_rows, head, query_positions]  # [Q, T]
            visible = torch.arange(length)[None] <= query_positions[:, None]
            torch.testing.assert_close(ours.exp()[visible], expected[visible], atol=1e-5, rtol=1e-4)
            assert (ours.exp()[~visible] == 0).all()


def hf_greedy(model, inputs: dict[str, torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: (new ids without a final EOS, per-step logits [steps, vocab])."""
    out = model.generate(**inputs, mm_token_type_ids=image_token_types(model, inputs["input_ids"]),
                         max_new_tokens=MAX_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    if new and new[-1] == model.config.text_config.eos_token_id:
        new = new[:-1]
    return new, torch.stack(out.logits)[:, 0]


def assert_close_logits(ours: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    scale = expected.abs().max().item()
    error = (ours.float().cpu() - expected).abs().max().item()
    assert error <= rtol * scale, f"max |diff| {error:.3g} > {rtol} x {scale:.3g}"


@torch.no_grad()
def test_runtime_on_the_folder_equals_transformers(folder, tokenizer, pools, tmp_path, monkeypatch):
    """``Runtime(folder)`` (converted on first use) on requests of 3 pages of 64 and 128 px: the
    prompt and M-RoPE positions, greedy tokens and logits equal transformers' in float32."""
    from conduit_rt import Runtime
    from conduit_rt.chat import build_prompt

    monkeypatch.setenv("CONDUIT_CACHE", str(tmp_path))
    reference = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    runtime = Runtime(folder, device="cpu", kv_cache_bytes=16 << 20)
    for request in pools["lookup"].requests(2, min_pages=3, max_pages=3):
        messages, images = task_messages(request, pools)
        inputs = prompt_inputs(tokenizer, request, images)
        model = runtime.model
        prepared = [model.prepare_image(image) for image in images]
        assets = model.assets
        prompt = build_prompt(messages, assets.chat_template, assets.tokenizer, assets.image_token_id,
                              [p.n_tokens for p in prepared])
        assert prompt.token_ids == inputs["input_ids"][0].tolist()
        expected_positions = mrope_position_ids(reference, inputs["input_ids"], inputs["image_grid_thw"])
        assert torch.equal(model.rope_positions(prompt, prepared).long(), expected_positions[:, 0])
        expected, expected_logits = hf_greedy(reference, inputs)
        result = runtime.generate(messages, max_tokens=MAX_NEW, return_logits=True)
        assert result.tokens == expected and result.stats.images == 3
        assert_close_logits(result.logits, expected_logits[: result.logits.shape[0]], rtol=1e-4)


def test_conduit_refresh_of_every_token_equals_a_cold_prefill(folder, pools, tmp_path, monkeypatch):
    """Pages cached by one request, restored at new M-RoPE positions under another prefix and order,
    then refreshed at budget 1.0: the logits of a cold prefill."""
    from conduit_rt import Runtime

    monkeypatch.setenv("CONDUIT_CACHE", str(tmp_path))
    request = pools["lookup"].requests(1, min_pages=3, max_pages=3)[0]
    messages, images = task_messages(request, pools)

    def fresh_runtime() -> Runtime:
        return Runtime(folder, device="cpu", kv_cache_bytes=16 << 20, prefix_cache_entries=0)

    warm = fresh_runtime()
    warm.generate(messages, max_tokens=1, refresh="conduit")
    assert warm.arena.stats().n_image_entries == 3
    parts = messages[0]["content"]
    reordered = [{"role": "system", "content": "owl"},
                 {"role": "user", "content": parts[4:6] + parts[0:2] + parts[2:4] + parts[6:]}]
    refreshed = warm.generate(reordered, max_tokens=1, return_logits=True, refresh="conduit", refresh_budget=1.0)
    assert refreshed.stats.image_hits == 3 and refreshed.stats.refreshed_tokens == refreshed.stats.visual_tokens > 0
    cold = fresh_runtime().generate(reordered, max_tokens=1, return_logits=True).logits[0]
    assert_close_logits(refreshed.logits[0], cold, rtol=1e-5)
    stale = warm.generate(reordered, max_tokens=1, return_logits=True, refresh="none").logits[0]
    assert (stale - cold).abs().max() > 1e-3 * cold.abs().max()
