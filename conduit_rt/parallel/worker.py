"""What each rank of a tensor-parallel Runtime runs: a ``Runtime`` over its share of the decoder,
and the loop that takes the calls rank 0 hands out.

Rank 0 gets each call (``Call``) from the driver (over a pipe, or in-process under ``torchrun``),
broadcasts it to the other ranks on the control group, and every rank runs it on its own
``Runtime`` (``Executor.run``). Since every rank makes the same calls in the same order on the same
inputs, their arenas, caches and selections stay the same; rank 0's answer is the one returned.
A ``ConduitError`` (a bad request, a full arena) is raised alike on every rank and only answers
the call; any other exception is fatal to the rank (its peers could be waiting in a collective),
which reports it to the driver and exits.
"""
from __future__ import annotations

import logging
import os
import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConduitError
from ..results import GenerationResult
from .group import TensorParallelGroup
from .sharding import DecoderShard, join_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every rank needs to build its Runtime: the converted model files, the device type
    ("cpu" or "cuda"; rank r takes cuda:r, or cuda:LOCAL_RANK under torchrun), the dtype (None:
    the Runtime's default) and the Runtime's other keyword arguments."""

    model_path: str
    mmproj: str | None
    device_type: str
    dtype: torch.dtype | None
    runtime_kwargs: dict = field(default_factory=dict)
    timeout_s: float = 600.0


@dataclass(frozen=True, slots=True)
class Call:
    """One call of the driver: ``op`` (see ``Executor``), the handle of the stream or chat session
    it is about (numbered by the driver, so every rank agrees), and its arguments."""

    op: str
    handle: int = 0
    args: tuple = ()


def open_runtime(spec: WorkerSpec, group: TensorParallelGroup):
    """The rank's Runtime over its share of the model, read from the files onto its device (the
    vision weights on rank 0 only: ``sharding.DecoderShard``). The default arena follows each
    rank's free GPU memory, which differs (rank 0 holds the vision tower): every rank takes the
    smallest, so that all arenas have the same blocks and make the same evictions."""
    from ..models import load_model
    from ..runtime import Runtime, _kv_bytes

    model = load_model(spec.model_path, spec.mmproj, group.device, spec.dtype,
                       shard=DecoderShard(group.rank, group.size))
    join_group(model, group)
    kwargs = dict(spec.runtime_kwargs)
    if kwargs.get("kv_cache_bytes") is None:
        kwargs["kv_cache_bytes"] = group.smallest(_kv_bytes(model, model.dtype, model.device))
    return Runtime.from_model(model, **kwargs)


class Executor:
    """Runs calls on one rank's Runtime; streams and chat sessions live under the driver's handles.

    ops: "generate" (messages, options) -> GenerationResult; "stream" (messages, options, session
    handle or None) opens a stream; "next" -> ("piece", text) or ("done", GenerationResult);
    "close_stream"; "chat" opens a session; "close_chat"; "close" closes the Runtime."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.streams: dict[int, Any] = {}
        self.sessions: dict[int, Any] = {}

    def run(self, call: Call) -> tuple[str, Any]:
        """("ok", value) or ("error", the ConduitError the call raised); other errors propagate."""
        try:
            return "ok", self._execute(call)
        except ConduitError as error:
            return "error", error

    def _execute(self, call: Call) -> Any:
        if call.op == "generate":
            messages, options = call.args
            return _on_host(self.runtime.generate(messages, options))
        if call.op == "stream":
            messages, options, session = call.args
            if session is None:
                self.streams[call.handle] = self.runtime.stream(messages, options)
            else:
                self.streams[call.handle] = self.sessions[session].stream(messages, options)
            return None
        if call.op == "next":
            return self._next(call.handle)
        if call.op == "close_stream":
            stream = self.streams.pop(call.handle, None)
            if stream is not None:
                stream.close()
            return None
        if call.op == "chat":
            self.sessions[call.handle] = self.runtime.chat()
            return None
        if call.op == "close_chat":
            session = self.sessions.pop(call.handle, None)
            if session is not None:
                session.close()
            return None
        if call.op == "close":
            self.streams.clear()
            self.sessions.clear()
            self.runtime.close()
            return None
        raise ValueError(f"unknown call {call.op!r}")

    def _next(self, handle: int) -> tuple[str, Any]:
        stream = self.streams[handle]
        try:
            return "piece", next(stream)
        except StopIteration:
            del self.streams[handle]
            return "done", _on_host(stream.result)
        except BaseException:
            self.streams.pop(handle, None)
            raise


def _on_host(result: GenerationResult) -> GenerationResult:
    """The result with its logits on the CPU (the driver never touches a GPU)."""
    if result.logits is not None:
        result.logits = result.logits.cpu()
    return result


def lead(executor: Executor, group: TensorParallelGroup, call: Call) -> tuple[str, Any]:
    """Rank 0: hands ``call`` to the other ranks and runs it."""
    group.broadcast_object(call)
    return executor.run(call)


def follow(executor: Executor, group: TensorParallelGroup) -> None:
    """Ranks > 0: run rank 0's calls until it closes. A ConduitError answers the call on rank 0 as
    here; anything else propagates (the rank is lost)."""
    while True:
        call = group.broadcast_object()
        executor.run(call)
        if call.op == "close":
            return


def run_worker(rank: int, size: int, spec: WorkerSpec, address: str, port: int, channel) -> None:
    """A process started by the driver (``torch.multiprocessing`` spawn): joins the group, builds
    the Runtime, says "ready", then serves; rank 0 takes the calls from ``channel`` (a pipe to the
    driver) and answers them on it. A fatal error is sent as ("fatal", traceback) before exiting."""
    try:
        if spec.device_type == "cuda":
            device = torch.device("cuda", rank)
        else:  # the ranks share the host's cores
            device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        group = TensorParallelGroup.join(rank, size, device, address, port, spec.timeout_s)
        try:
            executor = Executor(open_runtime(spec, group))
        except ConduitError as error:  # the model cannot be split or loaded: raised in the caller as is
            _send(channel, ("error", error))
            raise SystemExit(1) from None
        _send(channel, ("ready", None))
        if rank == 0:
            _serve_driver(executor, group, channel)
        else:
            follow(executor, group)
        group.close()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 (reported to the driver, then the process ends)
        try:
            _send(channel, ("fatal", f"rank {rank}: {traceback.format_exc()}"))
        finally:
            raise SystemExit(1)


def _serve_driver(executor: Executor, group: TensorParallelGroup, channel) -> None:
    """Rank 0's loop: a call from the driver, to every rank, the answer back. Ends after "close", or
    when the driver is gone (its end of the pipe closed): then the other ranks are told to close."""
    while True:
        try:
            call = pickle.loads(channel.recv_bytes())
        except EOFError:
            call = Call("close")
        reply = lead(executor, group, call)
        if call.op == "close":
            try:
                _send(channel, reply)
            except OSError:
                pass
            return
        _send(channel, reply)


def _send(channel, message: tuple) -> None:
    channel.send_bytes(pickle.dumps(message))
