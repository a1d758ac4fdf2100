"""The benchmark suite's smoke run: ``conduit bench --quick --device cpu`` runs every section on tiny
shapes and writes a report holding every field. Nothing here is timed as a pass criterion: CPU
numbers are noise. What is checked by value: the kernels' outputs against a float32 torch
reference, and each random-weight model's logits (LLaVA, Qwen3-VL, InternVL3, Qwen2.5-VL) against
transformers running the same tensors, and each family's vision tower's embeddings against
transformers' tower on the same pixels and tensors. The full-size family shapes are checked on the
meta device against transformers' configs and models (no weights drawn).
"""
from __future__ import annotations

import json
import math

import pytest

from conduit_rt import reuse
from conduit_rt.bench import family_models, synthetic
from conduit_rt.bench import report as bench_report
from conduit_rt.bench import serve
from conduit_rt.bench.breakdown import PHASES, PhaseClock
from conduit_rt.bench.config import make_config
from conduit_rt.bench.targets import ROW_FIELDS, ROW_KEYS, at_least, at_most
from conduit_rt.bench.timing import Timer
from conduit_rt.cli import main
from conduit_rt.models.random_init import meta_model
from conduit_rt.preprocess import to_rgb_array

DECODE_RUNS = ("decode", "decode_long", "decode_batch")
FP8_DECODE_RUNS = tuple(f"{name}_fp8" for name in DECODE_RUNS)  # the same problems over an fp8 arena
KERNEL_RUNS = (*DECODE_RUNS, *FP8_DECODE_RUNS, "compressed", "recompute", "prefill", "scoring", "topk")
MEMORY_RUNS = ("cold_full", "cold_conduit", "warm_conduit", "warm_full", "transformers_prefill", "decode",
               "transformers_generate", "long_full", "long_vlcache", "long_fp8")
FAMILY_MEMORY_RUNS = ("cold_full", "cold_conduit", "warm_conduit", "warm_full", "transformers_prefill", "vision",
                      "transformers_vision")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    status = main(["bench", "--quick", "--device", "cpu", "--out", str(out), "--quiet"])
    return status, out, json.loads((out / "benchmarks.json").read_text())


def test_quick_run_succeeds_with_every_target_row(report):
    status, _, data = report
    assert status == 0 and data["errors"] == {}
    assert [row["key"] for row in data["targets"]] == list(ROW_KEYS)
    for row in data["targets"]:
        assert set(row) == set(ROW_FIELDS)
        assert math.isfinite(row["measured"]) and math.isfinite(row["reference"]), row["key"]
        assert isinstance(row["passed"], bool) and row["target"].split()[0] in (">=", "<=")
    assert data["summary"]["total"] == len(ROW_KEYS)
    for section in ("command", "environment", "config", "ceilings", "kernels", "e2e", "memory", "wall_s"):
        assert section in data
    assert data["ceilings"]["copy"]["bytes_per_s"] > 0 and data["ceilings"]["matmul"]["flop_per_s"] > 0


def test_kernels_match_a_float32_reference(report):
    kernels = report[2]["kernels"]
    assert set(KERNEL_RUNS) <= set(kernels)
    for name in (*DECODE_RUNS, *FP8_DECODE_RUNS, "compressed", "recompute", "prefill"):
        assert kernels[name]["rel_err"] < 1e-4, name  # float32 on the CPU (fp8: over the K/V the arena holds)
        assert kernels[name]["seconds"] > 0
    for name in (*DECODE_RUNS, *FP8_DECODE_RUNS, "recompute", "prefill"):
        assert any("seconds" in backend for backend in kernels[name]["sdpa"].values()), name
    for name in FP8_DECODE_RUNS:
        fp8, dense = kernels[name], kernels[name.removesuffix("_fp8")]
        assert fp8["kv_format"] == "fp8" and (fp8["length"], fp8["batch"]) == (dense["length"], dense["batch"])
        assert 0 < fp8["kv_bytes"] < dense["kv_bytes"]  # e4m3 bytes and a float32 scale per row, of float32 K/V
        assert 1e-3 < fp8["rel_err_vs_unrounded"] < 0.1, name  # the e4m3 rounding shows, and only it
    assert kernels["topk"]["same_indices"]
    assert kernels["scoring"]["selected"] == kernels["scoring"]["budget"] > 0
    assert kernels["scoring"]["mass_rel_err_vs_attention_stats"] < 1e-4  # the lse given vs found again


