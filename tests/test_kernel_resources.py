"""``quack verify``'s resources report (quack_build/verify/resources.py): registers a thread
and the per-thread local-memory stack frame of every kernel in a compiled object, read from
its cubin. Unit tests on a synthetic cubin (every field placed by hand, then damaged), and
end to end on real sm_90a objects: a toy kernel whose run-time-indexed array ptxas keeps in
registers when small and in local memory when large."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import toykernels  # noqa: F401  (registers toy_scale, toy_local)
from typer.testing import CliRunner

from quack import settings
from quack_build.cli.app import app
from quack_build.verify.cubin import FATBIN_MAGIC
from quack_build.verify.resources import EIATTR_FRAME_SIZE, EIATTR_REGCOUNT, KernelResources, resources

runner = CliRunner()


def _sval(attr: int, sym: int, value: int) -> bytes:
    return struct.pack("<BBHII", 4, attr, 8, sym, value)


def _cubin(funcs: dict[str, tuple[int, int]]) -> bytes:
    """An ELF64 cubin (EM_CUDA) with a symbol per function and its REGCOUNT / FRAME_SIZE in
    ``.nv.info``, among attributes of the other formats (which the reader must step over)."""
    names = ["", *funcs]
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in names[1:])
    name_at = {n: strtab.index(b"\0" + n.encode() + b"\0") + 1 for n in names[1:]}
    symtab = b"\0" * 24 + b"".join(struct.pack("<IBBHQQ", name_at[n], 0x12, 0, 1, 0, 0) for n in names[1:])
    info = struct.pack("<BBH", 1, 0x54, 0) + struct.pack("<BBH", 3, 0x1B, 168)  # NVAL, HVAL
    for i, (regs, frame) in enumerate(funcs.values(), start=1):
        info += _sval(EIATTR_REGCOUNT, i, regs) + _sval(EIATTR_FRAME_SIZE, i, frame)
    info += struct.pack("<BBH", 4, 0x37, 4) + b"\x81\0\0\0"  # an SVAL of another size
    shstr = b"\0.shstrtab\0.strtab\0.symtab\0.nv.info\0"
    body = [shstr, strtab, symtab, info]
    at, data = 64, b""
    places = []
    for b in body:
        places.append((at + len(data), len(b)))
        data += b
    shoff = 64 + len(data)
    hdr = bytearray(64)
    hdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<H", hdr, 18, 190)
    struct.pack_into("<Q", hdr, 0x28, shoff)
    struct.pack_into("<HHH", hdr, 0x3A, 64, 5, 1)
    sh = bytes(64)
    # name, type, link, entry size: .shstrtab, .strtab, .symtab (Elf64_Sym: 24 bytes), .nv.info
    kinds = [(1, 3, 0, 0), (11, 3, 0, 0), (19, 2, 2, 24), (27, 0x70000000, 0, 0)]
    for (name, typ, link, entsize), (off, size) in zip(kinds, places):
        sh += struct.pack("<IIQQQQIIQQ", name, typ, 0, 0, off, size, link, 0, 1, entsize)
    return bytes(hdr) + data + sh


def _fatbin(*payloads: bytes) -> bytes:
    entries = b""
    for p in payloads:
        # kind 2 (ELF), version, a 64-byte header, the payload's size; the SM at offset 28
        hdr = struct.pack("<HHIQ", 2, 0x101, 64, len(p)) + bytes(12) + struct.pack("<I", 90) + bytes(32)
        entries += hdr + p
    return b"host code" + FATBIN_MAGIC + struct.pack("<HHQ", 1, 16, len(entries)) + entries + b"trailer"


def test_registers_and_frames_of_every_function_by_name():
    obj = _fatbin(_cubin({"kern_a": (168, 0), "kern_b": (40, 2064)}), _cubin({"kern_c": (255, 16)}))
    assert resources(obj) == [
        KernelResources("kern_a", 168, 0),
        KernelResources("kern_b", 40, 2064),
        KernelResources("kern_c", 255, 16),
    ]


def test_damaged_or_unreadable_cubins_report_what_they_can_and_never_raise():
    good = _cubin({"kern_a": (168, 0), "kern_b": (40, 2064)})
    assert resources(_fatbin(b"\x01compressed payload" * 8)) == []  # not an ELF: nothing
    assert resources(b"no fatbin here") == []
    for cut in range(0, len(good), 7):
        out = resources(_fatbin(good[:cut]))  # every truncation: a list, maybe shorter
        assert isinstance(out, list)
    wrong = bytearray(good)
    struct.pack_into("<H", wrong, 18, 62)  # an x86-64 ELF, not a cubin
    assert resources(_fatbin(bytes(wrong))) == []


def _project(d: Path, cache: Path, monkeypatch) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text('[build]\nkernel_packages = ["toykernels"]\n[runtime]\narch = "sm_90a"\n')
    (d / "m.toml").write_text(
        '[[kernel]]\nname = "toy_local"\narchs = ["sm_90a"]\nparams = { n = [8, 512] }\n'
        '[[kernel]]\nname = "toy_scale"\narchs = ["sm_90a"]\nparams = { dtype = "float16", block = 64 }\n'
    )
    monkeypatch.chdir(d)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache))


def test_verify_reports_the_local_memory_of_real_kernels(tmp_path, monkeypatch):
    saved = settings.installed()
    try:
        _project(tmp_path / "proj", tmp_path / "cache", monkeypatch)
        r = runner.invoke(app, ["build", "m.toml", "-j", "2", "--json"])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["verify", "m.toml", "--json"])
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout)
        by = {(e["kernel"], e["params"].get("n")): e for e in res["entries"]}
        assert res["ok"] and len(by) == 3
        (big,) = by["toy_local", 512]["resources"]
        assert big["frame_bytes"] >= 4 * 512 and big["registers"] > 0, big
        for small in (by["toy_local", 8], by["toy_scale", None]):
            (k,) = small["resources"]
            assert k["frame_bytes"] == 0 and k["registers"] > 0, small
        # the human report: a note naming the one configuration with a frame, not a problem
        r = runner.invoke(app, ["verify", "m.toml"])
        assert r.exit_code == 0, r.output
        out = " ".join(r.output.split())
        assert "1 configuration uses local memory" in out and "toy_local(n=512)" in out, out
        assert "toy_local(n=8)" not in out and "all good" in out
    finally:
        settings.set_current(saved)
