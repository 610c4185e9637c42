"""Inference-time interventions, written as `--steer NAME[:key=value,...]` (repeatable, composable).

* `split-softmax:k=0.9[,heads=0-5+7.2]` — split-softmax with exponent k (seed 000 Eq. 6-7);
* `bias:value=2.0[,span=system][,invert=true][,heads=...]` — additive logit bias on keys;
* `instaboost:m=5` — InstABoost: attention to the system prompt multiplied by m, renormalised;
* `trace[:prefill=true]` — record pi (attention mass on the system prompt), changing nothing.

Head selections: `all`, a layer `3`, a range `0-5`, `layer.head` pairs, joined with `+`.
See `driftlab.steering.interventions` for the typed model.
"""

from driftlab.steering.interventions import (
    KINDS,
    InstABoost,
    Intervention,
    Interventions,
    KeyBias,
    SplitSoftmax,
    Trace,
)

__all__ = ["KINDS", "InstABoost", "Intervention", "Interventions", "KeyBias", "SplitSoftmax", "Trace"]
