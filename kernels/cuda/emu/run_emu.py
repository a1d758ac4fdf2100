#!/usr/bin/env python3
"""Builds test_cuda_kernels.cpp, which compares the CUDA kernels with the CPU backend (kernels/cpu)
on random inputs, and runs it.

    python3 kernels/cuda/emu/run_emu.py            # on the CPU emulator (emu.h): g++ (C++20) and
                                                   # the CUDA headers, no GPU or driver needed
    python3 kernels/cuda/emu/run_emu.py -D CONDUIT_EMU_WGMMA=1   # the many-query attention's Hopper
                                                   # path (wgmma.cuh) on the emulator's model of wgmma
    python3 kernels/cuda/emu/run_emu.py --gpu      # on the real GPU: nvcc and a device
    python3 kernels/cuda/emu/run_emu.py --grid decode   # one grid alone: stats, split, decode, merge, fp8
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
CUDA_DIR = HERE.parent
KERNELS_DIR = CUDA_DIR.parent

LAUNCH = re.compile(r"^(\s*)([\w:]+(?:<[^;{}<>]*(?:<[^;{}<>]*>)?[^;{}<>]*>)?)<<<(.*?)>>>\((.*?)\);", re.S | re.M)
DYNAMIC_SMEM = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")


def rewrite(source: str) -> str:
    """Turns kernel<<<grid, block, smem, stream>>>(args); into emu::launch(...) and dynamic smem into a pointer."""
    source = DYNAMIC_SMEM.sub(r"\1 *\2 = reinterpret_cast<\1 *>(::emu::dynamic_smem());", source)

    def launch(m: re.Match) -> str:
        indent, kernel, config, args = m.groups()
        parts = [p.strip() for p in split_top_level(config)]
        while len(parts) < 4:
            parts.append("0" if len(parts) == 2 else "nullptr")
        grid, block, smem, stream = parts
        return f"{indent}::emu::launch({grid}, {block}, {smem}, {stream}, [&]() {{ {kernel}({args}); }});"

    return LAUNCH.sub(launch, source)


def split_top_level(text: str) -> list:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def run_on_gpu(build: pathlib.Path, arch: str, defines: list[str], grid: list[str]) -> int:
    build.mkdir(parents=True, exist_ok=True)
    binary = build / "test_cuda_kernels_gpu"
    units = sorted(CUDA_DIR.glob("*.cu")) + sorted((KERNELS_DIR / "cpu").glob("*.cpp")) + [HERE / "test_cuda_kernels.cpp"]
    cmd = ["nvcc", "-std=c++17", "-O2", f"-arch={arch}", "-DCONDUIT_TEST_ON_GPU", *defines, f"-I{KERNELS_DIR}", "-o",
           str(binary)] + [str(u) for u in units]
    print(" ".join(cmd), flush=True)
    if subprocess.call(cmd) != 0:
        return 1
    return subprocess.call([str(binary), *grid])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default="/tmp/conduit_cuda_emu")
    parser.add_argument("--cuda-include", default=os.environ.get("CUDA_INCLUDE", "/usr/local/cuda/include"))
    parser.add_argument("--gpu", action="store_true", help="build with nvcc and run on the GPU")
    parser.add_argument("--arch", default="native", help="nvcc -arch for --gpu")
    parser.add_argument("--define", "-D", action="append", default=[], metavar="NAME=VALUE",
                        help="a macro for the build (CONDUIT_EMU_WGMMA=1: the sm_90a path on the emulator)")
    parser.add_argument("--grid", choices=["stats", "split", "decode", "merge", "fp8"],
                        help="run one grid of tests alone (default: all of them)")
    args = parser.parse_args()
    defines = [f"-D{d}" for d in args.define]
    grid = [args.grid] if args.grid else []
    build = pathlib.Path(args.build_dir)
    if args.gpu:
        return run_on_gpu(build, args.arch, defines, grid)
    src = build / "cuda"
    src.mkdir(parents=True, exist_ok=True)
    # One copy of the interface for every include path: kernels.h and the CPU backend beside it.
    shutil.copy(KERNELS_DIR / "kernels.h", build / "kernels.h")
    shutil.rmtree(build / "cpu", ignore_errors=True)
    shutil.copytree(KERNELS_DIR / "cpu", build / "cpu")
    units = []
    for path in sorted(CUDA_DIR.glob("*.cu*")):
        text = rewrite(path.read_text())
        if path.suffix == ".cu":
            text = '#include "emu.h"\n' + text
            out = src / (path.stem + ".cpp")
            units.append(out)
        else:
            out = src / path.name
        out.write_text(text)
    units += [HERE / "emu.cpp", HERE / "test_cuda_kernels.cpp"] + sorted((build / "cpu").glob("*.cpp"))
    binary = build / "test_emu"
    cmd = ["g++", "-std=c++20", "-O1", "-g", "-ffp-contract=off", "-pthread", "-Wall", "-Wno-unknown-pragmas", *defines,
           f"-I{args.cuda_include}", f"-I{HERE}", f"-I{src}", f"-I{build}", "-o", str(binary)] + [str(u) for u in units]
    print(" ".join(cmd), flush=True)
    if subprocess.call(cmd) != 0:
        return 1
    return subprocess.call([str(binary), *grid])


if __name__ == "__main__":
    sys.exit(main())
