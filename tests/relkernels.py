"""Stand-in kernels for the reliability suite: compiles that cost nothing and can be counted.

``rel_copy`` "compiles" by copying a real toy_scale .o (path in QUACK_TEST_OBJ) and
appends one line per compile to QUACK_TEST_COUNTER (O_APPEND: safe across processes),
so tests can count compiles across many processes without paying for real ones.
QUACK_TEST_COMPILE_SLEEP makes each compile take that long (to widen race windows)."""
import os
import time

from quack import jit_cache
from quack.params import Int


class _Exported:
    def __init__(self, i):
        self.i = i

    def export_to_c(self, object_file_path, function_name):
        with open(os.environ["QUACK_TEST_OBJ"], "rb") as f:
            data = f.read()
        with open(object_file_path, "wb") as f:
            f.write(data)

    def __call__(self, *a):  # what an in-process (uncached) compile hands back
        return self.i


@jit_cache("rel_copy", params={"i": Int(min=0, max=100000)})
def rel_copy(i: int = 0):
    counter = os.environ.get("QUACK_TEST_COUNTER")
    if counter:
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {i}\n".encode())
        finally:
            os.close(fd)
    time.sleep(float(os.environ.get("QUACK_TEST_COMPILE_SLEEP", "0")))
    return _Exported(i)
