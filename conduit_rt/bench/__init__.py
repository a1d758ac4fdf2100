"""conduit-rt's benchmark suite: ``conduit bench`` / ``python3 -m conduit_rt.bench``.

Ceilings measured once per run (``ceilings``), kernel benchmarks over the native arena against torch
SDPA (``kernels``, ``scoring``), end-to-end runs of the Runtime on a LLaVA-1.5-7B-shaped model with
random weights against Hugging Face transformers (``e2e``, ``decode``), the same reuse and prefill
runs on Qwen3-VL-8B- and InternVL3-8B-shaped models (``families``, ``family_models``, ``twins``), the
server's scheduler under concurrent clients on the LLaVA model (``serve``), and the report: JSON, a
markdown page and PNG plots (``report``, ``plots``). ``targets.ROW_KEYS`` lists every target row.
"""

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``conduit bench`` (``cli.main``), imported on call: ``python -m conduit_rt.bench.report`` then
    runs its module without the package having imported it already."""
    from .cli import main as run

    return run(argv)
