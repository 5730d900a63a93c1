"""Default configurations from the tuning tables (``kernels/tuned/<arch>.toml``;
docs/tuning.md): ``default_config`` = the kernel's problem class (its readable heuristic:
which kind of plan the problem gets) + a table lookup by (kernel, GPU model, class, dtype,
N). No row: the config the caller's heuristic gives (``fallback``).

The derived configuration is a parameter of the compile function, so it is in the cache
key: editing a table changes exactly the keys whose configuration it changes. The tables
are read once per process (``reload`` after writing one: ``quack tune``)."""

import functools
import warnings
from pathlib import Path

TABLE_DIR = Path(__file__).parent / "tuned"
_warned: set = set()
#: kernel -> the pattern of the class names its classifier produces (``declare_classes``):
#: a row naming another class (a typo, a class renamed since) was never used, silently
_CLASSES: dict = {}


def declare_classes(kernel: str, pattern: str) -> None:
    """Declare the class names ``kernel``'s classifier produces (a regular expression,
    matched whole): its table rows are checked against it (``check_rows``)."""
    import re

    _CLASSES[kernel] = re.compile(pattern)


#: size_class's names (kernels/_plan.py): the row-length classes, fp32 rows apart
SIZE_CLASSES = r"(f32/)?(tiny|small|mid|cluster|large)"


@functools.lru_cache(maxsize=256)
def check_rows(t, kernel: str) -> None:
    """Refuse a row of ``kernel`` in table ``t`` that no lookup could ever reach: a class
    its classifier never produces, an unknown dtype, a GPU name not in its normalised form
    (rows are looked up by ``normalise_gpu``'s names). Once per table and kernel (an error
    is not cached: it is raised on every call). Raises TuningTableError naming the row."""
    from quack.errors import TuningTableError
    from quack.params import ALL_DTYPES
    from quack.tuning import normalise_gpu

    pattern = _CLASSES.get(kernel)
    for i, r in enumerate(t.rows, 1):
        if r.kernel != kernel:
            continue
        where = dict(row=i) if t.path else {}
        what = f"row {kernel} {r.cls} n={list(r.n)}: "
        if pattern is not None and not pattern.fullmatch(r.cls):
            raise TuningTableError(
                t.path or "<table>",
                what + f"class {r.cls!r} is not one {kernel} produces (they match {pattern.pattern})",
                field="class",
                **where,
            )
        bad = [d for d in r.dtype if d not in ALL_DTYPES]
        if bad:
            raise TuningTableError(
                t.path or "<table>",
                what + f"dtype {bad[0]!r} is not one of {', '.join(ALL_DTYPES)}",
                field="dtype",
                **where,
            )
        if normalise_gpu(r.gpu) != r.gpu:
            raise TuningTableError(
                t.path or "<table>",
                what + f"gpu {r.gpu!r}: write {normalise_gpu(r.gpu)!r} (the normalised model name)",
                field="gpu",
                **where,
            )


@functools.lru_cache(maxsize=None)
def table(arch: str):
    """The arch's table, or None when there is none (``TuningTableError`` when malformed:
    a bad table must not silently fall back to untuned defaults)."""
    from quack.tuning import Table

    path = TABLE_DIR / f"{arch}.toml"
    return Table.load(path) if path.is_file() else None


def active_table(arch: str):
    """The table in force: one ``quack.tuning.use_table`` set for this block (a side-by-side
    comparison of two tables), else the checked-in one."""
    from quack.tuning import table_override

    t = table_override(arch)
    return t if t is not None else table(arch)


def table_path(arch: str) -> Path:
    return TABLE_DIR / f"{arch}.toml"


def reload() -> None:
    table.cache_clear()
    check_rows.cache_clear()
    _lookup.cache_clear()
    _from_row.cache_clear()
    _derived.clear()
    _warned.clear()


def gpu_for(arch: str) -> str | None:
    """The GPU model whose rows apply (``quack.tuning.gpu``), None without a table."""
    return gpu_of(active_table(arch))


def gpu_of(t) -> str | None:
    """The GPU model whose rows of table ``t`` apply here (None: no table)."""
    from quack.tuning import current_gpu

    return current_gpu(t.default_gpu if t is not None else None)


@functools.lru_cache(maxsize=4096)
def _lookup(t, kernel: str, cls: str | None, dtype: str, n: int, arch: str, gpu: str | None):
    if t is None or gpu is None or not any(r.gpu == gpu for r in t.rows):
        if (arch, gpu) not in _warned:
            _warned.add((arch, gpu))
            where = f"no tuning table for {arch}" if t is None else f"no tuning-table rows for GPU {gpu!r}"
            warnings.warn(
                f"quack_kernels: {where} ({table_path(arch)}): untuned heuristic defaults; run "
                f"`quack tune` on {'a ' + gpu if gpu else 'the GPU'} to measure winners (rows are "
                "keyed by GPU model: the detected one, or [tune] gpu / QUACK_TUNE_GPU)",
                stacklevel=4,
            )
        return None
    if (arch, gpu, kernel) not in _warned and not any(r.gpu == gpu and r.kernel == kernel for r in t.rows):
        # the GPU was tuned, this kernel only for others (the H100's rows of session 21 hold
        # the norms, softmax and cross-entropy, not the GEMM): the GEMM ran its heuristic
        # there and nothing said so. A kernel whose rows everywhere keep the heuristic ({}:
        # the H100's softmax forward) says nothing: the heuristic is what was measured best.
        _warned.add((arch, gpu, kernel))
        others = sorted({r.gpu for r in t.rows if r.kernel == kernel and r.config})
        if others:
            warnings.warn(
                f"quack_kernels: no tuning-table rows for {kernel} on GPU {gpu!r} ({table_path(arch)}; "
                f"rows for {', '.join(others)}): untuned heuristic defaults; run "
                f"`quack tune --kernel {kernel}` on a {gpu} to measure winners",
                stacklevel=4,
            )
    if cls is None:
        return None
    row = t.lookup(kernel, gpu, cls, dtype, n)
    if row is None:
        return None
    # where a bad value is: the table's file (an in-memory table has none) and the row
    return dict(row.config), (f"{t.path}: " if t.path else "") + f"row {kernel} {cls} n={list(row.n)}"


