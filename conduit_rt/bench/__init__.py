"""conduit-rt's benchmark suite (issue 7): ``conduit bench`` / ``python3 -m conduit_rt.bench``.

Ceilings measured once per run (``ceilings``), kernel benchmarks over the native arena against torch
SDPA (``kernels``, ``scoring``), end-to-end runs of the Runtime on a LLaVA-1.5-7B-shaped model with
random weights against Hugging Face transformers (``e2e``, ``decode``), and the report: JSON, a
markdown page and PNG plots (``report``, ``plots``). ``targets.ROW_KEYS`` lists every target row.
"""
from .cli import main

__all__ = ["main"]
