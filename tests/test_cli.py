"""The command line as a user meets it: ``--version``, help on every option, and expected errors as one
``conduit: error:`` line with a non-zero exit status (never a traceback), for every subcommand.

Commands run through ``conduit_rt.cli.main`` on real files made in ``tmp_path``; one set runs the
installed ``conduit`` entry point (or ``python -m conduit_rt.cli``) in a subprocess.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

import conduit_rt
from conduit_rt import BUNDLED_MODEL, native
from conduit_rt.bench.cli import build_parser as bench_parser
from conduit_rt.cli import build_parser as conduit_parser
from conduit_rt.cli import main, reports_errors
from conduit_rt.convert.checkpoint import convert_checkpoint
from conduit_rt.convert.cli import build_parser as convert_parser
from conduit_rt.demo import build_parser as demo_parser
from conduit_rt.errors import DeviceUnavailableError, ImageTooLargeError
from conduit_rt.evaluation.cli import build_parser as eval_parser
from conduit_rt.preprocess import to_rgb_array
from conduit_rt.runtime import Runtime, resolve_device

from .conftest import cuda_ready

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "conduit: error: "
SUBCOMMAND_PARSERS = {"convert": convert_parser, "demo": demo_parser, "eval": eval_parser, "bench": bench_parser}


def status_of(argv: list[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse raises SystemExit."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1


def assert_one_error_line(err: str, *phrases: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert "Traceback" not in err
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


def save_png(path: Path, height: int = 64, width: int = 64, seed: int = 0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory) -> Path:
    """The bundled model converted to float32 GGUF in a temporary folder."""
    return convert_checkpoint(BUNDLED_MODEL, tmp_path_factory.mktemp("bundled"), dtype="f32", progress=False).text_model


# -- --version ------------------------------------------------------------------------------------------
def test_version_prints_the_package_and_library_versions(capsys):
    assert status_of(["--version"]) == 0
    out = capsys.readouterr().out
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert conduit_rt.__version__ == pyproject["project"]["version"]
    assert f"conduit-rt {conduit_rt.__version__}" in out
    assert f"native library {native.version()} ({native.find_library()})" in out


# -- help on every option ---------------------------------------------------------------------------------
def _parsers() -> dict[str, argparse.ArgumentParser]:
    top = conduit_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"conduit": top, "run": sub.choices["run"], "info": sub.choices["info"], "serve": sub.choices["serve"],
            **{name: build() for name, build in SUBCOMMAND_PARSERS.items()}}


def test_every_option_and_subcommand_has_help():
    top = conduit_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for choice in sub._choices_actions:
        assert choice.help, choice.dest
    assert set(sub.choices) == {"convert", "run", "demo", "bench", "eval", "info", "serve"}
    for name, parser in _parsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings or action.dest)


@pytest.mark.parametrize("command", ["convert", "run", "demo", "bench", "eval", "info", "serve"])
def test_command_help_lists_every_option(command, capsys):
    assert status_of([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: conduit {command}")
    for action in _parsers()[command]._actions:
        for option in action.option_strings:
            assert option in out, (command, option)


# -- one-line errors -------------------------------------------------------------------------------------
def test_missing_model_file(tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path / "missing.gguf"), "-p", "q", "--device", "cpu"]) == 1
    assert_one_error_line(capsys.readouterr().err, "no such model file", "missing.gguf")


def test_folder_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["run", "--model", str(tmp_path), "-p", "q", "--device", "cpu"]) == 1
    assert_one_error_line(capsys.readouterr().err, str(tmp_path), "model.gguf")


def test_file_that_is_not_gguf(tmp_path, capsys):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(np.random.default_rng(1).integers(0, 256, 64, dtype=np.uint8).tobytes())
    assert main(["run", "--model", str(junk), "-p", "q", "--device", "cpu"]) == 1
    assert_one_error_line(capsys.readouterr().err, str(junk))


def test_missing_image_is_reported_before_the_model_loads(tmp_path, capsys):
    image = tmp_path / "page.png"
    # the model path is bad too: the image is checked first
    assert main(["run", "--model", str(tmp_path / "none.gguf"), "--image", str(image), "-p", "q"]) == 1
    assert_one_error_line(capsys.readouterr().err, "image file not found", str(image))


@pytest.mark.parametrize("command", [["run", "--model", "m.gguf", "-p", "q"], ["demo"], ["eval"], ["bench"]])
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu0"])
def test_unknown_device_strings(command, device, capsys):
    assert main([*command, "--device", device]) == 1
    assert_one_error_line(capsys.readouterr().err, f"unknown device {device!r}", "available here: cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("command", [["run", "--model", "m.gguf", "-p", "q"], ["demo"], ["eval"], ["bench"]])
def test_cuda_without_a_gpu(command, capsys):
    assert main([*command, "--device", "cuda"]) == 1
    assert_one_error_line(capsys.readouterr().err, "no CUDA device", "--device cpu")


def test_resolve_device_raises_a_typed_error_listing_what_is_available():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if cuda_ready() else "cpu")
    with pytest.raises(DeviceUnavailableError, match="available here: cpu"):
        resolve_device("npu")
    with pytest.raises(DeviceUnavailableError, match="cuda:99"):
        resolve_device("cuda:99")


def test_convert_refusals(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nowhere" / "x"), "--outdir", str(tmp_path / "out")]) == 1
    assert_one_error_line(capsys.readouterr().err, "no such folder")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"architectures": ["NotAModel"], "model_type": "none"}')
    assert main(["convert", str(tmp_path / "ckpt"), "--outdir", str(tmp_path / "out"), "--quiet"]) == 1
    assert_one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out" / "model.gguf").exists()


def test_output_folder_that_cannot_be_made(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the output folder's parent should be")
    assert main(["eval", "--device", "cpu", "--out", str(blocker / "out"), "-q"]) == 1
    assert_one_error_line(capsys.readouterr().err, str(blocker / "out"))


def test_eval_refuses_a_folder_that_is_not_a_model(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "out"), "-q"]) == 1
    assert_one_error_line(capsys.readouterr().err, str(tmp_path), "config.json")


def test_image_over_pils_pixel_limit(bundled_gguf, tmp_path, capsys, monkeypatch):
    image = save_png(tmp_path / "large.png")  # 4096 pixels: over twice the limit below, PIL's error
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageTooLargeError):
        to_rgb_array(image)
    assert main(["run", "--model", str(bundled_gguf), "--image", str(image), "-p", "q", "--device", "cpu"]) == 1
    assert_one_error_line(capsys.readouterr().err, str(image), "downscale")


def test_run_streams_the_runtimes_answer(bundled_gguf, tmp_path, capsys):
    image = save_png(tmp_path / "page.png", seed=3)
    assert main(["run", "--model", str(bundled_gguf), "--image", str(image), "-p", "elk purple?",
                 "--max-tokens", "6", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    runtime = Runtime(bundled_gguf, device="cpu")
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                             {"type": "text", "text": "elk purple?"}]}]
    want = runtime.generate(messages, max_tokens=6)
    assert captured.out == want.text + "\n"
    assert f"{want.stats.prompt_tokens} prompt tokens, {want.stats.decode_tokens} generated" in captured.err


@pytest.mark.parametrize("argv, option", [
    (["run", "--model", "m", "-p", "q", "--max-tokens", "-1"], "--max-tokens"),
    (["run", "--model", "m", "-p", "q", "--top-p", "0"], "--top-p"),
    (["run", "--model", "m", "-p", "q", "--temperature", "hot"], "--temperature"),
    (["demo", "--requests", "0"], "--requests"),
    (["demo", "--budget", "1.5"], "--budget"),
    (["eval", "--budgets", "0.1,x"], "--budgets"),
    (["eval", "--refresh-policies", "conduit,magic"], "--refresh-policies"),
    (["eval", "--min-pages", "5", "--max-pages", "2"], "--min-pages"),
    (["eval", "--together", "0.1"], "--together"),
    (["eval", "--together-policies", "conduit"], "--together-policies"),
    (["eval", "--together-policies", "vlcache,conduit"], "--together-policies"),
    (["bench", "--skip", "everything"], "--skip"),
    (["convert", "src", "--outdir", "o", "--dtype", "q4"], "--dtype"),
])
def test_bad_option_values_are_usage_errors(argv, option, capsys):
    assert status_of(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: conduit ") and f"conduit {argv[0]}: error: " in err and option in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command, extra, module, purpose", [
    ("eval", "eval", "matplotlib", "for its plot"),
    ("bench", "bench", "matplotlib", "for its plots"),
    ("bench", "bench", "transformers", "for its end-to-end comparison"),
])
def test_missing_extra_names_the_pip_command(command, extra, module, purpose, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    out = tmp_path / "out"
    assert main([command, "--device", "cpu", "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert_one_error_line(err)
    assert err.startswith(f"{PREFIX}conduit {command} needs {module} {purpose}: pip install 'conduit-rt[{extra}]'")
    assert not out.exists()  # refused before any work


def test_interrupt_is_one_line_and_status_130(capsys):
    @reports_errors
    def interrupted(argv=None) -> int:
        raise KeyboardInterrupt

    assert interrupted([]) == 130
    assert capsys.readouterr().err == "conduit: interrupted\n"


# -- the installed entry point, in a subprocess --------------------------------------------------------------
def _conduit_command() -> list[str]:
    script = Path(sys.executable).parent / "conduit"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "conduit_rt.cli"]


def test_entry_point_in_a_subprocess(tmp_path):
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def conduit(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([*_conduit_command(), *args], capture_output=True, text=True,
                              env={**environment, **env}, timeout=300)

    missing = conduit("run", "--model", str(tmp_path / "missing.gguf"), "-p", "q", "--device", "cpu")
    assert missing.returncode == 1 and missing.stdout == ""
    assert_one_error_line(missing.stderr, "no such model file")

    no_library = str(tmp_path / "libconduit.so")  # not there
    version = conduit("--version", CONDUIT_LIB=no_library)
    assert version.returncode == 0
    assert version.stdout.startswith(f"conduit-rt {conduit_rt.__version__}\nnative library not loaded")
    info = conduit("info", CONDUIT_LIB=no_library)
    assert info.returncode == 1
    assert_one_error_line(info.stderr, "native library was not found", no_library)
    assert info.stdout == ""
