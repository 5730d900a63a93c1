"""Exceptions (and the one warning category) of quack. All carry fields and pickle
cleanly: they cross the boundary between compile workers and the caller.

This module imports nothing from quack, so any module can import it."""

from __future__ import annotations

import re
import signal as _signal

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")  # colour codes in compiler output


class QuackError(Exception):
    """Base of quack's ordinary errors."""

    def __reduce__(self):
        # Exceptions with keyword-only fields don't survive pickle's default
        # (args-only) reduction; rebuild from __dict__ so a worker's error
        # arrives in the caller intact.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls, args, state):
    obj = cls.__new__(cls)
    Exception.__init__(obj, *args)
    obj.__dict__.update(state)
    return obj


class SettingsError(QuackError, ValueError):
    """A setting in quack.toml or the environment is malformed or unknown."""

    def __init__(self, message: str, *, source: str = "", key: str = ""):
        super().__init__(message)
        self.source = source
        self.key = key


class ParamError(QuackError, ValueError):
    """A kernel parameter is unknown, missing, of the wrong type or out of range."""

    def __init__(self, message: str, *, kernel: str = "", param: str = ""):
        super().__init__(message)
        self.kernel = kernel
        self.param = param


class KernelDependencyError(QuackError, ValueError):
    """A kernel's ``depends_on`` entry is malformed or names nothing that exists."""

    def __init__(self, kernel: str, entry: str, reason: str):
        super().__init__(f"kernel {kernel or '?'}: depends_on entry {entry!r}: {reason}")
        self.kernel = kernel
        self.entry = entry
        self.reason = reason


class UnknownKernel(QuackError, KeyError):
    """No kernel is registered under this name."""

    def __init__(self, name: str, known: tuple[str, ...] = ()):
        super().__init__(name)
        self.name = name
        self.known = tuple(known)

    def __str__(self) -> str:
        known = ", ".join(self.known) or "(none)"
        return f"unknown kernel {self.name!r}; registered kernels: {known}"


class KernelNotPrebuilt(QuackError, LookupError):
    """Prebuilt mode: the requested kernel is not in the cache, and nothing compiles."""

    def __init__(
        self,
        kernel: str,
        params: dict,
        arch: str,
        key: str,
        cache_dir: str,
        manifest_line: str = "",
        bundles: tuple[str, ...] = (),
        *,
        reason: str = "",
        tuned_for: str = "",
    ):
        # manifest_line: the manifest entry that would build it (quack.manifest_line),
        # made by the raiser so that this module imports nothing from quack.
        # tuned_for: for a kernel whose configuration a tuning table chooses, the GPU model
        # whose rows chose it and why ("H100 (this process's CUDA device)"): a build on
        # another machine keys for its own GPU's rows, and every call then misses (README
        # command 2 on an H100 before the build asked NVML: 179 of these, none saying why).
        self.kernel = kernel
        self.params = dict(params)
        self.arch = arch
        self.key = key
        self.cache_dir = cache_dir
        self.manifest_line = manifest_line
        self.bundles = tuple(bundles)  # "name version (n entries for this toolchain)" per bundle searched
        self.reason = reason  # why nothing could be loaded, when it is not a plain miss
        self.tuned_for = tuned_for
        super().__init__(self._message())

    def _message(self) -> str:
        line = self.manifest_line
        return (
            f"kernel {self.kernel!r} with {self.params} for {self.arch} is not prebuilt "
            f"(key {self.key[:16]}, cache {self.cache_dir}; "
            f"bundles searched: {'; '.join(self.bundles) or 'none installed'})"
            + (f": {self.reason}" if self.reason else "")
            + ".\n"
            + (
                f"Its configuration, where the call leaves it to the tuning table, comes from the "
                f"tuning rows of {self.tuned_for}; a build keys for the GPU of the machine it runs "
                "on (or QUACK_TUNE_GPU / [tune] gpu): build where these calls run, or name their "
                "GPU model: `quack build --gpu MODEL` (repeatable: several models in one cache or "
                "bundle).\n"
                if self.tuned_for
                else ""
            )
            + f"Add this to a manifest:\n{line}\n"
            f"and run: quack build --arch {self.arch} MANIFEST  "
            # Prebuilt mode comes from QUACK_MODE, quack.toml or pytest's --quack-prebuilt,
            # and this error can't tell which: naming only QUACK_MODE sent a user whose
            # strict mode came from --quack-prebuilt to unset a variable they never set.
            "(or run without prebuilt mode to compile on demand: QUACK_MODE=prebuilt, "
            '[runtime] mode = "prebuilt" in quack.toml, or pytest\'s --quack-prebuilt)'
        )


