"""Drift in what the model would say: the two KL divergences of one agent reply, read teacher-forced.

One definition, shared by `driftlab kl` (a recorded run, read again) and a self-chat's live `--kl`
(each reply as soon as it is generated). Per reply, the recorded tokens are read again under three
contexts and the model's next-token distributions compared at the positions that generated them
(the last prompt token, then every reply token but the last; the end-of-turn token too where the
reply ended with it), averaged over them:

* reminded KL, D_t = KL(q_t || p_t) (Dongre et al. 2025, "Drift No More?"): q_t is the model in the
  dialog as it was (the model under test), p_t the same dialog with the system prompt restated just
  before the user turn the reply answers (the goal-consistent reference). Where the system prompt
  already stands right before that turn (the first turn; a turn SPR reminded), the two contexts are
  the same and D_t is exactly 0.
* prompt influence, KL(p_with || p_without): the dialog as it was against the same dialog with its
  system prompt emptied (`chat.base.without_system`, CFG's unconditional context): how much the
  prompt still changes what the model says; 0 is the no-persona baseline of Persistent Personas.

The run's conversation steers (SPR) shape every context as they shaped what the model saw; its
other steers act in every context. The as-is and prompt-less contexts are kept in the prefix cache,
so the next turn's contexts, which extend them, compute only their new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from driftlab.chat.base import Conversation, Distributions, token_backend, without_system
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

#: Steers under which the model's own next-token distribution is not what a reply was drawn from.
UNMEASURED = ("cfg", "when-drifting")
#: Replies read together (one pass per kind of context): bounds the logits kept, [n, V] per context.
CHUNK = 8


@dataclass(frozen=True)
class Divergence:
    """One reply's divergences, each the mean over its positions (nats per token)."""

    reminded: float  # KL(as it was || system prompt restated before the turn)
    prompt: float  # KL(as it was || system prompt emptied)
    positions: int

    def fields(self) -> dict[str, float | int]:
        return {"reminded": round(self.reminded, 6), "prompt": round(self.prompt, 6), "positions": self.positions}


def require(backend, who: str) -> None:
    """One line where `backend` cannot give whole next-token distributions at a prompt's positions."""
    backend = token_backend(backend, who)
    if not backend.capabilities.distributions:
        raise DriftlabError(f"{backend.name} gives no whole next-token distributions at a prompt's positions, and "
                            f"{who} compares them.", hint="Measure the KL on a local model (a name or path, or "
                            "vllm:NAME; not openai: or a Ray pool).")


def measured_steer(steer: Interventions) -> Interventions:
    """The steers every context is read under (the run's, but its trace), or one line for a steer
    whose replies were not drawn from the model's own next-token distribution. A `when-drifting` that
    gates nothing but the trace is a monitor (it records its reading, every reply plain): measured."""
    if monitor(steer):
        steer = steer.without("when-drifting")
    found = sorted(steer.kinds & set(UNMEASURED))
    if found:
        raise DriftlabError(f"--steer {found[0]} mixes or switches distributions, so the KL of the model's own "
                            "next-token distributions does not describe its replies.",
                            hint=f"Measure the KL on a run without {' or '.join(UNMEASURED)}.")
    return steer.without("trace")


def monitor(steer: Interventions) -> bool:
    """Whether `steer`'s `when-drifting` gates only the trace: it reads its signal every turn (the
    `gate` of each reply) and changes no reply, which is how `driftlab warn` tests the gate's own
    reading as a warning."""
    return "when-drifting" in steer.kinds and not steer.without("when-drifting").without("trace").items


