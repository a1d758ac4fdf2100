"""Imports go one way: applications -> runtime -> model and policies -> arena -> native binding.

Each module of the package has a layer; a module may import its own layer and the ones below it,
never one above (checked on the source, function-level imports included). A new module must be
given its layer here.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "conduit_rt"

# (layer, name, module prefixes), lowest first; the longest matching prefix decides.
LAYERS = [
    (0, "foundation", ["errors", "extras", "config", "gguf_names", "gguf_keys", "gguf_parser", "locking", "results",
                       "validation", "evaluation.statistics"]),
    (1, "native binding", ["native"]),
    (2, "arena", ["arena", "topk"]),
    (3, "model and policies", ["model_config", "model_file", "model_keys", "preprocess", "preprocess_tiles", "tokenizer", "chat", "sampling",
                               "models", "selection", "refresh", "compress", "image_cache", "disk_cache", "disk_entry",
                               "prefix_cache", "decode_graph", "batch_decode", "prefill_graph", "convert",
                               "parallel", "parallel.group", "parallel.sharding"]),
    (4, "runtime", ["runtime", "reuse", "capture", "session", "request", "options", "planning", "decoding",
                    "prefill", "limits", "parallel.worker", "parallel.driver"]),
    (5, "applications", ["cli", "demo", "evaluation", "evaluation.recall", "bench", "convert.cli", "convert.__main__",
                         "serve"]),
]


def layer_of(module: str) -> tuple[int, str]:
    """The layer of a module path relative to the package ("runtime", "models.llama")."""
    best: tuple[int, int, str] | None = None
    for level, name, prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), level, name)
    assert best is not None, f"conduit_rt.{module} has no layer in tests/test_layering.py"
    return best[1], best[2]


def package_imports(path: Path) -> set[str]:
    """The package modules a source file imports, relative to the package ("arena", "models.base")."""
    module = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(module if path.name == "__init__.py" else module[:-1])
    package = [p for p in package if p != "__init__"]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            names = [target + [a.name] for a in node.names] if not node.module else [target]
            found.update(".".join(n) for n in names if n)
        elif isinstance(node, ast.ImportFrom) and node.module == "conduit_rt":
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("conduit_rt."):
            found.add(node.module.removeprefix("conduit_rt."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("conduit_rt.") for a in node.names if a.name.startswith("conduit_rt."))
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_no_import_goes_upward():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue  # the public face re-exports from every layer, lazily
        rel = path.relative_to(PACKAGE).with_suffix("")
        own = ".".join(p for p in rel.parts if p != "__init__")
        own_level, own_name = layer_of(own)
        for imported in package_imports(path):
            while imported and not _is_module(imported):  # "models.base.ForwardBatch" -> "models.base"
                imported = imported.rpartition(".")[0]
            if not imported:
                continue
            level, name = layer_of(imported)
            if level > own_level:
                upward.append(f"{own} ({own_name}) imports {imported} ({name})")
    assert not upward, "imports that go upward:\n  " + "\n  ".join(upward)


def test_layer_table_knows_every_module():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        own = ".".join(p for p in rel.parts if p != "__init__")
        if own:
            layer_of(own)
