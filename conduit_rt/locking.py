"""One Runtime's work, one piece at a time, from any number of threads (``RequestLock``).

A Runtime's requests share state: the KV arena (whose library allows one thread at a time), the
prefix cache, the image-KV store, the caches of embeddings and decoded images, the CUDA graphs.
Every piece of work on it holds the Runtime's ``RequestLock``: a request's read and prefill (its
stream's first step), each later decode step, and the end of a request (its sequence given back).
Between steps the lock is free, so the streams of several threads interleave step by step. The
lock is re-entrant (a chat session's stream drives the Runtime's stream inside its own step) and it
is the arena's ``lock``, under which the arena frees the children that finalizers left to it.

The lock also tracks every open request generator, so that none is finalized on its own by the
garbage collector (on an arbitrary thread, outside the lock). A stream dropped unfinished is closed
by its finalizer under the lock, or, when the lock is busy or held by the very thread the collector
interrupted, by the holder as it lets go; ``close`` closes every open one and then frees the
Runtime. Finalizers never wait for the lock: the thread holding it may be waiting for theirs.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Generator

from .errors import RuntimeClosedError

logger = logging.getLogger(__name__)


class RequestLock:
    """Re-entrant lock over ``lock`` (an RLock; ``after_work`` runs holding it each time the outermost
    holder lets go), with the registry of open request generators.

    Use it as a context manager around a piece of work (``with runtime.lock:``); ``check_open``
    raises RuntimeClosedError once ``close`` ran."""

    def __init__(self, lock: threading.RLock, after_work: Callable[[], None] = lambda: None) -> None:
        self._lock = lock
        self._after_work = after_work
        self._owner: int | None = None      # thread id of the holder (None: free)
        self._depth = 0                     # the holder's nesting
        self._open: dict[int, Generator] = {}
        self._abandoned: list[Generator] = []
        self._ids = itertools.count()
        self.closed = False

    def __enter__(self) -> "RequestLock":
        self._lock.acquire()
        self._owner = threading.get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        outermost = self._depth == 1
        try:
            if outermost:
                self._tidy()
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
            self._lock.release()
        if outermost and self._abandoned:  # dropped on another thread while this one finished
            self._tidy_if_free()

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeClosedError("this Runtime is closed (Runtime.close): its KV arena and caches are freed; "
                                     "create a new Runtime to answer more requests")

    # -- open request generators ------------------------------------------------------------------
    def register(self, pieces: Generator) -> int:
        """Keeps a request generator until ``done`` or ``abandon``; returns its token."""
        self.check_open()
        token = next(self._ids)
        self._open[token] = pieces
        return token

    def done(self, token: int) -> None:
        """The generator finished (exhausted, failed or closed under the lock)."""
        self._open.pop(token, None)

    def abandon(self, token: int) -> None:
        """From a stream's finalizer, on any thread, without waiting: closes its generator now if the
        lock is free, else leaves it to the holder."""
        pieces = self._open.pop(token, None)
        if pieces is None:
            return
        self._abandoned.append(pieces)
        if self._owner != threading.get_ident():  # else the collector interrupted this thread's work
            self._tidy_if_free()

    def close(self, free: Callable[[], None]) -> None:
        """Closes every open request generator (each gives its sequence back as a closed stream does),
        then runs ``free``, all under the lock; afterwards ``check_open`` raises. Idempotent."""
        with self:
            if self.closed:
                return
            self.closed = True
            while self._open:
                self._abandoned.append(self._open.popitem()[1])
            self._tidy()
            free()

    # -- internals ----------------------------------------------------------------------------------
    def _tidy(self) -> None:
        """Closes the abandoned generators, then runs ``after_work`` (holding the lock)."""
        while self._abandoned:
            pieces = self._abandoned.pop()
            try:
                pieces.close()
            except Exception:  # noqa: BLE001 (a cleanup that failed must not fail the work that ran it)
                logger.exception("closing an abandoned stream failed")
        self._after_work()

    def _tidy_if_free(self) -> None:
        if self._lock.acquire(blocking=False):
            try:
                with self:
                    pass  # the outermost exit tidies
            finally:
                self._lock.release()
