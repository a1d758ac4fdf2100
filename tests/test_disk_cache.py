"""The image-KV store on disk (``Runtime(cache_dir=...)``, ``disk_cache``, ``disk_entry``), on the bundled
model (CPU).

A Runtime started again over a cache folder restores the images a closed one computed and answers
as the closed one answered them warm; a request's images on disk are read together; unusable files
are misses, deleted (one among several alone), leave nothing in the arena, and the answer is the one
computed without them; the folder keeps its LRU byte budget; two processes writing one folder at
once leave only whole files, holding the KV a Runtime computes; bad arguments are typed errors.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from PIL import Image

import conduit_rt
from conduit_rt import Runtime, disk_entry
from conduit_rt.disk_cache import DiskImageStore
from conduit_rt.disk_entry import EntryLayout, checksum, model_fingerprint
from conduit_rt.errors import InvalidArgumentError

REPO = Path(__file__).resolve().parent.parent
ANSWER = {"max_tokens": 6, "refresh": "conduit", "return_logits": True}


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (40, 52, 3), dtype=np.uint8))


def messages(prefix: str, images: list[Image.Image], question: str = "Which is brighter?") -> list[dict]:
    content = [{"type": "text", "text": prefix}] + [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def new_runtime(cache_dir: Path | None, **kw) -> Runtime:
    """The bundled model on the CPU, without exact-prefix reuse (every image goes through the store)."""
    return Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", kv_cache_bytes=32 << 20, prefix_cache_entries=0,
                   cache_dir=cache_dir, **kw)


def entry_kv(runtime: Runtime, key: bytes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K before RoPE, V) of the image entry under ``key`` in the runtime's arena."""
    entry = runtime.arena.acquire_image(key)
    assert entry is not None
    try:
        return [entry.read(layer) for layer in range(runtime.model.config.n_layers)]
    finally:
        entry.release()


@dataclass
class Pristine:
    """A folder written by a Runtime that answered ``cold`` (both images computed) and then ``warm``
    (the same images under another prefix, restored from its arena); their results, the images'
    keys and files, their KV as the arena held it, and the store's identity."""

    directory: Path
    cold: list[dict]
    warm: list[dict]
    cold_result: object
    warm_result: object
    keys: list[bytes]
    paths: list[Path]
    kv: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]]
    model_id: str
    layout: EntryLayout
    n_tokens: int


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    directory = tmp_path_factory.mktemp("pristine")
    images = [picture(1), picture(2)]
    cold, warm = messages("Look:", images), messages("Here are two pictures, again:", images)
    runtime = new_runtime(directory)
    cold_result = runtime.generate(cold, **ANSWER)
    assert (cold_result.stats.image_misses, cold_result.stats.image_hits) == (2, 0)
    warm_result = runtime.generate(warm, **ANSWER)
    assert (warm_result.stats.image_hits, warm_result.stats.image_disk_hits) == (2, 0)
    request = runtime.requests.read(cold)
    keys, n_tokens = request.keys, request.prompt.image_slots[0].n_tokens
    kv = {key: entry_kv(runtime, key) for key in keys}
    c = runtime.model.config
    layout = EntryLayout(c.n_layers, c.n_kv_heads, c.head_dim, c.hidden, runtime.dtype)
    model_id = model_fingerprint(runtime.model)
    store = runtime.planner.image_kv.disk
    paths = [store.path(key) for key in keys]
    runtime.close()
    stats = runtime.disk_cache_stats()
    assert (stats.writes, stats.pending_writes, stats.files) == (2, 0, 2)
    assert all(path.is_file() for path in paths)
    return Pristine(directory, cold, warm, cold_result, warm_result, keys, paths, kv, model_id, layout, n_tokens)


def copy_of(pristine: Pristine, tmp_path: Path) -> Path:
    target = tmp_path / "cache"
    shutil.copytree(pristine.directory, target)
    return target


def assert_same_answer(result, expected) -> None:
    assert result.tokens == expected.tokens
    assert torch.equal(result.logits, expected.logits)


