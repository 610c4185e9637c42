"""lm-evaluation-harness on a driftlab model, steered: `DriftlabLM` (registered as "driftlab").

    import lm_eval
    from driftlab.integrations.lm_eval import DriftlabLM

    lm = DriftlabLM(model="smollm2-135m", steer=["split-softmax:k=0.8"], dtype="float32")
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"], apply_chat_template=True,
                            system_instruction="Answer with the letter only.")

The harness sends raw text: a context and a continuation to score, a document to score whole,
or a context to continue. `DriftlabLM` tokenises it as lm-eval's own `HFLM` does (context and
continuation from one encoding of their concatenation, the context's trailing spaces moved to
the continuation, an empty context replaced by the prefix token), so without a steer its
log-likelihoods are HFLM's. A steer acts on the system span, which raw text does not mark:
`system` says where it is (`driftlab.chat.text.SystemSpan`, or "chat": the system message where
the model's chat template puts it, i.e. prompts built with `--apply_chat_template
--system_instruction ...`; "until:MARKER": everything before the first MARKER; "none").

Scoring reuses passes: requests whose tokens differ only in their last one (the options of a
multiple-choice question with one-token answers) share one forward pass, identical requests
are scored once, and passes are batched by length. Generation decodes each batch with the
backend's own loop (`ChatRequest` of rendered prompts) and ends each row at the model's EOS or
at the first of the request's `until` strings.

On the command line (lm-eval 0.4.13 finds models only in its own registry: it has no entry
point or plugin group for models, and `--include_path` adds tasks, not models), run lm-eval
through this module, which registers "driftlab" first and then hands over to lm-eval's CLI:

    python -m driftlab.integrations.lm_eval run --model driftlab \\
        --model_args pretrained=smollm2-135m,dtype=float32,steer=split-softmax:k=0.8 \\
        --tasks arc_easy --apply_chat_template --system_instruction "Answer with the letter only."

Several steers are separated by ';' (`steer=split-softmax:k=0.8;cfg:alpha=1.5`), which no
`--steer` spec contains; a spec with several settings keeps its commas (`steer=pasta:alpha=0.01,
heads=heads.json`: a piece whose key is not a DriftlabLM argument belongs to the steer before
it), or is given as a list (`steer=["pasta:alpha=0.01,heads=heads.json"]`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from driftlab.chat import text
from driftlab.chat.base import ChatRequest, Rendered, Sampling
from driftlab.chat.text import SystemSpan
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

__all__ = ["DriftlabLM", "main", "parse_system"]

log = logging.getLogger(__name__)

STEER_SEPARATOR = ";"
DEFAULT_MAX_LENGTH = 2048  # the window when the model declares none, and the cap on its own
GEN_KWARGS = ("until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens", "do_sample",
              "temperature", "top_p", "top_k")
_ARGS = ("model", "pretrained", "steer", "system", "batch_size", "dtype", "device", "max_length", "add_bos_token",
         "seed", "max_batch_size")


def parse_system(system: SystemSpan | str | None) -> SystemSpan:
    """`system` as a SystemSpan: "chat" (the chat template's system message), "until:MARKER", "none"."""
    if isinstance(system, SystemSpan):
        return system
    if system is None or system == "none":
        return SystemSpan()
    if system == "chat":
        return SystemSpan(chat=True)
    if isinstance(system, str) and system.startswith("until:") and len(system) > len("until:"):
        return SystemSpan(until=system[len("until:") :])
    raise DriftlabError(f"system={system!r} does not say where the system span is.",
                        hint='Use "chat" (the chat template\'s system message), "until:MARKER" or "none".')


def _steer(steer: Interventions | str | Sequence[str] | None) -> Interventions:
    if isinstance(steer, Interventions):
        return steer
    if steer is None or steer == "":
        return Interventions()
    specs = steer.split(STEER_SEPARATOR) if isinstance(steer, str) else [s for part in steer
                                                                         for s in str(part).split(STEER_SEPARATOR)]
    return Interventions.parse([s.strip() for s in specs if s.strip()])


@dataclass(frozen=True)
class _Item:
    """One scoring row: its tokens, how many trailing ones are scored, and the system span."""

    ids: tuple[int, ...]
    n: int
    span: tuple[int, int] | None


@register_model("driftlab") if __name__ != "__main__" else (lambda cls: cls)
class DriftlabLM(TemplateLM):
    """An lm-evaluation-harness model backed by a local driftlab model, under `--steer` interventions.

    `model`: a driftlab backend already built (`driftlab.load(...)`, `driftlab.from_model(model,
    tokenizer)`, `HFChatBackend(...)`), or what `--model` takes for a local model (a preset, a
    model directory, a Hub id), loaded with `dtype` and `device`. `steer`: `--steer` specs (a
    list, or one string with ';' between specs). `system`: where a steer's system span is in
    the harness's prompts (see the module docstring). `batch_size`: forward passes (scoring) or
    rows (generation) run together. `max_length`: the token window of scoring and of prompt
    plus generation (default: the model's context window, at most 2048). `add_bos_token`: as
    HFLM's (None: the tokenizer's default; a prompt that starts with the BOS text gets none
    added). `seed`: the first row seed of sampled generation (request i uses seed + i).
    """

    def __init__(self, model: Any = None, steer: Interventions | str | Sequence[str] | None = None,
                 system: SystemSpan | str = "chat", batch_size: int | str = 8, dtype: str = "auto",
                 device: str | None = "auto", max_length: int | None = None, add_bos_token: bool | None = None,
                 seed: int = 0, *, pretrained: Any = None, max_batch_size: int | None = None) -> None:
        super().__init__()
        if model is not None and pretrained is not None:
            raise DriftlabError("DriftlabLM got both model= and pretrained=.", hint="Give one of them.")
        self.backend = _backend(model if model is not None else pretrained, dtype, device)
        self.steer = _steer(steer)
        self.backend.capabilities.require(self.backend.name, self.steer)
        if self.steer.by_hook("conversation"):
            raise DriftlabError(f"--steer {', '.join(i.kind for i in self.steer.by_hook('conversation'))} edits a "
                                "conversation; lm-evaluation-harness sends raw text.",
                                hint="Use attention or logit interventions (split-softmax, instaboost, bias, pasta, "
                                     "cfg) with DriftlabLM.")
        if self.steer.emphasis_marker() is not None:
            raise DriftlabError("An intervention on marked text (span=marked) needs emphasis markup, which raw "
                                "prompts do not carry.", hint="Steer the system span instead.")
        self.steer = self.steer.without("trace")  # nothing to return a pi trace in
        self.system = parse_system(system)
        self._template = text.system_template(self.backend.renderer) if self.system.chat else None
        self.tokenizer = self.backend.tokenizer
        if str(batch_size).startswith("auto"):
            batch_size = 8  # no search for the largest batch that fits; scoring keeps within LOGIT_BUDGET anyway
        if isinstance(batch_size, str) and batch_size.isdigit():  # lm-eval's CLI passes --batch_size as text
            batch_size = int(batch_size)
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise DriftlabError(f"batch_size={batch_size} must be a whole number, at least 1 (or 'auto').")
        self._batch_size = batch_size
        window = self.backend.shape.max_context
        if max_length is not None and not (isinstance(max_length, int) and max_length >= 2):
            raise DriftlabError(f"max_length={max_length} is not a usable window: give a whole number of tokens, "
                                "at least 2.", hint="Or leave it out (the model's window, at most 2048).")
        self._max_length = int(max_length) if max_length else min(window or DEFAULT_MAX_LENGTH, DEFAULT_MAX_LENGTH)
        if window and self._max_length > window:
            raise DriftlabError(f"max_length={self._max_length} exceeds the model's context window of {window}.")
        self.add_bos_token = add_bos_token
        self.seed = int(seed)
        self._no_span_said = False

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DriftlabLM:
        """`--model_args` as a string: key=value pairs between commas, where a piece whose key is
        not a DriftlabLM argument continues the steer before it (`steer=pasta:alpha=0.01,heads=h.json`)."""
        args: dict[str, Any] = {}
        last = None
        for piece in filter(None, (p.strip() for p in (arg_string or "").split(","))):
            key, sep, value = piece.partition("=")
            if sep and key.strip() in _ARGS:
                last = key.strip()
                args[last] = _value(value.strip()) if last != "steer" else value.strip()
            elif last == "steer":
                args["steer"] += "," + piece
            else:
                raise DriftlabError(f"Cannot read {piece!r} in DriftlabLM's model_args.",
                                    hint=f"Use key=value with keys among {', '.join(_ARGS)}.")
        return cls.create_from_arg_obj(args, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> DriftlabLM:
        """`--model_args` as lm-eval's CLI parses it (a dict); keys that are not DriftlabLM
        arguments, after steer=, are that steer's settings cut off at a comma."""
        args: dict[str, Any] = {}
        last = None
        for key, value in arg_dict.items():
            if key in _ARGS:
                args[key], last = value, key
            elif last == "steer" and isinstance(args["steer"], str):
                shown = str(value).lower() if isinstance(value, bool) else value
                args["steer"] += f",{key}={shown}"
            else:
                raise DriftlabError(f"DriftlabLM takes no argument {key!r}.", hint=f"Its arguments: {', '.join(_ARGS)}.")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI says cuda:0 unless told otherwise; on a machine without one, HFLM runs on the CPU too.
            log.warning("DriftlabLM: lm-eval asked for %s, which this machine lacks; using the CPU.", extra["device"])
            extra["device"] = "cpu"
        return cls(**args, **extra)

    # -- what lm-eval asks of a model ---------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self.backend.device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The history as the model's chat template writes it (HFLM's way: a template that
        refuses system messages gets the history without them)."""
        import jinja2

        def render(history):
            return self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            log.warning("The chat template refused the history; rendering it without its system message.")
            return render([m for m in chat_history if m["role"] != "system"])

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' config: the model and the steer."""
        facts = self.backend.describe()
        return {"driftlab_model": {k: facts.get(k) for k in ("name", "path", "dtype", "device") if k in facts},
                "driftlab_steer": self.steer.specs(), "driftlab_system": repr(self.system)}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string, **self._special(string, add_special_tokens))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _special(self, string: str, add_special_tokens: bool | None) -> dict[str, bool]:
        """HFLM's choice of special tokens: as asked, else `add_bos_token`, else the tokenizer's
        default, and none for a string that already starts with the BOS text."""
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        if has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            return {"add_special_tokens": False}
        return {"add_special_tokens": self.add_bos_token} if self.add_bos_token is not None else {}

    def _encode(self, string: str) -> tuple[list[int], tuple[int, int] | None]:
        """`tok_encode(string)` and the system span in those tokens (those overlapping its characters)."""
        chars = self.system.locate(string, self._template) if string else None
        if chars is None:
            return self.tok_encode(string), None
        if not getattr(self.tokenizer, "is_fast", False):
            raise DriftlabError("Locating the system span needs a fast tokenizer (character offsets).",
                                hint='Load the model with its fast tokenizer, or use system="none".')
        enc = self.tokenizer(string, return_offsets_mapping=True, **self._special(string, None))
        lo, hi = chars
        inside = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > lo and a < hi and b > a]
        return list(enc["input_ids"]), ((inside[0], inside[-1] + 1) if inside else None)

    # -- loglikelihood -------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """log p(continuation | context) and whether greedy decoding gives the continuation."""
        items = []
        for context, continuation in [req.args for req in requests]:
            if context == "":
                cont = self.tok_encode(continuation, add_special_tokens=False)
                ctx, cont = ([self.prefix_token_id], cont) if self.prefix_token_id != cont[0] else (cont[:1], cont[1:])
                span = None
            else:
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                whole = self.tok_encode(context + continuation)
                ctx, span = self._encode(context)
                cont = whole[len(ctx) :]
            if not cont:
                raise DriftlabError(f"The continuation {continuation!r} encodes to no tokens after its context.")
            items.append(self._fit(ctx + cont, len(cont), span))
        return self._score(items, disable_tqdm)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        """TemplateLM's token-level entry point: ((context, continuation), context ids, continuation ids)."""
        return self._score([self._fit(list(c) + list(t), len(t), None) for _, c, t in requests],
                           kwargs.get("disable_tqdm", False))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood after the prefix token, in windows of `max_length`
        (HFLM's rolling windows: every token predicted once, each window with as much context as fits)."""
        items, owner = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            ids, span = self._encode(string)
            full_span = (span[0] + 1, span[1] + 1) if span else None  # positions in [prefix] + ids
            predicted = 0
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                predicted += len(cont)
                row = ctx + cont
                start = predicted + 1 - len(row)  # where the window starts in [prefix] + ids
                items.append(_Item(tuple(row), len(cont), _shift(full_span, start, len(row))))
                owner.append(r)
        scores = self._score(items, disable_tqdm)
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owner, scores, strict=True):
            totals[r] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _fit(self, ids: list[int], n: int, span: tuple[int, int] | None) -> _Item:
        """The row cut from the left to the window, as HFLM cuts it (max_length inputs plus the
        last target; max_length in all where that is the model's whole context window)."""
        window = self.backend.shape.max_context
        limit = self.max_length + 1 if not window or self.max_length < window else self.max_length
        if n >= limit:
            raise DriftlabError(f"A continuation of {n} tokens does not fit the window of {self.max_length}.")
        cut = max(0, len(ids) - limit)
        return _Item(tuple(ids[cut:]), n, _shift(span, cut, len(ids) - cut))

    def _score(self, items: list[_Item], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(sum of log-probs, all greedy) of each item's last `n` tokens: one pass per distinct
        row-without-its-last-token, batched by length within LOGIT_BUDGET."""
        backend, steer = self.backend, self.steer
        alpha = steer.guidance()
        groups: dict[_Item, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(_Item(item.ids[:-1], item.n, item.span), []).append(i)
        order = sorted(groups.values(), key=lambda g: (-len(items[g[0]].ids), items[g[0]].ids))
        self._say_no_span(items)
        if alpha is not None and any(item.n + 1 > len(_rendered(item).without_system().ids) for item in items):
            raise DriftlabError(text.CFG_REACH, hint="Put the system prompt before the context.")
        out: list[tuple[float, bool] | None] = [None] * len(items)
        bar = tqdm(total=len(items), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for rows in text.chunks(backend, [items[g[0]].n + 1 for g in order], steer, self.batch_size):
            chunk = [order[r] for r in rows]
            reps = [items[g[0]] for g in chunk]
            with torch.inference_mode():
                lp = text.logprobs(backend, [_rendered(r) for r in reps], steer, max(r.n for r in reps) + 1,
                                   [r.n for r in reps])
            for b, group in enumerate(chunk):
                for i in group:
                    scores = text.row_scores(lp[b], list(items[i].ids), items[i].n, 0)
                    out[i] = (sum(scores.logprobs), all(scores.greedy))
            bar.update(sum(len(g) for g in chunk))
        bar.close()
        return out  # type: ignore[return-value]

    def _say_no_span(self, items: Sequence[_Item]) -> None:
        if self.steer and not self._no_span_said and any(item.span is None for item in items):
            self._no_span_said = True
            log.warning("DriftlabLM: some prompts have no system span under system=%r; the steer %s acts on "
                        "nothing there.", self.system, ";".join(self.steer.specs()))

    # -- generate_until ------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued until one of its `until` strings (cut off), EOS or `max_gen_toks`."""
        args = [req.args for req in requests]
        by_kwargs: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            by_kwargs.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(args)
        bar = tqdm(total=len(args), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
        for idxs in by_kwargs.values():
            sampling, until = self._sampling(args[idxs[0]][1])
            room = self.max_length - sampling.max_new_tokens
            prompts = {i: self._prompt(args[i][0], room) for i in idxs}
            self._say_no_span([_Item((), 0, p.system_span) for p in prompts.values()])
            order = sorted(idxs, key=lambda i: (-len(prompts[i].ids), i))
            for s in range(0, len(order), self.batch_size):
                chunk = order[s : s + self.batch_size]
                texts = self._generate([prompts[i] for i in chunk], sampling, until, [self.seed + i for i in chunk])
                for i, t in zip(chunk, texts, strict=True):
                    out[i] = t
                    self.cache_hook.add_partial("generate_until", args[i], t)
                bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    def _sampling(self, gen_kwargs: dict[str, Any]) -> tuple[Sampling, list[str]]:
        if not isinstance(gen_kwargs, dict):
            raise DriftlabError(f"generate_until: generation arguments {gen_kwargs!r} are not a mapping.")
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise DriftlabError(f"generate_until: DriftlabLM does not apply the generation argument(s) "
                                f"{', '.join(unknown)}.", hint=f"It takes {', '.join(GEN_KWARGS)}.")
        kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        try:
            until = handle_stop_sequences(kw["until"], eos=None)
        except ValueError as err:
            raise DriftlabError(f"generate_until: {err}") from None
        if not all(isinstance(s, str) for s in until):
            raise DriftlabError(f"generate_until: until={until!r} must be strings.")
        max_gen = int(kw["max_gen_toks"])
        if not 1 <= max_gen < self.max_length:
            raise DriftlabError(f"generate_until: max_gen_toks={max_gen} must be at least 1 and less than the "
                                f"window of {self.max_length} tokens.")
        temperature = float(kw.get("temperature") or 0.0)
        greedy = not kw.get("do_sample") or temperature == 0.0
        try:
            sampling = Sampling(max_new_tokens=max_gen, temperature=0.0 if greedy else temperature, greedy=greedy,
                                top_p=float(kw.get("top_p") or 1.0), top_k=int(kw.get("top_k") or 0),
                                ignore_eos=True)  # EOS ends a row here (see _generate), as in HFLM, not the chat stops
        except ValueError as err:
            raise DriftlabError(f"generate_until: {err}") from None
        return sampling, [s for s in until if s]

    def _prompt(self, context: str, room: int) -> Rendered:
        """The context as a rendered prompt, cut from the left to `room` tokens (as HFLM cuts it)."""
        if not context:
            return Rendered(ids=[self.prefix_token_id], text="", system_span=None)
        ids, span = self._encode(context)
        cut = max(0, len(ids) - room)
        return Rendered(ids=ids[cut:], text=context, system_span=_shift(span, cut, len(ids) - cut))

    def _generate(self, prompts: list[Rendered], sampling: Sampling, until: list[str], seeds: list[int]) -> list[str]:
        """Decode a batch; a row ends at an EOS token or once its text holds a stop string (its text
        is then cut before the first one)."""
        backend = self.backend
        stop_ids = set(backend.stop_ids) | ({self.eot_token_id} if self.eot_token_id is not None else set())
        tail = max((len(s) for s in until), default=0) + 8  # tokens: at least one character each, but partial UTF-8
        seen: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)

        def on_token(row: int, token: int) -> None:
            if done[row]:
                return
            seen[row].append(token)
            if token in stop_ids or (until and any(s in backend.decode(seen[row][-tail:]) for s in until)):
                done[row] = True

        replies = backend.generate(ChatRequest(prompts, sampling, seeds=seeds, interventions=self.steer,
                                               on_token=on_token, cancelled=lambda row: done[row]))
        texts = []
        for reply in replies:
            ids = list(reply.token_ids)
            end = next((k for k, t in enumerate(ids) if t in stop_ids), len(ids))
            out = backend.decode(ids[:end])
            cut = min((out.find(s) for s in until if s in out), default=-1)
            texts.append(out[:cut] if cut >= 0 else out)
        return texts


def _shift(span: tuple[int, int] | None, cut: int, length: int) -> tuple[int, int] | None:
    """A token span after the first `cut` tokens are dropped, clipped to a row of `length` (None: gone)."""
    if span is None:
        return None
    a, b = max(span[0] - cut, 0), min(span[1] - cut, length)
    return (a, b) if a < b else None


def _value(value: str) -> Any:
    """A model_args value: true/false, an integer, a number, or the string."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return None if value.lower() == "none" else value


def _backend(model: Any, dtype: str, device: str | None):
    """The local HFChatBackend to run: the one given, or the one a model name loads."""
    from driftlab.chat.hf import HFChatBackend

    if model is None:
        raise DriftlabError("DriftlabLM needs a model.",
                            hint="model=<a driftlab backend, preset or model directory> (pretrained= on lm-eval's "
                                 "command line).")
    if isinstance(model, HFChatBackend):
        return model
    if not isinstance(model, str):
        what = type(model).__name__
        hint = ("Wrap it first: driftlab.from_model(model, tokenizer)." if hasattr(model, "config")
                else "Give a driftlab backend (driftlab.load, driftlab.from_model), a preset or a model directory.")
        raise DriftlabError(f"DriftlabLM cannot run a {what}: it needs a local driftlab model.", hint=hint)
    from pydantic import ValidationError

    from driftlab.chat.factory import make_backend
    from driftlab.chat.spec import BackendSpec

    try:
        spec = BackendSpec(model=model, dtype=dtype or "auto", device=device or "auto")
    except ValidationError as err:
        first = err.errors()[0]
        raise DriftlabError(f"DriftlabLM: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if spec.remote:
        raise DriftlabError(f"DriftlabLM runs local models; {model} is a model behind a server.",
                            hint="Score it with lm-eval's local-completions model against that server "
                                 "(e.g. `driftlab serve`), or give a preset or model directory.")
    backend = make_backend(spec, prefix_cache_bytes=0)
    if not isinstance(backend, HFChatBackend):
        raise DriftlabError(f"DriftlabLM needs a model loaded in this process; {model} is a {type(backend).__name__}.")
    return backend


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line with the "driftlab" model registered (`python -m driftlab.integrations.lm_eval`)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    # Run as a script this file is `__main__`: register the importable module's class, not this copy.
    from driftlab.integrations.lm_eval import main as _main

    assert "driftlab" in model_registry
    _main()


def _rendered(item: _Item) -> Rendered:
    return Rendered(ids=list(item.ids), text="", system_span=item.span)