def test_end_to_end_runs_are_all_reported(report):
    e2e, memory = report[2]["e2e"], report[2]["memory"]
    # the random-weight model and transformers run the same tensors: the same logits
    assert e2e["transformers_prefill"]["logits_rel_err_vs_ours"] < 1e-4
    reuse_runs = e2e["reuse"]
    assert reuse_runs["warm_conduit"]["refreshed_tokens"] > 0
    assert reuse_runs["warm_conduit"]["image_hits"] == report[2]["config"]["e2e"]["n_images"]
    for key in ("breakdown_conduit", "breakdown_full"):
        assert set(PHASES) <= set(reuse_runs[key])
    assert reuse_runs["breakdown_conduit"]["recompute"] > 0 and reuse_runs["breakdown_full"]["recompute"] == 0
    decode = e2e["decode"]
    assert decode["ours"]["tokens_per_s"] > 0 and decode["transformers"]["tokens_per_s"] > 0
    long = e2e["long"]
    assert 0 < long["vlcache"]["kv_bytes_after_compress"] < long["vlcache"]["kv_bytes_before_compress"]
    assert long["full"]["prompt_tokens"] == report[2]["config"]["e2e"]["long_context"]
    fp8 = e2e["long_fp8"]  # the same request on an fp8 cache: fewer KV bytes for the same tokens
    assert fp8["prompt_tokens"] == long["full"]["prompt_tokens"] and fp8["tokens_per_s"] > 0
    assert 0 < fp8["kv_bytes_end"] < long["full"]["kv_bytes_end"]
    for run in MEMORY_RUNS:
        assert set(memory[run]) >= {"torch_peak_bytes", "arena_bytes", "total_bytes"}


def test_family_rows_match_transformers(report):
    """Each family's rows exist with real numbers, its decoder's logits are transformers' (the
    Qwen3-VL twin with our M-RoPE positions, DeepStack features and q/k in transformers' order; the
    Qwen2.5-VL twin with our M-RoPE positions), and so are its vision tower's embeddings (Qwen2.5-VL's
    tiny tower attends within 4 windows in its first block)."""
    data = report[2]
    sizes, families, memory = data["config"]["families"], data["families"], data["memory"]
    rows = {row["key"]: row for row in data["targets"]}
    assert list(families) == sizes["shapes"] == ["qwen3-vl-tiny", "internvl3-tiny", "qwen2.5-vl-tiny"]
    assert [raw["model"]["family"] for raw in families.values()] == ["qwen3vl", "internvl3", "qwen25vl"]
    # embedding width: Qwen3-VL's merged embedding and 2 DeepStack features, the others' text width
    widths = {"qwen3vl": 64 * 3, "internvl3": 64, "qwen25vl": 64}
    for name, raw in families.items():
        family = raw["model"]["family"]
        for key in (f"{family}.ttft.vs_full_prefill", f"{family}.prefill.vs_transformers",
                    f"{family}.vision.vs_transformers"):
            row = rows[key]
            assert row["name"].startswith(f"{name}: ")
            assert row["measured"] > 0 and row["reference"] > 0 and row["ratio"] > 0, key
        assert raw["transformers_prefill"]["logits_rel_err_vs_ours"] < 1e-4  # float32 on the CPU
        vision = raw["transformers_vision"]
        assert (vision["images"], vision["tokens"], vision["width"]) == (sizes["n_images"], sizes["n_images"] * 16,
                                                                         widths[family])
        # float32 on the CPU; tighter than the logits' bound: with weights of std 0.02 attention moves
        # the embeddings little (Qwen2.5-VL's tiny tower with full attention in its windowed block
        # differs from the windowed one by ~1e-4)
        assert vision["rel_err_vs_ours"] < 1e-5 and vision["max_abs_err_vs_ours"] < 1e-5 * vision["embeddings_max_abs"]
        reuse_runs = raw["reuse"]
        warm = reuse_runs["warm_conduit"]
        assert warm["image_hits"] == sizes["n_images"]
        assert warm["visual_tokens"] == sizes["n_images"] * 16  # 64-px images: 16 tokens each in both families
        assert 0 < warm["refreshed_tokens"] < warm["visual_tokens"]
        assert reuse_runs["warm_full"]["prompt_tokens"] == warm["prompt_tokens"]
        assert raw["transformers_prefill"]["tokens"] == warm["prompt_tokens"]
        assert reuse_runs["breakdown_full"]["prefill"] > 0 and reuse_runs["breakdown_full"]["recompute"] == 0
        for run in FAMILY_MEMORY_RUNS:
            assert f"{name}/{run}" in memory


# the vision_config of Qwen/Qwen2.5-VL-7B-Instruct's config.json
QWEN25VL_7B_VISION = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}


def _visible(config) -> dict:
    """A transformers config's own fields, without the bookkeeping ones."""
    return {key: value for key, value in config.to_dict().items()
            if key not in ("transformers_version", "architectures", "dtype", "_name_or_path")}


