"""The kernel registry: name -> KernelSpec (compile function + typed params)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import re
import sys
import time
from typing import Any, Callable, Iterable

from quack.errors import ParamError, UnknownKernel
from quack.params import Param, Rule, plain

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# The target arch: not a parameter (it is already in every key), but a compile function
# that declares it gets it, and a Rule naming it sees it (issue 27).
ARCH = "arch"
_REGISTRY: dict[str, "KernelSpec"] = {}


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: Callable
    params: dict[str, Param]
    defaults: dict[str, Any]
    module: str
    qualname: str
    version: int = 0
    reference: str | None = None  # "module:function" for `quack verify --run`
    rules: tuple[Rule, ...] = ()  # cross-parameter constraints (quack.params.Rule)
    takes_arch: bool = False  # the compile function declares `arch`: it gets the target arch
    # Extra files / modules its fingerprint covers (quack.cache.sources; docs/writing-kernels.md)
    depends_on: tuple[str, ...] = ()
    # `quack tune` (docs/tuning.md): search_space(bound params) -> candidate configs;
    # bench: "module:function" (params, device=, **sizes) -> a zero-argument call to time,
    # sizes = the problem's (below; a row kernel's: m, its rows)
    search_space: Callable | None = None
    bench: str | None = None
    # the sizes a tuning problem names beyond the compile parameters (docs/tuning.md): ()
    # for a row kernel (its N is a parameter, its M rows ``quack tune --rows``); the GEMM's
    # ("m", "n", "k"), given by a tuning manifest's ``problems = [[m, n, k], ...]``
    problem: tuple[str, ...] = ()
    # when this process registered the kernel (time.time_ns(), the clock file ctimes use):
    # a covered file whose status changed after it may hold code this process does not run
    loaded_ns: int = dataclasses.field(default_factory=time.time_ns, compare=False)

    def bind(self, args: tuple = (), kwargs: dict | None = None, arch: str | None = None) -> dict[str, Any]:
        """Check and canonicalize a call's or a manifest's parameters, defaults applied,
        in declaration order. Raises ParamError naming the kernel and parameter. With
        ``arch``, the rules naming ``arch`` are applied too (``check_arch``)."""
        kwargs = dict(kwargs or {})
        names = list(self.params)
        if len(args) > len(names):
            raise ParamError(
                f"{self.name}: takes {len(names)} parameters ({', '.join(names)}), "
                f"got {len(args)} positional",
                kernel=self.name,
            )
        for n, a in zip(names, args):
            if n in kwargs:
                raise ParamError(f"{self.name}: parameter {n!r} given twice", kernel=self.name, param=n)
            kwargs[n] = a
        unknown = [k for k in kwargs if k not in self.params]
        if unknown:
            raise ParamError(
                f"{self.name}: unknown parameter {unknown[0]!r}; parameters are " + ", ".join(names),
                kernel=self.name,
                param=str(unknown[0]),
            )
        out = {}
        for n, p in self.params.items():
            if n in kwargs:
                v = kwargs[n]
            elif n in self.defaults:
                v = self.defaults[n]
            else:
                raise ParamError(
                    f"{self.name}: missing parameter {n!r} ({p.describe()})", kernel=self.name, param=n
                )
            try:
                out[n] = p.check(n, v)
            except ParamError as e:
                raise ParamError(f"{self.name}: {e}", kernel=self.name, param=n) from None
        for n in self.derived_params:  # a derived default (quack.params.Config(derive=...))
            if out[n] is None:
                out[n] = self._derive(n, self.params[n], out, arch)
        for rule in self.rules:  # after each value is valid alone: the combination
            if rule.param != ARCH:
                rule.apply(self.name, out)
        if arch is not None:
            self.check_arch(out, arch)
        return out

    def _derive(self, n: str, p: Any, out: dict[str, Any], arch: str | None) -> Any:
        # Without an arch (a worker re-binding a request, a manifest checked before its
        # archs) the process's target arch: the one a run-time call keys for.
        if arch is None:
            from quack import settings

            arch = settings.get().arch
        others = {k: v for k, v in out.items() if k != n}
        from quack.tuning.override import override

        forced = override(self.name)  # quack.tuning.use_config: a candidate under test
        try:
            return p.check(n, forced if forced is not None else p.derive(others, arch))
        except ParamError as e:
            raise ParamError(f"{self.name}: default {n}: {e}", kernel=self.name, param=n) from None

    def derive_at(
        self, params: dict[str, Any], sizes: dict[str, int], arch: str, names: Iterable[str] | None = None
    ) -> dict[str, Any]:
        """``params`` (bound) with each derived parameter (or those in ``names``) chosen for a
        problem of ``sizes`` (the kernel's ``problem`` names: the GEMM's m, n, k) as a run-time
        call of that shape chooses it, validated: the tuning table's row, else the heuristic.
        One answer for the build (an entry's ``problems``), ``quack tune`` (today's default
        per size) and a miss's suggested manifest entry. A ``use_config`` override is not
        applied: these ask what the table chooses. Raises ParamError for a bad derived value."""
        out = dict(params)
        for n in self.derived_params if names is None else names:
            p: Any = self.params[n]  # a Config with derive= (derived_params)
            others = {k: v for k, v in params.items() if k != n}
            try:
                out[n] = p.check(n, p.derive(dict(others, **sizes), arch))
            except ParamError as e:
                raise ParamError(f"{self.name}: default {n}: {e}", kernel=self.name, param=n) from None
        return out

    def bind_at(
        self,
        given: dict[str, Any],
        bound: dict[str, Any],
        sizes: dict[str, int],
        arch: str,
        names: Iterable[str],
    ) -> dict[str, Any]:
        """``given`` (a manifest entry's or a journal record's parameters, ``bound`` their
        binding) bound again with the derived parameters ``names`` chosen at ``sizes``
        (``derive_at``): the kernel's rules check the chosen values. Raises ParamError."""
        names = tuple(names)
        at = self.derive_at(bound, sizes, arch, names)
        return self.bind((), dict(given, **{n: at[n] for n in names}), arch=arch)

    def check_arch(self, params: dict[str, Any], arch: str) -> None:
        """Apply the rules naming ``arch`` to bound ``params`` for target ``arch`` (manifest
        expansion, once per arch; every run-time call): an SM90-only kernel listed for
        sm_100a is refused here, with the rule's words, not inside the compiler."""
        for rule in self.rules:
            if rule.param == ARCH:
                rule.apply(self.name, dict(params, arch=arch))

    def encode(self, params: dict[str, Any]) -> dict:
        return {n: self.params[n].encode(v) for n, v in params.items()}

    def key(self, params: dict[str, Any], arch: str) -> str:
        # Imported here, not at the top: registering a kernel (importing its module)
        # needs no key; the first call does.
        from quack.cache import keys

        return keys.make_key(self.name, self.encode(params), arch, self.version)

    def plain(self, params: dict[str, Any]) -> dict[str, Any]:
        return {n: plain(v) for n, v in params.items()}

    @property
    def derived_params(self) -> tuple[str, ...]:
        """The parameters whose default ``bind`` derives (a tuned kernel's configuration,
        chosen by a tuning table: by GPU model), so a call that leaves them out gets a key
        that depends on where it runs."""
        return tuple(n for n, p in self.params.items() if getattr(p, "derive", None) is not None)

    @property
    def shippable(self) -> bool:
        """Can a worker process import this compile function by name?"""
        return self.module != "__main__" and "<locals>" not in self.qualname

    def source_fingerprint(self) -> str:
        """The fingerprint of the source this kernel's objects are filed under (the cache
        directory's ``srcfp``): its module and everything it imports (quack.cache.keys).
        A kernel of a script (``__main__``): the script's file like any module's; one with
        no file (a notebook, ``python -c``): its own source and that of what it names in
        ``__main__``. (Every ``__main__`` kernel shared the constant "main": a script
        edited since, or another script's kernel of the same name, loaded stale code.)"""
        from quack.cache import keys

        if self.module == "__main__" and _main_file() is None:
            return _code_fingerprint(self.fn)
        return keys.source_fingerprint(
            self.module, memo=_fingerprint_memo(), depends_on=self.depends_on, kernel=self.name
        )

    def changed_since_load(self) -> list[str]:
        """The files of the fingerprint's coverage whose status (ctime) changed after this
        kernel was registered here: the code this process would compile may differ from
        what ``source_fingerprint`` (read from the files now) names, and an object of the
        old code filed under the new fingerprint would be loaded by every later process
        (a compile worker forked from a forkserver that imported the kernel before an
        edit did exactly that). ctime, not mtime: set by this machine's clock, never by
        an archive or ``touch -d``. Empty for a ``__main__`` kernel without a file (its
        fingerprint is its live code)."""
        if self.module == "__main__" and _main_file() is None:
            return []
        from quack.cache import keys

        return keys.changed_since(self.module, self.loaded_ns, self.depends_on, self.name)

    def coverage(self):
        """What source_fingerprint covers (a quack.cache.sources.Coverage), walked afresh."""
        from quack.cache import keys

        return keys.coverage(self.module, self.depends_on, self.name)


