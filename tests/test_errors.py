"""quack.errors: every exception is a QuackError with its standard base, keeps its fields
through pickle (they cross from compile workers to the caller), and the module imports
nothing from quack."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from quack import errors as E

# (instance, standard base the callers rely on, fields that must survive pickle)
CASES = [
    (E.SettingsError("bad", source="quack.toml", key="arch"), ValueError, ("source", "key")),
    (E.ParamError("bad n", kernel="k", param="n"), ValueError, ("kernel", "param")),
    (E.KernelDependencyError("k", "../x/", "no such file"), ValueError, ("kernel", "entry", "reason")),
    (E.UnknownKernel("nope", ("a", "b")), KeyError, ("name", "known")),
    (
        E.KernelNotPrebuilt("k", {"n": 4}, "sm_90a", "ab" * 32, "/c", '[[kernel]]\nname = "k"'),
        LookupError,
        ("kernel", "params", "arch", "key", "cache_dir", "manifest_line"),
    ),
    (
        E.CompileError("k", {"n": 4}, "sm_90a", "boom", "/log"),
        RuntimeError,
        ("kernel", "params", "arch", "detail", "log_path"),
    ),
    (
        E.PreloadError("pkg.heavy", "/p/quack.toml", "ImportError: no", kernel="k", arch="sm_90a"),
        RuntimeError,
        ("module", "source", "detail", "kernel", "arch"),
    ),
    (E.OccupancyError(0, 2, 128, 0, "no driver"), RuntimeError, ("device", "cluster_size", "reason")),
    (E.CacheError("unusable", path="/c"), OSError, ("path",)),
    (E.CacheWriteError("full", path="/c", reason="disk full", code=28), OSError, ("path", "reason", "code")),
    (E.CacheWarning("recovered"), UserWarning, ()),
    (
        E.OutputFileError("/tmp", "is a directory", option="--emit-manifest"),
        OSError,
        ("path", "reason", "option"),
    ),
    (E.LockTimeout("/c/x.lock", 30.0), TimeoutError, ("path", "timeout")),
    (
        E.CompileTimeout(
            "k", "cd" * 32, 60.0, external=True, setting="compile_timeout", limit=60.0, holder=42
        ),
        TimeoutError,
        ("kernel", "key", "seconds", "external", "setting", "limit", "holder"),
    ),
    (
        E.WorkerDied("k", {"n": 4}, "sm_90a", "ef" * 32, 1234, -9),
        RuntimeError,
        ("kernel", "params", "arch", "key", "pid", "exitcode", "signal", "transient"),
    ),
    (E.EntryVanished("/c/x.o vanished"), LookupError, ()),
    (E.LinkError("cc failed", "/c/x.o"), RuntimeError, ("obj",)),
    (E.ManifestError(["m.toml: a", "m.toml: b"]), ValueError, ("problems",)),
    (
        E.MeasureError("gemm", "tile_m=128", "CUDA error: unspecified launch failure", restarted=True),
        RuntimeError,
        ("kernel", "config", "reason", "restarted"),
    ),
    (
        E.TuningTableError("kernels/tuned/sm_90a.toml", "unknown field 'x'", row=3, field="x"),
        ValueError,
        ("path", "problem", "row", "field"),
    ),
    (
        E.KernelNotPrebuilt(
            "k", {"n": 4}, "sm_90a", "ab" * 32, "/c", "line", bundles=("b 1.0 (2 of 2 entries)",)
        ),
        LookupError,
        ("bundles", "manifest_line"),
    ),
    (E.BundleError("refused", bundle="b", path="/site/b/index.json"), ValueError, ("bundle", "path")),
    (E.SignatureError("bad", signer="ci-1", reason="bad-signature"), ValueError, ("signer", "reason")),
    (E.KeyFileError("missing", path="/k.pub", reason="missing"), ValueError, ("path", "reason")),
    (
        E.TomlFileError("/m.toml", "TOML syntax error", line=3, col=7),
        ValueError,
        ("path", "problem", "line", "col"),
    ),
    (
        E.KernelNotPrebuilt("k", {"n": 4}, "sm_90a", "ab" * 32, "/c", "line", reason="the cache is disabled"),
        LookupError,
        ("reason",),
    ),
    (
        E.KernelNotPrebuilt("k", {"n": 4}, "sm_90a", "ab" * 32, "/c", "line", tuned_for="GPU H100 (NVML)"),
        LookupError,
        ("tuned_for",),
    ),
    (
        E.CompileError("k", {"n": 4}, "sm_90a", "\x1b[91merror:\x1b[0m boom", transient=True),
        RuntimeError,
        ("detail", "transient"),
    ),
    (E.RemoteError("down", url="redis://h/0", reason="timeout"), OSError, ("url", "reason")),
    (
        E.ObjectRejected("refused", key="ab" * 32, reason="checksum", signer="ci-1"),
        ValueError,
        ("key", "reason", "signer"),
    ),
    (E.RemoteWarning("remote off"), UserWarning, ()),
    (
        E.SourceChanged("k", {"n": 1}, "sm_90a", ["mykernels.scale"], in_worker=True),
        RuntimeError,
        ("kernel", "params", "arch", "files", "transient"),
    ),
    (E.ExecutorError("no Ray", executor="ray", address="h:1"), RuntimeError, ("executor", "address")),
    (
        E.ToolchainMismatch(
            "refused",
            worker_stamp="a",
            coordinator_stamp="b",
            worker="actor 1",
            executor="ray",
            address="h:1",
        ),
        RuntimeError,
        ("worker_stamp", "coordinator_stamp", "worker", "executor", "address"),
    ),
]


@pytest.mark.parametrize("err,base,fields", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_quack_error_with_standard_base_pickles(err, base, fields):
    assert isinstance(err, E.QuackError)
    assert isinstance(err, base)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    for f in fields:
        assert getattr(back, f) == getattr(err, f), f


def test_every_exception_class_is_covered():
    """A new exception in errors.py must be added to CASES (CompilePending is control flow)."""
    defined = {
        name
        for name, obj in vars(E).items()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == E.__name__
    }
    covered = {type(c[0]).__name__ for c in CASES} | {"QuackError", "CompilePending"}
    assert defined == covered


def test_external_compile_timeout_names_the_setting_that_ended_the_wait():
    """Another process's lock awaited past lock_timeout or past compile_timeout (the
    smaller): the message names the one that applied and the holder's pid. It always
    blamed lock_timeout, also where the wait that ran out was compile_timeout's; a build
    files only the former as "not built: another process held the lock past lock_timeout"."""
    from quack_build.build.failures import cause

    by_lock = E.CompileTimeout("k", "cd" * 32, 600.0, external=True, holder=4242)
    by_compile = E.CompileTimeout("k", "cd" * 32, 5.0, external=True, setting="compile_timeout", holder=4242)
    unknown = E.CompileTimeout("k", "cd" * 32, 5.0, external=True, setting="compile_timeout")
    assert "another process (pid 4242) held the lock of k key cdcd" in str(by_lock)
    assert "past lock_timeout: QUACK_LOCK_TIMEOUT" in str(by_lock) and "compile_timeout" not in str(by_lock)
    assert "past compile_timeout: QUACK_COMPILE_TIMEOUT" in str(by_compile)
    assert "lock_timeout" not in str(by_compile) and "not compiled in this process" in str(by_compile)
    assert str(unknown).startswith("another process held the lock")
    own = E.CompileTimeout("k", "cd" * 32, 5.0, limit=5.0)
    assert own.setting == "compile_timeout" and not own.external
    assert (cause(by_lock), cause(by_compile), cause(own)) == ("lock", "compile", "compile")


def test_kernel_not_prebuilt_message_carries_the_manifest_line():
    err = E.KernelNotPrebuilt("k", {"n": 4}, "sm_90a", "ab" * 32, "/c", "LINE-FROM-RAISER")
    assert "LINE-FROM-RAISER" in str(err) and "quack build --arch sm_90a" in str(err)


def test_kernel_not_prebuilt_names_every_way_prebuilt_mode_is_set():
    """The error can't tell where prebuilt mode came from: its text named only QUACK_MODE,
    wrong for a run under pytest's --quack-prebuilt (or a quack.toml's mode)."""
    text = str(E.KernelNotPrebuilt("k", {"n": 4}, "sm_90a", "ab" * 32, "/c", "LINE"))
    assert "run without prebuilt mode" in text
    assert "QUACK_MODE=prebuilt" in text and "--quack-prebuilt" in text and "[runtime] mode" in text
    assert "unset QUACK_MODE" not in text


def test_compile_pending_is_not_an_exception():
    p = pickle.loads(pickle.dumps(E.CompilePending("k", "ef" * 32)))
    assert not isinstance(p, Exception) and p.kernel == "k"


def test_errors_imports_nothing_from_quack():
    tree = ast.parse(Path(E.__file__).read_bytes())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in errors.py"
            mods.add(node.module or "")
    assert not {m for m in mods if m.split(".")[0] in ("quack", "quack_build", "quack_kernels")}
    # And importing it alone loads no other quack module.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, quack.errors; print(sorted(m for m in sys.modules if m.startswith('quack')))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == "['quack', 'quack.errors']"
