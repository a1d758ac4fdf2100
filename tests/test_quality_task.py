"""The quality task (quality/): generator, tokenizer and folder, training smoke run, stale-KV reference.

References are independent of the code under test where one exists: transformers' AutoTokenizer,
AutoProcessor and LlavaForConditionalGeneration, the project's chat code, and a template-matching
reader that recovers each page's fields from its pixels alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conduit_rt.evaluation.task import data, generator
from conduit_rt.evaluation.task.font import GLYPH_CHARS, GLYPH_HEIGHT, GLYPH_WIDTH, glyph_mask
from conduit_rt.evaluation.task.generator import CELL_SIZE, COLOURS, GRID_SIZE, page_for
from conduit_rt.evaluation.task.model_config import MODEL_SIZES, NUM_IMAGE_TOKENS, new_model, write_model_folder
from conduit_rt.evaluation.task.tokenizer import build_tokenizer, task_words

transformers = pytest.importorskip("transformers")

SEED = 7


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def pools():
    return {split: data.build_pool(SEED, split, 40) for split in generator.SPLITS}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    """A tiny task model with perturbed weights (logits far from uniform), saved in float32."""
    model = new_model(tokenizer, MODEL_SIZES["tiny"], seed=3)
    noise = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=noise))
    return write_model_folder(model, tokenizer, tmp_path_factory.mktemp("tiny_quality"), dtype=torch.float32)


def read_cells(pixels: np.ndarray) -> dict[tuple[int, int], tuple[str, str]]:
    """Recover {(row, column): (char, colour)} of the inked cells of a page's pixels [S, S, 3]
    alone, by matching each cell against every glyph and every colour (grey for distractors)."""
    masks = {char: np.asarray(glyph_mask(char), dtype=bool) for char in GLYPH_CHARS}
    palette = {**COLOURS, "grey": generator.DISTRACTOR_RGB}
    found = {}
    grid = pixels.shape[0] // CELL_SIZE
    for row in range(grid):
        for column in range(grid):
            cell = pixels[row * CELL_SIZE : (row + 1) * CELL_SIZE, column * CELL_SIZE : (column + 1) * CELL_SIZE]
            ink = (cell != 255).any(axis=-1)
            if not ink.any():
                continue
            inner = ink[1 : 1 + GLYPH_HEIGHT, 1 : 1 + GLYPH_WIDTH]
            chars = [char for char, mask in masks.items() if np.array_equal(mask, inner)]
            colours = [name for name, rgb in palette.items() if (cell[ink] == rgb).all()]
            assert len(chars) == 1 and len(colours) == 1 and ink.sum() == inner.sum()
            found[(row, column)] = (chars[0], colours[0])
    return found


def read_page(pixels: np.ndarray) -> dict[str, str]:
    """{colour: code} read off the pixels: coloured cells joined left to right, top to bottom."""
    codes: dict[str, str] = {}
    for (_, _), (char, colour) in sorted(read_cells(pixels).items()):
        if colour != "grey":
            codes[colour] = codes.get(colour, "") + char
    return codes


def test_glyphs_are_distinct():
    masks = {char: np.asarray(glyph_mask(char)).tobytes() for char in GLYPH_CHARS}
    assert len(set(masks.values())) == len(GLYPH_CHARS) == 27


def test_pages_and_requests_are_deterministic_from_the_seed(pools):
    again = data.build_pool(SEED, "train", 40, processes=2)
    assert again.pages == pools["train"].pages
    assert np.array_equal(again.pixels, pools["train"].pixels)
    assert again.requests(20) == pools["train"].requests(20)
    other_seed = data.build_pool(SEED + 1, "train", 40)
    assert [p.key for p in other_seed.pages] != [p.key for p in pools["train"].pages]


def test_splits_never_share_a_page(pools):
    keys = {split: {page.key for page in pool.pages} for split, pool in pools.items()}
    assert not keys["train"] & keys["val"] and not keys["train"] & keys["test"] and not keys["val"] & keys["test"]
    for split, pool in pools.items():
        assert {page.split for page in pool.pages} == {split}
        for request in pool.requests(10):
            assert request.split == split and all(pool.pages[i] == page for i, page in zip(request.page_ids, request.pages))


def test_rendered_page_shows_every_code_in_its_colour(pools, tmp_path):
    pool = pools["test"]
    for page, pixels in zip(pool.pages, pool.pixels):
        assert read_page(pixels) == {field.colour: field.code for field in page.fields}
    pool.pages[0].render().resize((256, 256), 0).save(tmp_path / "page.png")  # for a human look


def test_reading_labels_match_the_pixels(pools):
    from conduit_rt.evaluation.task.reading_loss import COLOUR_CLASSES, cell_labels

    pool = pools["val"]
    labels = cell_labels(pool.pages)
    for page_labels, pixels in zip(labels, pool.pixels):
        cells = read_cells(pixels)
        for cell in range(GRID_SIZE * GRID_SIZE):
            char, colour = cells.get(divmod(cell, GRID_SIZE), (None, "none"))
            assert page_labels[0, cell] == (0 if char is None else 1 + generator.CODE_ALPHABET.index(char))
            assert COLOUR_CLASSES[page_labels[1, cell]] == colour


def test_question_answer_and_distractors(pools):
    pool = pools["train"]
    requests = pool.requests(200)
    assert {r.num_pages for r in requests} == set(range(1, 9)) and {len(r.asked.asks) for r in requests} == {1, 2}
    for request in requests:
        assert len(set(request.tags)) == request.num_pages
        codes = [read_page(pool.pixels[request.page_ids[ask.position]])[ask.colour] for ask in request.asked.asks]
        assert request.answer == " ".join(codes)
        for ask in request.asked.asks:
            others = [p for i, p in enumerate(request.pages) if i != ask.position]
            shared = set(request.pages[ask.position].colours) & {c for p in others for c in p.colours}
            assert not shared or ask.colour in shared


def test_retagged_request_changes_every_tag_and_keeps_the_answer(pools):
    for request in pools["val"].requests(30, min_pages=2):
        seen = generator.retagged_request(request, salt=1)
        assert seen.answer == request.answer and sorted(seen.page_ids) == sorted(request.page_ids)
        old_tag = dict(zip(request.page_ids, request.tags))
        assert all(tag != old_tag[page_id] for page_id, tag in zip(seen.page_ids, seen.tags))


def test_tokenizer_agrees_with_transformers_and_keeps_task_words_whole(tiny_folder, tokenizer, pools):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    for request in pools["val"].requests(10):
        text = data.prompt_text(request, request.answer)
        assert hf(text, add_special_tokens=False).input_ids == tokenizer.encode(text, add_special_tokens=False).ids
        assert hf.decode(tokenizer.encode(" " + request.answer, add_special_tokens=False).ids) == request.answer
    for word in task_words():  # after BOS, as in a prompt ("USER:" alone would get a leading "▁")
        assert len(tokenizer.encode("<s>" + word, add_special_tokens=False).ids) == 2, word
    assert len(tokenizer.encode("<s> K7Q", add_special_tokens=False).ids) == 4


def test_prompt_matches_the_chat_template_processor_and_project_chat(tiny_folder, tokenizer, pools):
    from conduit_rt.chat import ChatTemplate, build_prompt
    from conduit_rt.tokenizer import TextTokenizer

    processor = transformers.AutoProcessor.from_pretrained(tiny_folder)
    text_tokenizer, template = TextTokenizer.from_hf_folder(tiny_folder)
    encoder = data.PromptEncoder(tokenizer)
    pool = pools["test"]
    for request in pool.requests(6):
        messages = request.messages()
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == data.prompt_text(request)
        ours = encoder.encode([request], with_answer=False)[0]
        images = [page.render() for page in request.pages]
        hf = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
        assert hf.input_ids[0].tolist() == ours.ids.tolist()
        expected = data.normalize_pixels(torch.from_numpy(pool.pixels[list(request.page_ids)]))
        torch.testing.assert_close(hf.pixel_values, expected, atol=1e-6, rtol=0)
        prompt = build_prompt(messages, ChatTemplate(template), text_tokenizer, encoder.image_token_id, NUM_IMAGE_TOKENS)
        assert prompt.token_ids == ours.ids.tolist()


def test_training_labels_are_the_answers_and_eos(tokenizer, pools):
    encoder = data.PromptEncoder(tokenizer)
    requests = pools["train"].requests(12, max_followups=3)
    assert any(r.followups for r in requests)
    batch = data.collate_for_training(encoder.encode(requests, with_answer=True), encoder.pad_token_id, encoder.image_token_id)
    assert batch["input_ids"].shape[1] % data.PAD_MULTIPLE == 0
    assert batch["page_ids"].tolist() == [i for r in requests for i in r.page_ids]
    for row, request in enumerate(requests):
        labels = batch["labels"][row][batch["labels"][row] != data.IGNORE_INDEX].tolist()
        answers = [request.answer_to(question) for question in request.questions]
        assert labels.count(encoder.eos_token_id) == len(answers) and labels[-1] == encoder.eos_token_id
        assert tokenizer.decode(labels, skip_special_tokens=False) == "</s> ".join(answers) + "</s>"
        assert (batch["input_ids"][row] == encoder.image_token_id).sum() == NUM_IMAGE_TOKENS * request.num_pages
        assert data.conversation_text(request)[0].startswith(data.prompt_text(request))
    # context-probe labels: each page's tag, and per question the token before its answer
    assert batch["image_tags"].tolist() == [generator.TAGS.index(t) for r in requests for t in r.tags]
    assistant = tokenizer.token_to_id("\u2581ASSISTANT:")
    rows, positions = batch["query_rows"], batch["query_positions"]
    assert (batch["input_ids"][rows, positions] == assistant).all()
    assert (batch["labels"][rows, positions + 1] != data.IGNORE_INDEX).all()
    questions = [(r.tags[q.asks[0].position], q.asks[0].colour) for r in requests for q in r.questions]
    colours = list(COLOURS)
    assert [(generator.TAGS[t], colours[c]) for t, c in zip(batch["query_tags"].tolist(), batch["query_colours"].tolist())] == questions


def test_first_question_trains_in_the_evaluation_format(tokenizer, pools):
    encoder = data.PromptEncoder(tokenizer)
    for request in pools["train"].requests(6, max_followups=3):
        prompt = encoder.encode([request], with_answer=False)[0].ids
        full = encoder.encode([request], with_answer=True)[0]
        assert full.ids[: len(prompt)].tolist() == prompt.tolist() and not full.label_mask[: len(prompt)].any()
        assert full.label_mask[len(prompt)]


def test_training_step_lowers_the_answer_loss_on_a_fixed_batch(tokenizer, pools):
    from conduit_rt.evaluation.task.train import answer_loss

    encoder = data.PromptEncoder(tokenizer)
    pool = pools["train"]
    batch = data.collate_for_training(encoder.encode(pool.requests(4, max_pages=2), with_answer=True), encoder.pad_token_id, encoder.image_token_id)
    pixel_values = data.normalize_pixels(torch.from_numpy(pool.pixels)[batch["page_ids"]])
    model = new_model(tokenizer, MODEL_SIZES["tiny"], seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = answer_loss(model, batch, {"pixel_values": pixel_values})
        assert loss.ndim == 0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]


def test_context_probe_loss_reads_the_probed_layer(tokenizer, pools):
    from conduit_rt.evaluation.task.context_probe import ContextProbe
    from conduit_rt.evaluation.task.train import answer_loss, training_losses

    encoder = data.PromptEncoder(tokenizer)
    pool = pools["train"]
    encoded = encoder.encode(pool.requests(3, max_followups=2), with_answer=True)
    batch = data.collate_for_training(encoded, encoder.pad_token_id, encoder.image_token_id)
    pixel_values = data.normalize_pixels(torch.from_numpy(pool.pixels)[batch["page_ids"]])
    model = new_model(tokenizer, MODEL_SIZES["tiny"], seed=0)
    probe = ContextProbe(model.config.text_config.hidden_size, layer=1)
    losses = training_losses(model, batch, {"pixel_values": pixel_values}, probe)
    torch.testing.assert_close(losses["answer"], answer_loss(model, batch, {"pixel_values": pixel_values}))
    losses["probe"].backward()
    layers = model.model.language_model.layers
    assert layers[0].mlp.down_proj.weight.grad.abs().sum() > 0  # the probed layer's input side
    assert layers[1].mlp.down_proj.weight.grad is None  # above the probed layer (index 1 = layer 0's output)


def _eager_forward(tokenizer, pool, batch):
    """A tiny model with non-trivial weights and eager attention, run on ``batch``: (model, output
    with hidden states and attention probabilities), the reference the attention hints must match."""
    model = new_model(tokenizer, MODEL_SIZES["tiny"], seed=1)
    model.config._attn_implementation = "eager"
    model.model.language_model.config._attn_implementation = "eager"
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        pixel_values = data.normalize_pixels(torch.from_numpy(pool.pixels)[batch["page_ids"]])
        out = model(input_ids=batch["input_ids"], pixel_values=pixel_values, output_hidden_states=True, output_attentions=True)
    return model, out


def test_attention_hint_targets_each_answer_cell_and_matches_the_layers_attention(tokenizer, pools):
    """Each answer character's target is the cell it is read from; the loss equals -log of head 0's
    attention there as transformers' eager attention reports it."""
    from conduit_rt.evaluation.task.attention_hint import attention_hint_loss

    encoder = data.PromptEncoder(tokenizer)
    pool = pools["train"]
    requests = pool.requests(4, max_pages=3, max_followups=2)
    batch = data.collate_for_training(encoder.encode(requests, with_answer=True), encoder.pad_token_id, encoder.image_token_id)
    assert len(batch["hint_targets"]) == sum(
        len(r.answer_to(question).replace(" ", "")) for r in requests for question in r.questions)
    for row, position, target in zip(*(batch[k].tolist() for k in ("hint_rows", "hint_positions", "hint_targets"))):
        request, row_ids = requests[row], batch["input_ids"][row]
        predicted = tokenizer.id_to_token(int(batch["labels"][row, position + 1])).lstrip("\u2581")
        image_positions = (row_ids == encoder.image_token_id).nonzero().flatten().tolist()
        page_position, cell = divmod(image_positions.index(target), NUM_IMAGE_TOKENS)
        char, colour = read_cells(pool.pixels[request.page_ids[page_position]])[divmod(cell, GRID_SIZE)]
        assert char == predicted and colour != "grey"
    model, out = _eager_forward(tokenizer, pool, batch)
    with torch.no_grad():
        loss = attention_hint_loss(model, out.hidden_states, batch, layer=1)
    attention = out.attentions[1][batch["hint_rows"], 0, batch["hint_positions"], batch["hint_targets"]]
    torch.testing.assert_close(loss, -attention.log().mean(), atol=1e-4, rtol=1e-4)


