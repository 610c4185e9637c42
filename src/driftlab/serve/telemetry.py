"""Drift telemetry of served replies: how far each conversation has drifted, per reply and in
`/metrics`.

A team that serves a chatbot under a long system prompt wants to see drift where it happens, in
production traffic, not only in an offline benchmark. Each reply can carry the two drift
signals driftlab measures, read off the reply's own decode at no extra forward pass:

* pi, the attention mass on the system prompt (mean over layers and heads), at the query that
  predicted the reply's first token, at the one that predicted its last, and over the reply;
* with `--directions`, the projection of the residual stream on the persona's direction
  (normalised: 0 like without the system prompt, 1 like with it; mean over the direction's
  layer band), at the same positions;
* the conversation's round count (its user turns), so a client can plot either against it;
* under `when-drifting:r=R`, its decision: pi_t / pi_1 (`by=projection`: the projection's ratio,
  first turn to now) and whether the reply was steered (also in
  the reply's `driftlab.gate` without telemetry, since it says what the reply is).

The server stays stateless: everything is computed from the conversation the request sends.
`/metrics` gets histograms of both, labelled by a short hash of the system prompt; the first
`limit` distinct prompts get a label each, the rest share "other" (Prometheus keeps one series
per label value, so the count of values must stay bounded whatever clients send).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import numpy as np

from driftlab.chat.base import Reply
from driftlab.messages import Conversation
from driftlab.steering.interventions import Interventions, Trace

NO_SYSTEM = "none"  # the label of conversations without a system prompt
OTHER = "other"  # the label of prompts past the limit


def traced(steer: Interventions) -> Interventions:
    """The steer with pi tracing on (a trace changes no token)."""
    return steer if "trace" in steer.kinds else Interventions.of(*steer.items, Trace())


def system_of(conversation: Conversation) -> str | None:
    return conversation[0]["content"] if conversation and conversation[0]["role"] == "system" else None


def rounds(conversation: Conversation) -> int:
    """The conversation's rounds so far: its user turns (the reply being made answers the last)."""
    return sum(m["role"] == "user" for m in conversation)


def summary(reply: Reply, conversation: Conversation, *, layers: bool = False) -> dict[str, Any]:
    """The `telemetry` object of one reply: `rounds`, `pi`, `projection` and `gate` (each null where
    not measured: pi without a system prompt or a trace, the projection without directions, the
    gate without `when-drifting`)."""
    return {"rounds": rounds(conversation), "pi": _pi(reply, layers), "projection": _projection(reply, layers),
            "gate": reply.gate}


def _pi(reply: Reply, layers: bool) -> dict[str, Any] | None:
    trace = reply.trace
    if trace is None or not trace.system_spans or not trace.n_generated:
        return None
    per_token = trace.mean()  # [tokens]: over layers and heads
    out: dict[str, Any] = {"first": _num(per_token[0]), "last": _num(per_token[-1]), "mean": _num(per_token.mean())}
    if layers:
        per_layer = trace.mean("head")  # [tokens, layers]
        out["layers"] = {"first": _nums(per_layer[0]), "last": _nums(per_layer[-1])}
    return out


def _projection(reply: Reply, layers: bool) -> dict[str, Any] | None:
    act = reply.activation
    if act is None:
        return None
    band = list(act.get("band") or range(len(act["reply"])))
    mean = lambda values: _num(np.mean([values[i] for i in band]))  # noqa: E731
    out: dict[str, Any] = {"direction": act["direction"], "band": band, "first": mean(act["prompt"]),
                           "last": mean(act["last"]), "mean": mean(act["reply"])}
    if layers:
        out["layers"] = {"first": act["prompt"], "last": act["last"], "mean": act["reply"]}
    return out


def _num(x: Any) -> float:
    return round(float(x), 5)


def _nums(values: Any) -> list[float]:
    return [_num(x) for x in values]


class PromptLabels:
    """A short, bounded label per system prompt: the first 12 hex digits of its SHA-256 for the
    first `limit` distinct prompts, `other` for later ones, `none` without one. Thread-safe (the
    server's event loop and its batcher's thread both ask)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, system: str | None) -> str:
        if system is None:
            return NO_SYSTEM
        label = hashlib.sha256(system.encode("utf-8")).hexdigest()[:12]
        with self._lock:
            if label in self._known:
                return label
            if len(self._known) < self.limit:
                self._known.add(label)
                return label
        return OTHER