class BundleError(QuackError, ValueError):
    """A deployment bundle (or its wheel) is malformed, damaged, or not signed by a
    trusted key. ``bundle`` names it, ``path`` the file at fault."""

    def __init__(self, message: str, *, bundle: str = "", path: str = ""):
        super().__init__(message)
        self.bundle = bundle
        self.path = path


class CompileError(QuackError, RuntimeError):
    """A kernel failed to compile; carries the compiler's traceback text."""

    def __init__(
        self,
        kernel: str,
        params: dict,
        arch: str,
        detail: str,
        log_path: str = "",
        *,
        transient: bool = False,
    ):
        # transient: the compile did not run to its end (worker killed, pool shut down,
        # no worker could start): another attempt may succeed, so it is not remembered.
        self.transient = transient
        self.kernel = kernel
        self.params = dict(params)
        self.arch = arch
        # CuTe DSL colours its diagnostics; the text ends up in logs, pytest reports and
        # JSON, never on a terminal as-is, so the codes go.
        self.detail = _ANSI.sub("", detail)
        self.log_path = log_path
        super().__init__(
            f"compiling {kernel} {self.params} for {arch} failed:\n{self.detail}"
            + (f"\n(full log: {log_path})" if log_path else "")
        )


class SourceChanged(CompileError):
    """The kernel's source changed after this process imported it (``files``: the covered
    files whose status changed since): the code it would compile is not the code the
    source fingerprint now names, so nothing is compiled or published here. In a compile
    worker the pool then starts workers that import the source afresh and asks again; in
    the calling process itself (a kernel a worker cannot import) the fix is to reload the
    module or restart the process. Transient: not remembered as the key's failure."""

    def __init__(self, kernel: str, params: dict, arch: str, files: list, *, in_worker: bool = False):
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        fix = (
            "the compile workers are restarted to import it afresh"
            if in_worker
            else "reload the kernel's module (importlib.reload) or restart the process"
        )
        super().__init__(
            kernel,
            params,
            arch,
            f"error: {kernel}'s source changed after this process imported it ({shown}): what it "
            f"would compile is not what the source fingerprint names, so nothing was built; {fix}",
            transient=True,
        )
        self.files = list(files)


class PreloadError(CompileError):
    """A module named in ``[build] preload`` (QUACK_PRELOAD) failed to import in a compile
    worker: no key can compile there. A CompileError (a runtime call that needed the
    worker raises it as one) that names the module and where it was set, with the
    import's traceback; ``quack build`` stops at the first and exits non-zero. ``checked``:
    found by ``quack build``'s check before starting any worker (quack.compile.preload.check)
    rather than by a worker's import; ``head`` is the one-line message."""

    def __init__(
        self,
        module: str,
        source: str,
        detail: str,
        *,
        kernel: str = "",
        arch: str = "",
        checked: bool = False,
    ):
        where = f" (set in {source})" if source else ""
        last = next((ln.strip() for ln in reversed(detail.splitlines()) if ln.strip()), "")
        how = (
            "cannot be imported (checked before compiling)"
            if checked
            else "failed to import in the compile worker"
        )
        # An "error:" line first: the one line `quack build` shows for a failed key.
        self.head = f"error: preload module {module!r}{where} {how}: {last}"
        super().__init__(kernel or "?", {}, arch or "?", f"{self.head}\n\n{detail}")
        self.module, self.source, self.checked = module, source, checked
        Exception.__init__(self, self.detail)


class WorkerDied(CompileError):
    """The compile worker of a key died before answering: ``signal`` names the signal that
    killed it (SIGKILL from the OOM killer, SIGSEGV), empty when it exited (``exitcode``).
    Transient; ``quack build`` tries a key whose worker a signal killed once more."""

    def __init__(self, kernel: str, params: dict, arch: str, key: str, pid: int | None, exitcode: int | None):
        sig = ""
        if exitcode is not None and exitcode < 0:
            names = {int(x): x.name for x in _signal.Signals}  # a realtime signal has no name
            sig = names.get(-exitcode, f"signal {-exitcode}")
        how = f"killed by {sig}" if sig else f"exited with status {exitcode}"
        detail = (
            f"compile worker pid {pid} {how} while compiling key {key[:16]} (crash, out of memory, or killed)"
        )
        super().__init__(kernel, params, arch, detail + "; the pool replaced it", transient=True)
        self.key, self.pid, self.exitcode, self.signal = key, pid, exitcode, sig


class OccupancyError(QuackError, RuntimeError):
    """``quack.runtime.max_active_clusters``: the driver could not say how many clusters
    of this shape fit (no GPU, no cuda.bindings, a driver error, or none fit)."""

    def __init__(self, device: int, cluster_size: int, threads: int, smem_bytes: int, reason: str):
        super().__init__(
            f"occupancy query failed on CUDA device {device} for clusters of {cluster_size} CTAs x "
            f"{threads} threads, {smem_bytes} B dynamic shared memory: {reason}"
        )
        self.device, self.cluster_size, self.threads = device, cluster_size, threads
        self.smem_bytes, self.reason = smem_bytes, reason


