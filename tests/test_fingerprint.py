"""Per-kernel source fingerprints: an edit invalidates only what depends on it."""

import importlib
import sys
import textwrap

import pytest

from quack.cache import keys


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "src"
    p = root / "fpkern"
    p.mkdir(parents=True)
    (p / "__init__.py").write_text("")
    (p / "_common.py").write_text("X = 1\n")
    (p / "_other.py").write_text("Y = 1\n")
    (p / "softmax.py").write_text(
        textwrap.dedent("""
        def compile_softmax():
            from fpkern import _common   # lazy import, as kernels do
            return _common.X
    """)
    )
    (p / "rmsnorm.py").write_text(
        textwrap.dedent("""
        from . import _other
        def compile_rmsnorm():
            return _other.Y
    """)
    )
    monkeypatch.syspath_prepend(str(root))
    yield p
    for m in [m for m in sys.modules if m.startswith("fpkern")]:
        del sys.modules[m]
    importlib.invalidate_caches()


def fps():
    keys.source_fingerprint.cache_clear()
    return keys.source_fingerprint("fpkern.softmax"), keys.source_fingerprint("fpkern.rmsnorm")


def test_files_followed_transitively_and_lazily(pkg):
    assert sorted(keys.source_files("fpkern.softmax")) == ["fpkern", "fpkern._common", "fpkern.softmax"]
    assert sorted(keys.source_files("fpkern.rmsnorm")) == ["fpkern", "fpkern._other", "fpkern.rmsnorm"]


def test_editing_one_kernel_leaves_the_other(pkg):
    soft, rms = fps()
    (pkg / "softmax.py").write_text((pkg / "softmax.py").read_text() + "\n# tuned\n")
    soft2, rms2 = fps()
    assert soft2 != soft and rms2 == rms


def test_editing_a_shared_helper_invalidates_its_users_only(pkg):
    soft, rms = fps()
    (pkg / "_common.py").write_text("X = 2\n")
    soft2, rms2 = fps()
    assert soft2 != soft and rms2 == rms
    (pkg / "_other.py").write_text("Y = 3\n")
    soft3, rms3 = fps()
    assert soft3 == soft2 and rms3 != rms2


def test_toolchain_stamp_names_versions():
    t = keys.toolchain()
    stamp = keys.toolchain_stamp("sm_90a")
    assert stamp.startswith(f"py{t['python']}-cutlass{t['cutlass_dsl']}-{t['libs']}-")
    assert stamp.endswith("-sm_90a") and "/" not in stamp


def test_toolchain_change_moves_every_entry(monkeypatch):
    before = keys.toolchain_stamp("sm_90a")
    monkeypatch.setattr(
        keys,
        "toolchain",
        lambda: {"python": "3.11", "cutlass_dsl": "4.9.0", "libs": "cu12", "tvm_ffi": "0.1.15"},
    )
    assert keys.toolchain_stamp("sm_90a") != before


def test_edit_seen_without_clearing_the_memo(pkg):
    soft, _ = fps()
    assert keys.source_fingerprint("fpkern.softmax") == soft  # memoized
    (pkg / "_common.py").write_text("X = 12345  # longer\n")
    assert keys.source_fingerprint("fpkern.softmax") != soft  # a long-lived process sees the edit


def test_fingerprinting_imports_none_of_the_modules_it_reads(pkg):
    """``from .mod import name`` asks whether ``pkg.mod.name`` is a module; finding that
    out must not import ``pkg.mod`` (a kernel helper imports cutlass at its top: a process
    that only loads prebuilt objects would pay for it). Subpackages are still followed."""
    (pkg / "_heavy.py").write_text("raise RuntimeError('imported while fingerprinting')\nZ = 1\n")
    sub = pkg / "sub"
    sub.mkdir()
    (sub / "__init__.py").write_text("raise RuntimeError('imported while fingerprinting')\n")
    (sub / "leaf.py").write_text("W = 1\n")
    (pkg / "ce.py").write_text(
        textwrap.dedent("""
        from ._heavy import Z
        from .sub import leaf
        def compile_ce():
            from fpkern.sub.leaf import W
            return Z + leaf.W + W
    """)
    )
    before = set(sys.modules)
    files = keys.source_files("fpkern.ce")
    # (fpkern itself too: importing fpkern.ce runs fpkern/__init__.py first)
    assert sorted(files) == ["fpkern", "fpkern._heavy", "fpkern.ce", "fpkern.sub", "fpkern.sub.leaf"]
    assert files["fpkern._heavy"] == pkg / "_heavy.py" and files["fpkern.sub.leaf"] == sub / "leaf.py"
    assert not {m for m in set(sys.modules) - before if m.startswith("fpkern")}


