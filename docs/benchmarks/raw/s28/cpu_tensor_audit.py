"""pytest plugin for a GPU machine without the interpreter (session 28's audit, not part of the suite): a Triton
kernel launched with a CPU tensor among its arguments fails at once, before its compile, naming the kernel, so
that a plain run lists the tests that hand CPU tensors to compiled kernels in seconds instead of compiling each.

    PYTHONPATH=docs/benchmarks/raw/s28 python -m pytest -p cpu_tensor_audit -m "not gpu" tests/kernels
"""
import torch
from triton.runtime.jit import JITFunction

_run = JITFunction.run


def _checked_run(self, *args, **kwargs):
    for arg in list(args) + list(kwargs.values()):
        if isinstance(arg, torch.Tensor) and arg.device.type == "cpu":
            raise RuntimeError(f"cpu_tensor_audit: a CPU tensor handed to the compiled kernel {self.fn.__name__}")
    return _run(self, *args, **kwargs)


JITFunction.run = _checked_run
