"""Tensor parallelism over torch.distributed: a model's decoder split over N ranks (one GPU each,
NCCL; or CPU processes, gloo), every rank running the same request path.

  group.py     the ranks and the collectives the layers and the request path call
  sharding.py  the Megatron-style split of the decoder (heads, KV heads, MLP, vocabulary) that
               each rank loads, reading only its share of the files
  worker.py    what each rank runs: the Runtime over its share, serving the calls rank 0 hands out
  driver.py    ``Runtime(..., tensor_parallel=N)`` in the caller: starts the workers (or joins the
               ranks ``torchrun`` started) and sends each call to them

docs/design-notes.md, "Tensor parallelism", describes the structure.
"""
