"""`driftlab serve`: an OpenAI-compatible server of a drift-controlled local model."""

from driftlab.serve.app import ServeSettings, TextStream, create_app
from driftlab.serve.background import background
from driftlab.serve.batcher import Batcher, Job

__all__ = ["Batcher", "Job", "ServeSettings", "TextStream", "background", "create_app"]
