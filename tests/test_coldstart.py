"""Cold start (issue 15): the source-fingerprint memo that lets a fresh process parse
nothing, and the safety it must keep: an edit is always seen, damage is a miss plus one
warning, nothing is followed through a symlink. Unit tests on real files, then real
fresh processes with a real compile."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from quack.cache import fpmemo, keys
from quack.errors import CacheWarning


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "src"
    p = root / "csk"
    p.mkdir(parents=True)
    (p / "__init__.py").write_text("")
    (p / "_common.py").write_text("X = 1\n")
    (p / "softmax.py").write_text(
        textwrap.dedent("""
        from . import _common
        def compile_softmax():
            from csk import _later   # lazy import, as kernels do
            return _common.X
    """)
    )
    (p / "_later.py").write_text("Z = 1  # pad: aaaa\n")
    monkeypatch.syspath_prepend(str(root))
    keys.source_fingerprint.cache_clear()
    yield p
    keys.source_fingerprint.cache_clear()
    for m in [m for m in sys.modules if m.startswith("csk")]:
        del sys.modules[m]
    importlib.invalidate_caches()


@pytest.fixture
def root(tmp_path):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def no_racy_window(monkeypatch):
    """Unit tests write their sources just before fingerprinting them; the one-second
    racy window is tested on its own below."""
    monkeypatch.setattr(fpmemo, "RACY_NS", 0)


def fresh_fp(memo=None, module="csk.softmax"):
    """What a fresh process computes: no in-process memo."""
    keys.source_fingerprint.cache_clear()
    return keys.source_fingerprint(module, memo=memo)


def rec_path(m, pkg, name="softmax"):
    """The memo's file for csk.<name> (one file per record)."""
    return m.path(f"csk.{name}", pkg / f"{name}.py")


def truth(module="csk.softmax"):
    return fresh_fp(None, module)


class Unparsed:
    """Fails the test if the imports are walked, a source parsed or hashed (the memo
    must answer: it re-stats, it never re-walks)."""

    def __init__(self, monkeypatch):
        from quack.cache import sources

        for mod, fn in (
            (keys, "coverage"),
            (keys, "_hash"),
            (sources, "coverage"),
            (sources, "imported_names"),
        ):
            monkeypatch.setattr(mod, fn, self._fail(fn))

    @staticmethod
    def _fail(fn):
        def fail(*a, **k):
            raise AssertionError(f"{fn}{a} called although the memo holds the fingerprint")

        return fail


def test_memo_survives_the_process_and_parses_nothing(pkg, root, no_racy_window, monkeypatch):
    want = truth()
    m1 = fpmemo.DiskFingerprintMemo(root)
    assert fresh_fp(m1) == want and (m1.hits, m1.misses) == (0, 1)
    assert m1.flush() is True and rec_path(m1, pkg).parent.parent == root / "srcfp"
    assert oct(rec_path(m1, pkg).stat().st_mode & 0o777) == "0o600"
    assert [f.name for f in m1.dir.iterdir()] == [rec_path(m1, pkg).name]
    m2 = fpmemo.DiskFingerprintMemo(root)  # a fresh process
    Unparsed(monkeypatch)
    assert fresh_fp(m2) == want and (m2.hits, m2.misses) == (1, 0)
    assert keys.source_fingerprint("csk.softmax", memo=m2) == want  # then the in-process memo
    assert m2.hits == 1


@pytest.mark.parametrize("edit", ["same_size_same_mtime", "helper", "lazy_helper", "new_inode"])
def test_an_edit_is_seen_by_the_next_process(pkg, root, no_racy_window, edit):
    before = truth()
    m1 = fpmemo.DiskFingerprintMemo(root)
    fresh_fp(m1)
    m1.flush()
    if edit == "same_size_same_mtime":  # size and mtime kept: only ctime tells
        f = pkg / "softmax.py"
        st = f.stat()
        f.write_text(f.read_text().replace("_common.X", "_common.Y"))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    elif edit == "helper":
        (pkg / "_common.py").write_text("X = 2\n")
    elif edit == "lazy_helper":
        (pkg / "_later.py").write_text("Z = 1  # pad: bbbb\n")
    else:  # an editor's save: a new file renamed over the old one
        tmp = pkg / ".softmax.py.new"
        tmp.write_text((pkg / "softmax.py").read_text() + "# saved\n")
        os.replace(tmp, pkg / "softmax.py")
    m2 = fpmemo.DiskFingerprintMemo(root)
    got = fresh_fp(m2)
    assert (m2.hits, m2.misses) == (0, 1)
    assert got == truth() and got != before


