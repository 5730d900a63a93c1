"""``quack tune`` on a GPU: a real search writes its winner to the table (the CPU side:
test_tune_cli.py)."""

import json

import pytest
from test_tune_cli import _quack


@pytest.mark.skipif(not __import__("conftest").has_gpu(), reason="needs a CUDA GPU")
def test_tune_writes_a_winner_on_the_gpu(tmp_path):
    table = tmp_path / "t.toml"
    m = tmp_path / "m.toml"
    m.write_text(
        '[defaults]\narchs = ["sm_90a"]\n[[kernel]]\nname = "rmsnorm_fwd"\n[kernel.params]\n'
        'dtype = "bfloat16"\nn = 65536\nweight_dtype = "float32"\n'
    )
    r = _quack(
        "tune",
        str(m),
        "--kernel",
        "rmsnorm_fwd",
        "--budget",
        "3c",
        "--rows",
        "4096",
        "--table",
        str(table),
        "--from-empty",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    (p,) = out["problems"]
    assert p["new"] and p["written"] and not p["refused"]
    from quack.tuning import Table

    t = Table.load(table)
    (row,) = t.rows
    assert row.kernel == "rmsnorm_fwd" and row.n == (65536, 65536) and row.time_us > 0 and row.date
