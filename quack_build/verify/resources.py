"""What a compiled kernel asks of an SM, read from the cubin in its .o: registers per thread
and the per-thread stack frame in local memory (``KernelResources``). A frame above zero is
register spills or an array the compiler could not keep in registers: local memory is
cached DRAM, so such a kernel is usually slower than one that fits (Triton shows the same
as ``n_spills``). ``quack verify`` reports it per configuration.

Pure Python, no CUDA: pyelftools reads the cubin's sections and symbol table; its
``.nv.info`` section (NVIDIA's own format, read here) holds, per function, the attributes
EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11) as (symbol index, value) pairs; the
symbol table names the function. ptxas -v prints the same two numbers ("Used N registers",
"N bytes stack frame"). A compressed cubin cannot be read here and reports nothing; a
malformed one reports what was read before the damage (verify's checksum has vouched for
the bytes already: this is a report, never a reason to fail)."""

from __future__ import annotations

import dataclasses
import io
import struct

from quack_build.verify.cubin import EM_CUDA, fatbin_entries

EIATTR_FRAME_SIZE = 0x11
EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 4  # u16 size, then the value; the other formats are 4 bytes in all


@dataclasses.dataclass(frozen=True)
class KernelResources:
    function: str
    registers: int  # per thread at launch (a kernel's setmaxnreg may move it while it runs)
    frame_bytes: int  # per-thread stack frame in local memory: spills, local arrays; 0 = none


def resources(data: bytes) -> list[KernelResources]:
    """The resources of every function of every readable cubin embedded in ``data`` (a .o
    or .so), in the order of the cubins' symbol indices."""
    out: list[KernelResources] = []
    for kind, payload, _sm, _flags in fatbin_entries(data):
        if kind == 2:
            out += _cubin_resources(payload)
    return out


def _cubin_resources(elf: bytes) -> list[KernelResources]:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    regs: dict[int, int] = {}
    frames: dict[int, int] = {}
    syms: dict[int, str] = {}
    try:
        f = ELFFile(io.BytesIO(elf))
        if f["e_machine"] not in ("EM_CUDA", EM_CUDA):  # pyelftools names it where it knows it
            return []
        for sec in f.iter_sections():
            if isinstance(sec, SymbolTableSection):
                syms = {i: sym.name for i, sym in enumerate(sec.iter_symbols())}
            elif sec.name == ".nv.info":
                _attributes(sec.data(), regs, frames)
    except (ELFError, struct.error, ValueError, UnicodeDecodeError):
        pass  # a damaged cubin: what was read before the damage
    return [
        KernelResources(syms.get(i, f"<symbol {i}>"), regs.get(i, 0), frames.get(i, 0))
        for i in sorted(set(regs) | set(frames))
    ]


def _attributes(info: bytes, regs: dict, frames: dict) -> None:
    """The per-function register counts and frame sizes of a ``.nv.info`` section."""
    q = 0
    while q + 4 <= len(info):
        fmt, attr = info[q], info[q + 1]
        if fmt != _EIFMT_SVAL:
            q += 4
            continue
        (size,) = struct.unpack_from("<H", info, q + 2)
        if size == 8 and q + 12 <= len(info) and attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE):
            sym, value = struct.unpack_from("<II", info, q + 4)
            (regs if attr == EIATTR_REGCOUNT else frames)[sym] = value
        q += 4 + size