def test_a_module_served_by_a_meta_path_finder_is_followed_without_importing(pkg, tmp_path, monkeypatch):
    """A dependency found by a finder on sys.meta_path (an editable install's, a zip's)
    counts as an import would see it: searching the parent's directory alone missed it,
    so an edit to it went unseen."""
    import importlib.abc
    import importlib.util

    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text("raise RuntimeError('imported while fingerprinting')\nQ = 1\n")

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "fpkern._elsewhere":
                return importlib.util.spec_from_file_location(name, elsewhere)
            return None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    (pkg / "mp.py").write_text("def compile_mp():\n    from ._elsewhere import Q\n    return Q\n")
    files = keys.source_files("fpkern.mp")
    assert files["fpkern._elsewhere"] == elsewhere
    assert "fpkern._elsewhere" not in sys.modules


# --- issue 24, item 3: what the fingerprint covers beyond the kernel's own package --------


def _dist(root, name, version, files, editable=False):
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files) + f"{info.name}/RECORD,,\n")
    if editable:
        (info / "direct_url.json").write_text('{"url": "file:///x", "dir_info": {"editable": true}}')


@pytest.fixture
def world(tmp_path, monkeypatch):
    """fpk (the kernel package) imports: fphelp (a package beside it), ppmod (another
    sys.path folder), json (stdlib), instdist (installed: a dist-info lists its files),
    edpkg (an editable install: its dist-info lists only a .pth, its files are elsewhere)."""
    proj, pp, site, edsrc = (tmp_path / d for d in ("proj", "pp", "site", "edsrc"))
    files = {
        proj / "fpk" / "__init__.py": "",
        proj / "fpk" / "k.py": "import json\nimport fphelp.a\ndef compile_k():\n"
        "    import ppmod, instdist, edpkg\n    return 1\n",
        proj / "fphelp" / "__init__.py": "",
        proj / "fphelp" / "a.py": "from . import b\n",
        proj / "fphelp" / "b.py": "B = 1\n",
        proj / "fphelp" / "unused.py": "U = 1\n",
        proj / "data" / "t.txt": "1\n",
        proj / "data" / "sub" / "u.txt": "2\n",
        pp / "ppmod.py": "P = 1\n",
        site / "instdist" / "__init__.py": "import instdist.inner\n",
        site / "instdist" / "inner.py": "I = 1\n",
        edsrc / "edpkg" / "__init__.py": "E = 1\n",
    }
    for f, text in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    _dist(site, "instdist", "1.0", ["instdist/__init__.py", "instdist/inner.py"])
    _dist(site, "edpkg", "0.3", ["__editable__.edpkg-0.3.pth"], editable=True)
    for d in (edsrc, site, pp, proj):
        monkeypatch.syspath_prepend(str(d))
    keys.source_fingerprint.cache_clear()
    yield {"proj": proj, "pp": pp, "site": site, "edsrc": edsrc}
    keys.source_fingerprint.cache_clear()
    for m in [m for m in sys.modules if m.split(".")[0] in ("fpk", "fphelp", "ppmod", "instdist", "edpkg")]:
        del sys.modules[m]
    importlib.invalidate_caches()


def fp(depends_on=()):
    keys.source_fingerprint.cache_clear()
    return keys.source_fingerprint("fpk.k", depends_on=tuple(depends_on), kernel="k")


def test_the_coverage_reaches_beyond_the_kernel_package(world):
    cov = keys.coverage("fpk.k")
    assert sorted(cov.files) == ["edpkg", "fphelp", "fphelp.a", "fphelp.b", "fpk", "fpk.k", "ppmod"]
    assert cov.files["edpkg"] == world["edsrc"] / "edpkg" / "__init__.py"  # editable: hashed
    assert {n: v for n, (v, _) in cov.dists.items()} == {"instdist": "1.0"}
    assert cov.dists["instdist"][1] == world["site"] / "instdist-1.0.dist-info" / "METADATA"