def default_config(kernel: str, cfg_cls, cls: str | None, dtype: str, n: int, arch: str, fallback=None):
    """The table's configuration for the problem, else ``fallback`` (else the empty one:
    every knob at the kernel's heuristic)."""
    t = active_table(arch)
    if t is not None:
        check_rows(t, kernel)
    hit = _lookup(t, kernel, cls, dtype, n, arch, gpu_of(t))
    if hit is None:
        return fallback if fallback is not None else _empty(cfg_cls)
    try:
        return _from_row(cfg_cls, tuple(sorted(hit[0].items())), hit[1])
    except TypeError:  # an unhashable value (a list in a hand-edited row): from_dict names it
        return cfg_cls.from_dict(hit[0], where=hit[1])


@functools.lru_cache(maxsize=None)
def _empty(cfg_cls):
    """The configuration with every knob at the heuristic, one per class (it is frozen)."""
    return cfg_cls()


@functools.lru_cache(maxsize=4096)
def _from_row(cfg_cls, items: tuple, where: str):
    """A row's configuration, built and validated once: the instance is frozen, and a bind
    derives one on every call (a sweep over N binds ~100k: ``from_dict`` was a sixth of it)."""
    return cfg_cls.from_dict(dict(items), where=where)


def derive(kernel: str, cfg_cls, classify, fallback=None, n_range=None, classes=None):
    """A ``quack.params.Config(derive=...)`` callable: ``classify(params) -> class or None``,
    ``fallback(params) -> config or None`` (the heuristic's own choice), ``n_range(params)
    -> (lo, hi)``: the N range a winner's row covers (default: its own N only; the GEMM's
    rows cover the N bucket its class names); ``classes``: the pattern of the class names
    ``classify`` produces (``declare_classes``)."""
    if classes is not None:
        declare_classes(kernel, classes)

    def _derive(params: dict, arch: str):
        fb = fallback(params) if fallback is not None else None
        # a family without a row length among its parameters (the GEMM: every shape is one
        # object) classifies to None here and gets ``fallback``; its wrapper looks rows up
        return default_config(
            kernel, cfg_cls, classify(params), params["dtype"], params.get("n", 0), arch, fb
        )

    _derive.__qualname__ = f"derive[{kernel}]"
    _derive.classify = classify  # type: ignore[attr-defined]  # quack tune: a winner's row class
    _derive.table_path = table_path  # type: ignore[attr-defined]  # quack tune: where rows go
    _derive.n_range = n_range or _own_n  # type: ignore[attr-defined]  # quack tune: a row's N range
    _derive.check_rows = functools.partial(check_rows, kernel=kernel)  # type: ignore[attr-defined]
    return _derive


def _own_n(params: dict) -> tuple[int, int]:
    n = int(params.get("n", 0))
    return n, n


def derived_config(spec, args: tuple):
    """The configuration a run-time call of ``spec`` with positional ``args`` compiles:
    ``spec.bind(args)["config"]`` for the process's arch, once per (args, arch, table in
    force, GPU model, ``use_config`` override). A bind per call re-derived it from the
    table and validated every parameter: ~50 us of a ~100 us RMSNorm call's host time on
    the H200, where torch's whole call takes 15."""
    from quack.tuning.override import override

    arch = runtime_arch()
    forced = override(spec.name)
    # the spec by identity (it holds dicts: unhashable); specs live in the registry for good.
    # The argument types are in the key, as in jit_cache's memo (quack/runtime/jit.py):
    # True == 1 and 4096 == 4096.0 hash alike, and a bad type must still reach bind's check.
    # A use_config override is the configuration, whatever the table says: the table is not
    # read then (quack tune --from-empty measures candidates where the table is broken).
    if forced is not None:
        key = (id(spec), args, tuple(map(type, args)), arch, forced)
    else:
        t = active_table(arch)
        key = (id(spec), args, tuple(map(type, args)), arch, t, gpu_of(t))
    cfg = _derived.get(key)
    if cfg is None:
        if len(_derived) >= 4096:  # bounded: a sweep over N binds ~100k distinct calls
            _derived.clear()
        cfg = _derived[key] = spec.bind(args, {}, arch=arch)["config"]
    return cfg


_derived: dict = {}


def runtime_arch() -> str:
    from quack import settings

    return settings.get().arch
