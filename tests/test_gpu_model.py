"""Which GPU model's tuning rows apply (quack.tuning.gpu): a build and the processes that run
its objects must key for the same model. Before session 21 a build never asked (CUDA is not
initialised in a build) and keyed for the table's default model, H200, while tests on an H100
asked with CUDA up for the H100's: README command 2 failed 179 tests with KernelNotPrebuilt.
Now a build on a GPU machine asks NVML (nvidia-ml-py) for the model, without CUDA.

Unit tests with a fake NVML module; a CLI test runs `quack build --dry-run` in a process
that imports a fake ``pynvml`` (a GPU host here has none) and reads the keys it would build."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import types

import pytest

from quack import settings
from quack.tuning import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeNVML(types.ModuleType):
    """pynvml's calls quack makes, over a list of (name, uuid); counts inits and shutdowns."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices, init_error=False, query_error=False):
        super().__init__("pynvml")
        self.devices, self.init_error, self.query_error = devices, init_error, query_error
        self.inits = self.shutdowns = 0

    def nvmlInit(self):
        self.inits += 1
        if self.init_error:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        if self.query_error:
            raise self.NVMLError("GPU is lost")
        return i

    def nvmlDeviceGetName(self, h):
        return self.devices[h][0]

    def nvmlDeviceGetUUID(self, h):
        return self.devices[h][1].encode()  # older bindings return bytes


