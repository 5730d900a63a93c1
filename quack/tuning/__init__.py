"""Typed kernel configurations and tuning tables (issue 25; docs/tuning.md).

A kernel family declares its launch configuration as a ``TuneConfig`` subclass (a frozen,
validated dataclass whose fields are ``knob(...)``s), takes it as a ``Config`` parameter of
its compile function (so it is in the cache key), and picks the default one from a tuning
table (``Table``: a TOML data file beside the kernels) through ``default_config``."""

from quack.gpumodel import normalise_gpu
from quack.tuning.config import TuneConfig, knob
from quack.tuning.gpu import current_gpu, gpu_choice
from quack.tuning.override import table_override, use_config, use_table, without_tables
from quack.tuning.problem import at_problem, current_problem
from quack.tuning.table import Row, Table

__all__ = [
    "TuneConfig",
    "knob",
    "current_gpu",
    "gpu_choice",
    "normalise_gpu",
    "Row",
    "Table",
    "use_config",
    "use_table",
    "without_tables",
    "table_override",
    "at_problem",
    "current_problem",
]
