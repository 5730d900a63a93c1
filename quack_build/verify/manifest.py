"""``quack verify``: every configuration of the manifests is present for the
current fingerprint, its checksum intact, built for the requested arch (read
from the cubin embedded in the .o) and loadable in a fresh process that finds
the entry function; with ``--run`` (GPU) each kernel's reference hook runs.

Read-only: a corrupt entry is reported, not quarantined."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quack.cache import fsutil
from quack.cache.contract import MISSING
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import CacheError
from quack_build.verify.cubin import arch_matches, gpu_codes

LOAD_TIMEOUT = 300.0


class _Child:
    def __init__(self, gpu: bool):
        env = dict(os.environ)
        if not gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            env["QUACK_MODE"] = "prebuilt"  # a reference run uses the prebuilt entries, never compiles
        self.err = tempfile.TemporaryFile()
        self.p = subprocess.Popen(
            # The parent's sys.path goes along as an argument (not through the
            # environment: settings.py is the only reader of that), so the child
            # imports kernel modules from the same places.
            [
                sys.executable,
                "-m",
                "quack_build.verify.child",
                "--sys-path=" + os.pathsep.join(p for p in sys.path if p),  # "=": a path may start with "-"
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
        )
        # PIPE: both exist (typed Optional by Popen).
        assert self.p.stdin is not None and self.p.stdout is not None
        self.stdin, self.stdout = self.p.stdin, self.p.stdout

    def ask(self, req: dict, timeout: float = LOAD_TIMEOUT) -> dict | None:
        try:
            self.stdin.write((json.dumps(req) + "\n").encode())
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        r, _, _ = select.select([self.stdout], [], [], timeout)
        if not r:
            self.p.kill()
            return {"ok": False, "error": f"loading took over {timeout:.0f} s (killed)"}
        line = self.stdout.readline()
        if not line:
            return None
        try:
            return json.loads(line)
        except ValueError:
            return {"ok": False, "error": f"bad answer from the loader: {line[:200]!r}"}

    def death(self) -> str:
        try:
            rc = self.p.wait(5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        self.err.seek(0)
        tail = self.err.read()[-600:].decode("utf-8", "replace").strip()
        why = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        return f"the loader process died ({why})" + (f": {tail}" if tail else "")

    def close(self) -> None:
        try:
            self.stdin.close()
            self.p.wait(10)
        except Exception:  # noqa: BLE001
            self.p.kill()
        self.err.close()


def load_fresh(reqs: list[dict], *, run: bool = False, progress=None) -> tuple[list[dict], str]:
    """Load each request's object (``quack_build.verify.child``'s request format) in a fresh process,
    restarted after a crash so the crash is blamed on its entry. Returns (one answer per
    request, a note when ``run`` was asked for and no GPU is visible). ``progress(n)``
    is called after each answer."""
    answers: list[dict] = []
    note = ""
    child = _Child(gpu=run)
    try:
        if run:
            a = child.ask({"op": "gpu"}, timeout=120)
            if not a or not a.get("gpu"):
                note = "--run needs a CUDA GPU and none is visible; kernels were not run"
                run = False
        for req in reqs:
            a = child.ask(dict(req, run=run and req.get("run", True)))
            if a is None:
                a = {"ok": False, "error": child.death()}
                child.close()
                child = _Child(gpu=run)
            elif child.p.poll() is not None:
                child.close()
                child = _Child(gpu=run)
            answers.append(a)
            if progress is not None:
                progress(len(answers))
    finally:
        child.close()
    return answers, note


def check_static(store: DiskStore, cfg) -> tuple[list[str], dict]:
    """Presence, checksum and arch of one configuration, without touching the cache."""
    ref = builder.entry_ref(cfg.spec, cfg.params, cfg.arch)
    info: dict = {"obj": str(store.paths(ref)["obj"]), "so": None, "gpu_code": []}
    try:
        found = store.inspect(ref)
    except CacheError as e:  # a planted link or file on the entry's path: name it
        if e.path and Path(e.path) != Path(store.root):
            return [f"planted in the cache: {e}"], info
        raise
    lock = store.paths(ref)["lock"]
    if os.path.islink(lock):
        return [
            f"planted in the cache: the lock file {lock} is a symbolic link (never followed); "
            f"quack build refuses the key; quack cache clean removes it"
        ], info
    if found.status == MISSING:
        other = _elsewhere(store, ref)
        return [
            (
                "missing: not built for the current fingerprint"
                + (f" (a stale build exists: {other})" if other else "")
                + "; run quack build"
            )
        ], info
    if not found.ok:
        return [found.problem], info
    data = fsutil.read_nofollow(found.obj)
    codes = gpu_codes(data)
    info["gpu_code"] = [c.arch for c in codes]
    problems = []
    if not codes:
        problems.append("no embedded GPU code found in the object")
    elif not arch_matches(cfg.arch, codes):
        problems.append(f"built for {', '.join(c.arch for c in codes)}, expected {cfg.arch}")
    info["so"] = str(found.so) if found.so else None
    return problems, info


def _elsewhere(store: DiskStore, ref) -> str:
    d = store.entry_dir(ref)
    try:
        for fp in os.scandir(d.parent):
            if fp.name != d.name and os.path.exists(os.path.join(fp.path, ref.key + ".json")):
                return f"source fingerprint {fp.name}"
    except OSError:
        pass
    return ""


def verify(configs, store: DiskStore, *, load: bool = True, run: bool = False, console=None) -> dict:
    t0 = time.time()
    rows = []
    for c in configs:
        problems, info = check_static(store, c)
        rows.append(
            {
                "kernel": c.kernel,
                "params": c.plain_params,
                "arch": c.arch,
                "key": c.key,
                "problems": problems,
                "gpu_code": info["gpu_code"],
                "_cfg": c,
                "_info": info,
            }
        )
    note = ""
    if (load or run) and rows:
        todo = [r for r in rows if not r["problems"]]
        reqs = [
            {
                "key": r["_cfg"].key,
                "obj": r["_info"]["obj"],
                "so": r["_info"]["so"],
                "kernel": r["_cfg"].kernel,
                "module": r["_cfg"].spec.module,
                "params": r["_cfg"].plain_params,
            }
            for r in todo
        ]

        def progress(i: int) -> None:
            if console is not None and len(todo) > 20 and i % 50 == 0:
                console.print(f"  loaded {i}/{len(todo)}", markup=False)

        answers, note = load_fresh(reqs, run=run, progress=progress)
        run = run and not note
        for r, a in zip(todo, answers):
            if not a.get("ok"):
                r["problems"].append(a.get("error", "load failed"))
            if "how" in a:
                r["loaded"] = a["how"]
            if "run" in a:
                r["run"] = a["run"]
    bad = [r for r in rows if r["problems"]]
    for r in rows:
        r.pop("_cfg")
        r.pop("_info")
    ok = not bad and not note
    return {
        "ok": ok,
        "total": len(rows),
        "problems": len(bad),
        "loaded": load,
        "ran": run,
        "note": note,
        "seconds": round(time.time() - t0, 3),
        "entries": rows,
    }
