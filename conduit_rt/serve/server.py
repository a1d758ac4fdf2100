"""``conduit serve``: loads the Runtime as ``conduit run`` does, starts the engine's scheduler and
serves the app with uvicorn until interrupted; then the engine stops (503 to whatever still waits)
and the Runtime closes."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..extras import require

logger = logging.getLogger(__name__)

SERVE_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")


def require_serve_extra() -> None:
    """Raises MissingExtraError (``pip install 'conduit-rt[serve]'``) unless the serve extra is installed."""
    for module in SERVE_MODULES:
        require(module, extra="serve", command="conduit serve", purpose="to serve HTTP")


def model_id(model: str | Path) -> str:
    """The name the server gives its model: a GGUF's file stem (its folder's name for the usual
    ``DIR/model.gguf``), or a checkpoint folder's name."""
    path = Path(model)
    if path.suffix == ".gguf":
        return path.parent.name if path.stem == "model" and path.parent.name else path.stem
    return path.name


def load_runtime(args: argparse.Namespace):
    """The Runtime for ``args``: model, mmproj, device, KV size and, when given, the folder of the
    persistent image-KV store (``Runtime(cache_dir=...)``)."""
    from ..runtime import Runtime

    kwargs = {"mmproj": args.mmproj, "device": args.device, "kv_cache_bytes": args.kv_cache_bytes}
    if args.cache_dir is not None:
        kwargs["cache_dir"] = args.cache_dir
    return Runtime(args.model, **kwargs)


def serve(args: argparse.Namespace) -> int:
    """Runs the server for the parsed ``conduit serve`` options until Ctrl-C or SIGTERM; returns 0."""
    require_serve_extra()
    import uvicorn

    from .app import create_app
    from .engine import Engine
    from .images import ImageSource

    runtime = load_runtime(args)
    if args.cache_dir is not None and args.preload:
        loaded = runtime.preload_images()
        print(f"conduit serve: {loaded} image entries loaded from {args.cache_dir}", file=sys.stderr, flush=True)
    engine = Engine(runtime, max_batch=args.max_batch, max_queue=args.max_queue)
    name = args.model_name or model_id(args.model)
    app = create_app(engine, name, ImageSource(allow_local_files=args.allow_local_files), args.api_key)
    engine.start()
    print(f"conduit serve: {name} on {runtime.device}, http://{args.host}:{args.port}/v1 "
          f"(batch {args.max_batch}, queue {args.max_queue})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    finally:
        engine.stop()
        runtime.close()
    return 0
