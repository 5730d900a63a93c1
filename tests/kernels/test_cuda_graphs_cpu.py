"""CPU tier: the torch-facing kernel modules call nothing that waits for the GPU.

A CUDA graph capture fails on a host synchronisation (``.item()``, ``.cpu()``, a
data-dependent shape such as ``nonzero``), and torch.compile's CUDA graphs partition the graph
around it; outside a capture it stalls the launch queue, the host time a small op's latency
is made of. The GPU tier checks the ops inside real captures
(test_cuda_graphs_gpu.py); this scan keeps such a call out of the wrappers on machines
without a GPU, where CI runs. The references and the verify hooks (``_reference``,
``_verify*``) run outside the ops and may synchronise."""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
# methods / functions that wait for the device, or whose result's shape depends on data
SYNCING = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero", "masked_select", "unique"}
EXEMPT = ("_reference.py", "_verify.py", "_verify_gemm.py")


def syncing_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of each call of a SYNCING method or function in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in SYNCING:
                out.append((node.lineno, name))
    return out


def test_the_scan_finds_what_it_looks_for():
    src = "def f(x, t):\n    n = int(x.sum().item())\n    return t.nonzero(), torch.cuda.synchronize()\n"
    assert syncing_calls(src) == [(2, "item"), (3, "nonzero"), (3, "synchronize")]


def test_torch_facing_kernel_modules_never_synchronise_with_the_host():
    scanned, found = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        if path.name in EXEMPT:
            continue
        scanned += 1
        found += [f"{path.name}:{line}: {name}()" for line, name in syncing_calls(path.read_text())]
    assert scanned >= 20, f"only {scanned} modules under {KERNELS}"
    assert not found, "host synchronisation in the ops' path (breaks CUDA graph capture):\n" + "\n".join(
        found
    )
