"""Raw text instead of conversations: what `/v1/completions` and lm-evaluation-harness send.

A harness builds its own prompts (few-shot blocks, a chat template applied client-side) and
asks for the log-probabilities of that text or for a continuation of it. A steer still needs
the system span, which raw text does not mark: it is given as a character range
(`SystemSpan(chars=(a, b))`), as everything before a marker (`SystemSpan(until="...")`), or
found where the model's own chat template puts a system message (`SystemSpan(chat=True)`, the
default: a prompt rendered client-side with the same template is steered as the server
would steer the conversation).

`encode` turns text into a `Rendered` prompt (the token level every local decode takes);
`score` gives each token's log-probability under the interventions, teacher-forced, in
batches that share one forward pass per row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from driftlab.chat.base import Rendered, TokenLogprob
from driftlab.chat.guidance import guide
from driftlab.chat.teacher_forced import row_logprobs
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

if TYPE_CHECKING:
    from driftlab.chat.hf import HFChatBackend

SENTINEL_SYSTEM, SENTINEL_USER = "\u2063SYS\u2063", "\u2063USR\u2063"
CFG_REACH = "cfg scores the text after the system span only, and the tokens asked for reach into it."
LOGIT_BUDGET = 1 << 30  # bytes of float32 log-probabilities one scoring pass may hold


class SpanError(DriftlabError):
    """A system span that does not fit the prompt (a range outside it, a marker not in it)."""


@dataclass(frozen=True)
class SystemSpan:
    """Where the system-like prefix of a raw prompt is (the text system-span steers act on).

    `chars`: [start, end) characters; `until`: from the start to the first occurrence of this
    marker (the marker itself excluded); `chat`: the system message where the model's chat
    template puts one (nothing when the prompt does not start like the template's system turn).
    The first that is set wins; none set: no span.
    """

    chars: tuple[int, int] | None = None
    until: str | None = None
    chat: bool = False

    def locate(self, text: str, template: tuple[str, str] | None) -> tuple[int, int] | None:
        """The character range in `text` (None: no span); a range or marker that does not fit is an error."""
        if self.chars is not None:
            a, b = self.chars
            if not 0 <= a < b <= len(text):
                raise SpanError(f"The system span [{a}, {b}) lies outside the prompt of {len(text)} characters.",
                                    hint="Give 0 <= start < end <= the prompt's length.")
            return a, b
        if self.until is not None:
            at = text.find(self.until)
            if at <= 0:
                raise SpanError(f"The system marker {self.until!r} is not in the prompt after its first character.",
                                    hint="Put the marker right after the system text, or give a character range.")
            return 0, at
        if self.chat and template is not None:
            head, tail = template
            if text.startswith(head) and (end := text.find(tail, len(head))) > len(head):
                return len(head), end
        return None


def system_template(renderer) -> tuple[str, str] | None:
    """What the model's chat template writes before a system prompt and right after it: the
    header (from the start of the prompt) and the first piece of markup that ends it. None for
    a template without system messages, or one that writes nothing distinctive after it."""
    try:
        text = renderer.text([{"role": "system", "content": SENTINEL_SYSTEM},
                              {"role": "user", "content": SENTINEL_USER}], add_generation_prompt=False)
    except DriftlabError:
        return None
    at, user = text.find(SENTINEL_SYSTEM), text.find(SENTINEL_USER)
    if at < 0 or user < 0:
        return None
    tail = text[at + len(SENTINEL_SYSTEM) : user]
    end = tail.split("\n", 1)[0] or tail  # "<|im_end|>" of "<|im_end|>\n<|im_start|>user\n"
    return (text[:at], end) if end.strip() else None


def encode(backend: HFChatBackend, text: str, system: SystemSpan = SystemSpan(), *,
           special: bool = True) -> Rendered:
    """`text` as the model's tokens (with the tokenizer's special tokens, e.g. BOS, when
    `special`), its system span in tokens: those overlapping the span's characters."""
    if not text:
        raise DriftlabError("The prompt is empty.", hint="Give at least one character of text.")
    enc = backend.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    return Rendered(ids=ids, text=text, system_span=_token_span(backend, text, offsets, system))


def from_ids(backend: HFChatBackend, ids: Sequence[int], system: SystemSpan = SystemSpan()) -> Rendered:
    """A prompt given as token ids (how lm-eval sends them), its system span located in their
    text; ids outside the vocabulary are an error."""
    vocab = backend.model.get_input_embeddings().num_embeddings
    bad = [i for i in ids if not 0 <= int(i) < vocab]
    if not ids or bad:
        raise DriftlabError(f"Token ids {bad[:5]} are outside this model's vocabulary of {vocab}." if bad
                            else "The prompt has no tokens.", hint=f"Give ids in [0, {vocab}).")
    ids = [int(i) for i in ids]
    text = backend.decode(ids, skip_special=False)
    span = None
    if system != SystemSpan():
        span = _token_span(backend, text, _offsets_of(backend, ids, text), system)
    return Rendered(ids=ids, text=text, system_span=span)


def _offsets_of(backend: HFChatBackend, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Each token's character range in `text` (the ids' decoding): the tokenizer's own offsets
    when the text encodes back to these ids (the usual case), else by decoding prefixes."""
    enc = backend.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) == ids:
        return [tuple(o) for o in enc["offset_mapping"]]
    ends = [len(backend.decode(ids[: i + 1], skip_special=False)) for i in range(len(ids))]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _token_span(backend: HFChatBackend, text: str, offsets: list[tuple[int, int]],
                system: SystemSpan) -> tuple[int, int] | None:
    """The tokens overlapping the system span's characters (None: no span)."""
    chars = system.locate(text, system_template(backend.renderer) if system.chat else None)
    if chars is None:
        return None
    lo, hi = chars
    inside = [i for i, (a, b) in enumerate(offsets) if b > lo and a < hi and b > a]
    return (inside[0], inside[-1] + 1) if inside else None


