"""quack_build.cachedir.walk (cache walk, sizes, ages) and quack_build.verify.cubin (arch of an object), no compiles."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import pytest

from quack_build.cachedir import units
from quack_build.verify.cubin import arch_matches, decode_e_flags, gpu_codes


def _cubin(e_flags: int, abi: int) -> bytes:
    ident = b"\x7fELF" + bytes([2, 1, 1, 0x41 if abi >= 8 else 0x33, abi]) + bytes(7)
    hdr = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 64, 0, e_flags, 64, 0, 0, 64, 0, 0)
    return hdr + bytes(64)


def _fatbin(*entries: tuple[int, int, bytes]) -> bytes:
    body = b""
    for kind, sm, payload in entries:
        eh = (
            struct.pack("<HHIQ", kind, 0x101, 72, len(payload))
            + struct.pack("<IIII", 0, 0, 0x10007, sm)
            + bytes(72 - 32)
        )
        body += eh + payload
    return b"\x50\xed\x55\xba" + struct.pack("<HHQ", 1, 16, len(body)) + body


@pytest.mark.parametrize(
    "flags,abi,arch",
    [
        (0x5A0D5A, 7, "sm_90a"),
        (0x500550, 7, "sm_80"),
        (0x5A055A, 7, "sm_90"),
        (0x600640A, 8, "sm_100a"),
        (0x600780A, 8, "sm_120a"),
        (0x6006402, 8, "sm_100"),
    ],
)
def test_decode_arch_from_embedded_cubin(flags, abi, arch):
    sm, accel = decode_e_flags(flags, abi)
    assert f"sm_{sm}{'a' if accel else ''}" == arch
    obj = b"host object junk" * 10 + _fatbin((2, sm, _cubin(flags, abi))) + b"trailer"
    (code,) = gpu_codes(obj)
    assert code.arch == arch and code.kind == "cubin"
    assert arch_matches(arch, [code])


def test_arch_mismatch_and_ptx():
    obj = _fatbin((1, 90, b"// ptx text"), (2, 80, _cubin(0x500550, 7)))
    codes = gpu_codes(obj)
    assert [c.arch for c in codes] == ["compute_90", "sm_80"]
    assert not arch_matches("sm_90a", codes)
    assert arch_matches("sm_80", codes)
    # "sm_90" (no 'a') object does not satisfy an sm_90a request
    assert not arch_matches("sm_90a", gpu_codes(_fatbin((2, 90, _cubin(0x5A055A, 7)))))
    assert gpu_codes(b"no fatbin here") == []


def test_parse_size_and_age():
    assert units.parse_size("5G") == 5 << 30
    assert units.parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert units.parse_size("500m") == 500 << 20
    assert units.parse_size("1024") == 1024
    assert units.parse_age("30d") == 30 * 86400
    assert units.parse_age("12h") == 12 * 3600
    assert units.parse_age("2w") == 14 * 86400
    for bad in ("lots", "5X", "-1G", ""):
        with pytest.raises(ValueError):
            units.parse_size(bad)
    with pytest.raises(ValueError):
        units.parse_age("soon")


def test_tmp_debris_rules():
    """The one age rule (quack.cache.orphans), as ``quack cache clean`` applies it."""
    from quack.cache.orphans import tmp_is_orphan

    now = time.time()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = p.pid
    assert tmp_is_orphan(os.getpid(), now - 2 * 3600, now)  # old: whoever wrote it
    assert not tmp_is_orphan(os.getpid(), now - 120, now)  # young, writer alive
    assert tmp_is_orphan(dead, now - 120, now)  # writer dead
    assert not tmp_is_orphan(dead, now - 5, now)  # too young to judge
    assert tmp_is_orphan(dead, now - 5, now, grace=0)  # the caller knows it killed it


def test_human_bytes():
    assert units.human_bytes(512) == "512 B"
    assert units.human_bytes(3 << 20) == "3.0 MiB"


# The fatbin entry header of a real CUDA 13 (nvidia-cutlass-dsl-libs-cu13 4.8.1) sm_90a
# build, up to its flags word; its cubin's e_flags (0x6005a04, ABI 8) are the same for
# sm_90 and sm_90a, so only the entry flags tell them apart (a verify run on the H200
# reported every cu13 entry as "built for sm_90" before this was read).
_CU13_ENTRY_HEAD = bytes.fromhex(
    "020001014800000010110000000000000000000000000000080001005a0000004000000007000000"
)


@pytest.mark.parametrize(
    "hflags,arch", [(0x00100011, "sm_90a"), (0x00000011, "sm_90"), (0x00200011, "sm_90f")]
)
def test_cuda13_arch_from_fatbin_entry_flags(hflags, arch):
    cub = _cubin(0x6005A04, 8)
    head = _CU13_ENTRY_HEAD + struct.pack("<I", hflags)
    entry = head[:8] + struct.pack("<Q", len(cub)) + head[16:] + bytes(72 - len(head)) + cub
    blob = b"\x50\xed\x55\xba" + struct.pack("<HHQ", 1, 16, len(entry)) + entry
    (code,) = gpu_codes(b"host" * 8 + blob)
    assert code.arch == arch and code.sm == 90