def test_full_family_shapes_are_transformers_models():
    """The 7B/8B shapes (on the meta device: no weights) have the vision towers transformers' configs
    default to (Qwen3-VL's, InternViT-300M-448px) or the hub config gives (Qwen2.5-VL-7B-Instruct's),
    exactly the parameters of the transformers models of the hub configs, and the token counts the
    benchmark states for its images."""
    transformers = pytest.importorskip("transformers")
    import torch

    qwen_vision = _visible(transformers.Qwen3VLConfig().vision_config)
    hub_configs = {
        "qwen3-vl-8b": transformers.Qwen3VLConfig(
            text_config={"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                             "mrope_interleaved": True}},
            vision_config=qwen_vision | {"out_hidden_size": 4096}, tie_word_embeddings=False),
        "internvl3-8b": transformers.InternVLConfig(
            text_config={"model_type": "qwen2", "vocab_size": 151674, "hidden_size": 3584, "intermediate_size": 18944,
                         "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                         "tie_word_embeddings": False},
            vision_config={"attention_bias": True}, tie_word_embeddings=False),
        "qwen2.5-vl-7b": transformers.Qwen2_5_VLConfig(
            text_config={"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                         "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
            vision_config=QWEN25VL_7B_VISION, tie_word_embeddings=False),
    }
    qwen, intern = family_models.SHAPES["qwen3-vl-8b"], family_models.SHAPES["internvl3-8b"]
    v = qwen.vision
    assert (v.n_layers, v.hidden, v.intermediate, v.n_heads, v.patch_size, qwen.merge_size,
            qwen.num_position_embeddings, list(qwen.deepstack_indexes)) == tuple(
        qwen_vision[k] for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                                 "spatial_merge_size", "num_position_embeddings", "deepstack_visual_indexes"))
    intern_vision = _visible(transformers.InternVLConfig().vision_config)
    v = intern.vision
    assert (v.n_layers, v.hidden, v.intermediate, v.n_heads, [v.patch_size] * 2, [intern.tile] * 2) == tuple(
        intern_vision[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                   "patch_size", "image_size"))
    qwen25 = family_models.SHAPES["qwen2.5-vl-7b"]
    v, hub_vision = qwen25.vision, QWEN25VL_7B_VISION
    assert (v.n_layers, v.hidden, v.intermediate, v.n_heads, v.patch_size, qwen25.merge_size, qwen25.window_size,
            list(qwen25.fullatt_block_indexes)) == tuple(
        hub_vision[k] for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                                "spatial_merge_size", "window_size", "fullatt_block_indexes"))
    assert qwen25.rope_sections == (16, 24, 24) and qwen25.text.vocab == 152064
    tokens_per_image = {"qwen3-vl-8b": 1024, "internvl3-8b": 256, "qwen2.5-vl-7b": 1024}
    for name, hub in hub_configs.items():
        shape = family_models.SHAPES[name]
        ours = meta_model(*shape.configs(name))
        with torch.device("meta"):
            theirs = transformers.AutoModelForImageTextToText.from_config(hub)
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()), name
        image = synthetic.random_images(1, shape.vision.image_side, seed=0)[0]
        assert ours.prepare_image(to_rgb_array(image)).n_tokens == tokens_per_image[name]


