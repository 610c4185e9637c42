"""`driftlab serve`: an OpenAI-compatible server of a drift-controlled local model."""

from driftlab.serve.app import ServeSettings
from driftlab.serve.background import background
from driftlab.serve.batcher import Batcher, Job
from driftlab.serve.routes import create_app
from driftlab.serve.wire import TextStream

__all__ = ["Batcher", "Job", "ServeSettings", "TextStream", "background", "create_app"]
