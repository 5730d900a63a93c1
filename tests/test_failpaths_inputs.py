"""Hostile manifests and quack.toml (issue 9, bug 5 and the error-message friction):
deep nesting, FIFOs, devices, oversized files, a BOM, a 5 MB line, a NUL. Every one
ends at once with exit 1 and a file:line message; nothing hangs, nothing reads without
limit, no traceback. Real CLI subprocesses, each under a time-out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from reliability_support import env, run_quack, write_toy_project

from quack import tomlfile

NESTED = {
    "inline-tables": "x = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n",
    "arrays": "x = " + "[" * 50000 + "]" * 50000 + "\n",
}


def _cli(args, cwd: Path, timeout: float = 60):
    r = run_quack(args, cwd=cwd, timeout=timeout, env_=env(QUACK_CACHE_DIR=cwd / "cache"))
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "RecursionError" not in out, out[-3000:]
    return r.returncode, out


@pytest.mark.parametrize("kind", sorted(NESTED))
def test_deeply_nested_manifest(tmp_path, kind):
    write_toy_project(tmp_path)
    m = tmp_path / "deep.toml"
    m.write_text('[[kernel]]\nname = "toy_scale"\n' + NESTED[kind])
    for cmd in (["build", "--dry-run", str(m)], ["verify", "--no-load", str(m)]):
        rc, out = _cli(cmd, tmp_path)
        assert rc == 1, out
        assert f"{m}:3:" in out and f"nested more than {tomlfile.MAX_DEPTH} deep" in out, out


@pytest.mark.parametrize("kind", sorted(NESTED))
def test_deeply_nested_quack_toml_in_every_command(tmp_path, kind):
    (tmp_path / "quack.toml").write_text(
        "[build]\nmanifests = []\n"
        + NESTED[kind].replace("x =", "# x =")
        + "[runtime]\n"
        + NESTED[kind].replace("x =", "arch =")
    )
    cfg = tmp_path / "quack.toml"
    for cmd in (
        ["cache", "stats"],
        ["cache", "stats", "--json"],
        ["cache", "clean"],
        ["build"],
        ["verify"],
        ["prewarm", "--dry-run"],
    ):
        rc, out = _cli(cmd, tmp_path)
        assert rc == 1, (cmd, out)
        assert f"{cfg}:5:" in out and "nested more than" in out, (cmd, out)


def test_fifo_and_devices_refused_at_once(tmp_path):
    write_toy_project(tmp_path)
    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    for path, kind in (
        (fifo, "a FIFO"),
        (Path("/dev/zero"), "a character device"),
        (tmp_path, "a directory"),
    ):
        rc, out = _cli(["build", "--dry-run", str(path)], tmp_path, timeout=30)
        assert rc == 1, out
        assert f"{path}: is {kind}" in out and "regular file" in out, out


def test_quack_toml_fifo_refused(tmp_path):
    os.mkfifo(tmp_path / "quack.toml")
    rc, out = _cli(["cache", "stats"], tmp_path, timeout=30)
    assert rc == 1 and f"{tmp_path / 'quack.toml'}: is a FIFO" in out, out


def test_oversized_manifest_refused_without_reading_it(tmp_path):
    write_toy_project(tmp_path)
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:  # sparse: 16 MiB + 1 byte of nothing
        f.truncate(tomlfile.MAX_BYTES + 1)
    rc, out = _cli(["build", "--dry-run", str(big)], tmp_path)
    assert rc == 1 and f"{big}: is {tomlfile.MAX_BYTES + 1} bytes" in out and "16 MiB" in out, out


def test_bom_long_line_and_nul_reported_readably(tmp_path):
    write_toy_project(tmp_path)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b'\xef\xbb\xbf[[kernel]]\nname = "toy_scale"\n')
    rc, out = _cli(["build", "--dry-run", str(bom)], tmp_path)
    assert rc == 1 and f"{bom}:1:1: starts with a UTF-8 byte-order mark (BOM)" in out, out

    long = tmp_path / "long.toml"
    long.write_text('[[kernel]]\nname = "' + "y" * 5_000_000 + '" oops\n')
    rc, out = _cli(["build", "--dry-run", str(long)], tmp_path)
    assert rc == 1 and f"{long}:2:" in out and "TOML syntax error" in out, out[:500]
    assert len(out) < 2000, f"the 5 MB line was echoed ({len(out)} characters)"

    nul = tmp_path / "nul.toml"
    nul.write_bytes(b'[[kernel]]\nname = "toy\x00scale"\n')
    rc, out = _cli(["build", "--dry-run", str(nul)], tmp_path)
    assert rc == 1 and f"{nul}:2:" in out and "\\x00" in out and "\x00" not in out, out


def _rel_project(d: Path, tables: int, per_table: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text('[build]\nkernel_packages = ["relkernels"]\n')
    m = d / "m.toml"
    m.write_text(
        "".join(
            f'[[kernel]]\nname = "rel_copy"\nparams = {{ i = {list(range(per_table))} }}\n'
            for _ in range(tables)
        )
    )
    return m


def test_total_configurations_capped_across_tables(tmp_path):
    """Many tables each under the limit: the total after expansion is capped (exit 1 at
    once, naming the table that crossed it and --max-configs); raising the limit works."""
    m = _rel_project(tmp_path, tables=30, per_table=7800)  # 234,000 configurations
    rc, out = _cli(["build", "--dry-run", str(m)], tmp_path)
    assert rc == 1, out[-2000:]
    assert out.count("over the limit") == 1, out[-2000:]
    assert "[[kernel]] #2 (rel_copy): the cross product has 7800 configurations" in out
    assert "the tables before it already expand to 7800" in out and "--max-configs" in out
    assert len(out) < 3000

    m = _rel_project(tmp_path / "small", tables=6, per_table=1000)
    rc, out = _cli(["build", "--dry-run", "--max-configs", "5000", str(m)], tmp_path / "small")
    assert rc == 1 and "[[kernel]] #6" in out and "over the limit of 5000" in out, out[-2000:]
    rc, out = _cli(["build", "--dry-run", "--max-configs", "6000", str(m)], tmp_path / "small")
    assert rc == 0, out[-2000:]
    assert "6000 configurations" not in out and "1000 configurations (5000 duplicates dropped)" in out


def test_bad_values_one_error_per_problem(tmp_path):
    """Thousands of bad values in one list are one problem (a few shown, then a count);
    a bad value is not also reported as a missing parameter."""
    write_toy_project(tmp_path)
    m = tmp_path / "bad.toml"
    m.write_text(
        f'[[kernel]]\nname = "toy_scale"\nparams = {{ dtype = "int8", block = {list(range(2000, 7000))} }}\n'
    )
    rc, out = _cli(["build", "--dry-run", str(m)], tmp_path)
    assert rc == 1, out
    assert "3 problems" not in out and "missing parameter" not in out, out
    assert out.count("is not allowed for kernel toy_scale") == 4  # dtype + 3 of the blocks
    assert "params.block: 4997 more of its 5000 values are not allowed either" in out


def test_prewarm_emit_manifest_with_empty_journal_exits_1(tmp_path):
    write_toy_project(tmp_path)
    out_m = tmp_path / "used.toml"
    rc, out = _cli(["prewarm", "--emit-manifest", str(out_m)], tmp_path)
    assert rc == 1 and "nothing to emit" in out and not out_m.exists(), out
