#!/usr/bin/env python3
"""Same-machine A/B of native library builds: the decode rows and the decode step, alternating.

Kernel changes move decode figures by a few percent, and machines differ by as much, so builds are
compared on one machine, in alternating rounds (the sixth session's bisect, docs/benchmarks/runs.md).
A variant is a git ref of this repository and optional macros for the kernels' build-time knobs;
the Python package is the working tree's for every variant (the variants differ in the library).

Here (with git), source trees into .ab/ (ignore it: ``echo /.ab/ >> .git/info/exclude``):

    python3 tools/ab_builds.py prepare main ring3=mha-ring-aligned+CONDUIT_MHA_ATTN_STAGES=3 \
        main_nopdl=main+env:CONDUIT_PDL=0

On the GPU machine (carry ``.ab``): builds every variant in parallel, then per round runs
``tools/bench_decode_attention.py --no-sdpa`` and ``tools/profile_decode.py`` (with ``--prefill``:
``tools/bench_prefill_attention.py``) for each variant in turn:

    python3 tools/ab_builds.py run --rounds 2 --out $OUT/ab.json
    python3 tools/ab_builds.py fastest $OUT/ab.json       # the variant to test and benchmark next
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parent.parent
AB_DIR = ROOT / ".ab"
SOURCES = ["native", "kernels", "CMakeLists.txt", "pyproject.toml"]  # what a library build reads


def parse_variant(spec: str) -> dict:
    """``NAME=REF+MACRO=VALUE+env:VAR=VALUE+...`` or ``REF+...`` (then NAME = REF) -> {name, ref,
    defines, env}: macros for the library's build, environment variables for its measurements."""
    head, *rest = spec.split("+")
    name, named, ref = head.partition("=")
    if not named:
        ref = name
    env = dict(item[len("env:"):].split("=", 1) for item in rest if item.startswith("env:"))
    defines = [item for item in rest if not item.startswith("env:")]
    return {"name": name.replace("/", "_"), "ref": ref, "defines": defines, "env": env}


def prepare(specs: list[str]) -> None:
    variants = [parse_variant(s) for s in specs]
    AB_DIR.mkdir(exist_ok=True)
    for v in variants:
        tree = AB_DIR / v["name"]
        subprocess.run(["rm", "-rf", str(tree)], check=True)
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", v["ref"], *SOURCES], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        v["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", v["ref"]], check=True,
                                     capture_output=True, text=True).stdout.strip()
    (AB_DIR / "plan.json").write_text(json.dumps(variants, indent=1))
    print("\n".join(f"{v['name']}: {v['ref']} ({v['commit']}) {' '.join(v['defines'])} "
                    f"{' '.join(f'{k}={x}' for k, x in v['env'].items())}" for v in variants))


def build(v: dict, arch: str) -> pathlib.Path:
    build_dir = pathlib.Path(f"/tmp/ab-build-{v['name']}")
    flags = " ".join(f"-D{d}" for d in v["defines"])
    configure = ["cmake", "-S", str(AB_DIR / v["name"]), "-B", str(build_dir), "-G", "Ninja",
                 f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DCONDUIT_CUDA=ON", f"-DCMAKE_CUDA_FLAGS={flags}"]
    for cmd in (configure, ["cmake", "--build", str(build_dir), "-j", "6"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"build of {v['name']} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return build_dir / "libconduit.so"


def measure(lib: pathlib.Path, tool: list[str], extra_env: dict[str, str]) -> dict:
    """Runs a tool of tools/ with CONDUIT_LIB=lib (and extra_env) and returns the JSON it wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, **extra_env, "CONDUIT_LIB": str(lib),
               "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([sys.executable, *tool, "--out", out.name], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        return json.load(open(out.name))


def run(rounds: int, out_path: str, prefill: bool = False) -> None:
    import torch

    props = torch.cuda.get_device_properties(0)
    variants = json.loads((AB_DIR / "plan.json").read_text())
    start = time.monotonic()
    with ThreadPoolExecutor(len(variants)) as pool:
        arch = f"{props.major}{props.minor}" + ("a" if props.major == 9 else "")  # Hopper: wgmma needs 90a
        libs = list(pool.map(lambda v: build(v, arch), variants))
    print(f"built {len(libs)} variants in {time.monotonic() - start:.0f} s", flush=True)
    # The decode rows and the decode step's replay, or (prefill) the many-query attention's rows only.
    rows_tool = ["tools/bench_prefill_attention.py"] if prefill else ["tools/bench_decode_attention.py", "--no-sdpa"]
    results = {v["name"]: {**v, "rows_us": [], "step_ms": []} for v in variants}
    for done_rounds in range(1, rounds + 1):
        for v, lib in zip(variants, libs):
            env, r = v.get("env", {}), results[v["name"]]
            rows = measure(lib, rows_tool, env)["rows"]
            r["rows_us"].append({k: row["seconds"] * 1e6 for k, row in rows.items()})
            if not prefill:
                step = measure(lib, ["tools/profile_decode.py", "--steps", "64"], env)
                r["step_ms"].append(step["graph_replay_device_s"] * 1e3)
        # Every round's results are kept: a call that runs out of time still has the rounds it finished.
        json.dump({"device": props.name, "rounds": done_rounds, "variants": results}, open(out_path, "w"), indent=1)
        print_medians(results, prefill, f"after round {done_rounds}")


def print_medians(results: dict, prefill: bool, title: str) -> None:
    shapes = list(next(iter(results.values()))["rows_us"][0])
    step_head = "" if prefill else f" {'step ms':>8s}"
    print(f"{title}\n{'variant':16s} " + " ".join(f"{s:>15s}" for s in shapes) + step_head + "  (medians)")
    for name, r in results.items():
        cells = [statistics.median(row[s] for row in r["rows_us"]) for s in shapes]
        step_cell = "" if prefill else f" {statistics.median(r['step_ms']):8.3f}"
        print(f"{name:16s} " + " ".join(f"{c:15.1f}" for c in cells) + step_cell, flush=True)


def fastest(path: str) -> str:
    """The variant of an A/B JSON with the least sum of its rows' medians (and, for decode, its
    step's): the one a call goes on to test and benchmark."""
    variants = json.load(open(path))["variants"]

    def total(r: dict) -> float:
        rows = sum(statistics.median(row[k] for row in r["rows_us"]) for k in r["rows_us"][0])
        return rows + (statistics.median(r["step_ms"]) * 1e3 if r.get("step_ms") else 0.0)

    return min(variants, key=lambda name: total(variants[name]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: source trees of the variants into .ab/")
    p.add_argument("variants", nargs="+", help="NAME=REF[+MACRO=VALUE...] or REF")
    r = sub.add_parser("run", help="on the GPU machine: build, then alternate the measurements")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--out", default="ab.json")
    r.add_argument("--prefill", action="store_true",
                   help="measure the many-query attention (tools/bench_prefill_attention.py) instead of decode")
    b = sub.add_parser("fastest", help="print the fastest variant of a run's JSON (sum of the medians)")
    b.add_argument("json")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.variants)
    elif args.command == "fastest":
        print(fastest(args.json))
    else:
        run(args.rounds, args.out, args.prefill)


if __name__ == "__main__":
    main()
