"""The scheduler: one thread owns the Runtime and decodes every running request together.

Each turn of its loop, holding the Runtime's lock:
  1. drops the cancelled requests (a client gone): their sequences are freed;
  2. admits waiting requests, oldest first, while the batch has room (``max_batch``) and the KV
     arena has room for the new request and for every running one to reach its ``max_tokens``:
     ``Runtime.start`` reads and prefills it (CONDUIT's refresh included), and it joins the batch;
  3. samples one token for every running request from its logits (each with its own sampler, so
     its options and seed), streams the text, ends the requests that stopped, then runs one batched
     decode step (``batch_decode.BatchDecoder``) over the rest. A request whose decode steps
     re-compress its KV (``compress_options`` with ``recompress_every``) steps alone, eagerly.

A request that finds no room waits in the queue (at most ``max_queue`` of them: past that,
``submit`` raises a 503 with ``Retry-After``) until a running one ends. Every request submitted ends
with exactly one ``done`` or ``error`` event, or is cancelled by its client; none is dropped.
Events cross to the client's asyncio loop through ``loop.call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..arena import ArenaStats
from ..batch_decode import BatchDecoder
from ..decoding import AnswerText
from ..errors import ArenaFullError
from ..options import GenerationOptions
from ..runtime import Runtime, StartedRequest
from ..sampling import Sampler
from .api_errors import ApiError, api_error, overloaded
from .metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One request as the engine runs it, and its events for the client: ``("started", prompt
    tokens)``, then ``("text", piece)`` any number of times, then ``("done", GenerationResult)``; or
    ``("error", ApiError)`` at any point. ``loop``: the client's event loop (events go to ``events``
    on it)."""

    messages: list[dict]
    options: GenerationOptions
    loop: asyncio.AbstractEventLoop
    ignore_eos: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    finished: bool = False

    def emit(self, kind: str, value) -> None:
        if kind in ("done", "error"):
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the client's loop is closed: nobody is waiting for the event
            pass