@pytest.mark.parametrize(
    "edit", ["fphelp/b.py", "pp/ppmod.py", "edsrc/edpkg/__init__.py", "version", "not_the_unused_module"]
)
def test_an_edit_outside_the_package_changes_the_fingerprint(world, edit):
    before = fp()
    if edit == "version":
        (world["site"] / "instdist-1.0.dist-info").rename(world["site"] / "instdist-1.1.dist-info")
        meta = world["site"] / "instdist-1.1.dist-info" / "METADATA"
        meta.write_text(meta.read_text().replace("Version: 1.0", "Version: 1.1"))
        rec = world["site"] / "instdist-1.1.dist-info" / "RECORD"
        rec.write_text(rec.read_text().replace("1.0", "1.1"))
        importlib.invalidate_caches()
    elif edit == "not_the_unused_module":
        (world["proj"] / "fphelp" / "unused.py").write_text("U = 2\n")
        (world["site"] / "instdist" / "inner.py").write_text("I = 2  # an installed file\n")
        assert fp() == before  # neither imported nor hashed: installed files go by version
        return
    else:
        root = world["proj"] if edit.startswith("fphelp") else world[edit.split("/")[0]]
        f = root / edit.split("/", 1)[1] if not edit.startswith("fphelp") else root / edit
        f.write_text(f.read_text() + "# edited\n")
    assert fp() != before


def test_a_launch_side_framework_is_not_covered_unless_declared(world, monkeypatch):
    """torch tensors reach a kernel at call time only: keyed on torch's version, every
    object built in CI (torch 2.13) was a miss on the H200 (torch 2.11)."""
    _dist(world["site"], "torch", "9.9", ["torch/__init__.py"])
    (world["site"] / "torch").mkdir()
    (world["site"] / "torch" / "__init__.py").write_text("T = 1\n")
    k = world["proj"] / "fpk" / "k.py"
    k.write_text(k.read_text() + "def op(x):\n    import torch\n    return torch\n")
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # found by the walk, never imported
    importlib.invalidate_caches()
    assert "torch" not in keys.coverage("fpk.k").dists
    cov = keys.coverage("fpk.k", ("torch",))
    assert cov.dists["torch"][0] == "9.9"


def test_depends_on_paths_and_modules(world):
    base = fp()
    with_deps = fp(["../data/", "fphelp"])
    assert with_deps != base
    cov = keys.coverage("fpk.k", ("../data/", "fphelp"))
    assert {"path:../data//t.txt", "path:../data//sub/u.txt", "fphelp.unused"} <= set(cov.files)
    (world["proj"] / "data" / "sub" / "new.txt").write_text("3\n")  # a new file deep inside
    assert fp(["../data/", "fphelp"]) != with_deps
    (world["proj"] / "fphelp" / "unused.py").write_text("U = 9\n")  # every module of a package
    assert fp(["../data/", "fphelp"]) != with_deps


@pytest.mark.parametrize(
    "entries, entry, says",
    [
        ("fphelp", "'fphelp'", "must be a list of strings"),
        ([3], "3", "non-empty string"),
        (["not a module!"], "not a module!", "neither a module name"),
        (["../nothing/here.py"], "../nothing/here.py", "no such file or directory"),
        (["no_such_module_xyz"], "no_such_module_xyz", "no module of this name"),
    ],
)
def test_a_bad_depends_on_entry_fails_registration_naming_kernel_and_entry(world, entries, entry, says):
    import pickle

    import fpk.k

    from quack import registry
    from quack.errors import KernelDependencyError

    with pytest.raises(KernelDependencyError) as ei:
        registry.register("fp_bad_deps", fpk.k.compile_k, {}, depends_on=entries)
    e = ei.value
    assert e.kernel == "fp_bad_deps" and e.entry == entry and says in str(e)
    assert str(e).startswith(f"kernel fp_bad_deps: depends_on entry {entry!r}: ")
    assert isinstance(e, ValueError) and str(pickle.loads(pickle.dumps(e))) == str(e)
    assert "fp_bad_deps" not in registry.all_specs()


def test_a_vanished_depends_on_entry_is_an_error_at_fingerprint_time(world):
    from quack.errors import KernelDependencyError

    (world["proj"] / "data" / "t.txt").rename(world["proj"] / "t.txt")
    with pytest.raises(KernelDependencyError, match="'../data/t.txt'.*no such file"):
        fp(["../data/t.txt"])
