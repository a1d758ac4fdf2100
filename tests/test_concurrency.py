"""One Runtime from several threads (the bundled model on the quality task): every answer equals the
answer a fresh Runtime gives to the same requests one after another, the cached state is the same
afterwards, streams dropped unfinished give their sequences back, ``close`` frees everything, and
the interpreter exits cleanly with a stream still open.

Answers may depend on the caches (a restored image's KV is the one its first computation stored;
an exact prefix shares the KV an earlier request computed), so the concurrent requests are built for
their answers not to depend on the order they run in: every image a request restores was stored
before they start (by earlier sessions, ``retagged_request``) or is filled in isolation (the same
KV whoever fills it), an image a request computes in context is in no other request, and no two
prompts share an exact prefix the prefix cache would reuse, except duplicates with equal options.
"""
from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import conduit_rt
from conduit_rt import Runtime
from conduit_rt.errors import RuntimeClosedError
from conduit_rt.evaluation.sessions import request_messages
from conduit_rt.evaluation.task.data import build_pool
from conduit_rt.evaluation.task.families import make_request
from conduit_rt.evaluation.task.generator import Ask, Question, retagged_request
from conduit_rt.prefix_cache import common_prefix
from tests.conftest import DEVICES

SEED, SPLIT, N_THREADS, MAX_TOKENS = 11, "test", 8, 8
POOL = build_pool(SEED, SPLIT, 44)
SHARED, EXCLUSIVE = POOL.pages[:32], POOL.pages[32:]  # restored (stored first) / computed by one request
RESTORING = [dict(refresh="conduit"), dict(refresh="none"), dict(refresh="full"),
             dict(refresh="conduit", compress="vlcache", keep=0.5),
             dict(refresh="conduit", temperature=0.8, seed=5)]
COMPUTING = [dict(), dict(compress="vlcache", keep=0.5)]

Job = Callable[[Runtime], object]


def quality(index: int, pages=SHARED):
    return make_request(pages, SPLIT, SEED, index, min_pages=1, max_pages=3)


def outcome(result) -> tuple[str, list[int]]:
    return result.text, result.tokens


def answer(messages: list[dict], options: dict) -> Job:
    return lambda rt: outcome(rt.generate(messages, max_tokens=MAX_TOKENS, **options))


def partial(messages: list[dict], options: dict, close: bool) -> Job:
    """Reads one piece, then closes the stream or drops it (its finalizer gives the sequence back)."""
    def run(rt: Runtime) -> list[str]:
        stream = rt.stream(messages, max_tokens=MAX_TOKENS, **options)
        pieces = list(itertools.islice(stream, 1))
        if close:
            stream.close()
        del stream
        return pieces
    return run


def interleaved(first: list[dict], second: list[dict], options: dict) -> Job:
    """One thread with two answers open: a stream read partly, another request, the rest of the stream."""
    def run(rt: Runtime):
        stream = rt.stream(first, max_tokens=MAX_TOKENS, **options)
        head = next(stream)
        other = rt.generate(second, max_tokens=MAX_TOKENS, **options)
        return head + "".join(stream), stream.result.tokens, outcome(other)
    return run


def conversation(request, options: dict) -> Job:
    """Two turns of a chat session: the request's question, then another question on its pages."""
    followup = " " + request.question_for(Question("code", (Ask(0, request.pages[0].colours[-1]),)))

    def run(rt: Runtime):
        chat = rt.chat()
        turns = [outcome(chat.send(request_messages(request)[0]["content"], max_tokens=MAX_TOKENS, **options)),
                 outcome(chat.send(followup, max_tokens=MAX_TOKENS))]
        chat.close()
        return turns
    return run