def test_field_hint_targets_the_asked_fields_and_matches_the_layers_attention(tokenizer, pools):
    """The question's last tokens target every cell of the turn's asked field(s) (3 per ask, the
    answer's characters in order); the loss equals the mean over those queries of -mean log of the
    field head's attention on them, as transformers' eager attention reports it."""
    from conduit_rt.evaluation.task.attention_hint import field_hint_head, field_hint_loss

    encoder = data.PromptEncoder(tokenizer)
    pool = pools["train"]
    requests = pool.requests(4, max_pages=3, max_followups=2, pair_fraction=0.5)
    batch = data.collate_for_training(encoder.encode(requests, with_answer=True), encoder.pad_token_id, encoder.image_token_id)
    turns = [(row, question) for row, r in enumerate(requests) for question in r.questions]
    assert len(batch["field_rows"]) == data.FIELD_HINT_TOKENS * len(turns)
    queries, targets = batch["field_queries"].tolist(), batch["field_targets"].tolist()
    for query, (row, position) in enumerate(zip(batch["field_rows"].tolist(), batch["field_positions"].tolist())):
        (request_row, question) = turns[query // data.FIELD_HINT_TOKENS]
        assert row == request_row and batch["labels"][row, position] == -100  # a prompt token
        answer_starts = (batch["labels"][row] != -100).nonzero().flatten()
        assert position < int(answer_starts[answer_starts > position].min())  # before its answer
        row_ids = batch["input_ids"][row]
        image_positions = (row_ids == encoder.image_token_id).nonzero().flatten().tolist()
        chars = ""
        for target in [t for q, t in zip(queries, targets) if q == query]:
            page_position, cell = divmod(image_positions.index(target), NUM_IMAGE_TOKENS)
            chars += read_cells(pool.pixels[requests[row].page_ids[page_position]])[divmod(cell, GRID_SIZE)][0]
        assert chars == requests[row].answer_to(question).replace(" ", "")
    model, out = _eager_forward(tokenizer, pool, batch)
    with torch.no_grad():
        loss = field_hint_loss(model, out.hidden_states, batch, layer=1)
    head = field_hint_head(model)
    assert head == 2  # tiny: 4 query heads over 2 KV groups
    attention = out.attentions[1][:, head]  # [B, T, T]
    expected = torch.stack([
        -attention[row, position, [t for q, t in zip(queries, targets) if q == query]].log().mean()
        for query, (row, position) in enumerate(zip(batch["field_rows"].tolist(), batch["field_positions"].tolist()))
    ]).mean()
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)


