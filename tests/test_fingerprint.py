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
    assert sorted(files) == ["fpkern._heavy", "fpkern.ce", "fpkern.sub", "fpkern.sub.leaf"]
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