@dataclass(eq=False)
class _Running:
    """A job after its prefill: its sequence and sampler, its text so far, the logits of its next
    token (float32 [vocab]) and how many tokens it has generated."""

    job: Job
    started: StartedRequest
    sampler: Sampler
    answer: AnswerText
    logits: torch.Tensor
    generated: int = 0
    last_token: float = 0.0

    @property
    def position(self) -> int:
        """Causal position of the token sampled last (the one the next step feeds)."""
        return self.started.request.n_tokens + self.generated - 1

    @property
    def rope_position(self) -> int:
        return self.started.request.next_rope + self.generated - 1


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the engine last published: requests running and waiting, the arena's statistics (None
    before the first turn) and the sequences the prefix cache keeps."""

    running: int = 0
    waiting: int = 0
    arena: ArenaStats | None = None
    kept_sequences: int = 0

    @property
    def sequences_in_flight(self) -> int:
        """Sequences in the arena that no request and no kept prefix accounts for beyond the running
        requests (0 when the server is idle and nothing leaked)."""
        return (self.arena.n_seqs if self.arena else 0) - self.kept_sequences - self.running


class Engine:
    """Runs ``runtime``'s requests in one scheduler thread (``start``, ``stop``), up to ``max_batch``
    decoding together and up to ``max_queue`` waiting; ``metrics`` counts what happens."""

    def __init__(self, runtime: Runtime, max_batch: int = 16, max_queue: int = 64,
                 metrics: Metrics | None = None) -> None:
        self.runtime, self.max_batch, self.max_queue = runtime, max_batch, max_queue
        self.metrics = metrics or Metrics(lambda: self.state)
        self.batch = BatchDecoder(runtime.model, runtime.arena, max_batch, cuda_graphs=runtime.decoder.graphed is not None)
        self._waiting: deque[Job] = deque()
        self._running: list[_Running] = []
        self._cancelled: list[Job] = []
        self._wake = threading.Condition()
        self._blocked = False  # the arena had no room for the next waiting job: wait for a running one to end
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="conduit-engine", daemon=True)
        self.state = EngineState()

    # -- the client's side (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        with self.runtime.lock:
            self._publish()
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queues ``job``; raises ApiError 503 (Retry-After) when ``max_queue`` jobs already wait, or
        when the engine is stopping."""
        with self._wake:
            if self._stopping:
                raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
            if len(self._waiting) >= self.max_queue:
                self.metrics.requests.labels("rejected").inc()
                raise overloaded(f"the server is busy: {len(self._running)} requests running and "
                                 f"{len(self._waiting)} waiting, the most it queues; retry later")
            self._waiting.append(job)
            self.state = _replace_waiting(self.state, len(self._waiting))
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job leaves the queue; a running one is dropped and its KV freed
        before the next decode step. Does nothing for a finished job."""
        with self._wake:
            if job.finished or job.cancelled:
                return
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.requests.labels("cancelled").inc()
                self.state = _replace_waiting(self.state, len(self._waiting))
            else:
                self._cancelled.append(job)
            self._wake.notify()

    def stop(self) -> None:
        """Ends the loop; every job still waiting or running gets a 503 error. Then the runtime may be closed."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()
        error = ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        with self.runtime.lock:
            for running in self._running:
                self._fail(running, error)
            self._running.clear()
            self.batch.close()
        with self._wake:
            while self._waiting:
                self._waiting.popleft().emit("error", error)

    # -- the scheduler thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._cancelled or self._running
                           or (self._waiting and not self._blocked)):
                    self._wake.wait()
                if self._stopping:
                    return
                cancelled, self._cancelled = self._cancelled, []
            try:
                with self.runtime.lock:
                    self._drop(cancelled)
                    self._admit()
                    if self._running:
                        self._step()
                    self._publish()
            except Exception as error:  # noqa: BLE001 (a bug in a turn: fail its requests, keep serving)
                logger.exception("engine turn failed")
                with self.runtime.lock:
                    for running in self._running:
                        self._fail(running, api_error(error))
                    self._running.clear()
                    self._publish()

    def _publish(self) -> None:
        with self._wake:
            waiting = len(self._waiting)
        self.state = EngineState(len(self._running), waiting, self.runtime.arena.stats(),
                                 len(self.runtime.planner.prefix_cache))

    def _drop(self, cancelled: list[Job]) -> None:
        """Frees the sequences of the cancelled running jobs."""
        gone = set(cancelled)
        for running in [r for r in self._running if r.job in gone]:
            self._running.remove(running)
            self.runtime.finish(running.started, None, whole=False)
            running.job.finished = True
            self.metrics.requests.labels("cancelled").inc()
            self._blocked = False

    def _admit(self) -> None:
        """Prefills waiting jobs into the batch while there is room (see the module docstring)."""
        while len(self._running) < self.max_batch and not self._blocked:
            with self._wake:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
            try:
                started = self.runtime.start(job.messages, job.options)
            except ArenaFullError as error:
                if self._requeue(job):
                    return
                self._reject(job, api_error(error))
                continue
            except Exception as error:  # noqa: BLE001 (a bad request: its client gets the error)
                self._reject(job, api_error(error))
                continue
            if not self._room_to_decode(started):
                self.runtime.finish(started, None, whole=False)
                if self._requeue(job):
                    return
                self._reject(job, overloaded("the KV cache cannot hold this request's answer now"))
                continue
            self._begin(job, started)

    def _requeue(self, job: Job) -> bool:
        """Puts ``job`` back at the head of the queue until a running job ends; False when none runs
        (then no room will come back)."""
        if not self._running:
            return False
        with self._wake:
            self._waiting.appendleft(job)
        self._blocked = True
        return True

    def _reject(self, job: Job, error: ApiError) -> None:
        self.metrics.requests.labels("failed").inc()
        job.emit("error", error)

    def _room_to_decode(self, started: StartedRequest) -> bool:
        """Whether the arena's free blocks (evictable image entries and kept prefixes counted, the
        latter dropped when needed) cover every running request, and this one, reaching
        ``max_tokens``: a block per layer for each ``block_size`` tokens still to come, and one more
        per layer for a copy-on-write of a shared last block."""
        arena = self.runtime.arena
        need = sum(self._blocks_to_come(r.started, r.generated) for r in self._running)
        need += self._blocks_to_come(started, 0)
        stats = arena.stats()
        if stats.n_blocks_free + stats.n_blocks_image >= need:
            return True
        self.runtime.planner.prefix_cache.clear()
        stats = arena.stats()
        return stats.n_blocks_free + stats.n_blocks_image >= need

    def _blocks_to_come(self, started: StartedRequest, generated: int) -> int:
        n_layers, block = self.runtime.model.config.n_layers, self.runtime.arena.block_size
        now = started.request.n_tokens + max(generated - 1, 0)
        final = started.request.n_tokens + max(started.options.max_tokens - 1, 0)
        return n_layers * (math.ceil(final / block) - math.ceil(now / block) + 1)

    def _begin(self, job: Job, started: StartedRequest) -> None:
        """A prefilled job joins the batch (or ends at once with ``max_tokens`` 0)."""
        if job.cancelled:  # cancelled during its prefill
            self.runtime.finish(started, None, whole=False)
            job.finished = True
            self.metrics.requests.labels("cancelled").inc()
            return
        sampling = job.options.sampling()
        answer = AnswerText(self.runtime.assets, sampling, started.stats, job.arrived,
                            eos=frozenset() if job.ignore_eos else None)
        running = _Running(job, started, Sampler(sampling, self.runtime.device), answer, started.logits)
        self.metrics.admitted(started.stats)
        job.emit("started", started.stats.prompt_tokens)
        if sampling.max_tokens == 0:
            if not bool(torch.isfinite(started.logits).all()):
                self._fail(running, api_error(self.runtime.decoder.non_finite_error(started.request.n_tokens)))
            else:
                self._complete(running)
            return
        self._running.append(running)

    def _step(self) -> None:
        """Samples a token for every running job, streams it, ends the jobs that stopped, and runs one
        decode step over the rest."""
        t0 = time.perf_counter()
        sampled = [r.sampler(r.logits) for r in self._running]
        tokens = torch.stack([token for token, _ in sampled])
        ids, finite = torch.stack((tokens, torch.stack([f for _, f in sampled]).long())).tolist()
        going, rows = [], []
        for i, running in enumerate(self._running):
            if not finite[i]:
                self._fail(running, api_error(self.runtime.decoder.non_finite_error(running.position + 1)))
            elif self._accept(running, ids[i]):
                going.append(running)
                rows.append(i)
        self._running = going
        if going:
            self._forward(tokens[rows] if len(rows) < len(tokens) else tokens)
        self.metrics.step(len(ids), time.perf_counter() - t0)

    def _accept(self, running: _Running, token: int) -> bool:
        """Streams ``token``'s text; True while the job goes on, False once it ended (and was completed)."""
        now = time.perf_counter()
        piece, ended = running.answer.accept(token)
        if running.generated == 0:
            self.metrics.ttft.observe(now - running.job.arrived)
        else:
            self.metrics.token_latency.observe(now - running.last_token)
        running.generated += 1
        running.last_token = now
        if piece:
            running.job.emit("text", piece)
        if ended or running.generated == running.job.options.max_tokens:
            self._complete(running)
            return False
        return True

    def _forward(self, tokens: torch.Tensor) -> None:
        """Feeds each running job its token (int64 [n] on the device, in ``_running`` order); the
        logits of their next tokens replace theirs. A job whose decode steps re-compress its KV
        observes its own step's queries: it steps alone, eagerly."""
        alone = [r.started.recompress is not None for r in self._running]
        group = [r for r, a in zip(self._running, alone) if not a]
        if group:
            self._batched_step(group, tokens[[i for i, a in enumerate(alone) if not a]])
        for running, token in [(r, tokens[i]) for i, r in enumerate(self._running) if alone[i]]:
            try:
                running.logits = self.runtime.decoder.step(running.started.seq, token, running.position,
                                                           running.rope_position, running.started.recompress)
                running.started.recompress.after_step(running.position)
            except ArenaFullError as error:
                self._running.remove(running)
                self._fail(running, api_error(error))

    def _batched_step(self, group: list[_Running], tokens: torch.Tensor) -> None:
        """One batched step over ``group``. With the arena full even after dropping the kept
        prefixes, the newest job of the group fails (503) and the step runs without it (a step that
        raises changed no sequence)."""
        while group:
            try:
                logits = self.batch.step([r.started.seq for r in group], tokens,
                                         [r.position for r in group], [r.rope_position for r in group])
            except ArenaFullError as error:
                if len(self.runtime.planner.prefix_cache):
                    self.runtime.planner.prefix_cache.clear()
                    continue
                newest = group.pop()
                self._running.remove(newest)
                self._fail(newest, api_error(error))
                tokens = tokens[: len(group)]
                continue
            for row, running in enumerate(group):
                running.logits = logits[row]
            return

    def _complete(self, running: _Running) -> None:
        tail, result = running.answer.end(running.started.seq)
        if tail:
            running.job.emit("text", tail)
        self.runtime.finish(running.started, result, whole=True)
        self.metrics.requests.labels("completed").inc()
        self._blocked = False
        running.job.emit("done", result)

    def _fail(self, running: _Running, error: ApiError) -> None:
        self.runtime.finish(running.started, None, whole=False)
        self.metrics.requests.labels("failed").inc()
        self._blocked = False
        running.job.emit("error", error)


def _replace_waiting(state: EngineState, waiting: int) -> EngineState:
    return EngineState(state.running, waiting, state.arena, state.kept_sequences)