def assert_entry_is(entry, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A loaded ``DiskEntry`` holds exactly the per-layer K, V of ``kv``."""
    assert entry is not None
    assert torch.equal(entry.k, torch.stack([k for k, _ in kv]))
    assert torch.equal(entry.v, torch.stack([v for _, v in kv]))
    norms = torch.stack([v.float().flatten(1).norm(dim=1) for _, v in kv])
    assert torch.equal(entry.value_norms, norms)


# -- restarts ---------------------------------------------------------------------------------------

def test_a_restart_restores_the_images_and_answers_as_the_warm_runtime(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path)
    with new_runtime(directory) as runtime:
        result = runtime.generate(pristine.warm, **ANSWER)
        assert (result.stats.image_hits, result.stats.image_disk_hits, result.stats.image_misses) == (2, 2, 0)
        assert_same_answer(result, pristine.warm_result)
        for key in pristine.keys:  # the arena holds what the first runtime's arena held
            got = entry_kv(runtime, key)
            assert all(torch.equal(a, b) for pair, want in zip(got, pristine.kv[key]) for a, b in zip(pair, want))
        embedding = runtime.requests.embeddings.get(pristine.keys[0])
        assert embedding is not None  # loaded with the entry: the recompute starts from it
        request = runtime.requests.read(pristine.warm)
        (expected,) = runtime.model.encode_images([request.images[0]])
        # the tower's CPU matmuls may round differently between processes (threading): equal to scale
        assert float((embedding - expected).norm() / expected.norm()) < 1e-3
        again = runtime.generate(pristine.warm, **ANSWER)  # now in the arena: an ordinary warm hit
        assert (again.stats.image_hits, again.stats.image_disk_hits) == (2, 0)
        assert_same_answer(again, pristine.warm_result)
        stats = runtime.disk_cache_stats()
    assert (stats.hits, stats.misses, stats.rejected, stats.writes) == (2, 0, 0, 0)


def test_a_preload_makes_the_first_request_an_in_memory_hit_with_the_same_answer(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path)
    with new_runtime(directory) as runtime:
        assert runtime.preload_images() == 2
        assert all(runtime.arena.has_image(key) for key in pristine.keys)
        for key in pristine.keys:  # the arena holds what the first runtime's arena held
            got = entry_kv(runtime, key)
            assert all(torch.equal(a, b) for pair, want in zip(got, pristine.kv[key]) for a, b in zip(pair, want))
        assert runtime.requests.embeddings.get(pristine.keys[0]) is not None
        result = runtime.generate(pristine.warm, **ANSWER)
        assert (result.stats.image_hits, result.stats.image_disk_hits, result.stats.image_misses) == (2, 0, 0)
        assert_same_answer(result, pristine.warm_result)
        assert runtime.preload_images() == 0  # everything the folder holds is in memory already
        stats = runtime.disk_cache_stats()
    assert (stats.hits, stats.misses, stats.rejected) == (2, 0, 0)


def test_a_preload_takes_the_most_recent_files_that_fit_the_image_store(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path)
    older, newer = pristine.keys
    os.utime(pristine_path(directory, pristine, older), ns=(1, 1))  # least recently used
    size = pristine.paths[0].stat().st_size
    with new_runtime(directory, image_cache_bytes=size * 3 // 2) as runtime:
        assert runtime.preload_images() == 1
        assert runtime.arena.has_image(newer) and not runtime.arena.has_image(older)
        assert pristine_path(directory, pristine, older).is_file()  # left on disk for a later request


def test_a_preload_deletes_an_unusable_file_and_loads_the_rest(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path)
    bad, good = (pristine_path(directory, pristine, key) for key in pristine.keys)
    data = bytearray(bad.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor: the checksum fails
    bad.write_bytes(bytes(data))
    with new_runtime(directory) as runtime:
        assert runtime.preload_images() == 1
        assert not bad.exists() and good.exists()
        assert not runtime.arena.has_image(pristine.keys[0]) and runtime.arena.has_image(pristine.keys[1])
        result = runtime.generate(pristine.warm, **ANSWER)
        assert (result.stats.image_hits, result.stats.image_misses) == (1, 1)
        assert_same_answer(result, pristine.warm_result)
        assert runtime.disk_cache_stats().rejected == 1


def test_without_a_cache_dir_a_preload_loads_nothing(tmp_path):
    with new_runtime(None) as runtime:
        assert runtime.preload_images() == 0


def pristine_path(directory: Path, pristine: Pristine, key: bytes) -> Path:
    """The file of ``key`` in a copy of the pristine folder."""
    return directory / pristine.paths[pristine.keys.index(key)].name


def test_without_a_cache_dir_nothing_is_written_and_a_restart_is_cold(pristine, tmp_path):
    with new_runtime(None) as runtime:
        result = runtime.generate(pristine.warm, **ANSWER)
        assert runtime.disk_cache_stats() is None
    assert (result.stats.image_misses, result.stats.image_disk_hits) == (2, 0)


# -- unusable files -----------------------------------------------------------------------------------

def _resave(path: Path, change) -> None:
    """Rewrites an entry file after ``change(tensors, metadata)``, with a checksum that matches it."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    change(tensors, metadata)
    metadata["checksum"] = checksum(tensors, metadata)
    path.write_bytes(safetensors.torch.save(tensors, metadata))


def flipped(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x40  # inside the tensor data
    path.write_bytes(bytes(data))


def truncated(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path, other: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path, other: Path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def foreign_model(path: Path, other: Path) -> None:
    _resave(path, lambda tensors, metadata: metadata.update(model="0" * 32))


def other_dtype(path: Path, other: Path) -> None:
    def change(tensors, metadata):
        tensors["k"], tensors["v"] = tensors["k"].half(), tensors["v"].half()
    _resave(path, change)


def wrong_shape(path: Path, other: Path) -> None:
    def change(tensors, metadata):
        tensors["k"] = tensors["k"][:-1].contiguous()
    _resave(path, change)


def other_key(path: Path, other: Path) -> None:
    path.write_bytes(other.read_bytes())


def appended(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes() + bytes(8))  # the tensors no longer end where the file does


SPOILERS = [flipped, truncated, empty, garbage, foreign_model, other_dtype, wrong_shape, other_key, appended]


@pytest.mark.parametrize("spoil", SPOILERS, ids=lambda spoil: spoil.__name__)
def test_an_unusable_file_is_a_miss_and_is_deleted(pristine, tmp_path, spoil, caplog):
    directory = copy_of(pristine, tmp_path)
    store = DiskImageStore(directory, 1 << 30, pristine.model_id, pristine.layout)
    first, second = [store.path(key) for key in pristine.keys]
    assert_entry_is(store.load(pristine.keys[1], pristine.n_tokens), pristine.kv[pristine.keys[1]])
    spoil(first, second)
    assert store.load(pristine.keys[0], pristine.n_tokens) is None
    assert not first.exists() and second.exists()
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.rejected) == (1, 1, 1)
    assert "unusable" in caplog.text
    store.close()


def test_a_file_of_another_image_size_is_a_miss(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path)
    store = DiskImageStore(directory, 1 << 30, pristine.model_id, pristine.layout)
    assert store.load(pristine.keys[0], pristine.n_tokens + 1) is None
    assert not store.path(pristine.keys[0]).exists()
    store.close()


@pytest.mark.parametrize("spoil", [truncated, foreign_model, other_key], ids=lambda spoil: spoil.__name__)
def test_a_runtime_computes_what_an_unusable_file_held(pristine, tmp_path, spoil):
    directory = copy_of(pristine, tmp_path)
    paths = [directory / path.name for path in pristine.paths]
    spoil(paths[0], pristine.paths[1])
    spoil(paths[1], pristine.paths[0])
    with new_runtime(directory) as runtime:
        result = runtime.generate(pristine.cold, **ANSWER)
        assert (result.stats.image_misses, result.stats.image_disk_hits) == (2, 0)
        assert_same_answer(result, pristine.cold_result)
    stats = runtime.disk_cache_stats()
    assert (stats.misses, stats.rejected, stats.writes) == (2, 2, 2)
    store = DiskImageStore(directory, 1 << 30, pristine.model_id, pristine.layout)
    for key in pristine.keys:  # written again, whole
        assert_entry_is(store.load(key, pristine.n_tokens), pristine.kv[key])
    store.close()


# -- a request's images, read together ---------------------------------------------------------------

def spy_on_reads(monkeypatch) -> list[int]:
    """The number of files of each ``read_entries`` call the store makes from now on."""
    from conduit_rt import disk_cache

    calls, read = [], disk_cache.read_entries

    def counted(files, device):
        calls.append(len(files))
        return read(files, device)

    monkeypatch.setattr(disk_cache, "read_entries", counted)
    return calls


def test_a_requests_images_are_read_together_and_answer_as_the_warm_runtime(pristine, tmp_path, monkeypatch):
    reads = spy_on_reads(monkeypatch)
    with new_runtime(copy_of(pristine, tmp_path)) as runtime:
        result = runtime.generate(pristine.warm, **ANSWER)
    assert reads == [2]
    assert (result.stats.image_hits, result.stats.image_disk_hits) == (2, 2)
    assert_same_answer(result, pristine.warm_result)


def test_files_past_the_loading_bound_are_read_a_group_at_a_time(pristine, tmp_path, monkeypatch):
    from conduit_rt import disk_cache

    reads = spy_on_reads(monkeypatch)
    monkeypatch.setattr(disk_cache, "MAX_LOADING_BYTES", pristine.paths[0].stat().st_size * 3 // 2)
    with new_runtime(copy_of(pristine, tmp_path)) as runtime:
        result = runtime.generate(pristine.warm, **ANSWER)
    assert reads == [1, 1]
    assert (result.stats.image_hits, result.stats.image_disk_hits) == (2, 2)
    assert_same_answer(result, pristine.warm_result)


def test_the_same_image_twice_is_read_once(pristine, tmp_path, monkeypatch):
    """The second slot of an image takes the entry the first one loaded, from the arena; the answer
    is a warm Runtime's, which held the image in memory."""
    reads = spy_on_reads(monkeypatch)
    first = picture(1)
    twice = messages("Look:", [first, first])
    with new_runtime(None) as warm:
        warm.generate(messages("Look:", [first]), **ANSWER)  # computes the image as the pristine folder's
        expected = warm.generate(twice, **ANSWER)
    assert (expected.stats.image_hits, expected.stats.image_disk_hits) == (2, 0)
    with new_runtime(copy_of(pristine, tmp_path)) as runtime:
        result = runtime.generate(twice, **ANSWER)
    assert reads == [1]
    assert (result.stats.image_hits, result.stats.image_disk_hits, result.stats.image_misses) == (2, 1, 0)
    assert_same_answer(result, expected)
    assert runtime.disk_cache_stats().hits == 1


@pytest.mark.parametrize("spoil", [flipped, truncated], ids=lambda spoil: spoil.__name__)
def test_an_unusable_file_among_a_requests_images_is_a_miss_the_others_hits(pristine, tmp_path, spoil):
    """The answer is the one of a Runtime whose folder lacks the spoiled file."""
    spoiled, without = copy_of(pristine, tmp_path / "spoiled"), copy_of(pristine, tmp_path / "without")
    bad = pristine.paths[0].name
    spoil(spoiled / bad, pristine.paths[1])
    (without / bad).unlink()
    with new_runtime(without) as reference:
        expected = reference.generate(pristine.warm, **ANSWER)
    with new_runtime(spoiled) as runtime:
        result = runtime.generate(pristine.warm, **ANSWER)
    assert (result.stats.image_hits, result.stats.image_disk_hits, result.stats.image_misses) == (1, 1, 1)
    assert_same_answer(result, expected)
    stats = runtime.disk_cache_stats()
    assert (stats.hits, stats.misses, stats.rejected, stats.writes) == (1, 1, 1, 1)  # computed, written again


def test_a_checksum_mismatch_leaves_no_arena_entry(pristine, tmp_path):
    """Loading two files, one of them corrupted, commits the good one alone: the arena's counts move
    by exactly one entry of the good image."""
    directory = copy_of(pristine, tmp_path)
    bad, good = pristine.keys
    flipped(directory / pristine.paths[0].name, pristine.paths[1])
    with new_runtime(directory) as runtime:
        image_kv = runtime.planner.image_kv
        before = runtime.arena.stats()
        assert image_kv.acquire(bad, pristine.n_tokens) is None
        assert runtime.arena.stats() == before
        shutil.copy(pristine.paths[0], directory / pristine.paths[0].name)  # the miss deleted it: again
        flipped(directory / pristine.paths[0].name, pristine.paths[1])
        with image_kv.preloaded({bad: pristine.n_tokens, good: pristine.n_tokens}):
            assert image_kv.acquire(bad, pristine.n_tokens) is None
            cached = image_kv.acquire(good, pristine.n_tokens)
            assert cached is not None and cached.from_disk
            cached.release()
        after = runtime.arena.stats()
        assert not runtime.arena.has_image(bad) and runtime.arena.has_image(good)
        assert after.n_image_entries == before.n_image_entries + 1
        entry = after.image_bytes - before.image_bytes
        assert entry > 0 and after.bytes_used - before.bytes_used == entry
        got = entry_kv(runtime, good)
        assert all(torch.equal(a, b) for pair, want in zip(got, pristine.kv[good]) for a, b in zip(pair, want))
    assert runtime.disk_cache_stats().rejected == 2


def test_preloaded_entries_no_acquire_took_are_released(pristine, tmp_path):
    """Leaving ``preloaded`` lets go of the entries it loaded: they stay in the arena, unreferenced
    (so evictable), and a later acquire finds them there."""
    with new_runtime(copy_of(pristine, tmp_path)) as runtime:
        image_kv = runtime.planner.image_kv
        with image_kv.preloaded({key: pristine.n_tokens for key in pristine.keys}):
            pass
        for key in pristine.keys:
            runtime.arena.evict_image(key)  # refused for an entry still referenced
            assert not runtime.arena.has_image(key)
    assert runtime.disk_cache_stats().hits == 2


def test_a_file_cut_short_while_read_fails_alone(pristine, tmp_path):
    """``read_entries`` judges each file by the bytes it read: one cut after its header was checked
    gives an error, the other file of the same read its entry."""
    directory = copy_of(pristine, tmp_path)
    fmt = disk_entry.EntryFormat(pristine.model_id, pristine.layout)
    paths = [directory / path.name for path in pristine.paths]
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    try:
        files = [fmt.check(fd, key, pristine.n_tokens) for fd, key in zip(fds, pristine.keys)]
        os.truncate(paths[0], paths[0].stat().st_size - 1)
        cut, whole = disk_entry.read_entries(files, "cpu")
    finally:
        for fd in fds:
            os.close(fd)
    assert isinstance(cut, disk_entry.UnusableEntryError) and "ends" in str(cut)
    assert_entry_is(whole, pristine.kv[pristine.keys[1]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_entry_read_to_the_gpu_holds_the_files_bytes(pristine, tmp_path):
    """Through pinned buffers and a side stream: the tensors the CPU read gives; a corrupted file
    is an error there as here."""
    directory = copy_of(pristine, tmp_path)
    flipped(directory / pristine.paths[0].name, pristine.paths[1])
    fmt = disk_entry.EntryFormat(pristine.model_id, pristine.layout)
    fds = [os.open(directory / path.name, os.O_RDONLY) for path in pristine.paths]
    try:
        files = [fmt.check(fd, key, pristine.n_tokens) for fd, key in zip(fds, pristine.keys)]
        on_gpu, on_cpu = disk_entry.read_entries(files, "cuda"), disk_entry.read_entries(files, "cpu")
    finally:
        for fd in fds:
            os.close(fd)
    assert isinstance(on_gpu[0], disk_entry.UnusableEntryError) and isinstance(on_cpu[0], disk_entry.UnusableEntryError)
    for name in ("k", "v", "value_norms", "embedding"):
        assert getattr(on_gpu[1], name).device.type == "cuda"
        assert torch.equal(getattr(on_gpu[1], name).cpu(), getattr(on_cpu[1], name))


# -- the byte budget ------------------------------------------------------------------------------------

def test_the_least_recently_used_files_go_past_the_budget(pristine, tmp_path):
    size = pristine.paths[0].stat().st_size
    directory = tmp_path / "cache"
    a, b, c = picture(11), picture(12), picture(13)
    with new_runtime(directory, cache_dir_bytes=size * 5 // 2) as first:
        for image in (a, b):
            first.generate(messages("Look:", [image]), **ANSWER)
        keys = {name: first.requests.read(messages("", [im])).keys[0] for name, im in zip("abc", (a, b, c))}
        store = first.planner.image_kv.disk
    assert store.stats().evictions == 0
    assert all(store.path(keys[name]).is_file() for name in "ab")
    with new_runtime(directory, cache_dir_bytes=size * 5 // 2) as second:
        hit = second.generate(messages("Look:", [a]), **ANSWER)  # a: more recently used than b
        assert hit.stats.image_disk_hits == 1
        second.generate(messages("Look:", [c]), **ANSWER)
    stats = second.disk_cache_stats()
    assert stats.evictions == 1 and stats.files == 2 and stats.bytes <= size * 5 // 2
    assert [store.path(keys[name]).is_file() for name in "abc"] == [True, False, True]


def test_an_entry_larger_than_the_budget_is_not_written(pristine, tmp_path):
    with new_runtime(tmp_path / "cache", cache_dir_bytes=1024) as runtime:
        result = runtime.generate(pristine.cold, **ANSWER)
    assert_same_answer(result, pristine.cold_result)
    stats = runtime.disk_cache_stats()
    assert (stats.writes, stats.dropped_writes, stats.files) == (0, 2, 0)


# -- two processes, one folder --------------------------------------------------------------------------

WORKER = """
import sys
import threading
from tests.test_disk_cache import messages, new_runtime, picture
from pathlib import Path

directory, budget, order = Path(sys.argv[1]), int(sys.argv[2]), [int(i) for i in sys.argv[3].split(",")]
runtime = new_runtime(directory, cache_dir_bytes=budget)
for seed in order:
    runtime.generate(messages("Look:", [picture(seed)]), max_tokens=2, refresh="conduit")
# no close: the queued writes are written at interpreter exit
"""


def test_two_processes_writing_one_folder_leave_only_whole_files(pristine, tmp_path):
    directory = tmp_path / "cache"
    seeds = [21, 22, 23, 24, 25]
    budget = pristine.paths[0].stat().st_size * 3
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    orders = [seeds, seeds[::-1]]
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(directory), str(budget), ",".join(map(str, o))],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for o in orders]
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
        assert "Traceback" not in err, err

    names = sorted(os.listdir(directory))
    assert not [name for name in names if name.endswith(".tmp")]
    files = [name for name in names if name.endswith(".safetensors")]
    assert files and sum((directory / name).stat().st_size for name in files) <= budget

    with new_runtime(None) as reference:  # the KV each image's file must hold, computed here
        store = DiskImageStore(directory, budget, model_fingerprint(reference.model), pristine.layout)
        found = 0
        for seed in seeds:
            request = messages("Look:", [picture(seed)])
            reference.generate(request, max_tokens=1, refresh="conduit")
            key = reference.requests.read(request).keys[0]
            entry = store.load(key, pristine.n_tokens) if store.contains(key) else None
            if entry is not None:
                found += 1
                kv = entry_kv(reference, key)
                torch.testing.assert_close(entry.k, torch.stack([k for k, _ in kv]), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(entry.v, torch.stack([v for _, v in kv]), rtol=1e-5, atol=1e-6)
        store.close()
    assert found == len(files) and store.stats().rejected == 0


EXIT_SCRIPT = """
import atexit, sys, threading
from pathlib import Path
from conduit_rt.disk_cache import DiskImageStore
from tests.test_disk_cache import messages, new_runtime, picture

exiting, write = threading.Event(), DiskImageStore._write
DiskImageStore._write = lambda store, job: (exiting.wait(), write(store, job))  # held until exit
runtime = new_runtime(Path(sys.argv[1]))
atexit.register(exiting.set)  # runs before the handler that closes the Runtime (registered earlier)
runtime.generate(messages("Look:", [picture(1), picture(2)]), max_tokens=2, refresh="conduit")
assert runtime.disk_cache_stats().pending_writes > 0
"""


def test_saves_still_queued_at_exit_are_written(pristine, tmp_path):
    directory = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(directory)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "failed" not in done.stderr, done.stderr
    store = DiskImageStore(directory, 1 << 30, pristine.model_id, pristine.layout)
    for key in pristine.keys:  # the request computed both images as the pristine runtime's first did
        assert_entry_is(store.load(key, pristine.n_tokens), pristine.kv[key])
    store.close()


def test_the_checksum_hashes_chunks_and_needs_no_pool(monkeypatch):
    """Three chunks' blake2b under one over the metadata, against hashlib directly; the same when the
    pool is shut down (as at interpreter exit)."""
    chunk = disk_entry.CHECKSUM_CHUNK
    tensors = {"v": torch.randn(chunk // 2), "k": torch.randn(chunk // 4 + 3).half()}
    metadata = {"key": "ab", "checksum": "ignored"}
    data = {name: t.numpy().tobytes() for name, t in tensors.items()}
    expected = hashlib.blake2b(digest_size=32)
    expected.update(b'{"key": "ab"}')
    for name, offset in [("k", 0), ("v", 0), ("v", chunk)]:
        expected.update(name.encode() + hashlib.blake2b(data[name][offset: offset + chunk], digest_size=32).digest())
    assert checksum(tensors, metadata) == expected.hexdigest()
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    monkeypatch.setattr(disk_entry, "_hash_pool", lambda: pool)
    assert checksum(tensors, metadata) == expected.hexdigest()


# -- bad arguments --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,message", [
    ({"cache_dir_bytes": -1}, "cache_dir_bytes"),
    ({"cache_dir_bytes": 0}, "cache_dir_bytes"),
    ({"cache_dir_bytes": 1.5}, "cache_dir_bytes"),
    ({"cache_dir_bytes": "4G"}, "cache_dir_bytes"),
    ({"cache_dir": 42}, "cache_dir"),
    ({"cache_dir": ""}, "cache_dir"),
])
def test_bad_cache_arguments_are_typed_errors(tmp_path, kw, message):
    kw = {"cache_dir": tmp_path, **kw}
    with pytest.raises(InvalidArgumentError, match=message):
        Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", **kw)


def test_a_cache_dir_that_is_a_file_or_below_one_is_refused(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    with pytest.raises(InvalidArgumentError, match="is a file"):
        Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", cache_dir=a_file)
    with pytest.raises(InvalidArgumentError, match="cannot be created"):
        Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", cache_dir=a_file / "below")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permissions do not bind root")
def test_an_unwritable_cache_dir_is_refused(tmp_path):
    directory = tmp_path / "locked"
    directory.mkdir(mode=0o500)
    with pytest.raises(InvalidArgumentError, match="cannot be created or written"):
        Runtime(conduit_rt.BUNDLED_MODEL, device="cpu", cache_dir=directory)


def test_the_write_queue_holds_a_requests_worth_of_entries_larger_than_its_byte_bound(tmp_path, monkeypatch):
    """Entries larger than the queue's byte bound (a 7B-class image is ~300 MB) still queue eight at
    a time; the ninth, saved while the writer is stuck on the first, is dropped."""
    from conduit_rt import disk_cache

    layout = EntryLayout(n_layers=2, n_kv_heads=2, head_dim=4, hidden=8, dtype=torch.float32)
    store = DiskImageStore(tmp_path / "cache", 1 << 30, "model-under-test", layout)
    entry_bytes = (2 * 2 * 3 * 2 * 4 + 2 * 3 + 3 * 8) * 4  # K and V, value norms, embedding of 3 tokens
    monkeypatch.setattr(disk_cache, "MAX_PENDING_BYTES", entry_bytes)  # one entry, by bytes alone
    release, write = threading.Event(), store._write
    monkeypatch.setattr(store, "_write", lambda job: (release.wait(10), write(job)))
    generator = torch.Generator().manual_seed(3)
    entries = {bytes([i]) * 32: [torch.randn(2, 3, 2, 4, generator=generator) for _ in range(2)]
               + [torch.rand(2, 3, generator=generator), torch.randn(3, 8, generator=generator)] for i in range(9)}
    queued = [store.save(key, list(k), list(v), norms, embedding) for key, (k, v, norms, embedding) in entries.items()]
    release.set()
    store.flush()
    assert queued == [True] * disk_cache.MIN_PENDING_ENTRIES + [False]
    assert (store.stats().writes, store.stats().dropped_writes) == (8, 1)
    for key, (k, v, norms, embedding) in list(entries.items())[:8]:
        loaded = store.load(key, n_tokens=3)
        assert torch.equal(loaded.k, k) and torch.equal(loaded.v, v) and torch.equal(loaded.embedding, embedding)
        assert torch.equal(loaded.value_norms, norms)
    store.close()
