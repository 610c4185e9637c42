"""Rendering conversations to tokens, and locating the system prompt inside them.

Chat models bring their own template (from the GGUF). Base models have none: driftlab
renders them with a plain-text dialog template and stops generation at the next speaker
tag, so a base model can sit in the same experiments (e.g. base-vs-chat attention decay).

A model whose tokenizer starts every text with BOS (Gemma, Llama) was trained with it;
without it the first token is out of distribution (and the attention sink moves). Chat
templates usually write BOS themselves; where a rendering lacks it (the plain template, a
template that dropped it) the renderer prepends it, so every prompt starts as in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from driftlab.chat.base import Rendered
from driftlab.errors import DriftlabError
from driftlab.messages import Message
from driftlab.steering.emphasis import strip_emphasis, token_spans
from driftlab.steering.interventions import Interventions

PLAIN_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] + '\n\n' }}"
    "{%- elif m['role'] == 'user' -%}{{ 'User: ' + m['content'] + '\n' }}"
    "{%- else -%}{{ 'Assistant: ' + m['content'] + '\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)
PLAIN_STOP = ("\nUser:", "\nAssistant:")

# End-of-turn tokens used by common chat templates; any present in the vocabulary stops generation.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")

SPAN_MODES = ("prefix", "content")


class Renderer:
    """Applies a tokenizer's chat template (or the plain one) and finds token spans."""

    def __init__(self, tokenizer, span_mode: str = "content") -> None:
        if span_mode not in SPAN_MODES:
            raise DriftlabError(f"Unknown system span mode '{span_mode}'.", hint=f"Use one of {SPAN_MODES}.")
        self.tokenizer = tokenizer
        self.span_mode = span_mode
        self.plain = not getattr(tokenizer, "chat_template", None)
        if self.plain:
            tokenizer.chat_template = PLAIN_TEMPLATE
        self.stop_strings: tuple[str, ...] = PLAIN_STOP if self.plain else ()
        self.bos: list[int] = _expected_bos(tokenizer)

    def text(self, conversation: Sequence[Message], add_generation_prompt: bool = True) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # jinja raises TemplateError for e.g. non-alternating roles
            raise DriftlabError(
                f"The model's chat template rejected the conversation: {err}",
                hint="Some templates need alternating user/assistant turns or forbid a system message.",
            ) from err

    def encode(self, text: str) -> list[int]:
        # The template already wrote any BOS/special tokens it wants.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, text: str) -> list[int]:
        """Tokens of a rendered prompt: `encode`, with BOS first where the model expects one."""
        return self._with_bos(self.encode(text))

    def _with_bos(self, ids: list[int]) -> list[int]:
        return self.bos + ids if self.bos and ids[: len(self.bos)] != self.bos else ids

    def render(
        self,
        conversation: Sequence[Message],
        add_generation_prompt: bool = True,
        emphasis: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> Rendered:
        """Tokens of a conversation, with its system span and, given each message's emphasised
        character spans (`driftlab.steering.emphasis.strip_emphasis`), their token ranges."""
        text = self.text(conversation, add_generation_prompt)
        # One tokenizer call gives the ids and the offsets both spans read: a second full encode
        # cost as much again (a self-chat renders every row of every call).
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = self._with_bos(enc["input_ids"])
        offsets = ([tuple(o) for o in enc["offset_mapping"]], len(ids) - len(enc["input_ids"]))
        span = None
        if conversation and conversation[0]["role"] == "system":
            span = self._system_span(conversation[0], text, ids, offsets)
        marked: tuple[tuple[int, int], ...] = ()
        if emphasis is not None and any(emphasis):
            marked = tuple(token_spans(text, [m["content"] for m in conversation], emphasis, *offsets))
        return Rendered(ids=ids, text=text, system_span=span, emphasis=marked)

    def render_for(self, conversation: Sequence[Message], add_generation_prompt: bool = True,
                   interventions: Interventions | None = None) -> Rendered:
        """The tokens a local engine gives the model under `interventions`: with PASTA on marked text,
        the markers removed and turned into emphasis spans; with a pi floor or `when-drifting`, the
        first turn marked (their reference). Every engine renders through this, so their tokens and
        spans are the same."""
        marker = interventions.emphasis_marker() if interventions is not None else None
        if marker is None:
            rendered = self.render(conversation, add_generation_prompt)
        else:
            clean, emphasis = strip_emphasis(conversation, marker)
            rendered = self.render(clean, add_generation_prompt, emphasis=emphasis)
        if interventions is not None and interventions.kinds & {"pi-floor", "when-drifting"}:
            rendered = replace(rendered, first_turn=self.first_turn(conversation, rendered.ids))
        return rendered

    def cut_stop(self, text: str) -> str:
        """A reply's text up to the first stop string (a base model's next speaker), if any."""
        cut = min((text.find(s) for s in self.stop_strings if s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    def first_turn(self, conversation: Sequence[Message], ids: list[int]) -> int | None:
        """The token index, in `ids` (the conversation's rendering), of the last prompt token of its
        first turn: what the model read just before its first reply. None without a user message, or
        where the template does not render the first turn as a prefix of the whole."""
        k = next((i for i, m in enumerate(conversation) if m["role"] == "user"), None)
        if k is None:
            return None
        head = self.prompt_ids(self.text(conversation[: k + 1], add_generation_prompt=True))
        return len(head) - 1 if ids[: len(head)] == head else None

    def _system_span(self, system: Message, text: str, ids: list[int],
                     offsets: tuple[list[tuple[int, int]], int]) -> tuple[int, int]:
        """Token span of the system prompt: the rendered system turn, or only its text.

        `prefix` = the tokens of the chat template applied to the system message alone, from
        position 0 (includes the template header and any BOS, which is often an attention
        sink). `content` = only the tokens overlapping the system prompt's characters. `offsets`:
        the character offsets of `text`'s tokens, and how many tokens (BOS) `ids` has before them.
        A template that folds the system prompt into the first user turn (Llama-2-chat:
        `[INST] <<SYS>>\n...\n<</SYS>>\n\n{user}`) renders nothing for the system message
        alone: there `prefix` runs from position 0 to the end of the system prompt's text.
        """
        if self.span_mode == "prefix":
            alone = self.text([system], add_generation_prompt=False)
            if system["content"] and system["content"] not in alone:
                return (0, self._content_span(system, text, offsets)[1])
            sys_ids = self.prompt_ids(alone)
            n = 0
            for a, b in zip(sys_ids, ids, strict=False):
                if a != b:
                    break
                n += 1
            return (0, n)
        return self._content_span(system, text, offsets)

    def _content_span(self, system: Message, text: str, offsets: tuple[list[tuple[int, int]], int]) -> tuple[int, int]:
        content = system["content"]
        if not content or content not in text:
            return (0, 0)
        found = token_spans(text, [content], [[(0, len(content))]], *offsets)
        return found[0] if found else (0, 0)

    def eos_ids(self, model_config, generation_config) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        if not self.plain:
            vocab = self.tokenizer.get_vocab()
            ids.update(vocab[t] for t in END_OF_TURN if t in vocab and t in self.tokenizer.chat_template)
        return ids


def _expected_bos(tokenizer) -> list[int]:
    """[BOS id] if the tokenizer starts plain text with BOS (how the model was trained), else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if not isinstance(bos, int):
        return []
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if ids[:1] == [bos] else []
