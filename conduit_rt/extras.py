"""Optional dependencies: packages that only some commands need, behind the extras of pyproject.toml.

``require`` imports one and, when it is not installed, raises ``MissingExtraError`` whose message
is the command that installs it, so that a user sees what to do instead of an ``ImportError``.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError


def require(module: str, *, extra: str, command: str, purpose: str, otherwise: str = "") -> ModuleType:
    """Imports ``module`` (e.g. ``"matplotlib.pyplot"``) and returns it.

    Raises MissingExtraError reading ``"{command} needs {package} {purpose}: pip install
    'conduit-rt[{extra}]'"`` (then ``", or {otherwise}"`` when given) when the import fails,
    ``package`` being the module's top-level name.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.partition(".")[0]
        alternative = f", or {otherwise}" if otherwise else ""
        raise MissingExtraError(f"{command} needs {package} {purpose}: pip install 'conduit-rt[{extra}]'"
                                f"{alternative}") from error


def pyplot(*, extra: str, command: str, purpose: str) -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed); raises
    MissingExtraError as ``require`` does when matplotlib is not installed."""
    matplotlib = require("matplotlib", extra=extra, command=command, purpose=purpose)
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
