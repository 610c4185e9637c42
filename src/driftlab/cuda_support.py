"""The torch versions driftlab's CUDA fast path has run on, declared in one place.

Why: the CUDA fast path (steered attention in FlexAttention's compiled Triton kernels, and a
compiled static decode step replayed as CUDA graphs) leans on torch internals that change from
release to release: the layout flex's kernels assume for a block mask, how dynamo treats flex,
inductor's CUDA-graph trees. It has run on one CUDA torch, 2.11 (lent H100s and H200s; see
docs/performance.md). On a CUDA torch outside `TORCH_RANGE`, `auto` takes the paths that need none of
that (the SDPA kernels and the dynamic decode loop) and says so in one line, once per process;
DRIFTLAB_ATTENTION_KERNEL=flex and `--decode compiled` still choose the fast path explicitly.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Widen this only after the GPU test families pass on the new torch (docs/testing.md).
TORCH_RANGE = ">=2.11,<2.12"
_said = False


def tested(version: str | None = None) -> bool:
    """Whether `version` (default: this process's torch) is in `TORCH_RANGE`; a local build's suffix
    (+cu130, +cpu) does not count."""
    return Version(Version(version or torch.__version__).base_version) in SpecifierSet(TORCH_RANGE)


def auto_fast_path(device: torch.device) -> bool:
    """Whether `auto` may take the CUDA fast path on `device`: CUDA with a tested torch. On CUDA
    with another torch it says once why it does not."""
    if device.type != "cuda":
        return False
    if tested():
        return True
    _say_untested()
    return False


def _say_untested() -> None:
    global _said
    if _said:
        return
    _said = True
    from driftlab.console import err_console

    err_console().print(
        f"note: torch {torch.__version__} is outside the range driftlab's CUDA fast path is tested on ({TORCH_RANGE}): "
        "auto runs the SDPA kernels and the dynamic decode loop (DRIFTLAB_ATTENTION_KERNEL=flex and --decode compiled "
        "choose the fast path anyway).", highlight=False, markup=False, soft_wrap=True)
