"""Reading a TOML file that may be hostile: manifests and quack.toml.

The file must be a regular file (a FIFO would block the reader forever,
``/dev/zero`` never ends) of at most ``MAX_BYTES`` (16 MiB), UTF-8 without a
byte-order mark, nested at most ``MAX_DEPTH`` arrays / inline tables deep (the
parser recurses per level: 5,000 levels end in RecursionError). Every problem is
a TomlFileError naming the file and, where known, the line and column, with an
excerpt of the line cut to a readable length and its control characters escaped."""

from __future__ import annotations

import os
import re
import stat
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from quack.errors import TomlFileError
from quack.filekind import describe

MAX_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 64
EXCERPT = 100  # characters of a line shown around an error column

_POS = re.compile(r"\s*\(at line (\d+), column (\d+)\)")
_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029\ufeff]")
_TOKEN = re.compile(r'"""|\'\'\'|"|\'|#|[\[\]{}]|\n')
_STRINGS = {
    '"""': re.compile(r'"""(?:\\.|[^\\])*?"""', re.S),
    "'''": re.compile(r"'''.*?'''", re.S),
    '"': re.compile(r'"(?:\\.|[^"\\\n])*"'),
    "'": re.compile(r"'[^'\n]*'"),
}


def read_bytes(path: Path | str, what: str = "file") -> bytes:
    """The file's bytes: a regular file of at most MAX_BYTES, else TomlFileError. Opened
    non-blocking, so a FIFO is refused instead of waiting for a writer."""
    p = str(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TomlFileError(p, f"no such {what}") from None
    except IsADirectoryError:
        raise TomlFileError(p, f"is a directory, not a {what}") from None
    except OSError as e:
        raise TomlFileError(p, f"cannot read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TomlFileError(p, f"is {describe(st.st_mode)}, not a {what}: give a regular file")
        if st.st_size > MAX_BYTES:
            raise TomlFileError(
                p,
                f"is {st.st_size} bytes; a {what} may be at most {MAX_BYTES} bytes "
                f"(16 MiB): split it into several files",
            )
        chunks, total = [], 0
        while True:  # bounded even if the file grows while we read it
            b = os.read(fd, min(1 << 20, MAX_BYTES + 1 - total))
            if not b:
                break
            chunks.append(b)
            total += len(b)
            if total > MAX_BYTES:
                raise TomlFileError(p, f"is larger than {MAX_BYTES} bytes (16 MiB), the limit for a {what}")
        return b"".join(chunks)
    except OSError as e:
        raise TomlFileError(p, f"cannot read ({e.strerror})") from None
    finally:
        os.close(fd)


def escape(text: str) -> str:
    """Control characters (NUL, ESC, ...) as \\xNN: shown, never sent raw to a terminal."""
    return _CTRL.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}", text
    )


def excerpt(line: str, col: int = 0) -> tuple[str, int]:
    """(shown, caret): ``line`` cut to about EXCERPT characters around ``col`` (1-based)
    with control characters escaped (a 5 MB line or a NUL must not reach the terminal
    whole), and the offset of ``col`` in what is shown."""
    col = max(1, col or 1)
    start = max(0, col - 1 - EXCERPT // 2) if len(line) > EXCERPT else 0
    head = "..." if start else ""
    tail = "..." if start + EXCERPT < len(line) else ""
    return head + escape(line[start : start + EXCERPT]) + tail, len(head) + len(escape(line[start : col - 1]))


def _too_deep(text: str, limit: int) -> tuple[int, int] | None:
    """(line, column) where arrays / inline tables nest deeper than ``limit``, skipping
    strings and comments; None if they never do."""
    depth, pos, line, line_start = 0, 0, 1, 0
    while True:
        m = _TOKEN.search(text, pos)
        if m is None:
            return None
        t = m.group()
        pos = m.end()
        if t == "\n":
            line, line_start = line + 1, pos
        elif t in ("[", "{"):
            depth += 1
            if depth > limit:
                return line, m.start() - line_start + 1
        elif t in ("]", "}"):
            depth = max(0, depth - 1)
        elif t == "#":
            nl = text.find("\n", pos)
            pos = len(text) if nl < 0 else nl
        else:  # a string: skip to its end (multi-line ones count their newlines)
            sm = _STRINGS[t].match(text, m.start())
            if sm:
                end = sm.end()
            elif len(t) == 3:  # unterminated: the parser reports it
                end = len(text)
            else:
                end = text.find("\n", pos)
                end = len(text) if end < 0 else end
            line += text.count("\n", pos, end)
            nl = text.rfind("\n", pos, end)
            if nl >= 0:
                line_start = nl + 1
            pos = end


def loads(text: str, path: Path | str) -> dict:
    """Parse ``text`` (the contents of ``path``); TomlFileError on any problem."""
    p = str(path)
    if text.startswith("\ufeff"):
        raise TomlFileError(
            p,
            "starts with a UTF-8 byte-order mark (BOM), which TOML does not allow: "
            "save the file as UTF-8 without BOM",
            line=1,
            col=1,
        )
    deep = _too_deep(text, MAX_DEPTH)
    if deep is not None:
        raise TomlFileError(
            p, f"arrays / inline tables nested more than {MAX_DEPTH} deep", line=deep[0], col=deep[1]
        )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = _POS.search(msg)
        line = getattr(e, "lineno", None) or (int(m.group(1)) if m else 0)
        col = getattr(e, "colno", None) or (int(m.group(2)) if m else 0)
        bare = _POS.sub("", getattr(e, "msg", msg)).strip()
        snippet = ""
        lines = text.splitlines() if line else []
        if 0 < line <= len(lines):
            shown, caret = excerpt(lines[line - 1], col)
            snippet = f"\n    {shown}\n    {' ' * caret}^"
        raise TomlFileError(p, f"TOML syntax error: {bare}{snippet}", line=line, col=col) from None
    except RecursionError:  # a nesting the depth scan missed
        raise TomlFileError(p, "nested too deeply to parse") from None


def load(path: Path | str, what: str = "TOML file") -> dict:
    """Read and parse ``path`` safely (see the module doc); TomlFileError on any problem."""
    data = read_bytes(path, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TomlFileError(
            str(path), f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})", line=line
        ) from None
    return loads(text, path)
