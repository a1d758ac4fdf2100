"""The README stays true: its Python example runs as written, and CI runs its two commands."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block(name: str) -> str:
    """The fenced block between ``<!-- name -->`` and ``<!-- /name -->``."""
    match = re.search(rf"<!-- {name} -->\n```\w*\n(.*?)```\n<!-- /{name} -->", README.read_text(), re.S)
    assert match, f"README.md has no {name} block"
    return match.group(1)


def test_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CONDUIT_CACHE", str(tmp_path))
    code = readme_block("python-example").replace('device="auto"', 'device="cpu"')
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    request, answer, again = namespace["request"], namespace["answer"], namespace["again"]
    assert answer.text.strip() == request.answer  # the bundled model reads its pages
    assert again.stats.image_hits == again.stats.images > 0
    assert again.stats.refreshed_tokens == -(-again.stats.visual_tokens // 10)  # ceil(10% of N_vis)
    assert namespace["small"].stats.kv_bytes_after_compress < namespace["small"].stats.kv_bytes_before_compress
    assert namespace["first"].text == answer.text  # a chat's first turn is the same request


def test_ci_runs_both_readme_commands():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "readme_command main-command" in ci and "readme_command test-command" in ci
    assert readme_block("main-command").strip().endswith("conduit demo")
