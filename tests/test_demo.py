"""The README's main job (`conduit demo`) runs end to end on the bundled model and reports the cache at work."""
from __future__ import annotations

from conduit_rt.demo import main


def test_demo_reuses_the_pages_under_a_changed_prefix(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CONDUIT_CACHE", str(tmp_path))
    assert main(["--requests", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    conduit_line = next(line for line in out.splitlines() if line.strip().startswith("conduit"))
    pages = int(out.split("request 1: ")[1].split(" pages")[0])
    assert f"hits {pages}/{pages}" in conduit_line and "refreshed" in conduit_line
    assert "full prefill 1/1" in out  # the bundled model reads its pages with a full prefill
    assert list((tmp_path / "models").glob("*/model.gguf"))  # converted once into the cache