def _windows(name: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A Qwen2.5-VL shape's attention segments over one benchmark image: (windows, whole image), as
    [(segments, patches each)] (meta device: no weights)."""
    import torch

    shape = family_models.SHAPES[name]
    model = meta_model(*shape.configs(name))
    image = synthetic.random_images(1, shape.vision.image_side, seed=0)[0]
    plan = model.visual.plan([model.prepare_image(to_rgb_array(image)).grid_thw], torch.device("cpu"))
    return [tuple(g.shape) for g in plan.window_groups], [tuple(g.shape) for g in plan.full_groups]


def test_qwen25vl_towers_attend_within_windows():
    """Qwen2.5-VL's towers see the benchmark's images as windows: 896 px in 8 x 8 windows of 112 px
    (8 x 8 patches); the smoke run's 64 px in 2 x 2 windows of 32 px (4 x 4 patches), so that the
    tiny twin comparison covers the windowed block (0) and the full one (1)."""
    assert _windows("qwen2.5-vl-7b") == ([(64, 64)], [(1, 64 * 64)])
    assert _windows("qwen2.5-vl-tiny") == ([(4, 16)], [(1, 64)])
    assert family_models.SHAPES["qwen2.5-vl-tiny"].fullatt_block_indexes == (1,)


@pytest.fixture(scope="module")
def serve_run():
    """The serve section alone at the quick sizes on the CPU (a copy bandwidth of 1e10 B/s assumed)."""
    config = make_config("cpu", quick=True)
    raw, rows, errors = serve.run(config.serve, config.e2e, Timer(config.device, 1, 3), config.dtype, 1e10)
    return config.serve, raw, rows, errors


def test_serve_section_answers_every_request_whole(serve_run):
    sizes, raw, rows, errors = serve_run
    assert errors == {}
    assert list(raw["clients"]) == [str(n) for n in sizes.clients]
    for run in raw["clients"].values():
        assert run["lost"] == 0 and run["errors"] == []
        assert run["requests"] == run["clients"] * sizes.requests_per_client
        assert run["tokens"] == run["requests"] * sizes.max_tokens
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] and run["tokens_per_s"] > 0
    assert raw["batch_step"]["batch"] == sizes.scaling_clients and raw["batch_step"]["tokens_per_s"] > 0
    restart = raw["restart"]
    assert restart["in_memory"]["image_hits"] == sizes.n_images and restart["in_memory"]["image_disk_hits"] == 0
    restarted = restart["restarted"]
    assert restarted["preloaded"] >= sizes.n_images  # loaded from the folder before the request, not computed
    assert restarted["image_hits"] == sizes.n_images and restarted["image_disk_hits"] == 0
    assert restart["on_demand"]["image_disk_hits"] == sizes.n_images  # no preload: loaded on the request's path
    assert [r.key for r in rows] == ["serve.throughput", "serve.no_loss", "serve.batch_step.vs_bound",
                                     "serve.restart_ttft"]
    for row in rows:
        assert math.isfinite(row.measured) and math.isfinite(row.reference) and math.isfinite(row.ratio), row.key
    no_loss = rows[1]
    assert no_loss.passed and no_loss.measured == no_loss.reference == raw["clients"][str(max(sizes.clients))]["requests"]


def test_markdown_page_and_plots(report):
    _, out, data = report
    page = (out / "benchmarks.md").read_text()
    assert data["command"] in page
    for row in data["targets"]:
        assert row["name"] in page
    pytest.importorskip("matplotlib")
    assert len(data["plots"]) == 4
    for plot in data["plots"]:
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_renders_again_from_the_json(report, tmp_path):
    """``python -m conduit_rt.bench.report --from-json`` gives the run's page back from its JSON alone."""
    _, out, _ = report
    copy = tmp_path / "benchmarks.json"
    copy.write_text((out / "benchmarks.json").read_text())
    assert bench_report.main(["--from-json", str(copy), "--no-plots"]) == 0
    assert (tmp_path / "benchmarks.md").read_text() == (out / "benchmarks.md").read_text()


def test_page_from_an_older_json_marks_the_rows_it_lacks(report, tmp_path):
    """A JSON written before a row existed renders with that row failing as not measured, in its place."""
    _, out, data = report
    dropped = data["targets"][3]["key"]
    older = dict(data, targets=[row for row in data["targets"] if row["key"] != dropped])
    (tmp_path / "benchmarks.json").write_text(json.dumps(older))
    assert bench_report.main(["--from-json", str(tmp_path / "benchmarks.json"), "--no-plots"]) == 0
    page = (tmp_path / "benchmarks.md").read_text()
    assert f"| {dropped}<br><sub>not measured ({bench_report.NOT_IN_RUN})</sub> |" in page
    assert f"## Targets: {sum(row['passed'] for row in older['targets'])} of {len(ROW_KEYS)} met" in page
    following = data["targets"][4]["name"]
    assert page.index(f"| {dropped}<br>") < page.index(f"| {following}")  # in its place, not at the end


def test_phase_clock_puts_the_methods_back():
    methods = (reuse.ReusePass, "run"), (reuse.ReusePass, "_forward"), (reuse.ReusePass, "_pass"), \
        (reuse._PassScores, "attention")
    before = [getattr(owner, name) for owner, name in methods]
    with PhaseClock("cpu"):
        assert all(getattr(owner, name) is not old for (owner, name), old in zip(methods, before))
    assert all(getattr(owner, name) is old for (owner, name), old in zip(methods, before))


def test_target_rows_compare_ratios_both_ways():
    faster = at_least("k", "n", measured=2.0, reference=5.0, unit="ms", threshold=2.0, ratio_is="", invert=True)
    assert faster.ratio == 2.5 and faster.passed
    assert not at_least("k", "n", 2.0, 5.0, "ms", 2.0, "", invert=True, valid=False).passed
    smaller = at_most("k", "n", measured=1.0, reference=5.0, unit="ms", threshold=0.15, ratio_is="")
    assert smaller.ratio == 0.2 and not smaller.passed
    assert not at_least("k", "n", float("nan"), 1.0, "x", 0.5, "").passed


def test_docs_page_describes_every_row():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md").read_text()
    assert "python3 -m conduit_rt.bench" in page
    for key in ROW_KEYS:
        assert f"`{key}`" in page