def test_a_new_module_in_the_package_is_a_miss(pkg, root, no_racy_window):
    """`from csk import _later` could resolve differently once a file appears beside it."""
    m1 = fpmemo.DiskFingerprintMemo(root)
    want = fresh_fp(m1)
    m1.flush()
    (pkg / "_unrelated.py").write_text("W = 1\n")
    m2 = fpmemo.DiskFingerprintMemo(root)
    assert fresh_fp(m2) == want == truth()
    assert (m2.hits, m2.misses) == (0, 1)


def test_racy_sources_are_not_memoized(pkg, root):
    """Files changed within RACY_NS of the computation may have changed while being read
    in the same timestamp tick: used in this process, never written to the memo."""
    m1 = fpmemo.DiskFingerprintMemo(root)
    want = fresh_fp(m1)
    assert want == truth()
    assert m1.flush() is False and not rec_path(m1, pkg).exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad_record", "another_record", "wrong_format"])
def test_a_damaged_memo_is_a_miss_with_one_warning_and_is_rewritten(pkg, root, no_racy_window, damage):
    m1 = fpmemo.DiskFingerprintMemo(root)
    want = fresh_fp(m1)
    fresh_fp(m1, "csk._common")
    m1.flush()
    path, other = rec_path(m1, pkg), rec_path(m1, pkg, "_common")
    texts = {path: path.read_text(), other: other.read_text()}
    for f, g in ((path, other), (other, path)):  # both records damaged: still one warning
        text = texts[f]
        if damage == "garbage":
            f.write_bytes(b"\x00\xff not json")
        elif damage == "truncated":
            f.write_text(text[: len(text) // 2])
        elif damage == "bad_record":
            doc = json.loads(text)
            doc["fp"] = 12345
            f.write_text(json.dumps(doc))
        elif damage == "another_record":  # the records swapped: each names the other module
            f.write_text(texts[g])
        else:
            f.write_text(json.dumps({"format": 99, "records": []}))
    m2 = fpmemo.DiskFingerprintMemo(root)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert fresh_fp(m2) == want
        assert fresh_fp(m2, "csk._common") == truth("csk._common")  # no second warning
    msgs = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
    assert len(msgs) == 1 and "fingerprint memo" in msgs[0] and str(path) in msgs[0]
    assert (m2.hits, m2.misses) == (0, 2)
    assert m2.flush() is True
    m3 = fpmemo.DiskFingerprintMemo(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh_fp(m3) == want and m3.hits == 1


def test_a_forged_fingerprint_for_changed_files_is_not_used(pkg, root, no_racy_window):
    """A record only answers while every file it names is exactly as recorded."""
    m1 = fpmemo.DiskFingerprintMemo(root)
    want = fresh_fp(m1)
    m1.flush()
    doc = json.loads(rec_path(m1, pkg).read_text())
    doc["fp"] = "0" * 16
    doc["files"][0][2] += 1  # a size that isn't the file's
    rec_path(m1, pkg).write_text(json.dumps(doc))
    m2 = fpmemo.DiskFingerprintMemo(root)
    assert fresh_fp(m2) == want and m2.misses == 1


def test_a_symlinked_memo_is_not_followed(pkg, root, tmp_path, no_racy_window):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "srcfp").symlink_to(elsewhere, target_is_directory=True)
    m1 = fpmemo.DiskFingerprintMemo(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh_fp(m1) == truth()
    assert m1.flush() is False
    assert list(elsewhere.iterdir()) == []


def test_a_read_only_cache_costs_only_time(pkg, root, no_racy_window):
    if os.geteuid() == 0:
        # root writes through 0500; a file where the directory should be fails for anyone
        (root / "srcfp").write_text("")
    else:
        root.chmod(0o500)
    try:
        m1 = fpmemo.DiskFingerprintMemo(root)
        assert fresh_fp(m1) == truth()
        assert m1.flush() is False
    finally:
        root.chmod(0o700)


def test_another_checkout_of_the_same_module_gets_its_own_record(
    pkg, root, tmp_path, no_racy_window, monkeypatch
):
    m1 = fpmemo.DiskFingerprintMemo(root)
    first = fresh_fp(m1)
    m1.flush()
    other = tmp_path / "other" / "csk"
    other.mkdir(parents=True)
    for f in pkg.iterdir():
        if f.is_file():
            (other / f.name).write_text(f.read_text().replace("X = 1", "X = 7"))
    for m in [m for m in sys.modules if m.startswith("csk")]:
        del sys.modules[m]
    monkeypatch.syspath_prepend(str(other.parent))
    importlib.invalidate_caches()
    m2 = fpmemo.DiskFingerprintMemo(root)
    second = fresh_fp(m2)
    assert second != first and second == truth() and m2.misses == 1
    m2.flush()
    assert len(list(m2.dir.glob("*.memo"))) == 2


def test_a_lookup_reads_only_its_own_record(pkg, root, no_racy_window, monkeypatch):
    """A cache shared by many checkouts holds a record per (module, checkout): a fresh
    process's lookup opens one file, not all of them (the single-file layout read and
    checked 1024 records, 14-19 ms, before every process's first kernel)."""
    m1 = fpmemo.DiskFingerprintMemo(root)
    want = fresh_fp(m1)
    fresh_fp(m1, "csk._common")
    fresh_fp(m1, "csk._later")
    assert m1.flush() is True and len(list(m1.dir.glob("*.memo"))) == 3
    opened = []
    real = fpmemo.fsutil.read_nofollow
    monkeypatch.setattr(fpmemo.fsutil, "read_nofollow", lambda p: opened.append(p) or real(p))
    m2 = fpmemo.DiskFingerprintMemo(root)
    Unparsed(monkeypatch)
    assert fresh_fp(m2) == want and m2.hits == 1
    assert opened == [rec_path(m2, pkg)]


def test_the_oldest_records_go_beyond_the_limit_and_the_old_layout_is_removed(
    pkg, root, no_racy_window, monkeypatch
):
    monkeypatch.setattr(fpmemo, "MAX_RECORDS", 2)
    m1 = fpmemo.DiskFingerprintMemo(root)
    old_layout = root / "srcfp" / (m1.dir.name + ".memo")  # every record in one file
    old_layout.parent.mkdir(mode=0o700)
    old_layout.write_text('{"format": 1, "records": {}}')
    for i, name in enumerate(("softmax", "_common", "_later")):
        fresh_fp(m1, f"csk.{name}")
        assert m1.flush() is True
        os.utime(rec_path(m1, pkg, name), ns=(i * 10**9, i * 10**9))  # written in this order
    assert not old_layout.exists()
    # the oldest record (softmax) went when the third was written
    left = {f.name for f in m1.dir.glob("*.memo")}
    assert left == {rec_path(m1, pkg, "_common").name, rec_path(m1, pkg, "_later").name}
    m2 = fpmemo.DiskFingerprintMemo(root)
    assert fresh_fp(m2, "csk._later") == truth("csk._later") and m2.hits == 1
    assert fresh_fp(m2, "csk.softmax") == truth() and m2.misses == 1


# --- real fresh processes, a real compile ------------------------------------------

KERNEL = """
from quack import jit_cache
from quack.params import Bool, Dtype, Int


@jit_cache("cs_toy", params={"dtype": Dtype(), "block": Int(min=32, max=1024)})
def cs_toy(dtype: str, block: int = 128):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    dt = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[dtype]
    scale = 2.0  # pad: aaaa

    @cute.kernel
    def k(gx: cute.Tensor, gy: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * block + tidx
        if i < cute.size(gx, mode=[0]):
            gy[i] = (gx[i].to(cutlass.Float32) * scale).to(gy.element_type)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, stream):
        n = cute.size(x, mode=[0])
        k(x, y).launch(grid=((n + block - 1) // block, 1, 1), block=(block, 1, 1), stream=stream)

    n = cute.sym_int()
    x = make_fake_tensor(dt, (n,), stride=(1,))
    y = make_fake_tensor(dt, (n,), stride=(1,))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, y, stream, options="--enable-tvm-ffi")
"""

CHILD = r"""
import json, sys
from quack.errors import KernelNotPrebuilt
from quack.cache import fpmemo, keys
from quack import registry
import cskern.toy as toy
out = {}
try:
    fn = toy.cs_toy("bfloat16", 128)
    out["loaded"] = type(fn).__name__
    out["how"] = toy.cs_toy.usage()[0]["how"]
except KernelNotPrebuilt as e:
    out["not_prebuilt"] = e.key
from quack import settings
m = fpmemo.for_root(settings.get().cache_dir)  # the memo the registry uses
out["fp"] = registry.get("cs_toy").source_fingerprint()
out["memo"] = [m.hits, m.misses]
keys.source_fingerprint.cache_clear()
out["truth"] = keys.source_fingerprint("cskern.toy")  # no memo: parsed and hashed
out["cutlass_imported"] = "cutlass" in sys.modules
print(json.dumps(out))
"""


def _child(env, timeout=600):
    r = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_edit_between_two_fresh_processes_is_a_miss_never_a_wrong_load(tmp_path):
    src = tmp_path / "src"
    (src / "cskern").mkdir(parents=True)
    (src / "cskern" / "__init__.py").write_text("")
    toy = src / "cskern" / "toy.py"
    toy.write_text(KERNEL)
    cache = tmp_path / "cache"
    env = dict(
        os.environ,
        QUACK_CACHE_DIR=str(cache),
        QUACK_ARCH="sm_90a",
        QUACK_MODE="jit",
        PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    )
    # The package's __pycache__ exists before the racy window starts, as after any first
    # import: its creation changes the package directory, and a directory changed within the
    # window is not memoized (the first run would then depend on PYTHONDONTWRITEBYTECODE).
    import compileall

    assert compileall.compile_dir(str(src / "cskern"), quiet=1)
    time.sleep(fpmemo.RACY_NS / 1e9 + 0.1)  # the sources are older than the racy window
    # 1: a miss, compiled by a worker; the fingerprint is computed and memoized at exit.
    a = _child(env)
    assert a["loaded"] == "Function" and a["memo"] == [0, 1] and a["fp"] == a["truth"]
    assert len(list((cache / "srcfp").glob("*/*.memo"))) == 1
    # 2: prebuilt, a fresh process: the fingerprint comes from the memo; no compiler.
    pre = dict(env, QUACK_MODE="prebuilt")
    b = _child(pre)
    assert b["memo"] == [1, 0] and b["fp"] == a["fp"] == b["truth"]
    assert b["how"] == "so" and b["cutlass_imported"] is False
    # 3: the kernel is edited, same size, mtime put back: the next process must see it.
    st = toy.stat()
    toy.write_text(KERNEL.replace("scale = 2.0  # pad: aaaa", "scale = 3.0  # pad: bbbb"))
    os.utime(toy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (toy.stat().st_size, toy.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    c = _child(pre)
    assert c["memo"] == [0, 1]
    assert c["fp"] == c["truth"] != a["fp"]
    assert "not_prebuilt" in c and "loaded" not in c, "the old object must not load for new source"
    assert c["cutlass_imported"] is False


# --- the CLI: `quack build` and `quack cache stats` see an edit through the memo ------


def _quack(args, cwd, env):
    r = subprocess.run(
        [sys.executable, "-m", "quack_build", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_cli_build_and_stats_see_an_edit_through_the_memo(tmp_path):
    proj = tmp_path / "proj"
    (proj / "cskern").mkdir(parents=True)
    (proj / "cskern" / "__init__.py").write_text("")
    toy = proj / "cskern" / "toy.py"
    toy.write_text(KERNEL)
    (proj / "quack.toml").write_text('[build]\nkernel_packages = ["cskern"]\nmanifests = ["m.toml"]\n')
    (proj / "m.toml").write_text(
        '[[kernel]]\nname = "cs_toy"\n[kernel.params]\ndtype = "float16"\nblock = 64\n'
    )
    cache = tmp_path / "cache"
    env = dict(
        {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")},
        QUACK_CACHE_DIR=str(cache),
        QUACK_ARCH="sm_90a",
        PYTHONPATH=os.pathsep.join([str(proj), os.environ.get("PYTHONPATH", "")]),
    )
    # __pycache__ made before the racy window, as in the test above: created by the build's
    # own import it would change the package directory inside the window, and nothing
    # would be memoized where bytecode is written (the H200 run without
    # PYTHONDONTWRITEBYTECODE failed here with no memo file).
    import compileall

    assert compileall.compile_dir(str(proj / "cskern"), quiet=1)
    time.sleep(fpmemo.RACY_NS / 1e9 + 0.1)  # older than the racy window: the memo records them

    def stats():
        t = json.loads(_quack(["cache", "stats", "--json"], proj, env).stdout)["totals"]
        return t["current_entries"], t["stale_entries"]

    _quack(["build", "-j", "1"], proj, env)
    memo = list((cache / "srcfp").glob("*/*.memo"))
    assert len(memo) == 1 and "cskern.toy@" in memo[0].read_text()
    assert stats() == (1, 0) and stats() == (1, 0)  # the second from the memo alone
    assert re.search(r'"cached":1\b', _quack(["build", "--json"], proj, env).stdout.replace(" ", ""))
    st = toy.stat()
    toy.write_text(KERNEL.replace("scale = 2.0  # pad: aaaa", "scale = 3.0  # pad: bbbb"))
    os.utime(toy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stats() == (0, 1)
    out = _quack(["build", "--json"], proj, env).stdout.replace(" ", "")
    assert re.search(r'"compiled":1\b', out) and re.search(r'"cached":0\b', out)


def test_toolchain_versions_read_from_the_header_match_importlib_metadata():
    """The stamp reads Version: directly (no email parse); it must name what md.version
    names, or every cache entry would move to another stamp directory."""
    import importlib.metadata as md

    t = keys.toolchain()
    assert t["cutlass_dsl"] == md.version("nvidia-cutlass-dsl")
    assert t["tvm_ffi"] == md.version("apache-tvm-ffi")
    assert md.version(f"nvidia-cutlass-dsl-libs-{t['libs']}")


# --- what a kernel module's import and a first hit pull in (issue 15) -----------------------

IMPORTS = r"""
import json, sys
mode = sys.argv[1]
def ours():
    return sorted(m for m in sys.modules if m.startswith(("quack.", "cutlass")))
import quack_kernels.softmax as sm
out = {"after_import": ours()}
from quack.runtime import loader  # a module of the first call anyway: no dlopen of its own
out["runtime_before"] = loader.runtime_load_s()
fn = sm.compile_softmax_fwd("bfloat16", 4096)
out["runtime_after"] = loader.runtime_load_s()
out["how"] = [u["how"] for u in sm.compile_softmax_fwd.usage()]
out["after_call"] = ours()
out["tvm_ffi"] = sorted(m for m in sys.modules if m.split(".")[0] == "tvm_ffi")
print(json.dumps(out))
"""

# Not needed to register a kernel: imported by its first call (settings, store, loader,
# keys, journal) or only by a miss (the miss policy, tier chain, the contract's
# Protocols, the pool).
FIRST_CALL = ("quack.settings", "quack.cache.store", "quack.cache.keys", "quack.runtime.loader")
MISS_ONLY = (
    "quack.runtime.miss",
    "quack.runtime.tiers",
    "quack.cache.contract",
    "quack.compile.pool",
    "quack.compile.builder",
    "quack.bundles.tier",
)
# What a hit imports of tvm_ffi: the lean subset (quack.runtime.ffi), not the ~35 modules
# of `import tvm_ffi` (dataclasses, structural, serialization, the C++ build helper, ...).
TVM_FFI_LEAN = {"tvm_ffi", "tvm_ffi.core", "tvm_ffi._ffi_api"} | {
    f"tvm_ffi.{m}"
    for m in ("libinfo", "registry", "_dtype", "error", "_tensor", "module", "_optional_torch_c_dlpack")
}


def _imports(env, mode, cwd):
    r = subprocess.run(
        [sys.executable, "-c", IMPORTS, mode],
        env=dict(env, QUACK_MODE=mode),
        cwd=str(cwd),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_kernel_module_imports_only_the_registry_and_a_hit_never_the_tier_chain(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")}
    env.update(QUACK_CACHE_DIR=str(tmp_path / "cache"), QUACK_ARCH="sm_90a")
    a = _imports(env, "jit", tmp_path)  # a real miss: compiled by a worker, published
    assert a["how"] == ["so"]
    for m in FIRST_CALL + MISS_ONLY:
        assert m not in a["after_import"], m
    assert "quack.registry" in a["after_import"] and "quack.runtime.jit" in a["after_import"]
    assert "quack.compile.pool" in a["after_call"]  # the miss went to the pool
    b = _imports(env, "prebuilt", tmp_path)  # a fresh process: a local hit
    assert b["how"] == ["so"]
    for m in FIRST_CALL + MISS_ONLY:
        assert m not in b["after_import"], m
    for m in FIRST_CALL:
        assert m in b["after_call"], m
    for m in MISS_ONLY:
        assert m not in b["after_call"], m
    assert not any(m.startswith("cutlass") for m in b["after_call"])
    assert set(b["tvm_ffi"]) == TVM_FFI_LEAN, sorted(set(b["tvm_ffi"]) ^ TVM_FFI_LEAN)
    # The runtime library's dlopen is timed once, by the hit that loaded it (the cold-start
    # benchmark's third-party share), and not before.
    assert b["runtime_before"] is None
    assert isinstance(b["runtime_after"], float) and b["runtime_after"] > 0


# --- issue 24: the memo holds every file and distribution the fingerprint covers ----------


@pytest.fixture
def with_dist(pkg, tmp_path, monkeypatch):
    """csk.softmax also imports an installed distribution (a dist-info lists its files)."""
    site = tmp_path / "site"
    (site / "cskdist").mkdir(parents=True)
    (site / "cskdist" / "__init__.py").write_text("D = 1\n")

    def install(version):
        info = site / f"cskdist-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cskdist\nVersion: {version}\n\n")
        (info / "RECORD").write_text(f"cskdist/__init__.py,,\n{info.name}/METADATA,,\n")
        return info

    install("1.0")
    monkeypatch.syspath_prepend(str(site))
    (pkg / "_later.py").write_text("import cskdist\nZ = 1  # pad: aaaa\n")
    yield site, install
    sys.modules.pop("cskdist", None)


def test_a_distribution_upgrade_is_seen_through_the_memo(with_dist, root, no_racy_window, monkeypatch):
    import shutil

    site, install = with_dist
    m1 = fpmemo.DiskFingerprintMemo(root)
    before = fresh_fp(m1)
    assert m1.flush() is True
    doc = json.loads(next(m1.dir.glob("*.memo")).read_text())
    assert [d[:2] for d in doc["dists"]] == [["cskdist", "1.0"]]
    m2 = fpmemo.DiskFingerprintMemo(root)
    with monkeypatch.context() as mp:
        Unparsed(mp)
        assert fresh_fp(m2) == before and m2.hits == 1  # a hit re-stats, never re-walks
    shutil.rmtree(site / "cskdist-1.0.dist-info")
    install("1.1")
    m3 = fpmemo.DiskFingerprintMemo(root)
    after = fresh_fp(m3)
    assert (m3.hits, m3.misses) == (0, 1) and after != before and after == truth()


def test_a_record_of_the_previous_format_is_a_silent_miss_and_is_rewritten(pkg, root, no_racy_window):
    """Format 2 covered the kernel's own package only: its fingerprint can't be trusted,
    but it is no damage either (no warning)."""
    m1 = fpmemo.DiskFingerprintMemo(root)
    want = fresh_fp(m1)
    m1.flush()
    doc = json.loads(rec_path(m1, pkg).read_text())
    doc["format"] = 2
    doc["fp"] = "0" * 16
    del doc["dists"]
    rec_path(m1, pkg).write_text(json.dumps(doc))
    m2 = fpmemo.DiskFingerprintMemo(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh_fp(m2) == want and (m2.hits, m2.misses) == (0, 1)
    assert m2.flush() is True and json.loads(rec_path(m1, pkg).read_text())["format"] == fpmemo.FORMAT


def test_kernels_of_one_module_with_different_depends_on_get_their_own_records(pkg, root, no_racy_window):
    (pkg / "extra.txt").write_text("e\n")
    m1 = fpmemo.DiskFingerprintMemo(root)
    plain = fresh_fp(m1)
    keys.source_fingerprint.cache_clear()
    extra = keys.source_fingerprint("csk.softmax", memo=m1, depends_on=("./extra.txt",))
    assert extra != plain and m1.flush() is True and len(list(m1.dir.glob("*.memo"))) == 2
    m2 = fpmemo.DiskFingerprintMemo(root)
    assert fresh_fp(m2) == plain
    keys.source_fingerprint.cache_clear()
    assert keys.source_fingerprint("csk.softmax", memo=m2, depends_on=("./extra.txt",)) == extra
    assert m2.hits == 2
