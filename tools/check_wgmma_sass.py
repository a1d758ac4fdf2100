#!/usr/bin/env python3
"""Checks compiled sm_90a code for register hazards of warpgroup MMAs: no instruction may write a
register that an in-flight HGMMA still owns (its A fragment or its accumulators), nor read its
accumulators, before the WARPGROUP.DEPBAR that retires it.

Why: the PTX ISA makes touching a wgmma's A or accumulator registers before its wgmma.wait_group
undefined, and ptxas does not enforce it for A: given P packed into new registers before the wait
of the P V product that still reads the old ones, it reused the old registers (the eleventh
session's `wgmma-pipeline2`: 448 such writes here, 0.4% of the outputs wrong on an H200, while the
CPU emulator, which runs wgmma synchronously, passed). The compiler-level fences of wgmma.cuh act on
NVVM, not on ptxas's register allocation, so the SASS is the place to look.

The scan is linear per function: conditional branches fall through, an unconditional forward
branch is followed (the code it jumps over is another path). It is a check of the code as laid
out, not a proof; it finds the hazard above, and none in the shipped kernels.

    python3 tools/check_wgmma_sass.py build/libconduit.so      # or a .cubin; exit 1 on a hazard
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
HGMMA_SHAPE = re.compile(r"HGMMA\.64x(\d+)x")


@dataclass
class Hazard:
    function: str
    address: str
    instruction: str
    registers: list[int]
    kind: str  # "write" (A or accumulator) or "read" (accumulator)


def find_cuobjdump() -> str | None:
    """cuobjdump from $CUOBJDUMP, PATH, the CUDA toolkit beside nvcc, or triton's bundled copy."""
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates.append(str(pathlib.Path(home) / "bin" / "cuobjdump"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(pathlib.Path(nvcc).resolve().parent / "cuobjdump"))
    try:
        import triton  # its NVIDIA backend ships cuobjdump

        candidates.append(str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _registers(operand: str, width: int = 1) -> set[int]:
    regs: set[int] = set()
    for m in REGISTER.finditer(operand):
        n = 2 if m.group(2) else width
        regs |= {int(m.group(1)) + i for i in range(n)}
    return regs


def _destination_width(opcode: str) -> int:
    if ".128" in opcode:
        return 4
    if ".64" in opcode or ".WIDE" in opcode:
        return 2
    return 1


def scan(sass: str) -> tuple[list[Hazard], int]:
    """Hazards in cuobjdump -sass text, and the number of HGMMA instructions seen."""
    hazards: list[Hazard] = []
    function, skip_to, n_hgmma = "", None, 0
    groups: list[tuple[set[int], set[int]]] = []  # committed, in flight: (written regs, accumulators)
    owned, acc = set(), set()                    # the group being issued
    for line in sass.splitlines():
        if "Function :" in line:
            function, skip_to, groups, owned, acc = line.split(":", 1)[1].strip(), None, [], set(), set()
            continue
        m = INSTRUCTION.search(line)
        if not m:
            continue
        address, text = m.group(1), m.group(2).strip()
        if skip_to is not None and int(address, 16) < skip_to:
            continue
        skip_to = None
        jump = re.fullmatch(r"BRA 0x([0-9a-f]+)", text)  # unconditional (no predicate)
        if jump:
            if int(jump.group(1), 16) > int(address, 16):
                skip_to = int(jump.group(1), 16)
            continue
        text = re.sub(r"^@!?U?P\w+\s+", "", text)
        opcode, _, rest = text.partition(" ")
        operands = [o.strip() for o in rest.split(",")] if rest else []
        if opcode.startswith("HGMMA"):
            n_hgmma += 1
            n = int(HGMMA_SHAPE.search(opcode).group(1))
            d = _registers(operands[0], n // 2)
            acc |= d
            owned |= d | _registers(operands[1], 4)  # A in registers: 4 of them (RZ / a descriptor: none)
            if "gsb0" in text:  # the group's last instruction
                groups.append((owned, acc))
                owned, acc = set(), set()
            continue
        if opcode.startswith("WARPGROUP.DEPBAR"):
            keep = int(operands[-1], 0)
            groups = groups[len(groups) - keep:] if keep else []
            continue
        if not groups:
            continue
        in_flight = set().union(*(g[0] for g in groups))
        in_flight_acc = set().union(*(g[1] for g in groups))
        written = _registers(operands[0], _destination_width(opcode)) if operands and operands[0].startswith("R") else set()
        read = set().union(*(_registers(o) for o in operands[1:])) if len(operands) > 1 else set()
        if written & in_flight:
            hazards.append(Hazard(function, address, text, sorted(written & in_flight), "write"))
        elif read & in_flight_acc:
            hazards.append(Hazard(function, address, text, sorted(read & in_flight_acc), "read"))
    return hazards, n_hgmma


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", help="a cubin, or a library / executable with embedded sm_90a code")
    args = parser.parse_args()
    tool = find_cuobjdump()
    if tool is None:
        sys.exit("no cuobjdump found (set CUOBJDUMP)")
    sass = subprocess.run([tool, "-sass", args.binary], check=True, capture_output=True, text=True).stdout
    hazards, n_hgmma = scan(sass)
    for h in hazards:
        print(f"{h.function}: {h.address}: {h.instruction}  ({h.kind} of in-flight R{h.registers})")
    print(f"{n_hgmma} HGMMA instructions, {len(hazards)} hazards")
    return 1 if hazards else 0


if __name__ == "__main__":
    sys.exit(main())
