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
    """pynvml's calls quack makes, over a list of (name, uuid); ``lost``: indices whose
    queries fail (a lost GPU, one the job may not query); counts inits and shutdowns."""

    class NVMLError(Exception):
        """pynvml's error base: what quack catches around every NVML call."""

    def __init__(self, devices, init_error=False, lost=()):
        super().__init__("pynvml")
        self.devices, self.init_error, self.lost = devices, init_error, set(lost)
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
        if i in self.lost:
            raise self.NVMLError("GPU is lost")
        return i

    def nvmlDeviceGetName(self, h):
        return self.devices[h][0]

    def nvmlDeviceGetUUID(self, h):
        return self.devices[h][1].encode()  # older bindings return bytes


@pytest.fixture
def nvml(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "_DRIVER_PATHS", (str(tmp_path),))  # "a driver is here"
    monkeypatch.setattr(gpu, "_HOST", {})

    def install(devices, **kw):
        fake = FakeNVML(devices, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        gpu._HOST.clear()
        return fake

    yield install


def model(visible, order=None):
    return gpu._nvml_model(visible, order)[0]


def test_without_a_driver_nvml_is_not_even_imported(nvml, monkeypatch, tmp_path):
    """No /proc/driver/nvidia, /dev/nvidiactl or /dev/dxg: a CPU machine pays no pynvml
    import (13 ms a process here) and gets the table's default."""
    fake = nvml([H100])
    monkeypatch.setattr(gpu, "_DRIVER_PATHS", (str(tmp_path / "absent"),))
    assert gpu._nvml_model(None) == (None, "no NVIDIA driver here") and fake.inits == 0


H100 = ("NVIDIA H100 80GB HBM3", "GPU-1111aaaa-0000")
H200 = ("NVIDIA H200", "GPU-2222bbbb-0000")
A100 = ("NVIDIA A100-SXM4-80GB", "GPU-3333cccc-0000")


def test_one_model_host_gives_its_model_whatever_the_visible_list(nvml):
    fake = nvml([H100, H100])
    for visible in (None, "0", "1", "GPU-1111", "MIG-5c6d", "1,0", " 1"):
        assert gpu._nvml_model(visible) == ("H100", "this machine's GPU, through NVML"), visible
    assert fake.inits == fake.shutdowns == 7  # NVML is shut again every time


def test_a_mixed_host_names_a_device_only_where_cuda_and_nvml_agree_on_it(nvml):
    """CUDA's default order (fastest first) is not NVML's (PCI bus): an index names a known
    device only under CUDA_DEVICE_ORDER=PCI_BUS_ID; a UUID always; else no guess (a guessed
    L4 where CUDA's device 0 is the L40S made every call miss), and the reason says so."""
    nvml([A100, H100])
    assert model(None) is None and model("1") is None and model("0") is None
    assert "mixed GPU models (A100, H100)" in gpu._nvml_model("1")[1]
    assert model("1", "PCI_BUS_ID") == "H100" and model("0,1", "PCI_BUS_ID") == "A100"
    assert model(None, "PCI_BUS_ID") == "A100"
    assert model("GPU-1111aa") == "H100" and model("gpu-1111AA") == "H100"  # a UUID prefix
    assert model("MIG-5c6d") is None  # which physical GPU: unknown here


@pytest.mark.parametrize("visible", ["", "-1", " "])
def test_no_visible_device_is_no_model(nvml, visible):
    nvml([H100])
    assert gpu._nvml_model(visible) == (None, f"no GPU visible (CUDA_VISIBLE_DEVICES={visible!r})")


def test_a_gpu_nvml_cannot_query_leaves_the_others_to_decide(nvml):
    """One lost GPU (or one this job may not query) made the whole answer "no GPU": a build
    on an H100 host keyed the H200's rows while its processes asked for the H100's."""
    fake = nvml([H100, H100], lost={1})
    assert model("0") == "H100" and model(None) == "H100" and fake.shutdowns == 2
    nvml([A100, H100], lost={0})  # the only queryable one decides
    assert model(None) == "H100"
    nvml([H100], lost={0})
    assert gpu._nvml_model(None) == (None, "NVML could query no GPU")
    fake = nvml([H100], init_error=True)
    assert model(None) is None and fake.shutdowns == 0
    assert "NVML did not start" in gpu._nvml_model(None)[1]
    nvml([])
    assert model(None) is None


def test_without_nvidia_ml_py_the_reason_says_so(nvml, monkeypatch):
    nvml([H100])
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert gpu._nvml_model(None) == (None, "nvidia-ml-py is not installed: set [tune] gpu / QUACK_TUNE_GPU")


def test_the_answer_follows_cuda_visible_devices(nvml, monkeypatch):
    """A launcher that sets a rank's devices after the first ask gets its own answer."""
    fake = nvml([H100, H100])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu.host_gpu() is None and gpu.host_gpu() is None and fake.inits == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu.host_gpu() == "H100" and fake.inits == 2


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
    nvml([], init_error=True)  # a machine whose NVML does not start
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
        '''pynvml's error base (never raised here: the fake's one GPU always answers).'''

    def nvmlInit():
        '''The driver starts: there is nothing to open in a fake.'''

    def nvmlShutdown():
        '''Nothing was opened: nothing to close.'''

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
    assert json.loads(r.stdout)["tune_gpu"] == {"models": ["H100"], "source": "[tune] gpu / QUACK_TUNE_GPU"}
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0 and "tuning rows for" in r.stdout and "GPU H100 ([tune] gpu" in r.stdout, (
        r.stdout
    )


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
        assert e.value.tuned_for == "GPU H100 ([tune] gpu / QUACK_TUNE_GPU)"
        assert "comes from the tuning rows of GPU H100 ([tune] gpu / QUACK_TUNE_GPU)" in str(e.value)
        with pytest.raises(KernelNotPrebuilt) as e:
            relkernels.rel_copy(3)
        assert e.value.tuned_for == "" and "tuning table" not in str(e.value)


def test_the_setting_is_normalised_like_the_rows(monkeypatch, tmp_path):
    """QUACK_TUNE_GPU=h100 (or H100-SXM) keyed the heuristic: no rows are spelt 'h100'."""
    from quack.settings import resolve

    for raw in ("h100", "H100-SXM", " H100 "):
        monkeypatch.setenv("QUACK_TUNE_GPU", raw)
        assert resolve().tune_gpu == "H100", raw
    monkeypatch.delenv("QUACK_TUNE_GPU")
    (tmp_path / "quack.toml").write_text('[tune]\ngpu = "a100-sxm4-80gb"\n')
    assert resolve(cwd=tmp_path).tune_gpu == "A100"


def _quack(tmp_path, *args, manifest=MANIFEST):
    """``quack ARGS m.toml`` (``manifest`` written there) on a private cache, no
    QUACK_TUNE_GPU from the environment."""
    from test_tune_cli import _quack as quack_cli

    m = tmp_path / "m.toml"
    m.write_text(manifest)
    env = {"QUACK_CACHE_DIR": str(tmp_path / "c"), "QUACK_JOBS": "2"}
    return quack_cli(*args, str(m), env_extra=env, unset=("QUACK_TUNE_GPU",), timeout=600)


def test_one_build_for_several_gpu_models_holds_each_ones_configurations(tmp_path):
    """A fleet of H100 and H200 servers, one cache or bundle: --gpu H100 --gpu H200 expands
    each table once per model and builds the union (the cross-entropy forward at N = 4096:
    the H100's row keeps the heuristic, the H200's streams with 4 stages)."""
    import json

    r = _quack(tmp_path, "build", "--dry-run", "--json", "--gpu", "h100", "--gpu", "H200,H100")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["tune_gpu"] == {"models": ["H100", "H200"], "source": "--gpu"}
    configs = sorted(json.dumps(k["params"]["config"], sort_keys=True) for k in doc["keys"])
    assert doc["total"] == 2 and doc["duplicates"] == 0, doc
    one = {}
    for g in ("H100", "H200"):
        rr = _quack(tmp_path, "build", "--dry-run", "--json", "--gpu", g)
        (k,) = json.loads(rr.stdout)["keys"]
        one[g] = json.dumps(k["params"]["config"], sort_keys=True)
    assert configs == sorted(one.values()) and one["H100"] != one["H200"]
    r = _quack(tmp_path, "build", "--json", "--gpu", "H100", "--gpu", "H200")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["compiled"] == 2 and doc["tune_gpu"] == {"models": ["H100", "H200"], "source": "--gpu"}
    r = _quack(tmp_path, "verify", "--json", "--no-load", "--gpu", "H100", "--gpu", "H200")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(json.loads(r.stdout)["entries"]) == 2
    # a warning of the manifest's (an exclude matching nothing) is said once, not once a model
    unused = MANIFEST + '[[kernel.exclude]]\ndtype = "float16"\n'
    r = _quack(tmp_path, "build", "--dry-run", "--gpu", "H100,H200,", manifest=unused)
    assert r.returncode == 0 and r.stdout.count("matches no combination") == 1, r.stdout
    # a kernel both models configure alike: one key, not counted as a duplicate
    same = MANIFEST.replace('name = "cross_entropy_fwd"', 'name = "softmax_fwd"').replace(
        'smoothing = "none"\n', ""
    )
    r = _quack(tmp_path, "build", "--dry-run", "--json", "--gpu", "H100", "--gpu", "H200", manifest=same)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert (doc["total"], doc["duplicates"]) == (1, 0), doc


@pytest.mark.parametrize(
    "cmd", [["build", "--dry-run"], ["bundle", "--name", "x"], ["verify"], ["cache", "push"]]
)
def test_a_bad_gpu_model_is_a_usage_error_naming_it(tmp_path, cmd):
    r = _quack(tmp_path, *cmd, "--gpu", "H100", "--gpu", "no such/gpu")
    assert r.returncode == 2 and "'no such/gpu'" in r.stderr and "GPU model name" in r.stderr, r.stderr
    many = ",".join(f"X{i}" for i in range(17))  # each model re-expands every table
    r = _quack(tmp_path, *cmd, "--gpu", many)
    assert r.returncode == 2 and "17 GPU models; at most 16" in r.stderr, r.stderr


def test_a_wedged_nvml_is_no_answer_within_its_time_limit(nvml, monkeypatch):
    """NVML's calls block with no time-out of their own (a wedged driver): the question has
    an exit, the reason says so, and the process does not ask again."""
    import threading

    release = threading.Event()
    fake = nvml([H100])
    fake.nvmlInit = lambda: (setattr(fake, "inits", fake.inits + 1), release.wait(60))
    monkeypatch.setattr(gpu, "NVML_TIMEOUT_S", 0.2)
    try:
        assert gpu.host_gpu_why() == (
            None,
            "NVML did not answer within 0.2 s: set [tune] gpu / QUACK_TUNE_GPU",
        )
        assert gpu.host_gpu() is None and fake.inits == 1
    finally:
        release.set()
    nvml([H100])  # a driver that answers: the answer, from the same thread-bounded question
    assert gpu.host_gpu_why() == ("H100", "this machine's GPU, through NVML")
