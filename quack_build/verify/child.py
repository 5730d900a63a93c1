"""``quack verify``'s fresh process: load entries, one JSON request per stdin line,
one JSON answer per line of the process's ORIGINAL stdout (so a crash is blamed on the
entry in progress).

Request: {"key", "obj", "so", "kernel", "module", "params", "run"}.
Answer:  {"key", "ok", "how", "run", "error", "restart", "seconds"}; with "run" in the
request, the answer's "run" is "ok", "failed" (the reference hook raised: "error" says
how) or why it was not run ("no reference hook").
Also {"op": "gpu"} (is a CUDA GPU visible) and {"op": "imported", "names": [...]}.

The protocol's plumbing (why answers get their own copy of fd 1) is quack_build.verify.serve.
After a failed reference run the answer says ``restart`` and the process ends: a CUDA
error is sticky (every later launch in the process fails), so the next entry gets a fresh
process instead of the last one's error."""

from __future__ import annotations

import sys
import traceback

from quack_build.verify.serve import serve


def _one(req: dict, keep: list) -> dict:
    """One entry, its answer with ``seconds`` (load and run: what a slow entry costs)."""
    import time

    t0 = time.perf_counter()
    out = _load_and_run(req, keep)
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out


def _load_and_run(req: dict, keep: list) -> dict:
    from pathlib import Path

    from quack.runtime import loader

    out = {"key": req["key"], "ok": False, "how": ""}
    try:
        if req.get("so"):
            fn, mod = loader.load_so(Path(req["so"]))
            out["how"] = "so"
        else:
            fn, mod = loader.load_object(Path(req["obj"]))
            out["how"] = "o"
        keep.append(mod)
        if fn is None or not callable(fn):
            out["error"] = f"module has no callable {loader.FUNCTION_NAME!r}"
            return out
    except Exception as e:  # noqa: BLE001
        out["error"] = f"load failed: {type(e).__name__}: {str(e)[:500]}"
        return out
    if req.get("run"):
        try:
            import importlib

            from quack import registry

            spec = registry.import_spec(req["module"], req["kernel"])
            if not spec.reference:
                out["run"] = "no reference hook"
            else:
                mname, _, fname = spec.reference.partition(":")
                ref = getattr(importlib.import_module(mname), fname)
                from quack.tuning.override import as_bound

                bound = spec.bind((), req["params"])
                with as_bound(spec, bound):  # the op runs THIS entry's configuration
                    ref(bound, req.get("device", "cuda"))
                out["run"] = "ok"
        except AssertionError as e:
            out["run"] = "failed"
            out["error"] = f"wrong result: {str(e)[:500]}"
            return out
        except Exception as e:  # noqa: BLE001
            out["run"] = "failed"
            out["error"] = f"run failed: {type(e).__name__}: {str(e)[:300]}\n" + traceback.format_exc()[-800:]
            out["restart"] = True  # a CUDA error poisons the process: the next entry gets a fresh one
            return out
    out["ok"] = True
    return out


def main(argv: list[str] | None = None) -> None:
    keep: list = []

    def handle(req: dict) -> dict:
        if req.get("op") == "gpu":
            try:
                import torch

                return {"gpu": bool(torch.cuda.is_available())}
            except Exception as e:  # noqa: BLE001
                return {"gpu": False, "error": str(e)}
        if req.get("op") == "imported":  # which of these modules this process has imported
            return {"imported": {n: sys.modules.get(n) is not None for n in req.get("names", [])}}
        return _one(req, keep)

    serve("python -m quack_build.verify.child", handle, argv, warm=_warm)


def _warm() -> None:
    """What every entry needs, imported as the process starts: ``quack verify`` starts its
    loaders before its static checks, so the two overlap. tvm_ffi imports torch where it
    is installed (seconds), unless the parent said --no-torch (a static load: serve)."""
    import tvm_ffi  # noqa: F401

    from quack.runtime import loader  # noqa: F401


if __name__ == "__main__":
    main()
