"""Kernel-test set-up: make Triton 3.6's interpreter run loops with tensor bounds under NumPy >= 2.3.

The interpreter (``TRITON_INTERPRET=1``) holds scalars as 1-element arrays and converts a loop bound with
``int(array)``, which NumPy 2.3 rejects for arrays of one dimension; compiled kernels are unaffected.
"""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover - no Triton: the kernel tests skip themselves
        _interp = None
    if _interp is not None and not getattr(_interp, "_kvroll_index_patch", False):
        _patch_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._kvroll_index_patch = True
