"""What the harnesses share: the repository on the path, a scratch folder, and atheris's entry point.

Each harness imports its heavy dependencies (torch, numpy, PIL, jinja2, tokenizers) first,
uninstrumented, then ``conduit_rt`` under ``atheris.instrument_imports``: coverage comes from the
package's own code, and the fuzzer runs at the speed the package's dependencies allow.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def scratch_dir(name: str) -> Path:
    """A private folder for the files a harness writes (on tmpfs when there is one)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"conduit-fuzz-{name}-", dir=base))


def run(test_one_input, custom_mutator=None) -> None:
    """Hand ``test_one_input`` to libFuzzer with this process's command line (libFuzzer's flags)."""
    import atheris

    extra = {"custom_mutator": custom_mutator} if custom_mutator is not None else {}
    atheris.Setup(sys.argv, test_one_input, **extra)
    atheris.Fuzz()
