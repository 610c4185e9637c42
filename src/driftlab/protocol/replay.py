"""Replay: real user turns under a system prompt, every agent turn scored.

Why: a self-chat's user is a model, and small models talking to themselves loop by round ~15
(docs/results, the 40-round study), so a flat measure there may read the same text again. A
replay takes its user turns from data instead (`assets.conversations`: chained standalone ShareGPT
turns by default, whole ShareGPT dialogs, MT-Bench, or the user's own logs) and generates only the
agent's turns: the dialog the model sees is [s_B, u_1, b_1, ..., u_i] with its own replies b_j,
never the logged assistant's. Each b_i is scored by the agent persona's measure (one that applies
to every reply: the pattern and language personas by default, or `--system` with `--measure`), so
compliance is known at every turn, not only at probes; probes stay available (`probes`).

It is the self-chat protocol with the user LM replaced by data: the same runner, records (a turn
record per agent turn, with `score`), resume, KL (`kl`), pi (`--steer trace`) and projection
(`--directions`) on every agent turn, and the same readers (`Dialog.from_records` fills the user
turns from the plan). The plan records every dialog's user turns, so a resume and every later
reader replay exactly what the run saw, whatever the data set is by then.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator

from driftlab.assets.conversations import Source, draw_dialogs
from driftlab.bench import JUDGE, Persona
from driftlab.chat.base import Sampling
from driftlab.chat.gate import score_decision
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import Pair, ProbeRecord, TurnRecord
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, RunState
from driftlab.protocol.selfchat import Job, SelfChat, SelfChatConfig, _scored, input_hashes
from driftlab.steering.interventions import Interventions

REPLY_TOKENS = 200  # an agent turn's budget by default: room for an answer, short enough for 20+ rounds
# Categories whose measure scores any reply (a language, a pattern of the text), not the answer to one probe,
# but for the personas of those categories whose measure is bound to their probe (a count of its words, a
# word the probe's London question asks for): drawn only where named.
EVERY_REPLY = ["language", "pattern"]
PROBE_BOUND = ("count-user-words", "translate-london-questions-to-french")


class ReplayConfig(SelfChatConfig):
    """A replay (recorded in the run's manifest): the self-chat's fields that apply, and where the user
    turns come from."""

    source: Source = Field("sharegpt-chain", description="where the user turns come from: 'sharegpt-chain' "
                           "(first turns of distinct ShareGPT conversations, one per round), 'sharegpt' (whole "
                           "dialogs), 'mtbench' (two-turn questions) or 'file' (--conversations)")
    conversations: str | None = Field(None, description="a JSONL file of your own conversations, one per line as "
                                      '{"messages": [{"role": ..., "content": ...}]} (OpenAI\'s chat format)')
    dialogs: int | None = Field(None, ge=1, description="dialogs to replay (default 10; with --conversations: "
                                "every conversation of the file)")
    max_words: int = Field(60, ge=1, description="longest user turn drawn from ShareGPT, in words")
    probes: bool = Field(False, description="also probe the agent at rounds i with i % probe_every == 0")
    categories: list[str] | None = Field(default_factory=lambda: list(EVERY_REPLY),
                                         description="draw agent personas from these categories only")
    rounds: int = Field(10, ge=1, le=1000)
    sampling: Sampling = Sampling(max_new_tokens=REPLY_TOKENS)
    probe_tokens: int | str = REPLY_TOKENS

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*SelfChatConfig.RESUME_IGNORES, "conversations")
    SCORES_TURNS: ClassVar[bool] = True

    @model_validator(mode="after")
    def _replay_has_no_user_model(self) -> ReplayConfig:
        if self.conversations is not None and self.source == "sharegpt-chain":
            object.__setattr__(self, "source", "file")
        if self.source == "file" and self.conversations is None:
            raise ValueError("source 'file' needs conversations (--conversations FILE)")
        if self.conversations is not None and self.source != "file":
            raise ValueError(f"conversations is a file of your own; source {self.source!r} is a data set")
        unused = [name for name, default in (("user_model", None), ("pair_ids", []), ("user_probe", False),
                                             ("ablation", False), ("users", "personas"))
                  if getattr(self, name) != default]
        if unused:
            raise ValueError(f"{', '.join(unused)}: a replay has no user model (its user turns come from data)")
        return self

    @property
    def conditions(self) -> list[str]:
        return ["persona"]

    def probe_rounds(self) -> list[int]:
        return super().probe_rounds() if self.probes else []

    def n_dialogs(self) -> int | None:
        """Dialogs to draw: as asked; by default 10 from a data set, every one of a file (None)."""
        return self.dialogs if self.dialogs is not None else (None if self.source == "file" else 10)


def draw_replay(config: ReplayConfig) -> list[Pair]:
    """The run's dialogs: user turns from the source, and an agent persona each, cycling through the
    agent pool in an order drawn from the seed (so 10 personas over 30 dialogs get 3 each)."""
    _, agents = config.persona_pool()
    agents = [a for a in agents if a.measure != JUDGE and (config.agents is not None or a.id not in PROBE_BOUND)]
    if not agents:
        raise DriftlabError("No agent persona with a measure of its own to score every turn.",
                            hint="Choose --categories language,pattern, --agents, or --system with --measure.")
    n = config.n_dialogs()
    dialogs = draw_dialogs(config.source, n if n is not None else 10**9, config.rounds, config.seed,
                           config.conversations, config.max_words)
    order = random.Random(config.seed).sample(agents, len(agents))
    return [Pair(k, order[k % len(order)], None, d["turns"][0], d["turns"], d["id"]) for k, d in enumerate(dialogs)]


@register
class Replay(SelfChat, Protocol[ReplayConfig]):
    """Replay user turns from data to an agent under its system prompt (see the module docstring).
    `Protocol[ReplayConfig]` says its config (`config_type`: `driftlab protocol run replay`)."""

    name = "replay"

    @property
    def label(self) -> str:
        return "replay"

    def check(self) -> None:
        draw_replay(self.config)  # the data and personas, before any model loads

    def _fits_context(self) -> None:
        """The first replayed dialog whose context, every agent turn at its token limit, can pass the
        model's window: one line before any work, naming the dialog and the round."""
        window = self.backend.shape.max_context
        if not window:
            return
        turn = self.config.sampling.max_new_tokens
        for pair in draw_replay(self.config):
            conv = [{"role": "system", "content": pair.agent.system_prompt}]
            for i, text in enumerate(pair.turns or [], 1):
                conv.append({"role": "user", "content": text})
                tokens = len(self.backend.render(conv).ids) + i * turn
                if tokens > window:
                    raise DriftlabError(
                        f"dialog {pair.index} ({pair.source}) can pass the model's context window of {window} tokens "
                        f"at round {i} ({tokens} tokens where every agent turn reaches --max-new-tokens {turn}).",
                        hint=f"Use --rounds {i - 1} or fewer, shorter turns (--max-words, --max-new-tokens), "
                             "or a model with a longer context.")
                conv.append({"role": "assistant", "content": ""})

    def plan(self) -> dict[str, Any]:
        pairs = draw_replay(self.config)
        return {"pairs": [p.plan_entry() for p in pairs],
                "personas": {p.agent.id: p.agent.model_dump() for p in pairs}}

    def inputs(self) -> dict[str, str]:
        cfg = self.config
        if cfg.source == "file":
            data = hashlib.sha256(Path(cfg.conversations).read_bytes()).hexdigest()
        else:
            from driftlab.assets.datasets import get_dataset

            data = get_dataset("mtbench" if cfg.source == "mtbench" else "sharegpt").file_sha256
        return {"personas": input_hashes(cfg)["personas"], "conversations": data}

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts["models"] = {"agent": facts["models"]["agent"]}
        return {**facts, "source": self.config.source}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        """An agent turn per replayed user turn; probes at the probed rounds a dialog reaches."""
        cfg = manifest.get("config", {})
        rounds = int(cfg.get("rounds", 0))
        probed = [int(r) for r in manifest.get("probe_rounds", [])]
        reps = int(cfg.get("probe_repeats", 1))
        lengths = [min(rounds, len(p.get("turns") or [])) for p in manifest.get("pairs", [])]
        return {"turn": sum(lengths), "probe": sum(reps * sum(1 for r in probed if r <= n) for n in lengths)}

    def units(self, state: RunState) -> Iterator[list[Job]]:
        """The self-chat's batches, knowing every agent turn's score so far (what `by=score` reads)."""
        self._turn_scores: dict[tuple[int, str, int], float | None] = {}
        self._note_scores(state.records)
        yield from super().units(state)

    def _note_scores(self, records: list[Any]) -> None:
        self._turn_scores.update({(r.pair, r.condition, r.round): getattr(r, "score", None) for r in records
                             if r.kind == "turn" and r.speaker == "agent"})

    def _previous_score(self, job: Job) -> float | None:
        """The score of the last agent turn the job's conversation shows (None on a first turn): a turn of
        round i reads b_{i-1}'s, a probe after b_i reads b_i's."""
        shown = sum(m["role"] == "assistant" for m in job.conversation)
        return self._turn_scores.get((job.record["pair"], job.record["condition"], shown)) if shown else None

    def _generate(self, chunk: list[Job], sampling: Sampling,
                  steer: Interventions | None = None) -> list[TurnRecord | ProbeRecord]:
        """Under `when-drifting:by=score`, the chunk in two calls: the agent jobs whose conversation's last
        agent turn failed under the steer, the others under its trace only; each record keeps its decision."""
        found = self.config.steer.gated()
        if steer is not None or found is None or found[0].by != "score" or chunk[0].role != "agent":
            return super()._generate(chunk, sampling, steer)
        gate, on, off = found
        decided = [replace(j, record={**j.record, "gate": score_decision(gate, self._previous_score(j))})
                   for j in chunk]
        out: dict[int, TurnRecord | ProbeRecord] = {}
        for steered, iv in ((True, on), (False, off)):
            rows = [k for k, j in enumerate(decided) if j.record["gate"]["steered"] is steered]
            if rows:
                out.update(zip(rows, super()._generate([decided[k] for k in rows], sampling, iv), strict=True))
        records = [out[k] for k in range(len(chunk))]
        self._note_scores(records)
        return records

    def _turn_score(self, job: Any, reply: Any) -> dict[str, Any]:
        """Every agent turn's score by its persona's measure (or why none: `error`)."""
        persona: Persona = self._by_key[(job.record["pair"], job.record["condition"])].pair.agent
        return _scored(persona.score, reply.text, reply.finish_reason)


