"""Which GPU architectures a compiled .o holds: read its embedded CUDA fatbin.

Pure Python, no cutlass, no CUDA. The host object embeds a fatbin (magic
``50 ed 55 ba``: header u32 magic, u16 version, u16 header size, u64 payload
size), a list of entries (u16 kind: 1 PTX, 2 ELF; u16 version; u32 header
size; u64 payload size; ...; u32 SM at offset 28). An ELF entry is a cubin
(e_machine 190, EM_CUDA) whose e_flags encode the SM:

- ELF ABI version < 8 (up to sm_90): SM in bits 0-7, virtual SM in bits 16-23,
  0x800 = arch-specific ("a") features: 0x5a0d5a is sm_90a, 0x500550 sm_80.
- ABI version >= 8 (sm_100 on, and everything CUDA 13 builds): SM in bits 8-15,
  0x8 = "a" in CUDA 12 builds (0x600640a is sm_100a, 0x600780a sm_120a); CUDA 13
  builds leave it out, so the fatbin entry header's flags (u32 at offset 40:
  0x100000 "a", 0x200000 "f") decide the suffix.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator

FATBIN_MAGIC = b"\x50\xed\x55\xba"
EM_CUDA = 190


@dataclasses.dataclass(frozen=True)
class GpuCode:
    kind: str  # "cubin" or "ptx"
    sm: int  # e.g. 90
    arch: str  # e.g. "sm_90a" (cubin) or "compute_90" (ptx)
    e_flags: int | None = None
    compressed: bool = False


def decode_e_flags(e_flags: int, abi_version: int) -> tuple[int, bool]:
    """(SM number, arch-specific 'a' features) from a cubin's e_flags."""
    if abi_version >= 8:
        return (e_flags >> 8) & 0xFF, bool(e_flags & 0x8)
    return e_flags & 0xFF, bool(e_flags & 0x800)


# Fatbin entry-header flags (u32 at offset 40): the arch-specific / family variant.
# CUDA 13's ptxas no longer marks sm_90a in the cubin's e_flags (sm_90 and sm_90a
# give the same 0x6005a04), but the fatbin entry says it, in both CUDA 12 and 13 builds.
_HDR_ARCH_SPECIFIC = 0x100000
_HDR_FAMILY = 0x200000


def _suffix(hflags: int, accel_from_e_flags: bool) -> str:
    if hflags & _HDR_FAMILY:
        return "f"
    if hflags & _HDR_ARCH_SPECIFIC or accel_from_e_flags:
        return "a"
    return ""


def _cubin(payload: bytes) -> tuple[int, bool, int] | None:
    if len(payload) < 52 or payload[:4] != b"\x7fELF":
        return None
    little = payload[5] == 1
    fmt = "<" if little else ">"
    (machine,) = struct.unpack_from(fmt + "H", payload, 18)
    if machine != EM_CUDA:
        return None
    flags_off = 48 if payload[4] == 2 else 36  # ELF64 / ELF32
    (flags,) = struct.unpack_from(fmt + "I", payload, flags_off)
    sm, accel = decode_e_flags(flags, payload[8])
    return sm, accel, flags


def fatbin_entries(data: bytes) -> Iterator[tuple[int, bytes, int, int]]:
    """(kind, payload, SM of the entry header, entry-header flags) of every entry of the
    fatbins embedded in ``data``."""
    pos = data.find(FATBIN_MAGIC)
    while pos >= 0:
        try:
            _, hsize, fsize = struct.unpack_from("<HHQ", data, pos + 4)
        except struct.error:
            break
        p, end = pos + hsize, min(pos + hsize + fsize, len(data))
        while p + 24 <= end:
            kind, _ver, ehs, psz = struct.unpack_from("<HHIQ", data, p)
            if ehs < 24 or p + ehs > end:
                break
            (sm_hdr,) = struct.unpack_from("<I", data, p + 28) if ehs >= 32 else (0,)
            (hflags,) = struct.unpack_from("<I", data, p + 40) if ehs >= 44 else (0,)
            yield kind, data[p + ehs : p + ehs + psz], sm_hdr, hflags
            p += ehs + psz
        pos = data.find(FATBIN_MAGIC, max(end, pos + 4))


def gpu_codes(data: bytes) -> list[GpuCode]:
    """Every GPU code object in the fatbins embedded in ``data`` (a .o or .so)."""
    out: list[GpuCode] = []
    for kind, payload, sm_hdr, hflags in fatbin_entries(data):
        if kind == 2:
            cb = _cubin(payload)
            if cb is not None:
                sm, accel, flags = cb
                out.append(GpuCode("cubin", sm, f"sm_{sm}{_suffix(hflags, accel)}", flags))
            else:  # compressed or unreadable cubin: the entry header still names the SM
                out.append(
                    GpuCode("cubin", sm_hdr, f"sm_{sm_hdr}{_suffix(hflags, False)}", None, compressed=True)
                )
        elif kind == 1:
            out.append(GpuCode("ptx", sm_hdr, f"compute_{sm_hdr}"))
    return out


def arch_matches(requested: str, codes: list[GpuCode]) -> bool:
    """Does the object hold a cubin for ``requested`` (e.g. 'sm_90a')?"""
    want = requested.removeprefix("sm_")
    suffix = want[-1] if want and want[-1].isalpha() else ""
    num = int(want[:-1] if suffix else want)
    for c in codes:
        if c.kind != "cubin" or c.sm != num:
            continue
        if suffix == "a" and c.e_flags is not None and not c.arch.endswith("a"):
            continue
        return True
    return False