def _main_file() -> str | None:
    """The script ``__main__`` runs, if it is a .py file (None: a REPL, a notebook, -c)."""
    f = getattr(sys.modules.get("__main__"), "__file__", None)
    return f if isinstance(f, str) and f.endswith(".py") else None


def _code_fingerprint(fn: Callable) -> str:
    """16 hex digits over the source of ``fn`` and of every function or class of
    ``__main__`` it names, transitively (helpers defined in other notebook cells), by
    name; the byte code where the source cannot be read."""
    main = sys.modules.get("__main__")
    parts: dict[str, bytes] = {}
    todo: list = [("", fn)]
    while todo:
        name, obj = todo.pop()
        if name in parts:
            continue
        obj = inspect.unwrap(obj) if callable(obj) else obj
        try:
            text = inspect.getsource(obj).encode()
        except (OSError, TypeError):
            code = getattr(obj, "__code__", None)
            text = repr(code.co_code + repr(code.co_consts).encode()).encode() if code else b""
        parts[name] = text
        code = getattr(obj, "__code__", None)
        names: set[str] = set()
        stack = [code] if code is not None else []
        while stack:  # names used by the function and its nested functions / lambdas
            c = stack.pop()
            names.update(c.co_names)
            stack.extend(k for k in c.co_consts if inspect.iscode(k))
        for n in sorted(names):
            ref = getattr(main, n, None)
            if (
                n not in parts
                and getattr(ref, "__module__", None) == "__main__"
                and (inspect.isfunction(ref) or inspect.isclass(ref))
            ):
                todo.append((n, ref))
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(name.encode() + b"\0" + parts[name] + b"\0")
    return h.hexdigest()[:16]