class Workload:
    """The earlier sessions (serial), the concurrent jobs and the later serial requests."""

    def __init__(self) -> None:
        requests = self._distinct_openings(17)
        stored, unstored = requests[:14], requests[14:]  # pages stored by earlier sessions / maybe not
        own = [quality(i, EXCLUSIVE[4 * k: 4 * k + 4]) for k, i in enumerate((1, 2, 3))]  # computed in context
        self.earlier = [request_messages(retagged_request(r, salt=1)) for r in stored]
        page = stored[0].pages[0]
        near = page.render()
        near.putpixel((5, 5), tuple(c ^ 1 for c in near.getpixel((5, 5))))  # one bit of one pixel
        self.near_images = (page.render(), near)
        near_messages = stored[0].messages([near if p is page else p.render() for p in stored[0].pages])
        duplicate = request_messages(stored[9])
        self.jobs: list[Job] = [answer(request_messages(r), RESTORING[k % len(RESTORING)])
                                for k, r in enumerate(stored[:9])]
        self.jobs += [
            answer(near_messages, dict(refresh="conduit")),  # while stored[0] (the same but a pixel) runs
            answer(duplicate, {}), answer(duplicate, {}),
            answer(request_messages(own[0]), COMPUTING[0]), answer(request_messages(own[1]), COMPUTING[1]),
            conversation(stored[10], dict(refresh="conduit")), conversation(stored[11], {}),
            partial(request_messages(stored[12]), dict(refresh="conduit"), close=True),
            partial(request_messages(own[2]), {}, close=False),
            partial(request_messages(unstored[0]), dict(refresh="none"), close=False),
            interleaved(request_messages(stored[13]), request_messages(unstored[1]), dict(refresh="full")),
        ]
        self.later = [answer(near_messages, dict(refresh="none")),
                      answer(request_messages(stored[0]), dict(refresh="none")),
                      answer(request_messages(unstored[2]), dict(refresh="conduit")),
                      answer(request_messages(stored[5]), {}),
                      answer(request_messages(stored[6]), dict(refresh="conduit", compress="vlcache"))]
        self.first_turns = ([request_messages(r) for r in requests + own] + self.earlier + [near_messages])

    @staticmethod
    def _distinct_openings(count: int) -> list:
        """Requests on the shared pages whose first tag and page differ pairwise and from those of
        their earlier sessions."""
        chosen, openings = [], set()
        for i in itertools.count():
            request = quality(i)
            again = retagged_request(request, salt=1)
            pair = {(request.tags[0], request.page_ids[0]), (again.tags[0], again.page_ids[0])}
            if len(pair) < 2 or pair & openings:
                continue
            chosen.append(request)
            openings |= pair
            if len(chosen) == count:
                return chosen


def serve(rt: Runtime, workload: Workload, threads: int) -> list:
    """The earlier sessions one by one, then the jobs (on ``threads`` threads, round robin)."""
    for messages in workload.earlier:
        rt.generate(messages, max_tokens=MAX_TOKENS)
    results: list = [None] * len(workload.jobs)
    if threads == 1:
        return [job(rt) for job in workload.jobs]
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def worker(start: int) -> None:
        barrier.wait()
        for index in range(start, len(workload.jobs), threads):
            try:
                results[index] = workload.jobs[index](rt)
            except BaseException as error:  # noqa: BLE001 (reported below)
                errors.append(error)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return results


def idle_state(rt: Runtime, keys: list[bytes]) -> tuple:
    """Arena counts with no sequence kept, and the stored KV of each image key (None: not stored)."""
    rt.planner.prefix_cache.clear()
    stats = rt.arena.stats()
    entries = []
    for key in keys:
        entry = rt.arena.acquire_image(key)
        entries.append(None if entry is None else [entry.read(layer) for layer in range(rt.arena.n_layers)])
        if entry is not None:
            entry.release()
    return stats, entries


@pytest.fixture(scope="module")
def workload() -> Workload:
    return Workload()


@pytest.mark.parametrize("device", DEVICES)
def test_eight_threads_answer_as_serial_and_leave_the_same_state(device, workload):
    shared, fresh = Runtime(conduit_rt.BUNDLED_MODEL, device=device), Runtime(conduit_rt.BUNDLED_MODEL, device=device)
    openings = [shared.requests.read(m) for m in workload.first_turns]
    for a, b in itertools.combinations(openings, 2):  # the workload's premise: no shared exact prefix
        assert common_prefix(a.identity, b.identity) < shared.planner.prefix_cache.min_tokens
    keys = sorted({key for request in openings for key in request.keys})
    near_keys = [shared.requests.read([{"role": "user", "content": [{"type": "image", "image": image}]}]).keys[0]
                 for image in workload.near_images]
    assert near_keys[0] != near_keys[1]

    expected = serve(fresh, workload, threads=1)
    got = serve(shared, workload, threads=N_THREADS)
    assert got == expected
    assert not shared.lock._open  # every stream finished, closed or reaped

    # the prefix cache's entries depend on the order requests finished in: start both without them
    for rt in (shared, fresh):
        rt.planner.prefix_cache.clear()
    assert [job(shared) for job in workload.later] == [job(fresh) for job in workload.later]

    (stats, entries), (fresh_stats, fresh_entries) = idle_state(shared, keys), idle_state(fresh, keys)
    assert stats.n_seqs == 0 and stats.n_blocks_used == stats.n_blocks_image
    assert (stats.n_image_entries, stats.n_blocks_image) == (fresh_stats.n_image_entries, fresh_stats.n_blocks_image)
    for key, got_kv, want_kv in zip(keys, entries, fresh_entries):
        assert (got_kv is None) == (want_kv is None), key.hex()
        if got_kv is not None:
            assert all(torch.equal(a, b) for pair, want in zip(got_kv, want_kv) for a, b in zip(pair, want)), key.hex()
    for key in near_keys:
        assert entries[keys.index(key)] is not None
    shared.close()
    fresh.close()


# -- lifetime ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runtime():
    with Runtime(conduit_rt.BUNDLED_MODEL, device="cpu") as rt:
        yield rt


