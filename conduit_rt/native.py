"""Loading the native library through cffi, with declarations read from ``conduit.h``.

The header is the one source of truth: its declarations are stripped of comments and preprocessor
lines and handed to ``cffi.FFI.cdef``. Every status a call returns goes through :func:`check`, which
raises the typed exception of ``errors.NATIVE_ERRORS`` carrying the native message.

Where the library is looked for, in order: ``$CONDUIT_LIB``; next to this package (a wheel);
``conduit_rt/`` in every ``sys.path`` entry (an editable scikit-build-core install puts it in
site-packages, outside the source tree); ``build/*/`` of a source checkout.
"""
from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import cffi

from .config import env
from .errors import NATIVE_ERRORS, InternalError, LibraryNotFoundError, NativeError

LIB_NAMES = ("libconduit.so", "libconduit.dylib", "conduit.dll")
PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_HEADER = PACKAGE_DIR.parent / "native" / "include" / "conduit.h"


def header_declarations(text: str) -> str:
    """Turns ``conduit.h`` into declarations cffi accepts: no comments, no preprocessor, no macros."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    text = re.sub(r"#if defined\(_WIN32\).*?#endif", "", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return text.replace("CONDUIT_API", "")


def _candidate_libraries() -> list[Path]:
    found: list[Path] = []
    library = env().library
    if library is not None:
        return [library]
    dirs = [PACKAGE_DIR] + [Path(p) / "conduit_rt" for p in sys.path if p]
    for directory in dirs:
        found += [directory / name for name in LIB_NAMES]
    build_root = PACKAGE_DIR.parent / "build"
    if build_root.is_dir():
        found += sorted(build_root.glob("*/libconduit.*"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found


def find_library() -> Path:
    """Path of the native library; raises LibraryNotFoundError listing where it looked."""
    candidates = _candidate_libraries()
    for path in candidates:
        if path.is_file():
            return path
    tried = "\n  ".join(str(p) for p in candidates[:8])
    raise LibraryNotFoundError(
        "conduit-rt's native library was not found. Install the package (pip install .) or set "
        f"CONDUIT_LIB to the path of libconduit.so. Looked in:\n  {tried}"
    )


def _header_for(lib_path: Path) -> Path:
    beside = lib_path.parent / "conduit.h"
    return beside if beside.is_file() else SOURCE_HEADER


@functools.lru_cache(maxsize=1)
def load() -> tuple[cffi.FFI, object]:
    """The (ffi, lib) pair, loaded once per process."""
    lib_path = find_library()
    ffi = cffi.FFI()
    ffi.cdef(header_declarations(_header_for(lib_path).read_text()))
    try:
        lib = ffi.dlopen(str(lib_path))
    except OSError as exc:
        raise LibraryNotFoundError(f"could not load {lib_path}: {exc}") from exc
    return ffi, lib


def ffi() -> cffi.FFI:
    return load()[0]


def lib():
    return load()[1]


def last_error() -> str:
    f, l = load()
    return f.string(l.conduit_last_error()).decode("utf-8", "replace")


def check(status: int, what: str = "") -> None:
    """Raises the typed exception for a non-zero native status, with the native message."""
    if status == 0:
        return
    message = last_error() or load()[0].string(load()[1].conduit_status_name(status)).decode()
    if what:
        message = f"{what}: {message}"
    cls = NATIVE_ERRORS.get(status, InternalError if status < 0 else NativeError)
    raise cls(message, status)


def version() -> str:
    f, l = load()
    return f.string(l.conduit_version()).decode()


def backends() -> dict[str, dict[str, bool]]:
    """Which backends the library has: ``{"cpu": {"compiled": True, "available": True}, "cuda": ...}``."""
    _, l = load()
    out = {}
    for name, code in (("cpu", l.CONDUIT_BACKEND_CPU), ("cuda", l.CONDUIT_BACKEND_CUDA)):
        out[name] = {"compiled": bool(l.conduit_backend_compiled(code)), "available": bool(l.conduit_backend_available(code))}
    return out