def _fingerprint_memo():
    """The source-fingerprint memo of this process's cache (quack.cache.fpmemo), or None
    (cache disabled; settings invalid, which the caller's own settings.get() reports)."""
    from quack import settings
    from quack.cache import fpmemo

    try:
        s = settings.get()
    except Exception:  # noqa: BLE001
        return None
    return fpmemo.for_root(s.cache_dir) if s.cache_enabled else None


def register(
    name: str,
    fn: Callable,
    params: dict[str, Param],
    *,
    version: int = 0,
    reference: str | None = None,
    rules=(),
    depends_on=(),
    search_space: Callable | None = None,
    bench: str | None = None,
    problem: tuple[str, ...] = (),
) -> KernelSpec:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(f"kernel name {name!r} must match {NAME_RE.pattern}")
    if not isinstance(params, dict):
        # a list or None gave "AttributeError: 'list' object has no attribute 'items'"
        raise TypeError(
            f"kernel {name}: params= must be a dict of parameter name -> quack.params.Param "
            f"(e.g. {{'block': Int(min=32)}}, or {{}} for none), got {params!r}"
        )
    for pn, p in params.items():
        if not isinstance(pn, str) or not pn.isidentifier():
            raise TypeError(f"kernel {name}: parameter name {pn!r} must be a str, a Python identifier")
        if not isinstance(p, Param):
            raise TypeError(f"kernel {name}: parameter {pn!r} must be a quack.params.Param, got {p!r}")
    if ARCH in params:
        raise TypeError(
            f"kernel {name}: {ARCH!r} is reserved, not a parameter (the target arch is in every "
            f"key already): declare it in the compile function's signature to receive it, and "
            f"refuse archs with quack.params.Rule('arch', ...)"
        )
    sig = inspect.signature(fn)
    sig_names = [
        n
        for n, prm in sig.parameters.items()
        if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY) and n != ARCH
    ]
    takes_arch = ARCH in sig.parameters
    if sorted(sig_names) != sorted(params):
        raise TypeError(
            f"kernel {name}: compile function parameters {sig_names} "
            f"don't match declared params {list(params)}"
        )
    rules = tuple(rules)
    for r in rules:
        if not isinstance(r, Rule) or (r.param not in params and r.param != ARCH) or not callable(r.check):
            raise TypeError(
                f"kernel {name}: rules must be quack.params.Rule(param, allowed, check) "
                f"naming one of its parameters {list(params)} or {ARCH!r}, got {r!r}"
            )
    depends_on = _check_depends_on(name, fn, depends_on)
    problem = tuple(problem)
    if problem and (
        len(set(problem)) != len(problem)
        or not all(isinstance(d, str) and d.isidentifier() for d in problem)
        or set(problem) & set(params)
    ):
        # a size that is also a parameter would be given twice (compile key and problem)
        raise TypeError(
            f"kernel {name}: problem= must name distinct sizes (identifiers) that are not "
            f"parameters ({list(params)}), got {problem!r}"
        )
    defaults = {
        n: prm.default for n, prm in sig.parameters.items() if prm.default is not prm.empty and n != ARCH
    }
    for n, v in defaults.items():
        # A default its own Param refuses (``def f(n=5000)`` with ``Int(max=10)``) failed
        # every call that omits it, blaming the caller; refused here, naming the kernel.
        try:
            params[n].check(n, v)
        except ParamError as e:
            raise ParamError(
                f"kernel {name}: the compile function's default for {e}; "
                f"change the default or widen the parameter's spec",
                kernel=name,
                param=n,
            ) from None
    spec = KernelSpec(
        name,
        fn,
        dict(params),
        defaults,
        fn.__module__,
        fn.__qualname__,
        version,
        reference,
        rules,
        takes_arch,
        depends_on,
        search_space,
        bench,
        problem,
    )
    old = _REGISTRY.get(name)
    if old is not None and (old.module, old.qualname) != (spec.module, spec.qualname):
        raise ValueError(f"kernel name {name!r} already registered by {old.module}.{old.qualname}")
    _REGISTRY[name] = spec
    return spec


