"""Run-time failure paths: prebuilt mode never compiles, whatever the cache's state;
a failed compile is remembered per process (bugs 2 and 4 of issue 9)."""
from __future__ import annotations

import warnings

import pytest

import relkernels
from conftest import use_settings
from quack.errors import KernelNotPrebuilt
from quack.errors import CacheWarning


@pytest.fixture
def counter(tmp_path, monkeypatch):
    """Every rel_copy compile appends a line here (real counting, no mock)."""
    c = tmp_path / "compiles.txt"
    monkeypatch.setenv("QUACK_TEST_COUNTER", str(c))
    monkeypatch.setenv("QUACK_TEST_OBJ", "/nonexistent")  # an export would fail loudly
    return lambda: len(c.read_text().splitlines()) if c.exists() else 0


def _call_prebuilt(i: int):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(KernelNotPrebuilt) as ei:
            relkernels.rel_copy(i)
    return ei.value, [str(x.message) for x in w if issubclass(x.category, CacheWarning)]


def test_prebuilt_with_cache_disabled_raises(quack_settings, counter):
    use_settings(mode="prebuilt", cache_enabled=False)
    err, warned = _call_prebuilt(11)
    assert counter() == 0
    assert "cache is disabled" in str(err) and "QUACK_CACHE_ENABLED" in str(err)
    assert err.kernel == "rel_copy" and err.params == {"i": 11}
    assert warned == []


@pytest.mark.parametrize("how", ["world-writable", "symlink"])
def test_prebuilt_with_unusable_cache_raises_with_one_warning(quack_settings, counter, tmp_path, how):
    real = tmp_path / "real"
    real.mkdir()
    if how == "world-writable":
        real.chmod(0o777)
        root = real
    else:
        root = tmp_path / "link"
        root.symlink_to(real, target_is_directory=True)
    use_settings(mode="prebuilt", cache_dir=str(root))
    err, warned = _call_prebuilt(12)
    err2, warned2 = _call_prebuilt(13)  # a second miss: the same refusal, no second warning
    assert counter() == 0
    assert "cache is unusable" in str(err) and str(root) in str(err)
    assert len(warned) == 1 and "unusable" in warned[0], warned
    assert warned2 == [] and "cache is unusable" in str(err2)
    assert not any(p.suffix == ".o" for p in real.rglob("*"))


def test_first_error_line_of_a_python_failure_and_compile_error_without_ansi():
    import pickle
    import traceback

    from quack.compile.diagnostics import first_error_line
    from quack.errors import CompileError

    try:
        raise TypeError("export_to_c() got an unexpected keyword argument 'object_file_path'")
    except TypeError as e:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    assert first_error_line(text) == "TypeError: export_to_c() got an unexpected keyword argument " \
                                     "'object_file_path'"
    assert first_error_line("ValueError: a\x00b " + "x" * 1000, limit=40) == "ValueError: a\\x00b " + "x" * 18 + "..."
    err = CompileError("k", {"n": 1}, "sm_90a", "\x1b[91merror:\x1b[0m bad\n")
    assert err.detail == "error: bad\n" and "\x1b" not in str(err)
    assert pickle.loads(pickle.dumps(err)).detail == "error: bad\n"
