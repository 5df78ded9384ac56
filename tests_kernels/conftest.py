"""The kernels suite's environment: fla's triton kernels on CPU tensors under the triton interpreter.

Run by ``make test-kernels`` in ``.venv-kernels`` (torch CPU, flash-linear-attention, triton), never
by ``make test``; on a machine with a CUDA device (``make gpu-check``) the same tests run their
kernels on it (``tests_kernels.device``), compiled. Without a CUDA device the suite needs
``TRITON_INTERPRET=1`` (set here when missing, before triton is imported) and two work-arounds of
interpreter limits, applied here and only here, never in the library path a GPU runs:

1. autotuned kernels keep their first config (``harts.bench.gpu_child.first_config_only``, which
   ``make gpu-check`` applies on a device too): the interpreter has no device to benchmark the
   others on (``RuntimeError: 0 active drivers``);
2. ``for i in range(...)`` loop variables inside a kernel answer ``.to(dtype)`` as compiled triton's
   do: the interpreter leaves them Python ints, and a kernel calling ``i_t.to(tl.int64)`` fails
   (``'int' object has no attribute 'to'``); they stay ints otherwise.

What the interpreter cannot check (races, atomics, the GPU autotune space, TF32, bf16): docs/gpu.md.
The suite skips, saying why, where fla or triton is not installed.
"""

from __future__ import annotations

import builtins
import os
import tempfile

import pytest
import torch

_CPU = not torch.cuda.is_available()
if _CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's on-disk cache does not key its CPU kernels by ATen's vector capability: a FlexAttention
# kernel compiled under AVX-512 and read back under ATEN_CPU_CAPABILITY=avx2 (or the reverse) returned
# wrong outputs (off by 0.6), and a fresh cache under either gave the right ones. One cache per capability.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"harts-kernels-inductor-{torch.backends.cpu.get_cpu_capability()}"),
)

try:
    import fla  # noqa: F401
    import triton
    from triton.runtime import interpreter
except ImportError as e:  # pragma: no cover - the wrong venv
    pytest.skip(f"the kernels suite needs the gpu extra (make test-kernels): {e}", allow_module_level=True)


def _tensor_loop_variables():
    import triton.language as tl

    class LoopInt(int):
        """A Python int that also answers ``.to(dtype)`` as a triton scalar, as compiled loop variables do."""

        def to(self, dtype, *args, **kwargs):
            np_dtype = interpreter._get_np_dtype(dtype)
            value = interpreter.np.array([int(self)], dtype=np_dtype)
            return tl.tensor(interpreter.TensorHandle(value, dtype), dtype)

    def kernel_range(*args):
        plain = [int(a.handle.data.item()) if isinstance(a, tl.tensor) else a for a in args]
        return (LoopInt(i) for i in builtins.range(*plain))

    call = interpreter.GridExecutor.__call__

    def run(self, *args, **kwargs):
        # The kernel's module globals see this range only while the kernel body runs.
        scope = self.fn.__globals__
        had, old = "range" in scope, scope.get("range")
        scope["range"] = kernel_range
        try:
            return call(self, *args, **kwargs)
        finally:
            if had:
                scope["range"] = old
            else:
                del scope["range"]

    interpreter.GridExecutor.__call__ = run


if _CPU:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.exit("without a CUDA device the kernels suite runs under TRITON_INTERPRET=1", returncode=2)
    from harts.bench.gpu_child import first_config_only  # after TRITON_INTERPRET is set

    first_config_only()
    _tensor_loop_variables()

TRITON_VERSION = triton.__version__
