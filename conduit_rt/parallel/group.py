"""The ranks of a tensor-parallel model and the collectives its layers and request path call.

Every rank runs the same request path on the same inputs (SPMD); only the decoder's weights and
the KV arena are split. ``TensorParallelGroup`` wraps the torch.distributed process group: NCCL on
CUDA (one GPU per rank), gloo on the CPU, plus a gloo group for the commands (Python objects) that
rank 0 hands to the others. Tensors keep their shapes as documented at each call; every collective
is a sum or a concatenation in rank order, so its result is bit-identical on every rank.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# how long a rank waits in one collective before it raises (a peer that died without closing its
# sockets, or ranks that diverged); the caller's watchdog reports a dead worker long before
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """Rank ``rank`` of ``size`` ranks, each holding its share of the decoder on ``device``.

    ``group`` carries the tensors (NCCL on CUDA, gloo on the CPU); ``control`` (gloo) carries the
    pickled commands of ``broadcast_object``."""

    def __init__(self, rank: int, size: int, device: torch.device, group, control) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.group, self.control = group, control

    @classmethod
    def join(cls, rank: int, size: int, device: torch.device, address: str, port: int,
             timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> "TensorParallelGroup":
        """Joins the ``size`` ranks meeting at tcp://address:port (a process started by the driver)."""
        return cls._init(rank, size, device, f"tcp://{address}:{port}", timeout_s)

    @classmethod
    def from_environment(cls, device_type: str, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
                         ) -> "TensorParallelGroup":
        """The group ``torchrun`` set up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the
        environment); on CUDA each rank takes the GPU of its LOCAL_RANK."""
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
        return cls._init(rank, size, device, "env://", timeout_s)

    @classmethod
    def _init(cls, rank: int, size: int, device: torch.device, init_method: str,
              timeout_s: float) -> "TensorParallelGroup":
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=size,
                                timeout=timeout)
        group = dist.group.WORLD
        control = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else group
        return cls(rank, size, device, group, control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives of the decoder -------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of t (any shape), in place; returns t."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's t concatenated along ``dim`` in rank order (each rank's t of the same shape):
        the whole of a tensor split by heads or vocabulary rows."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t (contiguous, the same shape and dtype on every rank), in place; returns t."""
        dist.broadcast(t, src=0, group=self.group)
        return t

    def encoded_on_first_rank(self, model, image) -> torch.Tensor:
        """An image's projected features [n_tokens, embedding_width] (model dtype): the vision tower
        runs on rank 0 and the others receive its output, so that every rank's decoder input is the
        same bits (a tower run on each GPU need not round alike)."""
        if self.rank == 0:
            (features,) = model.encode_images([image])
            features = features.contiguous()
        else:
            features = torch.empty(image.n_tokens, model.config.embedding_width, dtype=model.dtype,
                                   device=model.device)
        return self.broadcast(features)

    # -- the commands of the request path -------------------------------------------------------
    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` (picklable) on every rank; the others pass nothing."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (an int), on every rank."""
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.control)
        return int(box.item())


def model_group(model) -> TensorParallelGroup | None:
    """The group a sharded model's ranks form (``sharding.join_group``); None for a whole model."""
    return getattr(model, "parallel", None)
