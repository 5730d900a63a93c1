"""Settings precedence (CLI > env > quack.toml > default) and clear errors."""

from pathlib import Path

import pytest

from quack import settings
from quack.errors import SettingsError


def write(tmp_path, text):
    (tmp_path / "quack.toml").write_text(text)
    return tmp_path


def test_defaults(tmp_path):
    s = settings.resolve(env={"HOME": str(tmp_path)}, cwd=tmp_path)
    assert s.mode == "jit" and s.cache_enabled and s.arch == "sm_90a"
    assert s.config_file is None


def test_xdg_default_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.default_cache_dir() == tmp_path / "xdg" / "quack"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert settings.default_cache_dir() == tmp_path / ".cache" / "quack"


def test_precedence(tmp_path):
    write(tmp_path, '[cache]\ndir = "from_toml"\n[runtime]\nmode = "prebuilt"\narch = "sm_80"\n')
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    s = settings.resolve(env={}, cwd=sub)  # found by walking up
    assert s.cache_dir == tmp_path / "from_toml"  # relative to the quack.toml
    assert (s.mode, s.arch) == ("prebuilt", "sm_80")
    s = settings.resolve(
        env={"QUACK_MODE": "jit", "QUACK_CACHE_DIR": "/x/env", "CUTE_DSL_ARCH": "sm_100a"}, cwd=sub
    )
    assert (s.mode, s.cache_dir, s.arch) == ("jit", Path("/x/env"), "sm_100a")
    assert s.sources["mode"] == "QUACK_MODE"
    s = settings.resolve({"mode": "prebuilt", "cache_dir": "/x/cli"}, env={"QUACK_MODE": "jit"}, cwd=sub)
    assert (s.mode, s.cache_dir) == ("prebuilt", Path("/x/cli"))


def test_quack_arch_beats_cute_dsl_arch(tmp_path):
    s = settings.resolve(env={"QUACK_ARCH": "sm_80", "CUTE_DSL_ARCH": "sm_100a"}, cwd=tmp_path)
    assert s.arch == "sm_80"


