"""``conduit eval`` on a tiny random task model (CPU, fp32): the command's outputs, the replay's stale
KV against the transformers reference of ``conduit_rt.evaluation.task.stale_kv``, the measures against torch.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conduit_rt import Runtime
from conduit_rt.cli import main as conduit_main
from conduit_rt.evaluation.metrics import Outcome, fidelity, kl_divergence
from conduit_rt.evaluation.replay import REFERENCE_KEY, Replay, Setting
from conduit_rt.evaluation.sessions import (
    earlier_sessions,
    request_messages,
    seen_before,
)
from conduit_rt.convert.cli import main as convert_main

transformers = pytest.importorskip("transformers")

SEED = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matrices are far too small for intra-op threads (which only contend for CI's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def task_model(tmp_path_factory):
    """The tiny task model with perturbed weights (logits far from uniform): (HF folder, GGUF folder)."""
    from conduit_rt.evaluation.task.model_config import MODEL_SIZES, new_model, write_model_folder
    from conduit_rt.evaluation.task.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model = new_model(tokenizer, MODEL_SIZES["tiny"], seed=SEED)
    noise = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=noise))
    hf_dir = write_model_folder(model, tokenizer, tmp_path_factory.mktemp("task_hf"), dtype=torch.float32)
    gguf_dir = tmp_path_factory.mktemp("task_gguf")
    assert convert_main([str(hf_dir), "--outdir", str(gguf_dir), "--dtype", "f32", "--quiet"]) == 0
    return hf_dir, gguf_dir


@pytest.fixture(scope="module")
def pool():
    from conduit_rt.evaluation.task.data import build_pool

    return build_pool(SEED, "test", 40)


def test_eval_command_writes_the_table_and_full_refresh_matches_the_reference(task_model, tmp_path):
    hf_dir, _ = task_model
    out = tmp_path / "eval"
    status = conduit_main(["eval", "--model", str(hf_dir), "--device", "cpu", "--n", "4", "--max-pages", "3",
                           "--pool-pages", "40", "--seed", str(SEED), "--families", "lookup", "--refresh-policies", "full,none,conduit",
                           "--budgets", "0,0.1", "--compress-policies", "none,vlcache", "--keeps", "0.1",
                           "--out", str(out), "-q"])
    assert status == 0
    assert {"results.json", "table.md", "plot.png", "quality.md"} <= {p.name for p in out.iterdir()}
    results = json.loads((out / "results.json").read_text())
    rows = {row["key"]: row for row in results["rows"]}
    assert set(rows) == {REFERENCE_KEY, "refresh:full@1", "refresh:none@0", "refresh:conduit@0.1",
                         "compress:none@1", "compress:vlcache@0.1", "refresh:conduit@0.1+compress:vlcache@0.1"}
    assert results["n_requests"] == 4 and all(row["n"] == 4 for row in rows.values())
    assert {"full_accuracy", "none_gap_points", "tells_policies_apart"} <= set(results["checks"])
    for row in rows.values():  # 95% intervals around every accuracy; every request is of the one family asked
        assert row["accuracy_ci"][0] <= row["accuracy"] <= row["accuracy_ci"][1]
        assert set(row["families"]) == {"lookup"} and row["families"]["lookup"]["n"] == 4
    assert results["comparisons"] == []  # no baseline among full, none and conduit, nor among none and vlcache
    for key in (REFERENCE_KEY, "refresh:full@1", "compress:none@1"):  # everything recomputed or kept
        row = rows[key]
        assert row["kl"] < 1e-6 and row["top1"] == 1.0 and row["continuation_match"] == 1.0, key
        assert row["hidden_rel_error"] < 1e-4, key
    none = rows["refresh:none@0"]
    assert none["image_hit_rate"] == 1.0 and none["refreshed_fraction"] == 0.0
    assert none["hidden_rel_error_first"] > 1e-3 and none["kl_first"] > 1e-7  # stale KV changes the answer state
    assert none["prefill_flops_ratio"] < rows["refresh:conduit@0.1"]["prefill_flops_ratio"] < 1.0
    assert 0.1 <= rows["refresh:conduit@0.1"]["refreshed_fraction"] < 0.2
    vlcache = rows["compress:vlcache@0.1"]
    assert vlcache["kv_ratio"] < 0.5 and vlcache["kl_first"] < 1e-6  # the prefill is untouched, decoding is not
    assert "| `conduit` |" in (out / "table.md").read_text()
    assert "CONDUIT at r = 10%" in (out / "quality.md").read_text()


def test_eval_with_an_fp8_kv_cache_reports_its_full_prefill_against_the_dense_one(task_model, tmp_path):
    hf_dir, _ = task_model
    out = tmp_path / "eval"
    n = 3
    status = conduit_main(["eval", "--model", str(hf_dir), "--device", "cpu", "--n", str(n), "--max-pages", "2",
                           "--pool-pages", "40", "--seed", str(SEED), "--families", "lookup", "--refresh-policies", "",
                           "--compress-policies", "", "--together", "", "--kv-dtype", "fp8", "--out", str(out), "-q"])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    rows = {row["key"]: row for row in results["rows"]}
    kv = results["kv_cache"]
    assert set(rows) == {REFERENCE_KEY, kv["key"]} and kv["kv_dtype"] == "fp8"
    assert kv["n"] == n == rows[kv["key"]]["n"] and len(results["outcomes"][kv["key"]]) == n
    assert 0.0 <= kv["accuracy"] <= 1.0 and kv["accuracy_ci"][0] <= kv["accuracy"] <= kv["accuracy_ci"][1]
    assert kv["full_accuracy"] == rows[REFERENCE_KEY]["accuracy"]
    assert kv["difference"] == pytest.approx(kv["accuracy"] - kv["full_accuracy"])
    assert kv["ci"][0] <= kv["difference"] <= kv["ci"][1]
    kl = kv["kl_first"]
    assert all(math.isfinite(value) and value >= 0.0 for value in kl.values())
    assert kl["mean"] <= kl["max"] and kl["p99"] <= kl["max"] and kl["max"] > 0.0  # the fp8 cache is rounded
    assert kl["mean"] == pytest.approx(rows[kv["key"]]["kl_first"])
    table = (out / "table.md").read_text()
    assert "| `fp8` |" in table and "Full prefill on the fp8 KV cache" in table


def test_replayed_stale_kv_equals_the_transformers_reference(task_model, pool):
    """`none` after a retagged session = quality.stale_kv's retagged source (plain transformers), and at
    budget 0 every refresh policy is `none`."""
    from conduit_rt.evaluation.task.data import PromptEncoder
    from conduit_rt.evaluation.task.stale_kv import prefill_with_page_kv, source_page_kv
    from conduit_rt.evaluation.task.tokenizer import build_tokenizer

    hf_dir, gguf_dir = task_model
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    encoder = PromptEncoder(build_tokenizer())
    runtime = Runtime(gguf_dir / "model.gguf", device="cpu", kv_cache_bytes=32 << 20, prefix_cache_entries=0)
    settings = [Setting("reference"), Setting("refresh", "none", 0.0), Setting("refresh", "conduit", 0.0),
                Setting("refresh", "cacheblend", 0.0)]
    replay = Replay(runtime, settings, max_tokens=1)
    for request in pool.requests(3, min_pages=2, max_pages=3):
        outcomes = replay.session(request_messages(request), seen_before(request, pool.pages, "retagged", salt=1))
        with torch.no_grad():
            _, hidden, _ = prefill_with_page_kv(hf, encoder, request, source_page_kv(hf, encoder, request, pool,
                                                                                     "retagged", salt=1))
            expected = hf.lm_head(hidden)[0]
        stale = outcomes["refresh:none@0"]
        torch.testing.assert_close(stale.logits[0], expected, atol=1e-4 * expected.abs().max().item(), rtol=0)
        torch.testing.assert_close(stale.hidden[0], hidden[0], atol=1e-4 * hidden.abs().max().item(), rtol=0)
        assert (stale.logits[0] - outcomes[REFERENCE_KEY].logits[0]).abs().max() > 1e-3 * expected.abs().max()
        for key in ("refresh:conduit@0", "refresh:cacheblend@0"):
            torch.testing.assert_close(outcomes[key].logits, stale.logits, atol=1e-6, rtol=0)


def test_earlier_sessions_show_every_page_once_under_another_tag(pool):
    for request in pool.requests(20, min_pages=2):
        earlier = earlier_sessions(request, pool.pages, salt=3)
        shown = [page_id for seen in earlier for page_id in seen.page_ids if page_id in request.page_ids]
        assert sorted(shown) == sorted(request.page_ids)
        tag_in_request = dict(zip(request.page_ids, request.tags))
        for seen in earlier:
            assert len(set(seen.tags)) == seen.num_pages and seen.answer
            assert all(tag != tag_in_request[i] for i, tag in zip(seen.page_ids, seen.tags) if i in tag_in_request)
        assert earlier == earlier_sessions(request, pool.pages, salt=3)


def test_kl_and_fidelity_against_torch():
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(5, 40, generator=generator) * 3
    other = reference + torch.randn(5, 40, generator=generator)
    expected = F.kl_div(F.log_softmax(other.double(), -1), F.log_softmax(reference.double(), -1),
                        reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(kl_divergence(reference, other), expected)
    hidden = torch.randn(5, 16, generator=generator)
    tokens = reference.argmax(-1)[:4].tolist()
    ref = Outcome("", tokens, reference, hidden, None)
    # a continuation that leaves the reference after its second token: steps 0..2 are comparable
    mine = Outcome("", tokens[:2] + [tokens[2] + 1], other[:4], hidden[:4] * 1.5, None)
    measures = fidelity(ref, mine)
    assert measures["aligned_steps"] == 3 and measures["continuation_match"] == 0.0
    assert measures["kl"] == pytest.approx(float(expected[:3].mean()))
    assert measures["hidden_rel_error"] == pytest.approx(0.5)
    assert measures["top1"] == pytest.approx(float((reference[:3].argmax(-1) == other[:3].argmax(-1)).double().mean()))