@dataclass(frozen=True)
class TokenScores:
    """Log-probabilities of the last `len(logprobs)` tokens of a prompt, each given all before it."""

    token_ids: list[int]
    logprobs: list[float]
    greedy: list[bool]  # the token is the most likely one at its position
    top: list[list[tuple[int, float]]]  # the k most likely tokens at each position (k = `score`'s top)

    def entries(self) -> list[TokenLogprob]:
        return [TokenLogprob(t, lp, alts) for t, lp, alts in zip(self.token_ids, self.logprobs, self.top, strict=True)]


@torch.inference_mode()
def score(backend: HFChatBackend, prompts: Sequence[Rendered], interventions: Interventions = Interventions(), *,
          last: Sequence[int] | None = None, generated: Sequence[int] | None = None, top: int = 0,
          batch_size: int = 8) -> list[TokenScores]:
    """log p(token | everything before it) for the last `last[i]` tokens of prompt i (default:
    all but the first, which nothing predicts), under `interventions`.

    `generated[i]` trailing tokens are what the attention engine treats as generated (a
    continuation scored after its context, as `loglikelihood` does); the rest is prompt.
    With cfg each row is mixed with its copy without the system span. Rows are batched up to
    `batch_size`, fewer when their log-probabilities would pass `LOGIT_BUDGET`.
    """
    backend.capabilities.require(backend.name, interventions)
    interventions = interventions.without("trace") if "trace" in interventions.kinds else interventions
    last = [len(p.ids) - 1 for p in prompts] if last is None else list(last)
    generated = [0] * len(prompts) if generated is None else list(generated)
    for i, (p, k, g) in enumerate(zip(prompts, last, generated, strict=True)):
        if not 1 <= k <= len(p.ids) - 1 or not 0 <= g <= k:
            raise DriftlabError(f"Prompt {i} has {len(p.ids)} tokens: cannot score its last {k} "
                                f"({g} as generated).", hint="Score at most all tokens but the first.")
    if interventions.guidance() is not None and any(k > len(p.without_system().ids) - 1 for p, k in zip(prompts, last,
                                                                                                      strict=True)):
        raise DriftlabError(CFG_REACH, hint="Score the text that follows the system span.")
    out: list[TokenScores] = []
    for chunk in chunks(backend, [k + 1 for k in last], interventions, batch_size):
        lp = logprobs(backend, [prompts[i] for i in chunk], interventions, max(last[i] for i in chunk) + 1,
                      [generated[i] for i in chunk])
        out += [row_scores(lp[b], prompts[i].ids, last[i], top) for b, i in enumerate(chunk)]
    return out


def chunks(backend: HFChatBackend, keeps: Sequence[int], interventions: Interventions,
           batch_size: int) -> Iterator[range]:
    """Consecutive rows to score together: at most `batch_size`, fewer where their [keep, V]
    log-probabilities (twice with cfg) would pass `LOGIT_BUDGET`."""
    vocab = backend.model.get_output_embeddings().weight.shape[0]
    per_position = 4 * vocab * (2 if interventions.guidance() is not None else 1)
    start = 0
    while start < len(keeps):
        head = keeps[start : start + batch_size]
        rows = max(1, min(len(head), LOGIT_BUDGET // (per_position * max(head))))
        yield range(start, start + rows)
        start += rows


def logprobs(backend: HFChatBackend, prompts: Sequence[Rendered], interventions: Interventions, keep: int,
             generated: Sequence[int]) -> torch.Tensor:
    """[B, keep, V] log-softmax of the last `keep` positions of each (left-padded) prompt; with
    cfg, mixed with each row's copy without its system span (which must leave `keep` tokens)."""
    lp = _teacher_forced(backend, prompts, interventions, keep, generated)
    alpha = interventions.guidance()
    if alpha is None:
        return lp
    plain = [p.without_system() for p in prompts]
    if max(len(u.ids) for u in plain) < keep:
        raise DriftlabError(CFG_REACH, hint="Score the text that follows the system span.")
    return torch.log_softmax(guide(torch.cat([lp, _teacher_forced(backend, plain, interventions, keep, generated)]),
                                   alpha), dim=-1)


def _teacher_forced(backend: HFChatBackend, prompts: Sequence[Rendered], interventions: Interventions, keep: int,
                    generated: Sequence[int]) -> torch.Tensor:
    keep = min(keep, max(len(p.ids) for p in prompts))
    return row_logprobs(backend, [np.asarray(p.ids, dtype=np.int64) for p in prompts], [p.spans() for p in prompts],
                        interventions, keep, list(generated))


def row_scores(lp: torch.Tensor, ids: list[int], k: int, top: int) -> TokenScores:
    """The scores of a row's last k tokens from its [keep, V] log-probabilities (`logprobs`,
    aligned at the end; rows that share all but their last token can read one pass)."""
    at = lp[-k - 1 : -1]  # position j predicts token j + 1
    target = torch.tensor(ids[-k:], device=at.device)
    picked = at.gather(-1, target[:, None])[:, 0]
    greedy = (at.argmax(-1) == target).tolist()
    alts: list[list[tuple[int, float]]] = [[] for _ in range(k)]
    if top:
        best = at.topk(top, dim=-1)
        alts = [list(zip(i, v, strict=True)) for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
    return TokenScores(token_ids=ids[-k:], logprobs=picked.tolist(), greedy=greedy, top=alts)
