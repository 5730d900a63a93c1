"""CPU check for README command 2 (issue 24 item 2): every kernel configuration the GPU tests
request (``_requests.requested()``: from the GPU tests' own parametrize marks) is in the
expansion of the manifests README command 2 builds, read from README.md itself, so
`quack build ... && python -m pytest --quack-prebuilt` cannot fail on a GPU machine with
KernelNotPrebuilt."""

import os
import re

import pytest

pytest.importorskip("torch")  # the GPU test modules import it (their data is what is read)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_command2_manifests() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = [
        ln
        for ln in text.splitlines()
        if re.search(r"quack build \S.*&& python -m pytest --quack-prebuilt", ln)
    ]
    assert len(lines) == 1, (
        f"README.md: expected one `quack build ... && pytest --quack-prebuilt` line: {lines}"
    )
    m = re.search(r"quack build((?:\s+\S+\.toml)+)", lines[0])
    assert m, f"README.md command 2 names no manifest: {lines[0]}"
    return m.group(1).split()


def _table_gpus() -> list[str]:
    from quack_kernels import _tuning

    t = _tuning.table("sm_90a")
    return sorted({r.gpu for r in t.rows} | {t.default_gpu})


@pytest.mark.parametrize("gpu", _table_gpus())
def test_readme_command2_manifests_hold_every_configuration_the_gpu_tests_request(gpu):
    """For every GPU model with rows (a build there keys for its rows, and so do its tests:
    quack.tuning.gpu): an H100's rows kept the heuristic at N = 3072, so one of the two
    candidates test_small_row_candidates_match_torch asks for was built nowhere."""
    from _requests import requested

    from quack import registry, settings
    from quack_build.manifest.read import expand

    registry.load_packages(settings.get().kernel_packages)
    paths = [os.path.join(ROOT, p) for p in readme_command2_manifests()]
    with settings.override(tune_gpu=gpu):
        have = {c.key for c in expand(paths).configs if c.arch == "sm_90a"}
        asked = requested()
        missing = []
        for (kernel, items), test in sorted(asked.items(), key=repr):
            spec = registry.get(kernel)
            if spec.key(spec.bind((), dict(items)), "sm_90a") not in have:
                missing.append(f"{kernel} {dict(items)} (first asked by {test})")
    assert not missing, (
        f"{gpu}: {len(missing)} of {len(asked)} configurations the GPU tests request are in none of "
        f"README command 2's manifests {readme_command2_manifests()}:\n" + "\n".join(missing[:40])
    )


def test_the_enumeration_reads_the_gpu_tests_real_parameters():
    """Issue 24's first KernelNotPrebuilt (layernorm_fwd bf16 N = 3072, fp32 weight: from
    the fp32-weight forwards' parametrize) is among the requests, and every GPU test is mapped."""
    from _requests import REQUESTS, gpu_test_functions, requested

    asked = requested()
    want = (
        "layernorm_fwd",
        tuple(
            sorted(
                dict(dtype="bfloat16", n=3072, has_weight=True, has_bias=True, weight_dtype="float32").items()
            )
        ),
    )
    assert asked[want] == "test_norm_fwd_fp32_weights_gpu.py::test_public_forwards_with_fp32_weights"
    tests = {t for t, _ in gpu_test_functions()}
    assert tests == set(REQUESTS), f"stale entries: {set(REQUESTS) - tests}"
    assert len(asked) > 500
