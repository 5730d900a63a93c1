"""What a compiled kernel asks of an SM, read from the cubin in its .o: registers per thread
and the per-thread stack frame in local memory (``KernelResources``). A frame above zero is
register spills or an array the compiler could not keep in registers: local memory is
cached DRAM, so such a kernel is usually slower than one that fits (Triton shows the same
as ``n_spills``). ``quack verify`` reports it per configuration.

Pure Python, no CUDA: the cubin's ``.nv.info`` section holds, per function, the attributes
EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11) as (symbol index, value) pairs; the
symbol table names the function. ptxas -v prints the same two numbers ("Used N registers",
"N bytes stack frame"). A compressed cubin cannot be read here and reports nothing; a
malformed one reports what was read before the damage (verify's checksum has vouched for
the bytes already: this is a report, never a reason to fail)."""

from __future__ import annotations

import dataclasses
import struct

from quack_build.verify.cubin import EM_CUDA, fatbin_entries

EIATTR_FRAME_SIZE = 0x11
EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 4  # u16 size, then the value; the other formats are 4 bytes in all
_SHT_SYMTAB = 2


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
    # ELF64 little-endian only: what ptxas writes; anything else is not read
    if len(elf) < 64 or elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return []
    try:
        (machine,) = struct.unpack_from("<H", elf, 18)
        if machine != EM_CUDA:
            return []
        (shoff,) = struct.unpack_from("<Q", elf, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
        secs = []  # (name, type, offset, size, link) of each section (Elf64_Shdr)
        for i in range(shnum):
            name, typ, _flags, _addr, off, size, link = struct.unpack_from(
                "<IIQQQQI", elf, shoff + i * shentsize
            )
            secs.append((name, typ, off, size, link))
        names_at = secs[shstrndx][2]
        regs: dict[int, int] = {}
        frames: dict[int, int] = {}
        symtab = None
        for name, typ, off, size, link in secs:
            sname = _cstr(elf, names_at + name)
            if typ == _SHT_SYMTAB:
                symtab = (off, size, secs[link][2])
            elif sname == ".nv.info":
                _attributes(elf[off : off + size], regs, frames)
    except (struct.error, IndexError, UnicodeDecodeError):
        return []
    syms = _symbol_names(elf, symtab) if symtab else {}
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


def _symbol_names(elf: bytes, symtab: tuple) -> dict:
    off, size, strings = symtab
    out = {}
    try:
        for i in range(size // 24):  # Elf64_Sym: 24 bytes, its name first
            (name,) = struct.unpack_from("<I", elf, off + 24 * i)
            out[i] = _cstr(elf, strings + name)
    except (struct.error, UnicodeDecodeError):
        pass
    return out


def _cstr(buf: bytes, at: int) -> str:
    end = buf.find(b"\0", at)
    return buf[at : end if end >= 0 else len(buf)].decode()
