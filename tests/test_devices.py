"""The test suite's `--device` option and its tolerances (tests/devices.py, docs/testing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import devices

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_tolerances_are_the_tests_own_and_exact() -> None:
    cpu = devices.Tolerance(torch.device("cpu"))
    assert cpu.exact
    for x in (1e-5, 5e-4, 2e-3):
        assert cpu(x) == x and cpu(x, torch.bfloat16) == x


def test_cuda_tolerances_are_looser_by_the_documented_factor() -> None:
    cuda = devices.Tolerance(torch.device("cuda", 1))  # only the type matters; no GPU needed
    assert not cuda.exact
    assert cuda(1e-5) == pytest.approx(2e-4) and cuda(5e-4) == pytest.approx(1e-2)
    assert cuda(1e-5, torch.bfloat16) == pytest.approx(1e-5 * devices.CUDA_FACTOR[torch.bfloat16])


def test_the_session_fixtures_follow_the_option(device, tol, request) -> None:
    assert device == torch.device(request.config.getoption("--device")) == devices.current()
    assert tol.device == device and tol(1e-5) == devices.tol(1e-5)
    assert tol.exact == devices.exact() == (device.type == "cpu")


@pytest.mark.parametrize("spec", ["tpu", "mps"])
def test_unsupported_devices_are_usage_errors(spec: str) -> None:
    with pytest.raises(pytest.UsageError, match=f"--device.*{spec}"):
        devices.configure(spec)
    assert devices.current() == torch.device(devices.backend_device())  # unchanged


@pytest.mark.process  # fresh interpreters
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_stops_the_run_with_a_usage_error() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--device", "cuda", "-p", "no:cacheprovider",
                           "tests/test_devices.py::test_cpu_tolerances_are_the_tests_own_and_exact"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "torch.cuda is not available" in done.stderr