def divergences(backend, replies: Sequence[tuple[Conversation, str]], steer: Interventions,
                chunk: int = CHUNK, keep_as_is: bool = True,
                generated: Sequence[Distributions | None] | None = None) -> list[Divergence]:
    """Each (conversation ending with an assistant reply, its finish reason) -> its `Divergence`,
    `chunk` replies at a time. The prompt-less context is kept in the prefix cache for the
    next turn's to extend; the as-is one too unless `keep_as_is` is False (a live run: there the
    generation's own cache entry serves the next turn, which then decodes exactly as without KL).
    `generated[k]`: reply k's distributions as its generation computed them (`Reply.distributions`),
    which stand for the as-is context's where that context is, token for token, what was generated."""
    out: list[Divergence] = []
    for first in range(0, len(replies), chunk):
        batch = replies[first : first + chunk]
        as_is = [steer.model_view(conv) for conv, _ in batch]
        ends = [end for _, end in batch]
        reminded = [remind(conv) for conv in as_is]
        # One pass per kind of context: a batch computes, for every row, the longest uncached suffix of
        # any row, and each kind's rows miss about as much of the cache as each other.
        a = reply_logprobs(backend, as_is, steer, ends, store=keep_as_is,
                           given=generated[first : first + chunk] if generated is not None else None)
        b = reply_logprobs(backend, [without_system(conv) for conv in as_is], steer, ends, store=True)
        due = [k for k, conv in enumerate(reminded) if conv is not None]
        c = dict(zip(due, reply_logprobs(backend, [reminded[k] for k in due], steer, [ends[k] for k in due],
                                         store=False), strict=True))
        out += [Divergence(kl_mean(a[k][0], c[k][0]) if k in c else 0.0, kl_mean(a[k][0], b[k][0]), a[k][1])
                for k in range(len(batch))]
    return out


def remind(conversation: Conversation) -> Conversation | None:
    """The conversation with its system prompt restated (a system message) just before its last user
    turn; None where it already stands there (then the reminded context is the conversation itself)."""
    last_user = max(i for i, m in enumerate(conversation) if m["role"] == "user")
    system = conversation[0]
    if system["role"] != "system" or conversation[last_user - 1] == system:
        return None
    return [*conversation[:last_user], dict(system), *conversation[last_user:]]


def reply_logprobs(backend, contexts: list[Conversation], steer: Interventions, ends: Sequence[str],
                   store: bool, given: Sequence[Distributions | None] | None = None) -> list[tuple[torch.Tensor, int]]:
    """Per context (each ending with an assistant reply): the next-token log-probabilities [n, V] at the
    n positions that generated the reply (its end-of-turn token only where `ends` says it ended with it);
    `store`: keep the contexts' KV in the prefix cache. `given[k]`, where its ids are context k's up to
    the reply's last read position, is taken instead of reading context k."""
    out: list[tuple[torch.Tensor, int] | None] = [None] * len(contexts)
    prompts, keeps, windows, read = [], [], [], []
    for k, (conv, end) in enumerate(zip(contexts, ends, strict=True)):
        rendered = backend.render(conv, add_generation_prompt=False, interventions=steer)
        start = len(backend.render(conv[:-1], add_generation_prompt=True, interventions=steer).ids)
        ids = rendered.ids
        stop = next((i + 1 for i in range(start, len(ids)) if ids[i] in backend.stop_ids), len(ids))
        stop = stop if end == "stop" else stop - 1  # a cut reply never generated its end-of-turn token
        n = stop - start  # positions start - 1 .. stop - 2 predict the reply's tokens
        got = given[k] if given is not None else None
        if got is not None and list(ids[:stop]) == got.ids[:stop] and len(got.ids) - len(got.logprobs) == start:
            out[k] = (got.logprobs[:n], n)
            continue
        prompts.append(rendered)
        keeps.append(len(ids) - (start - 1))
        windows.append(n)
        read.append(k)
    if prompts:
        lps = backend.prompt_logprobs(prompts, keeps, interventions=steer.without("spr"),
                                      cache_store=[store] * len(prompts))
        for k, lp, n in zip(read, lps, windows, strict=True):
            out[k] = (lp[:n], n)
    return out


def kl_mean(p: torch.Tensor, q: torch.Tensor) -> float:
    """The mean over positions of KL(P || Q), from log-probabilities [n, V], in float64."""
    p64, q64 = p.double(), q.double()
    return float((p64.exp() * (p64 - q64)).sum(-1).clamp_min(0.0).mean())
