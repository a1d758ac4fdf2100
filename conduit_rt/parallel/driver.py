"""``Runtime(..., tensor_parallel=N)``: the caller's side of a tensor-parallel Runtime.

Started from an ordinary process, ``ParallelRuntime`` spawns N worker processes
(``torch.multiprocessing``, spawn): rank r on cuda:r with NCCL, or on the CPU with gloo. It sends
each call to rank 0 over a pipe (rank 0 hands it to the others, ``worker``) and waits for the
answer while it watches the processes: a worker that dies or reports a fatal error becomes a
``WorkerFailedError`` within ``WATCH_INTERVAL_S``, the others are stopped and the Runtime is
closed. Under ``torchrun --nproc-per-node N`` (RANK and WORLD_SIZE in the environment) no process
is started: rank 0's process is the caller and runs its share in-process; on the other ranks the
constructor serves rank 0's calls until rank 0 closes, then ends the process.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Generator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..convert.cache import model_files
from ..disk_cache import DEFAULT_CACHE_DIR_BYTES
from ..errors import ConduitError, RuntimeClosedError, TensorParallelError, WorkerFailedError
from ..limits import check_runtime_arguments
from ..options import GenerationOptions
from ..results import GenerationResult, TextStream
from .group import DEFAULT_COLLECTIVE_TIMEOUT_S, TensorParallelGroup
from .worker import Call, Executor, WorkerSpec, follow, lead, open_runtime, run_worker

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05       # how often a waiting call checks that every worker is alive
STOP_GRACE_S = 10.0           # how long close waits for the workers to end before killing them
# how long a rank's fatal report waits for a peer's exit to show: a rank killed outright closes its
# sockets (which its peers report at once) a moment before its exit can be seen here
DEATH_GRACE_S = 1.0
# refresh policies whose scores are norms of K and V changes over each rank's own KV heads (not
# summed across ranks): they would select differently on each rank
UNSPLIT_POLICIES = frozenset({"cacheblend", "conduit_deviation"})


class ParallelRuntime:
    """A Runtime whose decoder is split over ``tensor_parallel`` ranks; ``generate``, ``stream``,
    ``chat`` and ``close`` as ``Runtime``'s, the answers rank 0's. The arguments are ``Runtime``'s,
    with ``kv_cache_bytes`` the arena of each rank (its share of the KV heads); ``cache_dir`` is
    refused. ``startup_timeout_s`` bounds the workers' start (loading the model included).

    Threads: calls are serialised by one lock; streams of several threads interleave step by step
    on every rank alike, as on one Runtime."""

    def __init__(self, model_path: str | Path, mmproj: str | Path | None = None, device: str | torch.device = "auto",
                 dtype: torch.dtype | None = None, kv_cache_bytes: int | None = None,
                 image_cache_bytes: int | None = None, prefix_cache_entries: int = 4, cuda_graphs: bool = True,
                 cache_dir: str | Path | None = None, cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES, *,
                 tensor_parallel: int, startup_timeout_s: float = 600.0,
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
        if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise TensorParallelError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
        check_runtime_arguments(dtype, kv_cache_bytes, image_cache_bytes, prefix_cache_entries, cuda_graphs,
                                cache_dir, cache_dir_bytes)
        if cache_dir is not None:
            raise TensorParallelError("cache_dir is not supported with tensor_parallel > 1: a rank that found "
                                      "its file while another did not would plan another prefill; leave it None")
        self.size = tensor_parallel
        self.device_type = _device_type(device)
        kwargs = {"kv_cache_bytes": kv_cache_bytes, "image_cache_bytes": image_cache_bytes,
                  "prefix_cache_entries": prefix_cache_entries, "cuda_graphs": cuda_graphs}
        self._lock = threading.Lock()
        self._handles = itertools.count(1)
        self._closed = False
        world = _torchrun_world()
        if world is None:
            text, vision = model_files(model_path, mmproj)  # converted once, here, before the workers read it
            spec = WorkerSpec(str(text), str(vision) if vision else None, self.device_type, dtype, kwargs,
                              collective_timeout_s)
            if self.device_type == "cuda" and torch.cuda.device_count() < self.size:
                raise TensorParallelError(f"tensor_parallel={self.size} needs {self.size} GPUs; "
                                          f"{torch.cuda.device_count()} are visible")
            self._ranks = _SpawnedRanks(spec, self.size, startup_timeout_s)
        elif world != self.size:
            raise TensorParallelError(f"tensor_parallel={self.size} under torchrun with WORLD_SIZE={world}: "
                                      "start torchrun with --nproc-per-node (times nodes) equal to tensor_parallel")
        else:
            self._ranks = _joined_ranks(model_path, mmproj, self.device_type, dtype, kwargs, collective_timeout_s)
        _OPEN.add(self)

    # -- the Runtime's API ------------------------------------------------------------------------
    def generate(self, messages: list[dict], options: GenerationOptions | None = None,
                 **overrides) -> GenerationResult:
        """As ``Runtime.generate``: one call, the whole answer decoded on every rank."""
        return self._call("generate", 0, (messages, self._options(options, overrides)))

    def stream(self, messages: list[dict], options: GenerationOptions | None = None, **overrides) -> TextStream:
        """As ``Runtime.stream``: every piece is one call, so that closing the stream early ends the
        answer on every rank at the same step."""
        return TextStream(self._pieces(messages, self._options(options, overrides), None))

    def chat(self) -> "ParallelChatSession":
        """A multi-turn session whose sequence stays in every rank's arena between turns."""
        return ParallelChatSession(self)

    def close(self) -> None:
        """Closes every rank's Runtime and ends the workers; closing again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ranks.close()
        _OPEN.discard(self)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the ranks (this process's own under torchrun)."""
        return self._ranks.pids

    def __enter__(self) -> "ParallelRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ------------------------------------------------------------------------------------
    def _options(self, options: GenerationOptions | None, overrides: dict) -> GenerationOptions:
        options = GenerationOptions.of(options, **overrides)  # checked here: a bad option never reaches a rank
        if options.refresh in UNSPLIT_POLICIES:
            raise TensorParallelError(f"refresh={options.refresh!r} is not supported with tensor_parallel > 1 "
                                      f"(its scores are over each rank's own KV heads); use conduit")
        return options

    def _call(self, op: str, handle: int, args: tuple = ()):
        with self._lock:
            if self._closed:
                raise RuntimeClosedError("this Runtime was closed (or lost a worker); create a new one")
            try:
                kind, value = self._ranks.call(Call(op, handle, args))
            except WorkerFailedError:
                self._closed = True
                _OPEN.discard(self)
                raise
        if kind == "error":
            raise value
        return value

    def _new_handle(self) -> int:
        with self._lock:
            return next(self._handles)

    def _pieces(self, messages, options: GenerationOptions,
                session: int | None) -> Generator[str, None, GenerationResult]:
        handle = self._new_handle()
        self._call("stream", handle, (messages, options, session))
        finished = False
        try:
            while True:
                kind, value = self._call("next", handle)
                if kind == "done":
                    finished = True
                    return value
                yield value
        finally:
            if not finished and not self._closed:
                self._call("close_stream", handle)