class CacheError(QuackError, OSError):
    """The cache directory is unusable (unsafe permissions, symlink, not writable)."""

    def __init__(self, message: str, *, path: str = ""):
        super().__init__(message)
        self.path = path


class OutputFileError(QuackError, OSError):
    """A file a command was asked to write (``quack prewarm --emit-manifest PATH``) can't
    be written: ``path`` is a directory, a component of it is a file, no permission, a
    full disk. ``option`` names the option that gave the path, ``reason`` says what is
    wrong; str() is ``option path: reason``."""

    def __init__(self, path: str, reason: str, *, option: str = ""):
        self.path = str(path)
        self.reason = reason
        self.option = option
        super().__init__(f"{option + ' ' if option else ''}{self.path}: {reason}")


class SignatureError(QuackError, ValueError):
    """A signed object is refused: its signer is not trusted (``reason``
    ``untrusted``) or its signature does not verify (``bad-signature``)."""

    def __init__(self, message: str, *, signer: str = "", reason: str = ""):
        super().__init__(message)
        self.signer = signer
        self.reason = reason


class KeyFileError(QuackError, ValueError):
    """A signing or trusted key file is missing, unreadable or malformed."""

    def __init__(self, message: str, *, path: str = "", reason: str = ""):
        super().__init__(message)
        self.path = path
        self.reason = reason


class RemoteError(QuackError, OSError):
    """A remote cache operation failed. ``reason``: ``unreachable`` (refused,
    DNS, reset), ``timeout``, ``full`` (out of memory or quota), ``denied``
    (credentials, permissions), ``protocol`` (an answer that makes no sense).
    ``unreachable`` and ``timeout`` switch the remote off for the process."""

    def __init__(self, message: str, *, url: str = "", reason: str = ""):
        super().__init__(message)
        self.url = url
        self.reason = reason

    @property
    def offline(self) -> bool:
        return self.reason in ("unreachable", "timeout")


class ObjectRejected(QuackError, ValueError):
    """A remote object failed verification (unsigned, untrusted or bad
    signature, another key's object, wrong toolchain or source, truncated or
    altered bytes). It is a miss: never loaded, never stored locally."""

    def __init__(self, message: str, *, key: str = "", reason: str = "", signer: str = ""):
        super().__init__(message)
        self.key = key
        self.reason = reason
        self.signer = signer


class CacheWriteError(CacheError):
    """Writing to the cache failed (disk full, read-only, permission): nothing was
    published and the temp files are gone. ``reason`` is a short label."""

    def __init__(self, message: str, *, path: str = "", reason: str = "", code: int = 0):
        super().__init__(message, path=path)
        self.reason = reason
        self.code = code


class CacheWarning(QuackError, UserWarning):
    """A cache problem quack recovered from (the entry is rebuilt)."""


class RemoteWarning(CacheWarning):
    """A remote cache problem quack recovered from (a miss, a skipped push)."""


class LockTimeout(QuackError, TimeoutError):
    """Another process held the key's lock past the time-out. Callers fall back: a
    runtime miss's pool compiles the key in a worker without publishing it (the holder
    publishes); a kernel no worker can import compiles in-process, unpublished."""

    def __init__(self, path: str, timeout: float):
        super().__init__(f"lock {path} still held after {timeout:.0f} s")
        self.path = path
        self.timeout = timeout


class CompileTimeout(QuackError, TimeoutError):
    """A compile ran past compile_timeout (its worker killed), or (``external``) another
    process held the key's lock without publishing it past the time-out that bounded this
    process's wait for it. ``setting`` names that time-out: "compile_timeout" (the
    process's own compile would have been killed by then) or "lock_timeout" (where it is
    the smaller); ``limit``: its value in seconds; ``holder``: the pid of the process
    holding the lock, where the system says (0 when unknown)."""

    def __init__(
        self,
        kernel: str,
        key: str,
        seconds: float,
        external: bool = False,
        *,
        setting: str = "",
        limit: float | None = None,
        holder: int = 0,
    ):
        setting = setting or ("lock_timeout" if external else "compile_timeout")
        who = f"another process (pid {holder})" if holder else "another process"
        if external and setting == "lock_timeout":  # bounded by lock_timeout (quack.compile.pool)
            msg = (
                f"{who} held the lock of {kernel} key {key[:16]} for {seconds:.0f} s without "
                "publishing it (past lock_timeout: QUACK_LOCK_TIMEOUT or [cache] lock_timeout; stopped or wedged?)"
            )
        elif external:  # compile_timeout, the smaller: the holder's compile ran past it
            msg = (
                f"{who} held the lock of {kernel} key {key[:16]} for {seconds:.0f} s without "
                "publishing it (past compile_timeout: QUACK_COMPILE_TIMEOUT or [runtime] "
                "compile_timeout; its compile wedged?); not compiled in this process, where it "
                "would run as long. If the compile is merely slow, raise compile_timeout"
            )
        else:
            msg = (
                f"compile of {kernel} key {key[:16]} still unfinished after {seconds:.0f} s (its compile "
                "worker; wedged?); the worker was killed. If the compile is merely slow, raise "
                "compile_timeout (QUACK_COMPILE_TIMEOUT or [runtime] compile_timeout)"
            )
        super().__init__(msg)
        self.kernel, self.key, self.seconds, self.external = kernel, key, seconds, external
        self.setting, self.limit, self.holder = setting, limit, holder


