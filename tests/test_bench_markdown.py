"""benchmarks/bench_kernels.py --markdown: the results table of docs/kernels.md, from one
run's rows (pure logic, on the CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")  # bench_kernels imports it at the top

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_kernels_md", ROOT / "benchmarks" / "bench_kernels.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_markdown_table_has_a_row_per_op_a_column_per_shape_and_the_stamp():
    rows = [
        {
            "op": "rmsnorm_fwd",
            "m": 32768,
            "n": 4096,
            "ours": (133.0, 4.012),
            "ref": (134.0, 4.0),
            "compile": None,
        },
        {"op": "rmsnorm_fwd", "m": 4096, "n": 262144, "ours": (1034.0, 3.75), "ref": (1000.0, 3.95)},
        {"op": "softmax_fwd", "m": 32768, "n": 4096, "ours": (133.0, 4.03), "ref": (133.0, 4.0)},
    ]
    text = _bench().markdown_table(rows, "Measured at commit abc1234, 2026-01-01, GPU X")
    lines = text.splitlines()
    assert lines[0] == "Measured at commit abc1234, 2026-01-01, GPU X"
    assert lines[2] == "| op: ours / ref / compile (TB/s) | 32768x4096 | 4096x262144 |"
    assert lines[3] == "|---|---|---|"
    assert lines[4] == "| rmsnorm_fwd | 4.01 / 4.00 / - | 3.75 / 3.95 / - |"
    # A shape that did not run for an op (OOM) is said, not left blank.
    assert lines[5] == "| softmax_fwd | 4.03 / 4.00 / - | OOM / not run |"
    assert len(lines) == 6
