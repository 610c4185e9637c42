"""Asking judge models: the protocol side of the LLM-judge measure (`driftlab.bench.judge`).

A run may hold several judges (one per persona whose measure is `judge:model=...`, and the
run's own `--judge` that rates every probe beside its deterministic measure). `Judges` loads
each judge model once, through the same backends as the dialog (a preset, a Hub id, a local
directory, or `openai:NAME` behind any OpenAI-compatible server, `driftlab serve` included),
reuses the agent's loaded model when the judge is the same model, always decodes greedily,
and caches every verdict in the run directory (`judge.jsonl`, keyed by the judge model and
the whole prompt), so a resumed or repeated scoring never asks twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driftlab.bench.judge import SYSTEM, TEMPLATE, JudgeParams, judge_conversation, verdict_score
from driftlab.chat.base import ChatBackend, ChatRequest, Sampling
from driftlab.chat.openai import RequestLog
from driftlab.chat.spec import BackendSpec, Runtime
from driftlab.errors import DriftlabError

VERDICTS = "judge.jsonl"


@dataclass(frozen=True)
class Ask:
    """One reply to rate: the judge, and what it reads."""

    params: JudgeParams
    system_prompt: str
    probe: str
    reply: str


class Judges:
    """The judge models of one run, loaded on first use, and their verdict cache."""

    def __init__(self, agent_spec: BackendSpec, agent: ChatBackend | None, run_dir: Path | None) -> None:
        self.agent_spec, self.agent = agent_spec, agent
        self.cache = RequestLog(Path(run_dir) / VERDICTS) if run_dir is not None else None
        self._backends: dict[tuple[str, str | None], ChatBackend] = {}
        self._owned: list[ChatBackend] = []

    @staticmethod
    def spec(params: JudgeParams, agent_spec: BackendSpec) -> BackendSpec:
        """The backend a judge runs on: its model, on the agent's device and dtype (a remote judge: its server)."""
        try:
            if params.model.startswith("openai:"):
                return BackendSpec(model=params.model, runtime=Runtime(base_url=params.base_url))
            return BackendSpec(model=params.model, device=agent_spec.device, dtype=agent_spec.dtype)
        except ValueError as err:  # a pydantic error: name the judge, in one line
            reason = (err.errors()[0]["msg"] if hasattr(err, "errors") else str(err)).removeprefix("Value error, ")
            raise DriftlabError(f"judge model {params.model!r}: {reason}.",
                                hint="Give a preset, a local directory, a Hub id org/name, or openai:NAME with "
                                     "base_url=http://HOST:PORT/v1.") from None

    def backend(self, params: JudgeParams) -> ChatBackend:
        """The loaded judge (the agent's own model when it is the same local model)."""
        key = (params.model, params.base_url)
        if key not in self._backends:
            spec = self.spec(params, self.agent_spec)
            if self.agent is not None and spec.model == self.agent_spec.model and not spec.remote:
                self._backends[key] = self.agent  # no interventions reach it: a judge request carries none
            else:
                from driftlab.chat.factory import make_backend

                try:
                    backend = make_backend(spec)  # no request log: the verdict cache is this judge's log
                except DriftlabError as err:
                    raise DriftlabError(f"judge model {params.model!r}: {err.message}", hint=err.hint) from None
                self._backends[key] = backend
                self._owned.append(backend)
        return self._backends[key]

    def describe(self, judges: list[JudgeParams]) -> dict[str, Any]:
        """What a manifest records: the prompt, and each judge model as its backend describes it."""
        return {"system": SYSTEM, "template": TEMPLATE,
                "models": {p.model: self.backend(p).describe() for p in judges}}

    def rate(self, asks: list[Ask]) -> list[dict[str, Any]]:
        """Each reply's `{"score", "error", "verdict"}`: the judge's rating / 10, or why there is none.

        A blank reply scores 0 unasked (as with every measure); the rest go to their judge in one
        greedy batch per judge model, from the cache where a verdict was recorded before.
        """
        out: list[dict[str, Any] | None] = [None] * len(asks)
        groups: dict[tuple[str, str | None, int], list[int]] = {}
        for i, ask in enumerate(asks):
            if not ask.reply.strip():
                out[i] = {"score": 0.0, "error": None, "verdict": None}
            else:
                groups.setdefault((ask.params.model, ask.params.base_url, ask.params.max_tokens), []).append(i)
        for rows in groups.values():
            verdicts = self._verdicts([asks[i] for i in rows])
            for i, verdict in zip(rows, verdicts, strict=True):
                out[i] = _read(verdict)
        return out  # type: ignore[return-value]

    def _verdicts(self, asks: list[Ask]) -> list[str]:
        """The judge's answers to `asks` (one judge model): cached ones read, the others asked at once."""
        params = asks[0].params
        convs = [judge_conversation(a.params, a.system_prompt, a.probe, a.reply) for a in asks]
        keys = [RequestLog.key({"judge": params.model, "base_url": params.base_url, "max_tokens": params.max_tokens,
                                "messages": c}) for c in convs]
        done = self.cache.done if self.cache is not None else {}
        todo = [i for i, k in enumerate(keys) if k not in done]
        if todo:
            sampling = Sampling(max_new_tokens=params.max_tokens, greedy=True)
            replies = self.backend(params).generate(ChatRequest([convs[i] for i in todo], sampling))
            fresh = {keys[i]: {"text": r.text} for i, r in zip(todo, replies, strict=True)}
            for i in todo:
                if self.cache is not None:
                    self.cache.add(keys[i], {"judge": params.model, "messages": convs[i]}, fresh[keys[i]], {})
            done = {**done, **fresh}
        return [done[k]["text"] for k in keys]

    def close(self) -> None:
        for backend in self._owned:
            backend.close()
        if self.cache is not None:
            self.cache.close()


def _read(verdict: str) -> dict[str, Any]:
    try:
        return {"score": verdict_score(verdict), "error": None, "verdict": verdict}
    except ValueError as err:
        return {"score": None, "error": f"JudgeError: {err}"[:500], "verdict": verdict}