@pytest.fixture
def nvml(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "_DRIVER_PATHS", (str(tmp_path),))  # "a driver is here"

    def install(devices, **kw):
        fake = FakeNVML(devices, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        monkeypatch.setattr(gpu, "_HOST", gpu._UNASKED)
        return fake

    yield install


def test_without_a_driver_nvml_is_not_even_imported(nvml, monkeypatch, tmp_path):
    """No /proc/driver/nvidia, /dev/nvidiactl or /dev/dxg: a CPU machine pays no pynvml
    import (13 ms a process here) and gets the table's default."""
    fake = nvml([H100])
    monkeypatch.setattr(gpu, "_DRIVER_PATHS", (str(tmp_path / "absent"),))
    assert gpu._nvml_model(None) is None and fake.inits == 0


H100 = ("NVIDIA H100 80GB HBM3", "GPU-1111aaaa-0000")
H200 = ("NVIDIA H200", "GPU-2222bbbb-0000")
A100 = ("NVIDIA A100-SXM4-80GB", "GPU-3333cccc-0000")


def test_one_model_host_gives_its_model_whatever_the_visible_list(nvml):
    fake = nvml([H100, H100])
    for visible in (None, "0", "1", "GPU-1111", "MIG-5c6d", "1,0"):
        assert gpu._nvml_model(visible) == "H100", visible
    assert fake.inits == fake.shutdowns == 6  # NVML is shut again every time


def test_a_mixed_host_gives_the_first_visible_device(nvml):
    nvml([A100, H100])
    assert gpu._nvml_model(None) == "A100"
    assert gpu._nvml_model("1") == "H100"
    assert gpu._nvml_model("1,0") == "H100"
    assert gpu._nvml_model("GPU-1111aa") == "H100"  # a UUID prefix, as CUDA takes it
    assert gpu._nvml_model("MIG-5c6d") is None  # which physical GPU: unknown here


@pytest.mark.parametrize("visible", ["", "-1", " "])
def test_no_visible_device_is_no_model(nvml, visible):
    nvml([H100])
    assert gpu._nvml_model(visible) is None


def test_no_driver_or_a_lost_gpu_is_no_model(nvml):
    fake = nvml([H100], init_error=True)
    assert gpu._nvml_model(None) is None and fake.shutdowns == 0
    fake = nvml([H100], query_error=True)
    assert gpu._nvml_model(None) is None and fake.shutdowns == 1
    nvml([])
    assert gpu._nvml_model(None) is None


def test_without_nvidia_ml_py_the_tables_default_applies(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert gpu._nvml_model(None) is None


@pytest.fixture
def no_setting():
    saved = settings.installed()
    settings.set_current(dataclasses.replace(settings.get(), tune_gpu=None))  # QUACK_TUNE_GPU unset
    yield
    settings.set_current(saved)


@pytest.mark.usefixtures("no_setting")
def test_the_setting_then_cuda_then_nvml_then_the_default(nvml, monkeypatch):
    fake = nvml([H100])
    monkeypatch.setattr(gpu, "detected_gpu", lambda: None)  # CUDA not initialised
    assert gpu.current_gpu("H200") == "H100"
    assert gpu.current_gpu("H200") == "H100" and fake.inits == 1  # asked once a process
    monkeypatch.setattr(gpu, "detected_gpu", lambda: "H200")  # CUDA up: its device decides
    assert gpu.current_gpu("B200") == "H200"
    with settings.override(tune_gpu="B200"):  # the setting wins over both
        assert gpu.current_gpu("H200") == "B200"
    nvml([], init_error=True)  # a CPU-only machine
    monkeypatch.setattr(gpu, "detected_gpu", lambda: None)
    assert gpu.current_gpu("H200") == "H200"


def test_model_names_as_torch_and_nvml_give_them():
    names = {
        "NVIDIA H100 80GB HBM3": "H100",
        "NVIDIA H100 PCIe": "H100",
        "NVIDIA H200": "H200",
        "NVIDIA GH200 480GB": "GH200",
        "NVIDIA A100-SXM4-80GB": "A100",
        "NVIDIA A100-PCIE-40GB": "A100",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb": "H100",
    }
    assert {k: gpu.normalise_gpu(k) for k in names} == names


FAKE_PYNVML = textwrap.dedent(
    """
    import os

    class NVMLError(Exception):
        pass

    def nvmlInit():
        pass

    def nvmlShutdown():
        pass

    def nvmlDeviceGetCount():
        return 1

    def nvmlDeviceGetHandleByIndex(i):
        return i

    def nvmlDeviceGetName(h):
        return os.environ["FAKE_GPU_NAME"]

    def nvmlDeviceGetUUID(h):
        return "GPU-0000"
    """
)

MANIFEST = """[[kernel]]
name = "cross_entropy_fwd"
archs = ["sm_90a"]
[kernel.params]
dtype = "bfloat16"
n = 4096
smoothing = "none"
"""


def _dry_run(tmp_path, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("QUACK_TUNE_GPU", "CUDA_VISIBLE_DEVICES")}
    full.update(QUACK_CACHE_DIR=str(tmp_path / "c"), **env)
    m = tmp_path / "m.toml"
    m.write_text(MANIFEST)
    # the child believes a driver is here (this machine has none) and imports the fake pynvml
    # ahead of any real one when FAKE_GPU_NAME is set
    boot = (
        "import os, runpy, sys\n"
        "import quack.tuning.gpu as g\n"
        "if os.environ.get('FAKE_GPU_NAME'): g._DRIVER_PATHS = ('/',)\n"
        "sys.argv = ['quack', *sys.argv[1:]]\n"
        "runpy.run_module('quack_build', run_name='__main__')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", boot, "build", "--dry-run", str(m)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=full,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("compile")]
    return line, r.stderr


def test_a_build_on_a_gpu_host_keys_for_that_gpus_rows(tmp_path):
    """A host whose GPU has no rows (model "QX9"): the build keys the heuristic's configuration,
    the one its processes will ask for, and says once that the model is untuned; the setting
    still builds for another model; a host without NVML keys for the table's default."""
    fake = tmp_path / "fakenvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_PYNVML)
    path = os.pathsep.join([str(fake), ROOT, os.environ.get("PYTHONPATH", "")])
    here, err = _dry_run(tmp_path, PYTHONPATH=path, FAKE_GPU_NAME="NVIDIA QX9 80GB")
    assert "no tuning-table rows for GPU 'QX9'" in err, err
    h200, _ = _dry_run(tmp_path, PYTHONPATH=path, FAKE_GPU_NAME="NVIDIA QX9 80GB", QUACK_TUNE_GPU="H200")
    assert "stages=4,ctas_per_sm=4}" in h200, h200  # the H200 row's (sm_90a.toml "small")
    assert here != h200 and "stages=3,ctas_per_sm=8}" in here, here  # the heuristic's
    # this machine's own NVML view (no driver in CI: the table's default, H200)
    plain, _ = _dry_run(tmp_path, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if gpu.host_gpu() in (None, "H200"):
        assert plain == h200


def test_the_build_summary_names_whose_rows_chose_the_configurations(tmp_path):
    """A CPU build farm making objects for H100 servers must see which model it keyed for."""
    import json

    m = tmp_path / "m.toml"
    m.write_text(MANIFEST)
    env = {k: v for k, v in os.environ.items() if k != "QUACK_TUNE_GPU"}
    env.update(QUACK_CACHE_DIR=str(tmp_path / "c"), QUACK_TUNE_GPU="H100", QUACK_JOBS="1")
    args = [sys.executable, "-m", "quack_build", "build", str(m)]
    r = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["tune_gpu"] == {"model": "H100", "source": "[tune] gpu / QUACK_TUNE_GPU"}
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0 and "tuning rows for" in r.stdout and "H100 ([tune] gpu" in r.stdout, r.stdout


def test_a_miss_of_a_tuned_kernel_names_whose_rows_chose_its_configuration(tmp_path):
    """The 179 misses of README command 2 on an H100 said only "not prebuilt": the model whose
    rows chose the configuration (the build had keyed for another) is in the error now; a
    kernel without a table-derived configuration says nothing of it."""
    import relkernels
    from quack_kernels import softmax

    from quack.errors import KernelNotPrebuilt

    with settings.override(cache_dir=str(tmp_path / "c"), mode="prebuilt", tune_gpu="H100"):
        with pytest.raises(KernelNotPrebuilt) as e:
            softmax.compile_softmax_fwd("bfloat16", 4096)
        assert e.value.tuned_for == "H100 ([tune] gpu / QUACK_TUNE_GPU)"
        assert "comes from the rows of GPU H100 ([tune] gpu / QUACK_TUNE_GPU)" in str(e.value)
        with pytest.raises(KernelNotPrebuilt) as e:
            relkernels.rel_copy(3)
        assert e.value.tuned_for == "" and "tuning table" not in str(e.value)
