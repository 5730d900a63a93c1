# Sourced by the benchmarks/h200_*.sh scripts, on the lent GPU machine, from the repository
# root, after call 1 of ../shared/device/README.md unpacked .device/big into /tmp/site:
# unpacks the carried wheels once (WHEELS, default .device/wheels), sets PYTHONPATH,
# installs the project editable (the pytest11 entry point and the `quack` script) and stops
# the calling script (exit 3) when cutlass, torch, a CUDA GPU or a module named in
# STAGE_NEEDS is missing: before any build or test, which would otherwise fail every
# configuration and spend the whole call (session 13 lost a 600 s call so).
# Call 1 carries the tracked tree too: .device/big (~61 MiB) beside it can pass the 64 MiB a
# call may carry. Then split the archive over two calls (as session 24 did):
#   split -b 40000000 .device/big/cutlass-cu13.tar.xz /tmp/cpart_   # here, once
#   (move /tmp/cpart_aa to .device/bigA/ and /tmp/cpart_ab to .device/bigB/)
#   call 1, carry [".device/bigA"]: cp .device/bigA/cpart_aa /tmp/
#   call 2, carry [".device/bigB", ".device/wheels", ...]:
#     mkdir -p /tmp/site && cat /tmp/cpart_aa .device/bigB/cpart_ab | tar -xJ -C /tmp/site
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.device/wheels}
if [ -d "$WHEELS" ] && [ ! -f /tmp/site/.wheels-unpacked ]; then
  for w in "$WHEELS"/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  touch /tmp/site/.wheels-unpacked
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
# The machine sets it: every import would recompile its source, which users do not pay.
unset PYTHONDONTWRITEBYTECODE
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1 \
  || echo "editable install failed: see $OUT/pip.log"
# Every runtime dependency pyproject.toml declares must be there as a distribution (session
# 19's staging lacked pyelftools: 16 of README command 2's tests failed on "No module named
# 'elftools'" after a full build, where this check stops the call at once and names it).
python3 -c "
import importlib, importlib.metadata as md, sys, tomllib
from packaging.requirements import Requirement
for m in ['cutlass.cute', 'torch', *'${STAGE_NEEDS:-}'.split()]:
    importlib.import_module(m)
missing = []
for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']:
    r = Requirement(d)
    if r.marker is not None and not r.marker.evaluate():
        continue
    try:
        md.version(r.name)
    except md.PackageNotFoundError:
        missing.append(r.name)
if missing:
    sys.exit('missing distributions (carry their wheels): ' + ', '.join(missing))
import cutlass, torch
print(torch.cuda.get_device_name(), 'x', torch.cuda.device_count(), cutlass.__version__, torch.__version__)
" || { echo "not staged: see ../shared/device/README.md"; exit 3; }
