"""Inference-time interventions, described as text on the command line (`--steer`).

Each spec is `NAME:key=value,key=value`; several `--steer` options compose. Today the
attention interventions of the engine are available:

* `split-softmax:k=0.9[,heads=0-5+7.2]` — split-softmax with exponent k (seed 000 Eq. 6-7);
* `bias:value=2.0[,span=system][,invert=true][,heads=...]` — additive logit bias on keys.
* `trace` — record pi (attention mass on the system prompt) without changing anything.

Head selections: `all`, a layer `3`, a range `0-5`, `layer.head` pairs, joined with `+`.
"""

from __future__ import annotations

from collections.abc import Sequence

from driftlab.attention.state import AttentionConfig
from driftlab.errors import DriftlabError

_FORMS = {
    "split-softmax": "split-softmax:k=0.9[,heads=0-5+7.2]",
    "bias": "bias:value=2.0[,span=system][,invert=true][,heads=3+5.1]",
    "trace": "trace[:prefill=true]",
}


def _kv(name: str, body: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, body.split(",")):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise DriftlabError(
                f"Cannot read '{part}' in --steer {name}:{body}.", hint=f"Write it as {_FORMS[name]}."
            )
        out[key.strip().lower()] = value.strip()
    return out


def _float(name: str, key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise DriftlabError(f"--steer {name}: {key}={value} is not a number.", hint=f"Write {_FORMS[name]}.") from None


def _bool(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


def parse_steer(specs: Sequence[str]) -> AttentionConfig | None:
    """Combine `--steer` specs into one AttentionConfig (None if there are none)."""
    fields: dict = {}
    for spec in specs:
        name, _, body = spec.strip().partition(":")
        name = name.lower()
        if name not in _FORMS:
            raise DriftlabError(
                f"Unknown steering method '{name}'.",
                hint="Known: " + "; ".join(_FORMS.values()),
            )
        kv = _kv(name, body)
        allowed = {"split-softmax": {"k", "heads"}, "bias": {"value", "span", "invert", "heads"},
                   "trace": {"prefill"}}[name]
        unknown = set(kv) - allowed
        if unknown:
            raise DriftlabError(
                f"--steer {name} does not take {', '.join(sorted(unknown))}.", hint=f"Write {_FORMS[name]}."
            )
        if name == "split-softmax":
            if "k" not in kv:
                raise DriftlabError("--steer split-softmax needs k.", hint=f"Write {_FORMS[name]}.")
            k = _float(name, "k", kv["k"])
            if not 0.0 <= k <= 1.0:
                raise DriftlabError(
                    f"--steer split-softmax: k={k} is outside [0, 1].",
                    hint="k = 1 leaves attention unchanged; smaller k gives the system prompt more attention.",
                )
            fields.update(split_k=k, split_heads=kv.get("heads"))
        elif name == "bias":
            if "value" not in kv:
                raise DriftlabError("--steer bias needs value.", hint=f"Write {_FORMS[name]}.")
            fields.update(
                bias=_float(name, "value", kv["value"]),
                bias_span=kv.get("span", "system"),
                bias_invert=_bool(kv.get("invert", "false")),
                bias_heads=kv.get("heads"),
            )
        else:
            fields.update(trace=True, trace_prefill=_bool(kv.get("prefill", "false")))
    return AttentionConfig(**fields) if fields else None