class ParallelChatSession:
    """``ChatSession`` of a ``ParallelRuntime``: each rank keeps the session's sequence; ``history``
    is the conversation as here."""

    def __init__(self, runtime: ParallelRuntime) -> None:
        self.runtime = runtime
        self.history: list[dict] = []
        self.handle = runtime._new_handle()
        runtime._call("chat", self.handle)

    def send(self, content: str | list[dict], options: GenerationOptions | None = None,
             **overrides) -> GenerationResult:
        return self.stream(content, options, **overrides).finish()

    def stream(self, content: str | list[dict], options: GenerationOptions | None = None,
               **overrides) -> TextStream:
        messages = self.history + [{"role": "user", "content": content}]
        pieces = self.runtime._pieces(content, self.runtime._options(options, overrides), self.handle)

        def turn() -> Generator[str, None, GenerationResult]:
            result = yield from pieces
            self.history = messages + [{"role": "assistant", "content": result.text}]
            return result

        return TextStream(turn())

    def close(self) -> None:
        self.runtime._call("close_chat", self.handle)


class _SpawnedRanks:
    """The worker processes of a ParallelRuntime started from an ordinary process, and the watchdog
    over them."""

    def __init__(self, spec: WorkerSpec, size: int, startup_timeout_s: float) -> None:
        context = mp.get_context("spawn")
        port = _free_port()
        self.channels, self.processes = [], []
        for rank in range(size):
            ours, theirs = context.Pipe()
            process = context.Process(target=run_worker, args=(rank, size, spec, "127.0.0.1", port, theirs),
                                      daemon=True, name=f"conduit-tp-rank{rank}")
            process.start()
            theirs.close()  # the worker holds the other end: its exit shows as EOF here
            self.channels.append(ours)
            self.processes.append(process)
        deadline = time.monotonic() + startup_timeout_s
        for rank, channel in enumerate(self.channels):
            kind, value = self._await(rank, deadline)
            if kind == "error":  # the model cannot be split this way, or cannot be loaded: as a Runtime raises it
                self.stop()
                raise value

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def call(self, call: Call) -> tuple[str, object]:
        try:
            self.channels[0].send_bytes(pickle.dumps(call))
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._check_alive()
            self._lost(0, "its pipe closed")
        return self._await(0)

    def close(self) -> None:
        try:
            self.call(Call("close"))
        except WorkerFailedError:
            return  # stopped already
        for process in self.processes:
            process.join(STOP_GRACE_S)
        self.stop()

    def stop(self) -> None:
        """Ends every worker still running (terminate, then kill) and closes the pipes."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for channel in self.channels:
            channel.close()

    def _await(self, rank: int, deadline: float | None = None) -> tuple[str, object]:
        """The next message from ``rank``, checking every WATCH_INTERVAL_S that all workers live."""
        channel = self.channels[rank]
        while True:
            if channel.poll(WATCH_INTERVAL_S):
                try:
                    kind, value = pickle.loads(channel.recv_bytes())
                except (EOFError, OSError):
                    self._check_alive(wait=True)
                    self._lost(rank, "its pipe closed")
                if kind == "fatal":  # a rank that died first is the cause (its peers see closed sockets)
                    other = self._dead_peer(rank)
                    if other is not None:
                        self._lost(other, f"{self._last_words(other)} (rank {rank} then failed: "
                                          f"{value.strip().splitlines()[-1]})")
                    self._lost(rank, value)
                return kind, value
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise WorkerFailedError(f"rank {rank} did not start in time (startup_timeout_s)")

    def _check_alive(self, wait: bool = False) -> None:
        for rank, process in enumerate(self.processes):
            if wait:
                process.join(1.0)
            if process.exitcode is not None:
                self._lost(rank, self._last_words(rank))

    def _dead_peer(self, rank: int) -> int | None:
        """A rank other than ``rank`` that has exited, waiting up to DEATH_GRACE_S for one to show."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            for other, process in enumerate(self.processes):
                if other != rank and process.exitcode is not None:
                    return other
            if time.monotonic() >= deadline:
                return None
            time.sleep(WATCH_INTERVAL_S / 5)

    def _last_words(self, rank: int) -> str:
        """The fatal error a dead worker sent before exiting, if any."""
        channel = self.channels[rank]
        try:
            while channel.poll(0):
                kind, value = pickle.loads(channel.recv_bytes())
                if kind == "fatal":
                    return value
        except (EOFError, OSError):
            pass
        return "no error message (killed or crashed)"

    def _lost(self, rank: int, what: str) -> None:
        exitcode = self.processes[rank].exitcode
        self.stop()
        raise WorkerFailedError(f"tensor-parallel worker rank {rank} (exit code {exitcode}) failed: {what}; "
                                "the other workers were stopped")


