"""The device the tests run on (`pytest --device`, default cpu) and the tolerances that go with it.

Why a module and not only fixtures: module-level helpers of the test files (a prefill, a
reference, a tensor built at import) need the device too. `conftest.pytest_configure` calls
`configure()` once, before any test module is imported; the session fixtures `device` and
`tol` (conftest.py) hand out the same objects.

Tolerances (docs/testing.md says the same):

* On the CPU every tolerance is exactly the one each test file states (its `*_TOL`
  constants); nothing is loosened, and where the tests assert bit-equality (the same
  computation in another batch layout, or a kernel path whose arithmetic is the plain one)
  they still do: `Tolerance.exact` is True.
* On CUDA, float32 reductions are split across thread blocks in an order that depends on the
  kernel chosen for each shape, so the same quantity computed by the fused kernel and by the
  eager reference, or for a row alone and in a padded batch, differs in the last bits: pi was
  seen 5e-5 apart where the CPU tolerance is 1e-5. Every float tolerance is multiplied by
  `CUDA_FACTOR[dtype]` (20 in float32: 1e-5 -> 2e-4 for pi, 5e-4 -> 1e-2 for logits up to ~40),
  TF32 is switched off so float32 matmuls really are float32, and `exact` is False: a
  bit-equality the CPU guarantees becomes "within the tolerance", and batched-vs-alone
  comparisons keep comparing greedy tokens (a tie broken differently would show there).
"""

from __future__ import annotations

import pytest
import torch

# How much looser a float tolerance is on a non-CPU device, per dtype (see the module docstring).
CUDA_FACTOR = {torch.float32: 20.0, torch.bfloat16: 20.0, torch.float16: 20.0}

_DEVICE = torch.device("cpu")


def configure(spec: str) -> torch.device:
    """Set the tests' device from `--device`; a device this machine lacks is a usage error."""
    global _DEVICE
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError) as e:
        raise pytest.UsageError(f"--device {spec!r} is not a torch device ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(
                f"--device {spec} was asked for, but torch.cuda is not available here "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                "install a CUDA build of torch or run without --device (cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise pytest.UsageError(
                f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        # float32 tests mean float32: no TF32 in matmuls or convolutions.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif device.type != "cpu":
        raise pytest.UsageError(f"--device {spec}: only cpu and cuda[:N] are supported by the tests")
    _DEVICE = device
    return device


def current() -> torch.device:
    """The device tests put models and tensors on."""
    return _DEVICE


def on_cpu() -> bool:
    return _DEVICE.type == "cpu"


class Tolerance:
    """Tolerances for one device: `tol(cpu_value, dtype)`, and `tol.exact`.

    `tol(x)` is `x` itself on the CPU (each test keeps the tolerance it always had) and
    `x * CUDA_FACTOR[dtype]` elsewhere.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def exact(self) -> bool:
        """Does bit-equality hold where the CPU tests assert it (batch layouts, kernel paths)?"""
        return self.device.type == "cpu"

    def __call__(self, cpu: float, dtype: torch.dtype = torch.float32) -> float:
        if self.device.type == "cpu":
            return cpu
        return cpu * CUDA_FACTOR[dtype]

    def __repr__(self) -> str:
        return f"Tolerance({self.device})"


def tol(cpu: float, dtype: torch.dtype = torch.float32) -> float:
    """The tolerance on the current device for a comparison whose CPU tolerance is `cpu`."""
    return Tolerance(_DEVICE)(cpu, dtype)


def exact() -> bool:
    """Bit-equality holds on the current device (the CPU) where the tests assert it."""
    return Tolerance(_DEVICE).exact


def cpu_only(reason: str):
    """Mark a test that exercises a CPU-only code path: skipped, with `reason`, on other devices."""
    return pytest.mark.skipif(not on_cpu(), reason=f"CPU-only: {reason}")


def backend_device() -> str:
    """`current()` as the string HFChatBackend/BackendSpec take (`cpu`, `cuda`, `cuda:1`)."""
    return str(_DEVICE)
