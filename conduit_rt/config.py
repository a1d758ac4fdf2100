"""Every environment variable the Python package reads, read here and nowhere else.

    CONDUIT_LIB        path of libconduit.so, instead of looking beside the package (native.py)
    CONDUIT_CACHE      cache folder for models converted on first use (default ~/.cache/conduit-rt)
    CONDUIT_NO_TRITON  "1": the torch ops instead of the Triton kernels on CUDA (models/fused.py)
    CONDUIT_PDL        "0": Triton kernels launch without programmatic dependent launch

Build-time switches (``CONDUIT_CUDA``) are read by CMake through pyproject.toml, and the native
library's tuning is a struct in its arena parameters (``conduit_tuning`` in conduit.h), not the
environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Environment:
    """The package's environment switches, as read once."""

    library: Path | None
    cache_dir: Path
    triton: bool
    pdl: bool

    @classmethod
    def read(cls) -> "Environment":
        lib = os.environ.get("CONDUIT_LIB")
        cache = os.environ.get("CONDUIT_CACHE")
        return cls(
            library=Path(lib) if lib else None,
            cache_dir=Path(cache) if cache else Path.home() / ".cache" / "conduit-rt",
            # the Triton interpreter runs kernels on the CPU, where a dependent launch means nothing
            triton=os.environ.get("CONDUIT_NO_TRITON") != "1",
            pdl=os.environ.get("CONDUIT_PDL") != "0" and os.environ.get("TRITON_INTERPRET") != "1",
        )


def env() -> Environment:
    """The environment, read now (cheap; callers that decide once per process cache their decision)."""
    return Environment.read()