def _check_depends_on(name: str, fn: Callable, entries) -> tuple[str, ...]:
    """Checked at registration: a typo fails the kernel module's import, naming the kernel
    and the entry, rather than its first call. Raises KernelDependencyError."""
    if not entries:
        return ()
    import sys
    from pathlib import Path

    from quack.cache import sources

    out = sources.check_entries(name, entries)
    f = getattr(sys.modules.get(fn.__module__), "__file__", None)
    sources.resolve(name, out, Path(f).parent if f else Path.cwd())
    return out


def get(name: str) -> KernelSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownKernel(name, tuple(sorted(_REGISTRY))) from None


def all_specs() -> dict[str, KernelSpec]:
    return dict(_REGISTRY)


SCANNED = (
    "every module of each [build] kernel_packages package and of its subpackages, "
    "except modules and subpackages whose name starts with '_' (helpers; a kernel "
    "registered there is found when a scanned module imports it) and those a package "
    "names in its QUACK_SCAN_SKIP tuple (torch-facing modules that register no kernel)"
)


def load_packages(packages) -> None:
    """Import what SCANNED says so the kernels register (a package may also be a single
    module). Cheap: kernel modules import cutlass and torch only inside functions."""
    import pkgutil

    for pkg in packages:
        mod = importlib.import_module(pkg)
        todo = [mod]
        while todo:  # subpackages too, depth first
            m = todo.pop()
            # A package's torch-facing module (quack_kernels.ops registers torch.library ops
            # at import) registers no kernel: scanning it imported torch into every build
            # coordinator and Ray driver, which only need the compile functions.
            skip = set(getattr(m, "QUACK_SCAN_SKIP", ()))
            for info in pkgutil.iter_modules(getattr(m, "__path__", []), prefix=m.__name__ + "."):
                last = info.name.rsplit(".", 1)[-1]
                if last.startswith("_") or last in skip:
                    continue
                sub = importlib.import_module(info.name)
                if info.ispkg:
                    todo.append(sub)


def import_spec(module: str, name: str) -> KernelSpec:
    """In a worker: import the kernel's module, then look the kernel up."""
    if name not in _REGISTRY:
        importlib.import_module(module)
    return get(name)
