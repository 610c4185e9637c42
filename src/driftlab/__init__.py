"""driftlab: measure and control instruction drift in language-model dialogs.

    import driftlab as dl
    be = dl.load("smollm2-135m", dtype="float32")
    run = dl.selfchat(be, pairs=2, rounds=2, max_new_tokens=16, steer="split-softmax:k=0.9")

The names below are the Python API (driftlab.api; docs/tutorial.md). Heavy dependencies
(torch, transformers) are imported on first use of a name that needs them, so
`import driftlab` and the data-only CLI commands stay fast.
"""

from driftlab.environment import hide_mismatched_builds
from driftlab.errors import DriftlabError

hide_mismatched_builds()  # CUDA builds of torchvision & co. beside a CPU torch (the vllm extra): see there

__version__ = "0.1.0"

# name -> module that defines it; imported on first access (PEP 562).
_LAZY = {
    "load": "driftlab.api", "from_model": "driftlab.api", "steer": "driftlab.api", "trace": "driftlab.api",
    "selfchat": "driftlab.api", "replay": "driftlab.api", "mmlu": "driftlab.api", "sweep": "driftlab.api", "calibrate": "driftlab.api",
    "run": "driftlab.api", "measure": "driftlab.api", "warm": "driftlab.api", "directions": "driftlab.api",
    "Directions": "driftlab.activation.directions",
    "Run": "driftlab.api", "Persona": "driftlab.bench", "personas": "driftlab.api",
    "Interventions": "driftlab.steering", "Sampling": "driftlab.chat",
    "results": "driftlab.api", "compare": "driftlab.api", "Results": "driftlab.report.results",
    "Estimate": "driftlab.report.results",
}
__all__ = ["DriftlabError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'driftlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
