#!/usr/bin/env python3
"""Checks compiled sm_90a code for register hazards of warpgroup MMAs: no instruction may write a
register that an in-flight HGMMA still owns (its A fragment or its accumulators), nor read its
accumulators, before the WARPGROUP.DEPBAR that retires it.

Why: the PTX ISA makes touching a wgmma's A or accumulator registers before its wgmma.wait_group
undefined, and ptxas does not enforce it for A: given P packed into new registers before the wait
of the P V product that still reads the old ones, it may reuse the old registers, and a fraction of
the outputs come out wrong on the GPU while the CPU emulator, which runs wgmma synchronously, passes.
The compiler-level fences of wgmma.cuh act on NVVM, not on ptxas's register allocation, so the SASS
is the place to look.

Every path of a function's control-flow graph is followed (both sides of a branch, loop back-edges,
the divergent-branch fallbacks) with the groups in flight along it. The operand parsing is by
pattern (the first operand of an instruction with a register there is its destination; .64 / .128
/ .WIDE widen it), so it is a check, not a proof; it finds the hazard above, and none in the
shipped kernels.

It also checks that every function with warpgroup MMAs that waits on an mbarrier (the
warp-specialized attention: its producer warpgroup hands tiles over through them) trades registers
between its warpgroups (USETMAXREG.DEALLOC and .TRY_ALLOC): ptxas drops a setmaxnreg it cannot
honour with only an info line (C7507), and the consumers would then run their 200-odd registers'
worth of code in 168.

    python3 tools/check_wgmma_sass.py build/libconduit.so      # or a .cubin; exit 1 on a finding
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
PREDICATE = re.compile(r"^@!?U?P\w+\s+")
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


def dump_sass(tool: str, binary: str) -> str | None:
    """cuobjdump -sass of a cubin or library; None when it holds no device code (a CPU-only build)."""
    done = subprocess.run([tool, "-sass", binary], capture_output=True, text=True)
    if "does not contain device code" in done.stdout + done.stderr:
        return None
    if done.returncode:
        raise RuntimeError(f"cuobjdump failed on {binary}: {done.stderr.strip()}")
    return done.stdout


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


@dataclass(frozen=True)
class _Flight:
    """What is in flight at an instruction: committed groups (each: registers it owns, its
    accumulators), and the registers of the group being issued."""
    groups: tuple[tuple[frozenset, frozenset], ...] = ()
    owned: frozenset = frozenset()
    acc: frozenset = frozenset()


def _functions(sass: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """cuobjdump -sass text -> [(function name, [(address, instruction text)])]."""
    out: list[tuple[str, list[tuple[int, str]]]] = []
    for line in sass.splitlines():
        if "Function :" in line:
            out.append((line.split(":", 1)[1].strip(), []))
        elif out and (m := INSTRUCTION.search(line)):
            out[-1][1].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _successors(code: list[tuple[int, str]], index: dict[int, int], i: int) -> list[int]:
    text = code[i][1]
    predicated = PREDICATE.match(text) is not None
    opcode = PREDICATE.sub("", text).split(" ", 1)[0]
    if opcode.startswith("BRA"):
        target = [index[int(re.search(r"0x([0-9a-f]+)\s*$", text).group(1), 16)]]
        return target + ([i + 1] if predicated or opcode.startswith("BRA.DIV") else [])
    # A trap ends the grid (`__trap()` on a path that must never run, e.g. guarding an impossible value).
    if opcode.startswith(("EXIT", "RET", "BPT.TRAP")) and not predicated:
        return []
    return [i + 1] if i + 1 < len(code) else []


def _step(flight: _Flight, text: str) -> tuple[_Flight, tuple[str, list[int]] | None]:
    """The in-flight state after one instruction, and the hazard it commits (kind, registers) if any."""
    opcode, _, rest = PREDICATE.sub("", text).partition(" ")
    operands = [o.strip() for o in rest.split(",")] if rest else []
    if opcode.startswith("HGMMA"):
        d = _registers(operands[0], int(HGMMA_SHAPE.search(opcode).group(1)) // 2)
        owned = flight.owned | d | _registers(operands[1], 4)  # A in registers: 4 of them (a descriptor: none)
        if "gsb0" in text:  # the group's last instruction
            return _Flight(flight.groups + ((owned, flight.acc | d),)), None
        return _Flight(flight.groups, owned, flight.acc | d), None
    if opcode.startswith("WARPGROUP.DEPBAR"):
        keep = int(operands[-1], 0)
        return _Flight(flight.groups[len(flight.groups) - keep:] if keep else (), flight.owned, flight.acc), None
    if not flight.groups:
        return flight, None
    in_flight = frozenset().union(*(g[0] for g in flight.groups))
    in_flight_acc = frozenset().union(*(g[1] for g in flight.groups))
    written = _registers(operands[0], _destination_width(opcode)) if operands and operands[0].startswith("R") else set()
    read = set().union(*(_registers(o) for o in operands[1:])) if len(operands) > 1 else set()
    if written & in_flight:
        return flight, ("write", sorted(written & in_flight))
    if read & in_flight_acc:
        return flight, ("read", sorted(read & in_flight_acc))
    return flight, None


def scan(sass: str) -> tuple[list[Hazard], int]:
    """Hazards in cuobjdump -sass text, and the number of HGMMA instructions seen. Every path of each
    function's control-flow graph is followed (taken and fall-through branches, loop back-edges),
    with the in-flight state it carries: a worklist over (instruction, state) pairs."""
    hazards: list[Hazard] = []
    n_hgmma = 0
    for function, code in _functions(sass):
        n_hgmma += sum(PREDICATE.sub("", text).startswith("HGMMA") for _, text in code)
        index = {address: i for i, (address, _) in enumerate(code)}
        seen: set[tuple[int, _Flight]] = set()
        found: dict[int, Hazard] = {}
        work = [(0, _Flight())] if code else []
        while work:
            i, flight = work.pop()
            if (i, flight) in seen:
                continue
            seen.add((i, flight))
            address, text = code[i]
            flight, hazard = _step(flight, text)
            if hazard and address not in found:
                found[address] = Hazard(function, f"{address:04x}", text, hazard[1], hazard[0])
            work += [(j, flight) for j in _successors(code, index, i)]
        hazards += [found[a] for a in sorted(found)]
    return hazards, n_hgmma


def missing_register_trades(sass: str) -> list[str]:
    """The functions with HGMMA that wait on an mbarrier (warp-specialized: a producer and consumers)
    but lack a USETMAXREG.DEALLOC or a USETMAXREG.TRY_ALLOC."""
    missing = []
    for function, code in _functions(sass):
        texts = [PREDICATE.sub("", text) for _, text in code]
        specialized = any(t.startswith("SYNCS.PHASECHK") for t in texts) and any(t.startswith("HGMMA") for t in texts)
        if specialized and not all(
                any(t.startswith(f"USETMAXREG.{kind}") for t in texts) for kind in ("DEALLOC", "TRY_ALLOC")):
            missing.append(function)
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", help="a cubin, or a library / executable with embedded sm_90a code")
    args = parser.parse_args()
    tool = find_cuobjdump()
    if tool is None:
        sys.exit("no cuobjdump found (set CUOBJDUMP)")
    sass = dump_sass(tool, args.binary)
    if sass is None:
        sys.exit(f"{args.binary} holds no device code")
    hazards, n_hgmma = scan(sass)
    for h in hazards:
        print(f"{h.function}: {h.address}: {h.instruction}  ({h.kind} of in-flight R{h.registers})")
    print(f"{n_hgmma} HGMMA instructions, {len(hazards)} hazards")
    untraded = missing_register_trades(sass)
    for function in untraded:
        print(f"{function}: waits on an mbarrier but trades no registers (setmaxnreg dropped by ptxas?)")
    return 1 if hazards or untraded else 0


if __name__ == "__main__":
    sys.exit(main())