@pytest.mark.parametrize(
    "text,match",
    [
        ("[runtime]\nmode = 'fast'\n", r"runtime.mode = 'fast' is invalid"),
        ("[runtime]\nbogus = 1\n", r"unknown key runtime.bogus; allowed in \[runtime\]"),
        ("[nope]\nx = 1\n", r"unknown section \[nope\]"),
        ("[cache]\nenabled = 'yes'\n", r"cache.enabled"),
        ("[runtime]\narch = 'sm_9000'\n", r"runtime.arch"),
        ("[build]\njobs = -1\n", r"build.jobs"),
        ("[build]\nmanifests = 'one.toml'\n", r"list of strings"),
        ("[runtime\nmode='jit'\n", r"TOML syntax error"),
        # Path('') == '.': the cache went into the project directory
        ("[cache]\ndir = ''\n", r"cache.dir = '' is invalid: must not be empty or blank"),
        ("[cache]\ndir = ' '\n", r"cache.dir = ' ' is invalid: must not be empty or blank"),
        ("[cache]\ndir = 5\n", r"cache.dir = 5 is invalid: expected a string \(a non-empty directory path\)"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, match):
    write(tmp_path, text)
    with pytest.raises(SettingsError, match=match) as e:
        settings.resolve(env={}, cwd=tmp_path)
    assert str(tmp_path / "quack.toml") in str(e.value)


def test_binary_garbage_config(tmp_path):
    (tmp_path / "quack.toml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SettingsError, match="not UTF-8"):
        settings.resolve(env={}, cwd=tmp_path)


@pytest.mark.parametrize(
    "var,value",
    [
        ("QUACK_MODE", "sometimes"),
        ("QUACK_CACHE_ENABLED", "maybe"),
        ("QUACK_COMPILE_JOBS", "-2"),
        ("QUACK_ARCH", "gpu"),
        ("QUACK_CACHE_DIR", " "),  # was a directory named ' ' under the working directory
        ("QUACK_CACHE_DIR", "\t\n"),
    ],
)
def test_bad_env_names_variable(tmp_path, var, value):
    with pytest.raises(SettingsError, match=var):
        settings.resolve(env={var: value}, cwd=tmp_path)


def test_empty_cache_dir_variable_is_unset_as_every_variable(tmp_path):
    write(tmp_path, '[cache]\ndir = "from_toml"\n')
    s = settings.resolve(env={"QUACK_CACHE_DIR": ""}, cwd=tmp_path)
    assert s.cache_dir == tmp_path / "from_toml" and s.sources["cache_dir"] == str(tmp_path / "quack.toml")


def test_settings_error_pickles():
    import pickle

    e = SettingsError("boom", source="f", key="k")
    e2 = pickle.loads(pickle.dumps(e))
    assert (str(e2), e2.source, e2.key) == ("boom", "f", "k")


def test_section_given_as_a_value(tmp_path):
    write(tmp_path, "cache = 5\n")
    with pytest.raises(SettingsError, match=r"cache = 5 must be a table"):
        settings.resolve(env={}, cwd=tmp_path)


def test_settings_behaves_as_the_generated_frozen_dataclass(tmp_path):
    """Settings' methods are written out (issue 15: generating them was ~1.2 ms of every
    fresh process's first kernel load); they must do what @dataclass(frozen=True) would."""
    import copy
    import dataclasses
    import pickle

    fields = dataclasses.fields(settings.Settings)
    Gen = dataclasses.make_dataclass(
        "Settings",
        [
            (
                f.name,
                f.type,
                dataclasses.field(default=f.default, default_factory=f.default_factory, compare=f.compare),
            )
            for f in fields
        ],
        frozen=True,
    )
    assert len(fields) >= 20 and fields[0].name == "cache_dir"
    base = settings.Settings(cache_dir=tmp_path)
    gbase = Gen(cache_dir=tmp_path)
    for f in fields:  # every default, the factory's too (a new dict each time)
        assert getattr(base, f.name) == getattr(gbase, f.name), f.name
    assert base.sources == {} and base.sources is not settings.Settings(cache_dir=tmp_path).sources
    kw = dict(mode="prebuilt", arch="sm_100a", manifests=("m.toml",), sources={"mode": "QUACK_MODE"})
    s, g = settings.Settings(cache_dir=tmp_path, **kw), Gen(cache_dir=tmp_path, **kw)
    assert repr(s) == repr(g)
    # sources is not compared (nor hashed): only where a value came from
    same = settings.Settings(cache_dir=tmp_path, **dict(kw, sources={}))
    assert s == same and hash(s) == hash(same)
    assert Gen(cache_dir=tmp_path, **dict(kw, sources={})) == g
    for other in (base, dataclasses.replace(s, arch="sm_90a"), settings.Settings(cache_dir=tmp_path / "x")):
        assert s != other
    assert s != g  # another class
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.mode = "jit"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del s.arch
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such'"):
        settings.Settings(cache_dir=tmp_path, no_such=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        settings.Settings()  # type: ignore[call-arg]
    r = dataclasses.replace(s, mode="jit")
    assert r.mode == "jit" and r.arch == "sm_100a" and s.mode == "prebuilt"
    for dup in (pickle.loads(pickle.dumps(s)), copy.copy(s), copy.deepcopy(s)):
        assert dup == s and dup.sources == s.sources and repr(dup) == repr(s)
    assert {s: 1}[same] == 1


def test_the_pytest_sessions_prebuilt_cache_is_prebuilt_in_every_process(tmp_path):
    """pytest --quack-prebuilt exports its cache directory (QUACK_PYTEST_PREBUILT_CACHE) for
    the processes its tests start: one whose cache it is (by any spelling), or that sets
    none, resolves prebuilt mode whatever QUACK_MODE or quack.toml say; one given another
    cache (a test's private QUACK_CACHE_DIR) resolves its own; an explicit mode wins."""
    session = tmp_path / "session"
    session.mkdir()
    (tmp_path / "link").symlink_to(session)
    var = {settings.PREBUILT_CACHE_ENV: str(session), "HOME": str(tmp_path)}
    write(tmp_path, '[runtime]\nmode = "jit"\n')
    for cache, mode in (
        (str(session), "prebuilt"),
        (str(tmp_path / "link"), "prebuilt"),
        (None, "prebuilt"),  # the default cache: it would have compiled there
        (str(tmp_path / "private"), "jit"),
    ):
        env = dict(var, QUACK_MODE="jit", **({"QUACK_CACHE_DIR": cache} if cache else {}))
        s = settings.resolve(env=env, cwd=tmp_path)
        assert s.mode == mode, cache
        if mode == "prebuilt":
            assert s.sources["mode"] == settings.PREBUILT_CACHE_ENV
    s = settings.resolve({"mode": "jit"}, env=dict(var, QUACK_CACHE_DIR=str(session)), cwd=tmp_path)
    assert s.mode == "jit"  # a CLI flag or code says so
    assert settings.resolve(env={"QUACK_CACHE_DIR": str(session)}, cwd=tmp_path).mode == "jit"  # not exported
