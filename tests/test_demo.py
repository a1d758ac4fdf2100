"""The README's main job (`conduit demo`) runs end to end and reports the cache at work."""
from __future__ import annotations

from conduit_rt.demo import main


def test_demo_reuses_the_pages_under_a_changed_prefix(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUIT_CACHE", str(tmp_path))
    assert main(["--requests", "1", "--device", "cpu", "--model", str(tmp_path / "no-model")]) == 0
    out = capsys.readouterr().out
    assert "random weights" in out  # no trained model given: it says so
    conduit_line = next(line for line in out.splitlines() if line.strip().startswith("conduit"))
    pages = int(out.split("request 1: ")[1].split(" pages")[0])
    assert f"hits {pages}/{pages}" in conduit_line and "refreshed" in conduit_line
