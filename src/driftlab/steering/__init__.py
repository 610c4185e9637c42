"""Inference-time interventions, written as `--steer NAME[:key=value,...]` (repeatable, composable).

* `split-softmax:k=0.9[,heads=0-5+7.2]` — split-softmax with exponent k (persona-drift paper Eq. 6-7);
* `bias:value=2.0[,span=system|marked][,invert=true][,heads=...]` — additive logit bias on keys;
* `instaboost:m=5` — InstABoost: attention to the system prompt multiplied by m, renormalised;
* `pasta:heads=FILE.json|3.1+5.2[,topk=K][,alpha=0.01][,span=marked|system]` — PASTA: attention
  outside the user's emphasised text (`*...*`, or the system prompt) scaled by alpha on chosen heads;
* `trace[:prefill=true]` — record pi (attention mass on the system prompt), changing nothing;
* `spr:p=0.5[,seed=0]` — system-prompt repetition before user turns, with probability p;
* `cfg:alpha=1.5` — classifier-free guidance (with vs without the system prompt, Eq. 5);
* `vector:alpha=1.0[,layers=10-14]`, `cap:q=0.25[,layers=...]` — activation steering and capping
  along the persona's direction (needs directions);
* `pi-floor:f=0.8` — the system prompt keeps at least f times its first turn's attention mass;
* `when-drifting:r=0.9` — the other steers act only on conversations whose pi has fallen below
  r times their first turn's (adaptive control).

Key biases (bias, instaboost, pasta) compose: the engine adds them up. Head selections:
`all`, a layer `3`, a range `0-5`, `layer.head` pairs, joined with `+`. Emphasis markup
(`emphasis`) and PASTA's head configs and profiles (`heads`) live here, beside the
interventions that read them. See `driftlab.steering.interventions` for the typed model.
"""

from driftlab.steering.interventions import (
    KINDS,
    BaseIntervention,
    ClassifierFreeGuidance,
    DialogSteer,
    InstABoost,
    Intervention,
    Interventions,
    KeyBias,
    OneSteer,
    Pasta,
    SplitSoftmax,
    Steer,
    SystemPromptRepetition,
    Trace,
)

__all__ = [
    "KINDS", "BaseIntervention", "ClassifierFreeGuidance", "DialogSteer", "InstABoost", "Intervention",
    "Interventions", "KeyBias", "OneSteer", "Pasta", "SplitSoftmax", "Steer", "SystemPromptRepetition", "Trace",
]
