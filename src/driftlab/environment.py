"""The Python environment driftlab runs in: companion builds of torch that cannot load beside it.

Why: PyPI serves torchvision, torchaudio and torchcodec built for CUDA, and PyPI's CPU build of
vLLM (`pip install -e ".[vllm]"`) pulls them in. Beside a CPU build of torch (version `+cpu`) they
fail to load (`operator torchvision::nms does not exist`, missing CUDA libraries), and
transformers and vLLM import them unguarded, so even `from transformers import LlamaConfig`
crashes. No CPU build of them is on the registries. `hide_mismatched_builds` hides each one whose
build does not match torch's (`sys.modules[name] = None`: importing it raises ImportError, which
transformers and vLLM handle as "not installed"), in this process and, through `BLOCK_ENV`, in
the processes vLLM starts (chat/vllm_engine/child_site). Nothing is uninstalled, and only package
metadata is read (no import): a few milliseconds at `import driftlab`. Elsewhere it does nothing.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

MEDIA = ("torchvision", "torchaudio", "torchcodec")
BLOCK_ENV = "DRIFTLAB_HIDDEN_MODULES"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def hide_mismatched_builds() -> list[str]:
    """Hide the media packages built for CUDA beside a CPU torch; the names hidden (in this process)."""
    torch = _version("torch")
    if torch is None or not torch.endswith("+cpu"):
        return []
    hidden = [name for name in MEDIA
              if (sys.modules.get(name, False) is None)
              or (name not in sys.modules and (v := _version(name)) is not None and not v.endswith("+cpu"))]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    if hidden:
        os.environ[BLOCK_ENV] = ",".join(hidden)
    return hidden
