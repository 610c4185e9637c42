"""JSON-constrained decoding (`Sampling.json_schema`, the server's `response_format`) with xgrammar.

A schema is compiled once per (tokenizer, vocabulary size, schema) into a grammar; each row of
a batch gets its own matcher, advanced with the tokens the row sampled since the last step, and
before sampling (or the greedy argmax) the tokens its grammar does not allow next get -inf. The
stop tokens are allowed only once the JSON is complete. Output is compact JSON (no free
whitespace between tokens of the syntax, `", "` and `": "` as separators), so a reply cannot
spend its tokens on whitespace; properties follow the schema's order.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from driftlab.errors import DriftlabError

__all__ = ["JSON_OBJECT", "JsonConstraint", "canonical_schema", "check_schema", "compiled", "grammar_text"]

JSON_OBJECT = '{"type":"object"}'  # `{"type": "json_object"}`: any JSON object
# How a schema becomes a grammar, for every engine: compact JSON, additional properties as the schema says.
JSON_OPTIONS = {"any_whitespace": False, "strict_mode": False}


def canonical_schema(schema: Any) -> str:
    """The schema as compact JSON, key order kept (it is the order properties are generated in)."""
    if not isinstance(schema, (dict, bool)):
        raise DriftlabError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


_lock = threading.Lock()
_compilers: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}  # key -> (tokenizer kept alive, compiler)
_grammars: dict[tuple[tuple[int, int, tuple[int, ...]], str], Any] = {}  # (compiler key, schema) -> grammar
MAX_GRAMMARS = 256  # compiled schemas kept (the oldest go first)


def compiled(tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], schema: str) -> Any:
    """The schema's grammar for this tokenizer, vocabulary width and stop tokens: compiled once,
    then cached (a DriftlabError saying why if xgrammar cannot use the schema)."""
    try:
        import xgrammar as xgr  # imported on first use: most runs never constrain
    except ImportError:
        raise DriftlabError("JSON-constrained decoding needs xgrammar, which is not installed.",
                            hint='pip install "driftlab[json]" (xgrammar 0.2.8).') from None

    key = (id(tokenizer), vocab_size, tuple(sorted(set(stop_ids))))
    with _lock:
        if key not in _compilers:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(key[2]))
            _compilers[key] = (tokenizer, xgr.GrammarCompiler(info))
        compiler = _compilers[key][1]
        if (key, schema) in _grammars:
            return _grammars[key, schema]
    try:
        grammar = compiler.compile_json_schema(schema, **JSON_OPTIONS)
    except RuntimeError as err:
        raise _schema_error(err) from None
    with _lock:
        while len(_grammars) >= MAX_GRAMMARS:
            del _grammars[next(iter(_grammars))]
        _grammars[key, schema] = grammar
    return grammar


def _schema_error(err: RuntimeError) -> DriftlabError:
    """xgrammar's "[time] file.cc:line: message" as a one-line error."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else "unusable schema"
    return DriftlabError(re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message))


def grammar_text(schema: str) -> str:
    """The schema's grammar as EBNF text, built with `compiled`'s options: what an engine that
    compiles grammars itself (vLLM's structured outputs) is given, so that it constrains a reply
    exactly as the transformers engine does (vLLM's own JSON mode compiles with other options)."""
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_json_schema(schema, **JSON_OPTIONS))
    except RuntimeError as err:
        raise _schema_error(err) from None


def check_schema(tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], schema: str) -> None:
    """A DriftlabError saying why if the schema cannot be compiled (the compiled grammar is kept)."""
    compiled(tokenizer, vocab_size, stop_ids, schema)


class JsonConstraint:
    """Per row of a batch, the tokens its JSON grammar allows next; rows index `sampled`."""

    def __init__(self, tokenizer: Any, stop_ids: Iterable[int], schema: str, rows: int) -> None:
        self.tokenizer, self.stop_ids, self.schema = tokenizer, tuple(stop_ids), schema
        self.matchers: list[Any] | None = None  # built at the first step, once the logits' width is known
        self.counted = [0] * rows  # sampled tokens of each row already given to its matcher
        self.broken = [False] * rows  # a token the grammar refused (e.g. past the end with ignore_eos): unconstrained

    def __call__(self, logits: torch.Tensor, rows: Sequence[int], sampled: Sequence[Sequence[int]]) -> torch.Tensor:
        import xgrammar as xgr

        V = logits.shape[-1]
        if self.matchers is None:
            grammar = compiled(self.tokenizer, V, self.stop_ids, self.schema)
            self.matchers = [xgr.GrammarMatcher(grammar) for _ in self.counted]
            self.bitmask = xgr.allocate_token_bitmask(len(self.counted), V)
        for b in rows:
            m = self.matchers[b]
            for tok in sampled[b][self.counted[b] :]:
                if not self.broken[b] and not m.is_terminated() and not m.accept_token(tok):
                    self.broken[b] = True
            self.counted[b] = len(sampled[b])
        bitmask = self.bitmask[: len(rows)]
        bitmask.fill_(-1)  # all bits set: every token allowed
        for i, b in enumerate(rows):
            if not self.broken[b] and not self.matchers[b].is_terminated():
                self.matchers[b].fill_next_token_bitmask(bitmask, i)
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True))
        return out
