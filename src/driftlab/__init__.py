"""driftlab: measure and control instruction drift in language-model dialogs.

Heavy dependencies (torch, transformers) are imported lazily by the modules that need
them, so `import driftlab` and the data-only CLI commands stay fast.
"""

from driftlab.errors import DriftlabError

__version__ = "0.1.0"
__all__ = ["DriftlabError", "__version__"]
