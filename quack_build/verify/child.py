"""``quack verify``'s fresh process: load entries, one JSON request per stdin line,
one JSON answer per stdout line (so a crash is blamed on the entry in progress).

Request: {"key", "obj", "so", "kernel", "module", "params", "run"}.
Answer:  {"key", "ok", "how", "error"}."""

from __future__ import annotations

import json
import os
import sys
import traceback


def _answer(d: dict) -> None:
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()


def _one(req: dict, keep: list) -> dict:
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
            out["error"] = f"wrong result: {str(e)[:500]}"
            return out
        except Exception as e:  # noqa: BLE001
            out["error"] = f"run failed: {type(e).__name__}: {str(e)[:300]}\n" + traceback.format_exc()[-800:]
            return out
    out["ok"] = True
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m quack_build.verify.child")
    ap.add_argument("--sys-path", default="", help="the parent's sys.path, os.pathsep-joined")
    extra = ap.parse_args(argv).sys_path
    if extra:
        for p in reversed(extra.split(os.pathsep)):
            if p and p not in sys.path:
                sys.path.insert(0, p)
    keep: list = []
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        if req.get("op") == "gpu":
            try:
                import torch

                _answer({"gpu": bool(torch.cuda.is_available())})
            except Exception as e:  # noqa: BLE001
                _answer({"gpu": False, "error": str(e)})
            continue
        _answer(_one(req, keep))


if __name__ == "__main__":
    main()