class _JoinedRanks:
    """Rank 0 of ranks ``torchrun`` started: this process runs its share and hands each call to the
    others over the control group."""

    def __init__(self, executor: Executor, group: TensorParallelGroup) -> None:
        self.executor, self.group = executor, group

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]

    def call(self, call: Call) -> tuple[str, object]:
        try:
            return lead(self.executor, self.group, call)
        except dist.DistError as error:  # a peer is gone (its sockets closed) or a collective timed out
            raise WorkerFailedError(f"a tensor-parallel rank failed: {error}") from error

    def close(self) -> None:
        try:
            self.call(Call("close"))
        finally:
            self.group.close()


def _joined_ranks(model_path, mmproj, device_type: str, dtype: torch.dtype | None, kwargs: dict,
                  timeout_s: float) -> _JoinedRanks:
    """Joins the group torchrun set up and builds this rank's Runtime; on ranks > 0, serves rank 0's
    calls until it closes and then ends the process (SystemExit)."""
    group = TensorParallelGroup.from_environment(device_type, timeout_s)
    if group.rank != 0:
        group.barrier()  # rank 0 converts a Hugging Face checkpoint first; the others find it cached
    text, vision = model_files(model_path, mmproj)
    if group.rank == 0:
        group.barrier()
    spec = WorkerSpec(str(text), str(vision) if vision else None, device_type, dtype, kwargs, timeout_s)
    executor = Executor(open_runtime(spec, group))
    if group.rank == 0:
        return _JoinedRanks(executor, group)
    follow(executor, group)
    group.close()
    raise SystemExit(0)


def _device_type(device: str | torch.device) -> str:
    """"cuda" or "cpu" for ``device`` (a bare type: rank r takes cuda:r), without touching a GPU."""
    from .. import native

    name = str(device)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() and native.backends()["cuda"]["available"] else "cpu"
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda") or kind != name:
        raise TensorParallelError(f"device={name!r} with tensor_parallel > 1: use auto, cpu or cuda "
                                  "(rank r takes cuda:r, or cuda:LOCAL_RANK under torchrun)")
    return kind


def _torchrun_world() -> int | None:
    """WORLD_SIZE when this process is one of the ranks torchrun started, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# closed at interpreter exit, while the pipes still work (the workers close their Runtimes)
_OPEN: "weakref.WeakSet[ParallelRuntime]" = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for runtime in list(_OPEN):
        try:
            runtime.close()
        except ConduitError:
            logger.exception("closing a tensor-parallel Runtime at exit failed")
