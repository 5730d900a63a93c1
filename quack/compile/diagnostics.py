"""The one line that says why a compile failed, out of a compiler's whole output.

CuTe DSL wraps its diagnostics in ANSI colour codes and ends them with generic
advice ("suggestion: Re-run with CUTE_DSL_SHOW_STACKTRACE=1 ..."); the last line
of the text is therefore the wrong summary. These helpers are pure text (no
cutlass, no torch): the build display and logs use them."""

from __future__ import annotations

import re

# CSI sequences (colours, cursor moves) and the two-byte escapes.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# A compiler diagnostic: "error: ...", "error[INTERNAL]: ...", MLIR's "loc(...): error: ...".
_DIAG = re.compile(r"^\s*(?:\S+:\s+)?(error(?:\[(?P<tag>[^\]]*)\])?):\s*(?P<msg>.*)$")
_STOP = re.compile(r"^\s*(?:error(?:\[[^\]]*\])?|warning|note|suggestion|hint):")
# The exception line Python's traceback ends with: "pkg.mod.SomeError: message".
_EXC = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Fault))(?::\s*(?P<msg>.*))?$"
)
_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _clip(line: str, limit: int) -> str:
    line = _CTRL.sub(lambda m: f"\\x{ord(m.group()):02x}", " ".join(line.split()))
    return line if len(line) <= limit else line[: limit - 3] + "..."


def first_error_line(detail: str, limit: int = 300) -> str:
    """The compiler's own first error (with its wrapped continuation lines), else the
    exception line a traceback ends with, else the last non-empty line; ANSI removed,
    whitespace collapsed, control characters escaped, at most ``limit`` characters.

    A generic wrapper diagnostic (``error[INTERNAL]: The compiler could not build
    valid IR``) yields to the specific plain ``error:`` that follows it."""
    lines = strip_ansi(detail or "").splitlines()
    diags: list[tuple[bool, str]] = []
    for i, ln in enumerate(lines):
        m = _DIAG.match(ln)
        if not m:
            continue
        indent = len(ln) - len(ln.lstrip())
        parts = [f"{m.group(1)}: {m.group('msg').strip()}"]
        for nxt in lines[i + 1 :]:
            if not nxt.strip() or _STOP.match(nxt) or len(nxt) - len(nxt.lstrip()) <= indent:
                break
            parts.append(nxt.strip())
        diags.append((m.group("tag") is None, " ".join(parts)))
    if diags:
        plain = [d for untagged, d in diags if untagged]
        return _clip(plain[0] if plain else diags[0][1], limit)
    for i in range(len(lines) - 1, -1, -1):
        m = _EXC.match(lines[i])
        if m:
            msg = (m.group("msg") or "").strip()
            if not msg:  # a multi-line message starts on the next line
                msg = next((ln.strip() for ln in lines[i + 1 :] if ln.strip()), "")
            return _clip(f"{m.group('type').rsplit('.', 1)[-1]}: {msg}" if msg else m.group("type"), limit)
    rest = [ln for ln in lines if ln.strip()]
    return _clip(rest[-1], limit) if rest else "failed"
