"""The kernels' reference hooks (what `quack verify --run` calls): on a GPU each runs its
kernel on generated inputs and asserts against torch; without one, verify --run says so."""

import importlib
import os
import subprocess
import sys

import pytest
from _cases import COMPILE_FNS
from _fixtures import kernel_cache  # noqa: F401  (a fixture, used by name)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def _spec(kernel):
    from quack import registry

    importlib.import_module(COMPILE_FNS[kernel][0])
    return registry.get(kernel)


@pytest.mark.parametrize("kernel", sorted(COMPILE_FNS))
def test_every_kernel_has_an_importable_reference_hook(kernel):
    spec = _spec(kernel)
    mod, _, fn = (spec.reference or "").partition(":")
    assert callable(getattr(importlib.import_module(mod), fn))


@pytest.mark.skipif(_gpu(), reason="checks the no-GPU message")
def test_verify_run_without_gpu_says_kernels_were_not_run(tmp_path):
    env = dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    man = tmp_path / "m.toml"
    man.write_text(
        '[[kernel]]\nname = "softmax_fwd"\narchs = ["sm_90a"]\nparams = { dtype = "float32", n = 1024 }\n'
    )
    b = subprocess.run(
        [sys.executable, "-m", "quack_build", "build", "-j", "1", str(man)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert b.returncode == 0, b.stdout + b.stderr
    r = subprocess.run(
        [sys.executable, "-m", "quack_build", "verify", "--run", str(man)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    # Asked to run the kernels and couldn't: not a success, and it says why.
    assert r.returncode == 1, out
    assert "--run needs a CUDA GPU and none is visible" in out and "Traceback" not in out


def test_background_shipped_build_is_waited_for_bounded_and_stopped(tmp_path, monkeypatch):
    """The verify-all test's background build (_fixtures.py): its status and output are
    what the test waits for; past the time-out it is killed (124); one nobody waited for is
    ended at session finish; without one started, the build runs in line."""
    import _fixtures as fx

    def cmd(code):
        monkeypatch.setattr(fx, "_build_cmd", lambda: [sys.executable, "-c", code])

    cmd("print('built 3 of 3')")
    fx.start_shipped_build(str(tmp_path / "a"))
    fx.start_shipped_build(str(tmp_path / "a"))  # once a session per cache
    assert fx.finish_shipped_build(str(tmp_path / "a"), 60) == (0, "built 3 of 3\n")
    cmd("import sys; print('in line'); sys.exit(3)")
    rc, out = fx.finish_shipped_build(str(tmp_path / "a"), 60)  # none started now: in line
    assert (rc, out) == (3, "in line\n")
    cmd("import time; time.sleep(120)")
    fx.start_shipped_build(str(tmp_path / "b"))
    assert fx.finish_shipped_build(str(tmp_path / "b"), 0.5)[0] == 124
    fx.start_shipped_build(str(tmp_path / "c"))
    (p, _log) = fx._SHIPPED[str(tmp_path / "c")]  # noqa: SLF001 - the test's own helper module
    fx.stop_shipped_builds()
    assert p.poll() is not None and not fx._SHIPPED  # noqa: SLF001
