"""``quack bundle inspect``: what a bundle wheel holds, checked without installing it.

Order (issue 30: a 1.1 MB wheel with a 1 GiB zero-filled member took 2.1 GB and 6 s and
was called ok, as was a member named ``../../../../tmp/x``, which pip refuses):

1. the zip's central directory only, nothing decompressed: every member's name (no
   absolute path, drive letter, backslash, control character, empty / ``.`` / ``..``
   component, no name twice), every member's declared size against its cap
   (quack.bundles.index: MAX_INDEX_BYTES for the index and the dist-info files,
   MAX_SIG_BYTES, MAX_META_BYTES, MAX_FILE_BYTES for anything else), and where each
   member may be (the bundle's package or its dist-info directory; nothing else,
   since pip would install it: a ``.pth`` or a script is code);
2. RECORD (WheelFile checks each member's hash against it as it is read);
3. the entry point, which must name the bundle's own package (as the runtime requires);
4. the index and, when present, its signature, verified over the raw bytes before the
   index is parsed when trusted keys are given (an index whose signature fails then is
   not parsed at all);
5. each entry's files: declared size against the index before reading, then SHA-256
   streamed in 1 MiB chunks; each entry's metadata against the index.

A member refused in step 1 is never read."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import zipfile
import zlib
from pathlib import Path

from quack.bundles import index as _index
from quack.cache import keys
from quack.errors import BundleError
from quack.filekind import describe

CHUNK = 1 << 20
# Four files an entry, the package's three, the dist-info's five, and some slack.
MAX_MEMBERS = 4 * _index.MAX_ENTRIES + 64
_DRIVE = re.compile(r"^[A-Za-z]:")


def name_problem(name: str) -> str:
    """'' if ``name`` is a safe relative member name, else why not."""
    if "\\" in name:
        return "has a backslash (a path separator on Windows)"
    if name.startswith("/") or _DRIVE.match(name):
        return "is an absolute path"
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        return "has a control character"
    parts = name.split("/")
    if name.endswith("/"):
        parts = parts[:-1]  # a directory entry
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' path component (it could land outside site-packages)"
    return ""


def _cap(name: str, pkg: str | None) -> int:
    if ".dist-info/" in name:
        return _index.MAX_INDEX_BYTES
    if pkg is not None:
        if name == f"{pkg}/{_index.INDEX_NAME}":
            return _index.MAX_INDEX_BYTES
        if name == f"{pkg}/{_index.SIG_NAME}":
            return _index.MAX_SIG_BYTES
        if name.startswith(f"{pkg}/") and name.endswith(".json"):
            return _index.MAX_META_BYTES
    return max(_index.MAX_FILE_BYTES, _index.MAX_INDEX_BYTES)


def _open_regular(path: Path):
    """``path`` opened for reading if it is a regular file, else BundleError saying what it
    is. Opened non-blocking and checked on the descriptor: zipfile on a FIFO waited forever
    for a writer, and on /dev/zero read (and kept) data until memory ran out."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise BundleError(f"{path}: cannot open it ({e.strerror or e})", path=str(path)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BundleError(
            f"{path}: is {describe(st.st_mode)}, not a wheel file: give a .whl file", path=str(path)
        )
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _same_file(f, other) -> bool:
    a, b = os.fstat(f.fileno()), os.fstat(other.fileno())
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _members(path: Path, problems: list[str], f) -> dict[str, zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise BundleError(f"{path}: not a readable wheel ({e})", path=str(path)) from None
    if len(infos) > MAX_MEMBERS:
        raise BundleError(
            f"{path}: {len(infos)} members, more than the {MAX_MEMBERS} a bundle wheel may have",
            path=str(path),
        )
    out = {i.filename: i for i in infos}
    if len(out) != len(infos):  # zipfile reads the last of two members of one name
        problems.append("two members have the same name (one hides the other)")
    return out


class _Reader:
    """Streams members of an open WheelFile, collecting problems; never reads a
    member refused by name or declared size."""

    def __init__(self, wf, infos: dict[str, zipfile.ZipInfo], problems: list[str], refused: set[str]):
        self.wf, self.infos, self.problems, self.refused = wf, infos, problems, refused
        from wheel.wheelfile import WheelError

        self.errors = (WheelError, zipfile.BadZipFile, EOFError, OSError, zlib.error)

    def stream(self, member: str, keep: bool = False) -> tuple[str, int, bytes] | None:
        """(sha256 hex, size, the bytes if ``keep``) of a member, or None (reported)."""
        if member in self.refused:
            return None
        if member not in self.infos:
            self.problems.append(f"{member}: missing from the wheel")
            return None
        h, n, kept = hashlib.sha256(), 0, []
        try:
            with self.wf.open(member) as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    n += len(chunk)
                    if keep:
                        kept.append(chunk)
        except self.errors as e:  # RECORD hash mismatch, damaged data
            self.problems.append(f"{member}: {e}")
            return None
        return h.hexdigest(), n, b"".join(kept)

    def small(self, member: str, cap: int) -> bytes | None:
        info = self.infos.get(member)
        if info is not None and info.file_size > cap and member not in self.refused:
            self.problems.append(f"{member}: {_index.too_large('it', info.file_size, cap)}")
            self.refused.add(member)
        got = self.stream(member, keep=True)
        return None if got is None else got[2]


def _entry_point(rd: _Reader, path: Path) -> tuple[str, str]:
    eps = [n for n in rd.infos if n.endswith(".dist-info/entry_points.txt")]
    pkg = name = None
    text = (rd.small(eps[0], _index.MAX_META_BYTES) or b"") if eps else b""
    section = None
    for line in text.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif section == _index.ENTRY_POINT_GROUP and "=" in line:
            name, _, pkg = (x.strip() for x in line.partition("="))
    if pkg is None or name is None:
        raise BundleError(
            f"{path}: no {_index.ENTRY_POINT_GROUP} entry point: not a quack bundle", path=str(path)
        )
    try:
        want = _index.package_name(name)
    except ValueError as e:
        raise BundleError(f"{path}: entry point name: {e}", path=str(path)) from None
    if pkg != want:
        raise BundleError(
            f"{path}: its entry point names package {pkg!r}; a bundle's is its own ({want!r}), "
            f"and the runtime refuses any other",
            path=str(path),
        )
    return pkg, name


def _check_members(infos: dict[str, zipfile.ZipInfo], problems: list[str]) -> set[str]:
    """Step 1: names and declared sizes from the central directory. The refused set."""
    refused = set()
    for n, info in infos.items():
        why = name_problem(n)
        cap = _cap(n, None)
        if not why and info.file_size > cap:
            why = _index.too_large("it", info.file_size, cap)
        if why:
            problems.append(f"member {n!r}: {why}")
            refused.add(n)
    return refused


def inspect_wheel(path: Path, trusted=None) -> dict:
    """What a bundle wheel holds, checked without installing it (see the module's
    docstring for what is checked, in which order). Raises BundleError when it is not
    a readable bundle wheel at all."""
    from quack_build.bundle.wheel import wheelfile_api

    WheelFile, WheelError = wheelfile_api()
    problems: list[str] = []
    with _open_regular(path) as f:
        infos = _members(path, problems, f)
        refused = _check_members(infos, problems)
        record = [n for n in refused if n.endswith(".dist-info/RECORD")]
        if record:
            raise BundleError(f"{path}: {record[0]} refused, nothing can be checked: " + "; ".join(problems))
        try:
            wf = WheelFile(path, "r")  # by name: it parses the wheel's file name
        except (OSError, WheelError, ValueError, zipfile.BadZipFile) as e:
            raise BundleError(f"{path}: not a readable wheel ({e})", path=str(path)) from None
        if not _same_file(f, wf.fp):  # replaced since it was checked: what was read is not this
            wf.close()
            raise BundleError(
                f"{path}: replaced while it was being read; run the command again", path=str(path)
            )
    with wf:
        rd = _Reader(wf, infos, problems, refused)
        pkg, ep_name = _entry_point(rd, path)
        distinfo = wf.dist_info_path
        idx_member, sig_member = f"{pkg}/{_index.INDEX_NAME}", f"{pkg}/{_index.SIG_NAME}"
        data = rd.small(idx_member, _index.MAX_INDEX_BYTES)
        if data is None:
            raise BundleError(f"{path}: {idx_member} unreadable: " + "; ".join(problems), path=str(path))
        signer, signed, verified = "", sig_member in infos, False
        if signed:
            from quack.bundles import trust

            sig = rd.small(sig_member, _index.MAX_SIG_BYTES) or b""
            try:
                signer, raw = trust.parse_signature(sig, _index.SIG_NAME)
                if trusted is not None:
                    trusted.verify(signer, data, raw)  # over the raw bytes, before parsing
                    verified = True
            except Exception as e:  # noqa: BLE001 - BundleError / SignatureError: reported
                problems.append(f"signature: {e}")
        elif trusted is not None:
            problems.append("not signed, and trusted keys are configured")
        idx = None if trusted is not None and not verified else _index.parse(data)
        rows = [_entry_row(rd, pkg, ent) for ent in idx.entries] if idx is not None else []
        for r in rows:
            problems.extend(f"{r['kernel']} key {r['key'][:16]}: {b}" for b in r["problems"])
        expected = {f"{pkg}/__init__.py", idx_member, sig_member}
        if idx is not None:
            for ent in idx.entries:
                expected.update(f"{pkg}/{rel}" for rel in (ent.rel_obj, ent.rel_meta))
                if ent.so_sha256 is not None:
                    expected.update(f"{pkg}/{rel}" for rel in (ent.rel_so, ent.rel_so_meta))
        for n in sorted(infos):
            if n in refused or n.endswith("/") or n in expected:
                continue
            if n.startswith(f"{distinfo}/"):
                if n != wf.record_path:
                    rd.stream(n)  # RECORD's hash for it
            elif n.startswith(f"{pkg}/"):
                if idx is not None:
                    problems.append(f"{n}: in the bundle's package but not written by quack bundle")
            else:
                problems.append(
                    f"{n}: outside the bundle's package {pkg}/ and {distinfo}/ (pip would install it)"
                )
        version = idx.version if idx is not None else wf.parsed_filename.group("ver")
    return {
        "wheel": str(path),
        "name": idx.name if idx is not None else ep_name,
        "version": version,
        "package": pkg,
        "entry_point": ep_name,
        "created": idx.created if idx is not None else 0.0,
        "quack": idx.quack if idx is not None else "",
        "tune_gpu": (
            {"models": list(idx.tune_gpu[0]), "source": idx.tune_gpu[1]}
            if idx is not None and idx.tune_gpu is not None
            else None
        ),
        "signed": signed,
        "signer": signer,
        "entries": rows,
        "stamps": idx.stamps if idx is not None else [],
        "bytes": idx.bytes if idx is not None else 0,
        "wheel_bytes": os.path.getsize(path),
        "problems": problems,
        "ok": not problems,
    }


def _entry_row(rd: _Reader, pkg: str, ent) -> dict:
    bad: list[str] = []
    files = [("object", ent.rel_obj, ent.size, ent.sha256)]
    if ent.so_sha256 is not None:
        files.append(("shared object", ent.rel_so, ent.so_size, ent.so_sha256))
    for label, rel, size, sha in files:
        member = f"{pkg}/{rel}"
        info = rd.infos.get(member)
        if info is None:
            bad.append(f"{label} missing from the wheel")
        elif info.file_size != size:  # declared size, before a byte is read
            bad.append(f"{label} is {info.file_size} bytes in the wheel, the index says {size}")
        else:
            got = rd.stream(member)
            if got is not None and got[:2] != (sha, size):
                bad.append(f"{label} does not match the index")
    metas = [(ent.rel_meta, _index.check_meta)]
    if ent.so_sha256 is not None:
        metas.append((ent.rel_so_meta, _index.check_so_meta))
    for rel, check in metas:
        raw = rd.small(f"{pkg}/{rel}", _index.MAX_META_BYTES)
        problem = "metadata missing or unreadable" if raw is None else check(ent, raw)
        if problem:
            bad.append(f"metadata: {problem}")
    return {
        "kernel": ent.kernel,
        "params": ent.params,
        "arch": ent.arch,
        "key": ent.key,
        "stamp": ent.stamp,
        "current_stamp": keys.toolchain_stamp(ent.arch) == ent.stamp,
        "size": ent.size,
        "so_size": ent.so_size,
        "problems": bad,
    }
