"""``quack verify``'s start-up and timing (unit, with fakes): every loader process starts
at once, each answer says what its entry cost, and a reference run's report names the
slowest entries (the GPU tier's verify test spent ~38 s of the warm tier's 93 s there)."""

import io
import threading

from quack_build.verify import loaders


class _FakeChild:
    """A loader that answers at once; the GPU probe records how many loaders had started."""

    started: list = []
    at_probe: list = []

    def __init__(self, gpu: bool, torch: bool = True):
        self.p = self
        self.gpu, self.torch = gpu, torch
        self.killed = self.closed = False
        _FakeChild.started.append(self)

    def poll(self):
        return None

    def ask(self, req, timeout=0.0):
        if req.get("op") == "gpu":
            _FakeChild.at_probe.append(len(_FakeChild.started))
            return {"gpu": True}
        return {"key": req["key"], "ok": True, "how": "o", "run": "ok", "seconds": 0.01}

    def kill(self):
        """Nothing runs to kill: recorded, as a real loader's end would be."""
        self.killed = True

    def close(self):
        """Recorded: load_fresh must close every loader it started (no process or pipe left)."""
        self.closed = True


def test_every_loader_starts_before_the_gpu_probe_is_answered(monkeypatch):
    """Each loader imports torch and the runtime (~8 s on the H200 host): started only after
    the first had answered the GPU probe, the others' imports came after its own, doubling
    the start-up. Before: 1 loader had started when the probe was answered."""
    monkeypatch.setattr(_FakeChild, "started", [])
    monkeypatch.setattr(_FakeChild, "at_probe", [])
    monkeypatch.setattr(loaders, "ChildProcess", _FakeChild)
    reqs = [{"key": f"k{i}"} for i in range(10)]
    answers, note = loaders.load_fresh(reqs, run=True, jobs=4)
    assert note == "" and [a["key"] for a in answers] == [r["key"] for r in reqs]
    assert _FakeChild.at_probe == [4] and len(_FakeChild.started) == 4
    assert all(c.gpu and c.torch for c in _FakeChild.started)  # they run kernels: torch stays
    assert threading.active_count() < 50  # the workers ended
    assert all(c.closed for c in _FakeChild.started)  # every loader closed at the end
    _FakeChild.started.clear()
    loaders.load_fresh(reqs, jobs=2)  # loading only: no tensor reaches tvm_ffi, torch hidden
    assert [(c.gpu, c.torch) for c in _FakeChild.started] == [(False, False)] * 2


def test_no_requests_start_one_loader_for_the_probe(monkeypatch):
    monkeypatch.setattr(_FakeChild, "started", [])
    monkeypatch.setattr(_FakeChild, "at_probe", [])
    monkeypatch.setattr(loaders, "ChildProcess", _FakeChild)
    assert loaders.load_fresh([], run=True, jobs=8) == ([], "")
    assert len(_FakeChild.started) == 1


def test_each_answer_says_what_its_entry_cost(monkeypatch, tmp_path):
    from quack.runtime import loader
    from quack_build.verify import child

    def slow_failure(path):
        raise OSError("no such object")

    monkeypatch.setattr(loader, "load_object", slow_failure)
    out = child._one({"key": "k", "obj": str(tmp_path / "x.o"), "kernel": "toy"}, [])
    assert not out["ok"] and "load failed: OSError" in out["error"]
    assert isinstance(out["seconds"], float) and out["seconds"] >= 0
    monkeypatch.setattr(loader, "load_object", lambda path: (lambda *a: None, object()))
    out = child._one({"key": "k", "obj": str(tmp_path / "x.o"), "kernel": "toy"}, [])
    assert out["ok"] and out["seconds"] >= 0


def _report(ran: bool, n: int = 6) -> str:
    from rich.console import Console

    from quack_build.cli.verify_view import print_report

    entries = [
        {"kernel": "softmax_fwd", "params": {"n": 1024 * (i + 1)}, "problems": [], "seconds": 0.1 * (i + 1)}
        for i in range(n)
    ]
    res = {
        "ok": True,
        "entries": entries,
        "note": "",
        "loaded": True,
        "ran": ran,
        "reference_runs": n if ran else 0,
        "total": n,
        "seconds": 3.0,
    }
    buf = io.StringIO()
    print_report(Console(file=buf, width=200, color_system=None), res)
    return buf.getvalue()


def test_a_reference_runs_report_names_its_slowest_entries():
    out = _report(ran=True)
    assert "all good" in out
    line = next(x for x in out.splitlines() if x.startswith("slowest: "))
    # the three slowest, slowest first
    assert line.index("n=6144") < line.index("n=5120") < line.index("n=4096") and "n=3072" not in line
    assert "0.60s" in line


def test_a_load_only_report_has_no_slowest_line():
    assert "slowest" not in _report(ran=False)
