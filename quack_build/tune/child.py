"""``quack tune``'s measuring process: checks and times candidates, one JSON request per
stdin line, one JSON answer per line of the process's ORIGINAL stdout (the design of
``quack verify``'s loader, quack_build.verify.child: native and Python prints go to stderr,
never into the answers).

Requests: {"op": "hello", "device"} (imports paid, the GPU's context made: the parent's
start-up wait) and {"op": "check" | "time", "id", "kernel", "module", "params" (the plain
bound parameters, the candidate's config among them), "sizes", "device", "reference",
"bench", "timer"}. Answers: {"id", "ok", "time", "wrong", "error", "restart"}.

A candidate runs through the kernel's own op under ``quack.tuning.use_config`` (the
configuration in the key, as in-process tuning did). A check whose comparison fails
(AssertionError) is a wrong result and the process goes on. Any other failure is answered
with ``restart`` and the process ends: a faulting launch ("CUDA error: unspecified launch
failure") is sticky, every later launch of the process fails with it, so on the H200 one bad
candidate used to end the whole ``quack tune`` without naming itself. The device is
synchronised before each answer, so an asynchronous fault is blamed on the request that
launched it, not on the next one."""

from __future__ import annotations

import importlib
import json
import traceback

from quack_build.verify.serve import serve

_CALL: dict = {}  # the current problem's timed call (its tensors), one problem at a time


def _resolve(ref: str):
    mod, _, fn = ref.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _hello(req: dict) -> dict:
    import quack.registry  # noqa: F401 - imports paid inside the start-up wait, not a candidate's
    import quack.tuning  # noqa: F401

    device = req.get("device", "cuda")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return {"ready": False, "error": "no CUDA GPU is visible to the measuring process"}
        torch.zeros(1, device=device).add_(1)  # the context, made before the first candidate's time limit
        _sync(device)
    return {"ready": True}


def _one(req: dict) -> dict:
    from quack import registry
    from quack.tuning import use_config

    out: dict = {"id": req["id"], "ok": False}
    device = req.get("device", "cuda")
    try:
        spec = registry.import_spec(req["module"], req["kernel"])
        cfg = spec.bind((), req["params"])["config"]
        with use_config(spec.name, cfg):
            if req["op"] == "check":
                try:
                    _resolve(req["reference"])(dict(req["params"], config=cfg), device)
                except AssertionError as e:
                    out["wrong"] = f"wrong result: {str(e)[:500]}"
                    return out
            else:
                ident = json.dumps([req["kernel"], req["bench"], req["sizes"], device], sort_keys=True)
                ident += json.dumps({k: v for k, v in req["params"].items() if k != "config"}, sort_keys=True)
                if ident not in _CALL:
                    _CALL.clear()  # the last problem's tensors go before this one's are made
                    _CALL[ident] = _resolve(req["bench"])(dict(req["params"]), device=device, **req["sizes"])
                timer = _resolve(req.get("timer") or "quack.tuning.bench:gpu_time")
                out["time"] = float(timer(_CALL[ident], device=device))
            _sync(device)
    except Exception as e:  # noqa: BLE001 - any failure may have poisoned the CUDA context
        text = " ".join(str(e).split())[:400] or type(e).__name__
        out["error"] = f"{type(e).__name__}: {text}"
        out["trace"] = traceback.format_exc()[-1500:]
        out["restart"] = True
        return out
    out["ok"] = True
    return out


def _handle(req: dict) -> dict:
    if req.get("op") == "hello":
        try:
            return _hello(req)
        except Exception as e:  # noqa: BLE001
            return {"ready": False, "error": f"{type(e).__name__}: {e}"}
    # an answer with "restart" ends the process: a fresh CUDA context for the next candidate
    return _one(req)


def main(argv: list[str] | None = None) -> None:
    serve("python -m quack_build.tune.child", _handle, argv)


if __name__ == "__main__":
    main()