class EntryVanished(QuackError, LookupError):
    """The entry was removed (``quack cache clean``) or replaced between its verification
    and its loading. Not corruption: the caller treats it as a miss."""


class LinkError(QuackError, RuntimeError):
    """Linking a cached .o into a loadable shared object failed."""

    def __init__(self, message: str, obj: str = ""):
        super().__init__(message)
        self.obj = obj


class TomlFileError(QuackError, ValueError):
    """A TOML file (manifest, quack.toml) that can't be read or parsed: not a regular
    file, too large, not UTF-8, nested too deeply, or a syntax error. ``line`` and
    ``col`` are 1-based, 0 when unknown; str() is ``path:line:col: problem``."""

    def __init__(self, path: str, problem: str, *, line: int = 0, col: int = 0):
        self.path = str(path)
        self.problem = problem
        self.line = line
        self.col = col
        where = self.path + (f":{line}" if line else "") + (f":{col}" if line and col else "")
        super().__init__(f"{where}: {problem}")


class ManifestError(QuackError, ValueError):
    """One or more problems in the manifests; ``problems`` lists them all."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class CompilePending(BaseException):
    """Control flow, not an error: the kernel is compiling in the background.

    Derived from BaseException on purpose, so test code's ``except Exception``
    cannot swallow it; the pytest plugin catches it and defers the test."""

    def __init__(self, kernel: str, key: str):
        super().__init__(kernel, key)
        self.kernel = kernel
        self.key = key
        self.root: str | None = None  # the cache the compile publishes into
        self.pool: object = None  # the CompilePool compiling it (the plugin polls it)

    def __str__(self) -> str:
        return f"kernel {self.kernel} (key {self.key[:16]}) is still compiling"


class ExecutorError(QuackError, RuntimeError):
    """A build executor cannot run (``quack build --executor ...``): its package is not
    installed, its cluster is unreachable, or no worker it started is usable. The message
    says what to do; ``executor`` names it ("ray"), ``address`` the cluster, if any."""

    def __init__(self, message: str, *, executor: str = "", address: str = ""):
        super().__init__(message)
        self.executor = executor
        self.address = address


class ToolchainMismatch(ExecutorError):
    """A remote build worker's toolchain (Python, cutlass-dsl, its CUDA libraries,
    tvm-ffi) differs from the coordinator's: its objects would not be the ones this
    cache key promises, so the worker is refused."""

    def __init__(
        self,
        message: str,
        *,
        worker_stamp: str = "",
        coordinator_stamp: str = "",
        worker: str = "",
        executor: str = "",
        address: str = "",
    ):
        super().__init__(message, executor=executor, address=address)
        self.worker_stamp = worker_stamp
        self.coordinator_stamp = coordinator_stamp
        self.worker = worker


class TuningTableError(QuackError, ValueError):
    """A tuning table (kernels/tuned/<arch>.toml; docs/tuning.md) with a bad row: an
    unknown field, a wrong type, a duplicate key. ``row`` is 1-based (0: the whole file)."""

    def __init__(self, path: str, problem: str, *, row: int = 0, field: str = ""):
        self.path = str(path)
        self.problem = problem
        self.row = row
        self.field = field
        super().__init__(
            f"{self.path}{f': row {row}' if row else ''}{f' ({field})' if field else ''}: {problem}"
        )


class MeasureError(QuackError, RuntimeError):
    """A tuning candidate could not be measured: its launch faulted (a sticky CUDA error,
    which poisons the process's context), its measuring process died (segfault, abort) or
    hung past its time limit. Not a wrong result (the candidate was never compared), so
    ``quack.compile.autotune`` lists it under ``errors``, not ``refused``. ``restarted``:
    the measuring process was replaced, so the next candidate gets a fresh CUDA context."""

    def __init__(self, kernel: str, config: str, reason: str, *, restarted: bool = False):
        self.kernel = kernel
        self.config = config
        self.reason = reason
        self.restarted = restarted
        super().__init__(f"{kernel} {config}: {reason}")
