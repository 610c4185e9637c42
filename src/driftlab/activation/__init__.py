"""The residual stream: persona directions, what a row's activations project onto them, and
steering there (adding a direction, capping a projection from below).

Why a package beside `attention`: drift shows in three places (probe scores, the attention mass
pi on the system prompt, and the residual stream's projection onto a persona's direction); this
is the third. Its state reaches every decoder layer the way the attention state reaches every
attention call: as a forward keyword, per batch row, so rows with different personas and steers
share a batch, and a compiled decode step reads only tensors.

    config      ResidualConfig: what a call asks (no torch)
    directions  Directions: per persona, a unit direction per layer with its projection statistics
    state       ResidualState: per-call, per-row tensors; the layer hook's arithmetic; what it records
    hooks       install / remove the forward hooks on a model's decoder layers
"""

from driftlab.activation.config import ResidualConfig

__all__ = ["ResidualConfig"]
