"""What the torch-facing modules (``ops``, ``_gemm_ops``) share: the custom ops' namespace
``NS``, and when an eager call may skip the ``torch.library`` dispatcher (``direct``): the
test ``ops``' functions make before running a family's torch wrapper themselves. Imports
torch: import it from the torch-facing modules only."""

import torch
from torch import Tensor

NS = "quack_kernels"  # the custom ops' namespace: torch.ops.quack_kernels.*

_PLAIN = (Tensor, torch.nn.Parameter)


def direct(*tensors) -> bool:
    """Whether an eager call may run the family's torch wrapper itself instead of going
    through the custom op: the dispatcher's Python path (autograd wrapper, redispatch,
    aliasing check) cost ~70 us of host time a GEMM call on the H200, where cuBLAS's whole
    call costs 19, and for a small problem that time is the op's latency.

    Only when nothing the dispatcher does would differ: not traced (torch.compile, export,
    jit.trace record the op by name), no functorch transform (vmap, grad), no Python
    dispatch mode (FakeTensorMode, FlopCounterMode) and no function mode but default-device
    contexts (``modes_allow_direct``), the profiler off (it records the op), and every
    tensor given a plain CUDA torch.Tensor (or
    an nn.Parameter: a module's weight, which intercepts nothing) that needs no gradient
    (else autograd must record the op). None entries are absent optional inputs."""
    if torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None:
        return False
    if (
        torch._C._len_torch_dispatch_stack()
        or not modes_allow_direct()
        or torch.autograd._profiler_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
    ):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or not t.is_cuda or (grad and t.requires_grad)):
            return False
    return True


def modes_allow_direct() -> bool:
    """No Python function mode is active but default-device contexts (``with
    torch.device(...)``, ``torch.set_default_device``: common in inference scripts, where
    every call would otherwise pay the dispatch). Such a context only picks the device of
    a factory call that names none, and the wrappers name theirs (``device=x.device``, or
    ``*_like``). Any other mode must see the op itself."""
    if not torch._C._is_torch_function_mode_enabled():
        return True
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return all(type(m) is DeviceContext for m in _get_current_function_mode_stack())
