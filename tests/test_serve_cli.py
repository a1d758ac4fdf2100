"""``conduit serve``'s command line before any server starts: a missing ``serve`` extra and a
``--cache-dir`` that cannot be a folder are one error line naming what to do, exit status 1."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conduit_rt.cli import build_parser


def run_cli(*args: str, hide: str = "") -> subprocess.CompletedProcess:
    """``conduit ARGS`` in a subprocess; ``hide``: a module made unimportable there."""
    hiding = f"sys.modules[{hide!r}] = None; " if hide else ""
    code = f"import sys; {hiding}from conduit_rt.cli import main; raise SystemExit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", ["fastapi", "uvicorn", "sse_starlette", "prometheus_client"])
def test_without_the_serve_extra_the_error_says_what_to_install(module):
    result = run_cli("serve", "--device", "cpu", hide=module)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"conduit: error: conduit serve needs {module} to serve HTTP: "
                                     "pip install 'conduit-rt[serve]'")


def test_serve_options_and_their_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.max_batch, args.max_queue) == ("127.0.0.1", 8000, 16, 64)
    assert args.api_key is None and args.cache_dir is None and not args.allow_local_files
    assert args.model.endswith("quality_model")  # the bundled model


def test_a_cache_dir_that_is_a_file_is_an_error(tmp_path):
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file")
    result = run_cli("serve", "--device", "cpu", "--cache-dir", str(not_a_folder))
    assert result.returncode == 1
    assert result.stderr.startswith("conduit: error:") and str(not_a_folder) in result.stderr
