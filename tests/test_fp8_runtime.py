"""A Runtime over the fp8 KV cache (``Runtime(kv_dtype="fp8")``), on the CPU: a tiny LLaVA-1.5 against
transformers, and the bundled model through CONDUIT's refresh, VL-Cache's compaction and the cache
folder."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import conduit_rt
from conduit_rt import Runtime
from conduit_rt.convert.cli import main as convert_main
from conduit_rt.errors import InvalidArgumentError
from tests.fixtures.tiny_llava import build_tiny_llava
from tests.test_runtime import hf_generate, images, user


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf_dir = build_tiny_llava(tmp_path_factory.mktemp("hf"), seed=3)
    out = tmp_path_factory.mktemp("gguf")
    assert convert_main([str(hf_dir), "--outdir", str(out), "--dtype", "f32"]) == 0
    return hf_dir, out


def test_fp8_logits_stay_close_to_transformers_and_the_cache_holds_twice_the_tokens(checkpoint):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf_dir, out = checkpoint
    hf = (LlavaForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32).eval(),
          AutoProcessor.from_pretrained(hf_dir))
    messages = [user("What is in the picture and why?", images(2, seed=5))]
    want_tokens, want = hf_generate(hf, messages, n_new=4)
    with Runtime(out / "model.gguf", device="cpu", kv_cache_bytes=8 << 20) as dense, \
            Runtime(out / "model.gguf", device="cpu", kv_cache_bytes=8 << 20, kv_dtype="fp8") as fp8:
        assert fp8.arena.kv_format == "fp8"
        assert fp8.arena.stats().n_blocks_total > 1.9 * dense.arena.stats().n_blocks_total
        exact = dense.generate(messages, max_tokens=4, return_logits=True)
        rounded = fp8.generate(messages, max_tokens=4, return_logits=True)
    # the steps whose inputs agree: the first, and each after a token both chose
    steps = 1
    while steps < min(len(rounded.tokens), len(want_tokens), 4) and rounded.tokens[steps - 1] == want_tokens[steps - 1]:
        steps += 1
    scale = want.abs().max()
    dense_error = (exact.logits[0] - want[0]).abs().max() / scale
    fp8_error = (rounded.logits[0] - want[0]).abs().max() / scale
    assert dense_error <= 1e-4
    assert 1e-5 < fp8_error <= 0.05  # the cache is rounded (3 mantissa bits), and only that far
    p, q = torch.log_softmax(want[:steps].double(), -1), torch.log_softmax(rounded.logits[:steps].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert float(kl.max()) < 0.01


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (40, 52, 3), dtype=np.uint8))


def request(prefix: str, question: str = "Which is brighter?") -> list[dict]:
    content = [{"type": "text", "text": prefix}] + [{"type": "image", "image": picture(s)} for s in (1, 2)]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def test_refresh_compression_and_the_cache_folder_on_fp8(tmp_path):
    """The seen images come back from the fp8 store under a new prefix (CONDUIT refreshes some of
    their tokens), VL-Cache compacts the fp8 KV, and a cache folder written by an fp8 runtime restores
    its entries into an fp8 runtime and is a miss for a dense one."""
    def new(kv_dtype):
        return Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", kv_cache_bytes=32 << 20, prefix_cache_entries=0,
                       cache_dir=tmp_path, kv_dtype=kv_dtype)

    with new("fp8") as runtime:
        runtime.generate(request("Look:"), max_tokens=1)
        runtime.planner.image_kv.disk.flush()
        warm = runtime.generate(request("Now these:"), max_tokens=6, refresh="conduit", refresh_budget=0.2)
        assert warm.stats.image_hits == 2 and warm.stats.refreshed_tokens > 0
        compressed = runtime.generate(request("Again:"), max_tokens=6, compress="vlcache", keep=0.3)
        assert compressed.stats.kv_bytes_after_compress < compressed.stats.kv_bytes_before_compress
        assert runtime.arena.stats().n_seqs == 0  # nothing left behind
    with new("fp8") as restarted:
        again = restarted.generate(request("Now these:"), max_tokens=6, refresh="conduit", refresh_budget=0.2)
        assert again.stats.image_disk_hits == 2
        assert again.tokens == warm.tokens
    with new(None) as dense:
        other = dense.generate(request("Now these:"), max_tokens=6, refresh="conduit", refresh_budget=0.2)
        assert other.stats.image_disk_hits == 0 and other.stats.image_misses == 2


def test_an_unknown_kv_dtype_is_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", kv_dtype="int4")
