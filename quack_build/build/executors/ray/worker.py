"""The Ray actor of ``quack build --executor ray``: a warm, GPU-blind compile worker on a
cluster node that never writes to a cache. It arrives on the node with quack,
quack_build and the kernel packages (runtime_env.py_modules); the node needs only the
toolchain. Imported on the nodes: nothing here imports ray at module level."""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

from quack.errors import CompileError, LinkError


class BuildWorker:
    """The body of a Ray actor: a warm, GPU-blind compile worker that never writes to a
    cache. Constructed once per actor (compiler import + warm-up compile)."""

    def __init__(
        self,
        packages: list[str],
        arch: str,
        stamp_override: str | None = None,
        preload: list[str] = (),  # type: ignore[assignment]
        preload_source: str = "",
    ):
        t0 = time.perf_counter()
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
        os.environ["CUTE_DSL_ARCH"] = arch
        from quack.runtime.ffi import torch_hidden

        # tvm_ffi imports torch when it can (seconds a compile never needs): hide it
        # while the compiler imports, as the local forkserver does.
        with torch_hidden():
            import cutlass.cute  # noqa: F401
            import tvm_ffi  # noqa: F401
        from quack import registry
        from quack.compile import preload as _preload
        from quack.compile.warmup import warm_up

        # [build] preload, once per actor, after cutlass: a module that fails to import
        # fails the actor's start with PreloadError naming it (the coordinator reports it).
        self.preload_s = _preload.ensure(preload, preload_source)
        registry.load_packages(packages)
        warm_up()
        self.arch = arch
        self.stamp_override = stamp_override
        self.warm_s = time.perf_counter() - t0

    def hello(self) -> dict:
        from quack import registry
        from quack.cache import keys

        srcfps = {}
        for name, spec in registry.all_specs().items():
            try:
                srcfps[name] = spec.source_fingerprint()
            except Exception:  # noqa: BLE001 - reported per key if it is built
                pass
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": _node_ip(),
            "node_id": _node_id(),
            "stamp": self.stamp(self.arch),
            "toolchain": keys.toolchain(),
            "srcfps": srcfps,
            "warm_s": round(self.warm_s, 3),
            "preload_s": round(self.preload_s, 3),
        }

    def stamp(self, arch: str) -> str:
        from quack.cache import keys

        return self.stamp_override or keys.toolchain_stamp(arch)

    def build(self, item: dict) -> dict:
        """Compile one key into a temp directory; return its bytes and checksums, or
        {"error": CompileError} with the compiler's text. Never raises for a compile."""
        from quack import registry
        from quack.compile import builder
        from quack.runtime import loader

        t_start = time.time()
        p0 = time.perf_counter()
        kernel, params, arch = item["kernel"], item["params"], item["arch"]
        try:
            spec = registry.import_spec(item["module"], kernel)
            bound = spec.bind((), params)
            key = spec.key(bound, arch)
            srcfp = spec.source_fingerprint()
            with tempfile.TemporaryDirectory(prefix="quack-ray-") as d:
                obj = Path(d) / "k.o"
                seconds = builder.compile_to(spec, bound, arch, obj)
                data = obj.read_bytes()
                so = None
                if loader.can_link():
                    try:
                        loader.link(obj, Path(d) / "k.so")
                        so = (Path(d) / "k.so").read_bytes()
                    except (LinkError, OSError):
                        so = None  # the coordinator links it (or the loader, on first use)
        except CompileError as e:
            return {"error": e, "pid": os.getpid()}
        except BaseException as e:  # noqa: BLE001 - everything goes back as text
            detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            return {"error": CompileError(kernel, params, arch, detail), "pid": os.getpid()}
        return {
            "key": key,
            "srcfp": srcfp,
            "stamp": self.stamp(arch),
            "obj": data,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "so": so,
            "so_sha256": hashlib.sha256(so).hexdigest() if so is not None else "",
            "compile_s": round(seconds, 4),
            "wall_s": time.perf_counter() - p0,
            "t_start": t_start,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def pid(self) -> int:
        return os.getpid()


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        return ""


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return socket.gethostname()