def held_elsewhere(lock):
    """A thread that holds ``lock`` until the returned event is set (then join the thread)."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            done.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait()
    return thread, done


def test_a_dropped_stream_gives_its_sequence_back_at_once_or_when_the_lock_is_free(runtime):
    messages = request_messages(quality(200))
    for busy in (False, True):
        runtime.planner.prefix_cache.clear()
        stream = runtime.stream(messages, max_tokens=MAX_TOKENS)
        next(stream)
        if busy:  # another thread works: this thread's finalizer must not wait, the holder closes it
            thread, done = held_elsewhere(runtime.lock)
            del stream
            assert len(runtime.planner.prefix_cache) == 0
            done.set()
            thread.join()
        else:
            del stream
        assert len(runtime.planner.prefix_cache) == 1 and not runtime.lock._open
        assert runtime.arena.stats().n_seqs == 1  # the kept prefix, nothing else
        again = runtime.generate(messages, max_tokens=MAX_TOKENS)  # reuses the dropped stream's prompt
        assert again.stats.reused_tokens == again.stats.prompt_tokens - 1


def test_children_finalized_while_the_arena_is_busy_are_freed_by_the_holder():
    from conduit_rt.arena import KVArena
    from conduit_rt.errors import InvalidArgumentError
    from conduit_rt.locking import RequestLock

    arena = KVArena(n_layers=2, n_kv_heads=1, head_dim=16, kv_bytes=1 << 20)
    lock = RequestLock(arena.lock, arena.free_deferred)
    seqs = [arena.new_sequence() for _ in range(3)]
    for s in seqs:
        s.append(range(40))
    del s
    thread, done = held_elsewhere(lock)
    seqs.pop()  # finalized here while the other thread holds the lock: left to it
    done.set()
    thread.join()
    stats = arena.stats()
    assert (stats.n_seqs, stats.n_blocks_used) == (2, 2 * 2 * 3)  # 40 tokens: 3 blocks of 16 a layer
    arena.close()
    with pytest.raises(InvalidArgumentError):
        seqs[0].n_tokens()  # its arena is closed: no call reaches freed memory
    seqs[0].free()  # nothing to free
    seqs.clear()


def test_close_ends_open_streams_frees_everything_and_later_calls_raise():
    rt = Runtime(conduit_rt.BUNDLED_MODEL, device="cpu")
    first, second = request_messages(quality(300)), request_messages(quality(301))
    rt.generate(first, max_tokens=MAX_TOKENS, refresh="conduit")
    chat = rt.chat()
    chat.send(first[0]["content"], max_tokens=MAX_TOKENS)
    open_stream, unstarted = rt.stream(second, max_tokens=MAX_TOKENS), rt.stream(second, max_tokens=MAX_TOKENS)
    next(open_stream)
    answered, outcome_of_worker = threading.Event(), []

    def worker() -> None:  # answers in a loop until the Runtime closes under it
        try:
            while True:
                rt.generate(second, max_tokens=MAX_TOKENS)
                answered.set()
        except RuntimeClosedError as error:
            outcome_of_worker.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    answered.wait()
    with rt:
        pass  # leaving the block closes it
    thread.join()
    assert len(outcome_of_worker) == 1
    assert rt.arena.closed and not rt.lock._open
    assert len(rt.planner.prefix_cache) == len(rt.requests.embeddings) == len(rt.requests.decoded_images) == 0
    for call in (lambda: rt.generate(first), lambda: next(open_stream), lambda: next(unstarted),
                 lambda: chat.send("bee red?"), rt.chat, lambda: rt.stream(first)):
        with pytest.raises(RuntimeClosedError):
            call()
    open_stream.close()
    chat.close()
    rt.close()


EXIT_SCRIPT = """
import sys, threading
import conduit_rt
from conduit_rt import Runtime
from conduit_rt.evaluation.sessions import request_messages
from conduit_rt.evaluation.task.data import build_pool

variant = sys.argv[1]
rt = Runtime(conduit_rt.BUNDLED_MODEL, device="cpu")
request = build_pool(0, "test", 16).requests(1, min_pages=2, max_pages=2)[0]
if variant == "no_exit_hook":  # what is left to the interpreter's final collection
    import atexit
    from conduit_rt import runtime
    atexit.unregister(runtime._close_open_runtimes)


def opened():
    stream = rt.stream(request_messages(request), max_tokens=32, refresh="conduit")
    next(stream)
    return [stream, rt.chat()]


kept = opened()
if variant == "daemon":
    def loop():
        try:
            while True:
                kept.append(rt.stream(request_messages(request), max_tokens=32))
                next(kept[-1])
        except Exception:
            pass
    threading.Thread(target=loop, daemon=True).start()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("variant", ["kept", "daemon", "no_exit_hook"])
def test_the_interpreter_exits_cleanly_with_streams_open(variant, tmp_path):
    script = tmp_path / "exit_with_open_stream.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    done = subprocess.run([sys.executable, str(script), variant], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting" in done.stdout
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]
