"""The export compile (quack.compile.builder.compile_to) builds no JIT execution engine:
the object it writes is the same bytes, and the engine was half a compile's time."""

import pytest

pytest.importorskip("cutlass")

import toykernels  # noqa: E402  (tests/ is on sys.path: conftest)

from quack.compile import builder  # noqa: E402


def _export(compiled, path):
    compiled.export_to_c(object_file_path=str(path), function_name="f")
    return path.read_bytes()


def test_no_jit_engine_exports_the_same_object_without_an_engine(tmp_path):
    import cutlass.cutlass_dsl  # noqa: F401  (no_jit_engine acts once cutlass is imported)

    builder.pin_arch("sm_90a")
    with_engine = toykernels.toy_scale.compile_uncached("float16", 96, True, arch="sm_90a")
    with builder.no_jit_engine():
        without = toykernels.toy_scale.compile_uncached("float16", 96, True, arch="sm_90a")
    # this machine "can run" sm_90a as far as the DSL knows: outside, it builds an engine
    assert with_engine.engine is not None
    assert without.engine is None
    assert _export(without, tmp_path / "a.o") == _export(with_engine, tmp_path / "b.o")
    # closed: the DSL's own rule again (an in-process compile keeps its engine)
    again = toykernels.toy_scale.compile_uncached("float16", 96, True, arch="sm_90a")
    assert again.engine is not None


def test_compile_to_compiles_without_an_engine(tmp_path, monkeypatch):
    import cutlass.cutlass_dsl  # noqa: F401

    seen = []
    real = builder.call_compile

    def spy(spec, params, arch):
        seen.append(real(spec, params, arch))
        return seen[-1]

    monkeypatch.setattr(builder, "call_compile", spy)
    spec = toykernels.toy_scale.spec
    builder.compile_to(spec, spec.bind(("float32", 64, False), {}, arch="sm_90a"), "sm_90a", tmp_path / "o.o")
    assert len(seen) == 1 and seen[0].engine is None
    assert (tmp_path / "o.o").stat().st_size > 0
