"""Where a request's time goes: wall time per phase of the prefill, by wrapping methods of the
request path for the duration of a ``with`` block (nothing in ``conduit_rt`` is edited).

Phases (exclusive times: a phase's nested phases are subtracted from it):
  prefill     ``ReusePass.run`` (the whole prefill; its own remainder goes to "other")
  restore     ``ReusePass._restore``: cached image KV written at the new positions
  text pass   ``ReusePass._forward``: every non-restored token through all layers
  scoring     ``reuse._PassScores.attention``: the attention mass of every chosen layer
  selection   ``refresh.Conduit.select`` without the scoring inside it
  recompute   ``ReusePass._pass`` called by ``ReusePass.run`` itself (the recompute pass, eager or
              replayed from the prefill graphs)
Each wrapper synchronizes the device at its entry and exit, so the instrumented request runs a
little slower than an untimed one; the TTFT targets use untimed requests.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

from conduit_rt import refresh, reuse

PHASES = ("restore", "text pass", "scoring", "selection", "recompute", "other")


class PhaseClock:
    """``with PhaseClock(device) as clock: runtime.generate(...)``; then ``clock.phases(ttft)``."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.exclusive: dict[str, float] = defaultdict(float)
        self.inclusive: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [label, seconds spent in nested phases]
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> "PhaseClock":
        self._patch(reuse.ReusePass, "run", "prefill")
        self._patch(reuse.ReusePass, "_restore", "restore")
        self._patch(reuse.ReusePass, "_forward", "text pass")
        self._patch(reuse._PassScores, "attention", "scoring")
        self._patch(refresh.Conduit, "select", "selection")
        self._patch(reuse.ReusePass, "_pass", "recompute", only_under="prefill")
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def phases(self, ttft_s: float) -> dict[str, float]:
        """Seconds per phase of ``PHASES``; "other" is the TTFT minus the timed phases."""
        out = {phase: self.exclusive.get(phase, 0.0) for phase in PHASES if phase != "other"}
        out["other"] = max(0.0, ttft_s - sum(out.values()))
        out["ttft"] = ttft_s
        out["prefill"] = self.inclusive.get("prefill", 0.0)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _patch(self, owner, name: str, label: str, only_under: str | None = None) -> None:
        had_own = name in vars(owner)
        original = vars(owner)[name] if had_own else None
        target = getattr(owner, name)  # for a class: the function; for an instance: the bound method

        def timed(*args, **kwargs):
            if only_under is not None and (not self._stack or self._stack[-1][0] != only_under):
                return target(*args, **kwargs)
            self._sync()
            start = time.perf_counter()
            self._stack.append([label, 0.0])
            try:
                return target(*args, **kwargs)
            finally:
                self._sync()
                elapsed = time.perf_counter() - start
                _, nested = self._stack.pop()
                self.exclusive[label] += elapsed - nested
                self.inclusive[label] += elapsed
                if self._stack:
                    self._stack[-1][1] += elapsed

        setattr(owner, name, timed)
        if had_own:
            self._undo.append(lambda: setattr(owner, name, original))
        else:
            self._undo.append(lambda: delattr(owner, name))