def test_tiny_training_run_saves_a_loadable_folder(tmp_path):
    from conduit_rt.evaluation.task.train import main

    main(["--out", str(tmp_path), "--tiny", "--arch", "llava", "--stale-requests", "0"])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 3 and 0 <= metrics["test_exact_match"] <= 1
    folder = tmp_path / "model"
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and model.config.image_seq_length == NUM_IMAGE_TOKENS
    assert type(transformers.AutoProcessor.from_pretrained(folder)).__name__ == "LlavaProcessor"


def test_tiny_qwen2vl_training_run_measures_every_family_and_saves_a_loadable_folder(tmp_path):
    from conduit_rt.evaluation.task.families import FAMILIES
    from conduit_rt.evaluation.task.train import main

    main(["--out", str(tmp_path), "--tiny", "--arch", "qwen2vl", "--families", ",".join(FAMILIES)])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["arch"] == "qwen2vl" and set(metrics["by_family"]) == set(FAMILIES)
    assert metrics["test_exact_match"] == min(f["test_exact_match"] for f in metrics["by_family"].values())
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "model")
    assert model.dtype == torch.bfloat16 and model.config.vision_config.patch_size == 4


def full_last_logits(model, encoder, request, pool):
    item = encoder.encode([request], with_answer=False)[0]
    pixel_values = data.normalize_pixels(torch.from_numpy(pool.pixels[list(request.page_ids)]))
    return model(input_ids=torch.from_numpy(item.ids)[None], pixel_values=pixel_values).logits[0, -1]


