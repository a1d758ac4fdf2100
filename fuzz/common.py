"""What the harnesses share: the repository on the path, a scratch folder, and atheris's entry point.

Each harness imports what it fuzzes, then calls ``instrument_packages`` on the packages whose code
should give coverage (``conduit_rt``, and PIL for the image decoders): torch, numpy, jinja2 and
tokenizers stay uninstrumented, so the fuzzer runs at the speed the package's dependencies allow.
"""
from __future__ import annotations

import gc
import os
import sys
import types
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


def instrument_packages(*packages: str) -> int:
    """Adds atheris's coverage instrumentation to every function of ``packages`` imported so far.

    ``atheris.instrument_imports`` patches modules as their loader reads them, and cannot patch a
    module that an editable install's import hook loads (``pip install -e .``, as the test command
    does): the fuzzer would then see no coverage, keep no corpus and mutate one-byte inputs. Patching
    the functions' code objects after import works whatever loaded them. Nested functions and
    lambdas are patched with the code that holds them. Returns the number of functions patched.
    """
    import atheris

    patched = 0
    for obj in gc.get_objects():
        if type(obj) is types.FunctionType and (obj.__module__ or "").partition(".")[0] in packages:
            atheris.instrument_func(obj)
            patched += 1
    if patched == 0:
        raise RuntimeError(f"no function of {packages} is imported: nothing to instrument")
    return patched


def run(test_one_input, custom_mutator=None) -> None:
    """Hand ``test_one_input`` to libFuzzer with this process's command line (libFuzzer's flags)."""
    import atheris

    extra = {"custom_mutator": custom_mutator} if custom_mutator is not None else {}
    atheris.Setup(sys.argv, test_one_input, **extra)
    atheris.Fuzz()