@torch.no_grad()
def test_stale_kv_from_the_request_itself_equals_full_prefill(tiny_folder, tokenizer, pools):
    from conduit_rt.evaluation.task import stale_kv

    model = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_folder).eval()
    encoder = data.PromptEncoder(tokenizer)
    pool = pools["test"]
    for request in pool.requests(3, min_pages=2):
        reference = full_last_logits(model, encoder, request, pool)
        for source in stale_kv.SOURCES:
            pages_kv = stale_kv.source_page_kv(model, encoder, request, pool, source)
            _, hidden, _ = stale_kv.prefill_with_page_kv(model, encoder, request, pages_kv)
            logits = model.lm_head(hidden)[0]
            if source == "fresh":
                torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
            else:
                assert (logits - reference).abs().max() > 1e-3


@torch.no_grad()
def test_stale_page_kv_differs_only_beyond_the_first_layer(tiny_folder, tokenizer, pools):
    """Layer 0's K and V of an image token depend on the token alone; deeper ones on its context."""
    from conduit_rt.evaluation.task import stale_kv

    model = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_folder).eval()
    encoder = data.PromptEncoder(tokenizer)
    pool = pools["val"]
    request = pool.requests(1, min_pages=3)[0]
    fresh = stale_kv.source_page_kv(model, encoder, request, pool, "fresh")
    for source in ("isolated", "retagged"):
        stale = stale_kv.source_page_kv(model, encoder, request, pool, source)
        for fresh_page, stale_page in zip(fresh, stale):
            torch.testing.assert_close(stale_page[0], fresh_page[0], atol=1e-5, rtol=1e-5)
            assert (stale_page[-1][1] - fresh_page[-1][1]).abs().max() > 1e-4


def test_stale_kv_report_runs(tiny_folder, tokenizer, pools):
    from conduit_rt.evaluation.task.stale_kv import stale_kv_report

    model = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_folder).eval()
    requests = pools["test"].requests(3)
    report = stale_kv_report(model, data.PromptEncoder(tokenizer), requests, pools["test"])
    assert report["requests"] == 3 and report["fresh_agrees_with_full"] == 1.0
    assert {f"{s}_exact_match" for s in ("fresh", "isolated", "retagged")} <= set(report)
