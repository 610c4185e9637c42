"""The self-chat drift protocol of seeds 000/001 (section 3.1, Figure 2).

Two chatbots talk: the user LM with system prompt s_A and the agent LM with s_B. The user
LM opens with a conversation starter a_1; then they alternate for N rounds. At round i
the agent is probed: a_i is replaced by the probe p_B, the reply b'_i is scored by f_B
(instruction stability), and optionally by p_A / f_A (does the agent adopt the user's
persona?). Probe replies never enter the dialog.

Every generation has its own seed, derived from (run seed, pair, condition, round, what,
repeat), so results do not depend on how work is batched, and a resumed run continues
exactly where the killed one stopped: it continues the plan recorded in its manifest
(pairs, personas, starters as they were), recomputes exactly the records that are
missing, in dependency order, and never writes one twice.

Schedule, per round i, batched over all conversations:
    user call    a_i for every dialog (i >= 2; a_1 is the starter)
    agent call   b_i for every dialog + all probes of round i, sharing the dialog's KV prefix
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.bench import Persona, get_persona, load_personas, starters, user_probe
from driftlab.bench.probes import ProbeVersion
from driftlab.bench.starters import StarterSetName
from driftlab.chat.base import MAX_SEED, ChatBackend, ChatRequest, Conversation, Sampling
from driftlab.chat.factory import BackendSpec, Dtype, ModelName, Runtime, SpanMode, make_backend
from driftlab.console import WorkProgress
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS, Dialog, Pair, ProbeRecord, TurnRecord, pairs_from_manifest
from driftlab.protocol.registry import register
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import Interventions

PAPER_TOKENS = 400  # new tokens per turn in seed 000's experiments (reference code: max_new_tokens=400)


class SelfChatConfig(BaseModel):
    """Everything that defines a self-chat experiment (recorded in the run's manifest)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = DEFAULT_MODEL
    user_model: ModelName | None = Field(None, description="a different model for the user LM; default: same as model")
    pairs: int = Field(10, ge=0, description="random (agent, user) persona pairs to draw")
    pair_ids: list[tuple[str, str]] = Field(default_factory=list, description="explicit (agent, user) pairs")
    categories: list[str] | None = Field(None, description="draw agent personas from these categories only")
    rounds: int = Field(8, ge=1, le=1000)
    probe_every: int = Field(1, ge=1, description="probe rounds i with i % probe_every == 0")
    probe_repeats: int = Field(1, ge=1, le=1000)
    user_probe: bool = False
    user_probe_version: ProbeVersion = Field(
        "000", description="p_A: the user persona's own probe (seed 000) or seed 001's crafted/generic probes")
    starters: StarterSetName = Field("reference", description="a_1 list: the reference code's topics or driftlab's")
    ablation: bool = Field(False, description="also run every pair with an empty user system prompt")
    fold_first_exchange: bool = True
    sampling: Sampling = Sampling(max_new_tokens=PAPER_TOKENS)
    seed: int = Field(0, ge=0, le=MAX_SEED, description="run seed: pairs, starters and every sample derive from it")
    dtype: Dtype = "auto"
    device: str = "auto"
    span: SpanMode = "content"
    runtime: Runtime = Runtime()
    steer: list[str] = Field(default_factory=list, description="agent-side interventions, normalised --steer specs")
    persona_file: str | None = None
    batch_size: int = Field(32, ge=1, le=4096, description="most conversations per generate call")

    # Fields that may change between a run and its resume (they do not change results).
    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ("device", "batch_size", "persona_file", "runtime")

    @field_validator("categories")
    @classmethod
    def _known_categories(cls, v):
        from driftlab.bench import CATEGORIES

        if v is not None:
            bad = [c for c in v if c not in CATEGORIES]
            if bad:
                raise ValueError(f"unknown categories {bad}; use {list(CATEGORIES)}")
        return v

    @field_validator("steer")
    @classmethod
    def _normalise_steer(cls, v: list[str]) -> list[str]:
        return Interventions.parse(v).for_dialogs().specs()  # a bad spec raises its own one-line DriftlabError

    @property
    def interventions(self) -> Interventions:
        return Interventions.parse(self.steer)

    @property
    def conditions(self) -> list[str]:
        return ["persona", "empty-user"] if self.ablation else ["persona"]

    def probe_rounds(self) -> list[int]:
        return [i for i in range(1, self.rounds + 1) if i % self.probe_every == 0]

    def backend_spec(self, user: bool = False) -> BackendSpec:
        model = (self.user_model or self.model) if user else self.model
        return BackendSpec(model=model, dtype=self.dtype, device=self.device, span=self.span, runtime=self.runtime)

    def persona_pool(self) -> tuple[list[Persona], list[Persona]]:
        """(every persona, those agents are drawn from), after checking the named data.

        Cheap (no model): run before anything is loaded or written, so an unknown pair id,
        an empty category or an unreadable persona file fails at once.
        """
        pool = load_personas(extra=self.persona_file)
        agents = [p for p in pool if self.categories is None or p.category in self.categories]
        for ids in self.pair_ids:
            for pid in ids:
                get_persona(pid, self.persona_file)  # raises with close matches for an unknown id
        if self.pairs and not agents:
            raise DriftlabError(f"No personas in categories {self.categories}.", hint="See `driftlab personas list`.")
        if not self.pair_ids and not self.pairs:
            raise DriftlabError("No persona pairs to run.", hint="Use --pairs N or --pair AGENT_ID:USER_ID.")
        return pool, agents


def draw_pairs(config: SelfChatConfig) -> list[Pair]:
    """Explicit pairs first, then `pairs` random ones (agent from `categories`, user != agent)."""
    pool, agents = config.persona_pool()
    by_id = {p.id: p for p in pool}
    rng = random.Random(config.seed)
    topics = starters(config.starters)
    out: list[Pair] = []
    for a, u in config.pair_ids:
        out.append(Pair(len(out), by_id[a], by_id[u], rng.choice(topics)))
    for _ in range(config.pairs):
        agent = rng.choice(agents)
        user = rng.choice([p for p in pool if p.id != agent.id])
        out.append(Pair(len(out), agent, user, rng.choice(topics)))
    return out


def input_hashes(config: SelfChatConfig) -> dict[str, str]:
    """sha256 of the data a plan is drawn from, so a changed data set is noticed on resume."""
    digest = lambda obj: hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()  # noqa: E731
    pool = [p.model_dump() for p in load_personas(extra=config.persona_file)]
    return {"personas": digest(pool), "starters": digest(starters(config.starters))}


def item_seed(seed: int, *parts: Any) -> int:
    """A stable 63-bit seed for one generation, independent of batching and of Python's hash."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def expected_counts(manifest: dict[str, Any]) -> dict[str, int]:
    """How many turn and probe records a complete run of this manifest holds."""
    cfg = manifest.get("config", {})
    n_pairs = len(manifest.get("pairs", []))
    rounds = int(cfg.get("rounds", 0))
    reps = int(cfg.get("probe_repeats", 1))
    n_probe_rounds = len(manifest.get("probe_rounds", []))
    turns = probes = 0
    for cond in manifest.get("conditions", []):
        turns += n_pairs * (2 * rounds - 1)  # a_1 is the starter, not a record
        targets = 2 if cfg.get("user_probe") and cond == "persona" else 1
        probes += n_pairs * n_probe_rounds * reps * targets
    return {"turn": turns, "probe": probes}


register("selfchat", RECORDS, expected_counts)


def resume_guarantee(dtype: str) -> str:
    """What a resumed run promises, by compute dtype (recorded in the manifest)."""
    if dtype == "float32":
        return "exact: a resumed run writes the records an uninterrupted run would (tested in float32)"
    return (f"records written before the interruption are kept; in {dtype}, regenerated ones can differ from an "
            "uninterrupted run's (a dialog prefix recomputed in one pass rounds differently than the cached one)")


@dataclass
class Job:
    """One generation to run and the record it becomes."""

    record: dict[str, Any]
    conversation: Conversation
    seed: int
    role: str  # "agent" or "user"
    keep_cache: bool
    score: Callable[..., float | None] | None = None  # Persona.score(text, truncated=...)


class SelfChat:
    """Runs (or resumes) a self-chat experiment into a run directory, on given backends.

    Backends are passed in (see `make_backend`), so a sweep reuses one loaded model for
    every point. The agent backend must support the config's interventions.
    """

    def __init__(
        self,
        config: SelfChatConfig,
        out: str | RunDir,
        agent: ChatBackend,
        user: ChatBackend | None = None,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.rundir = out if isinstance(out, RunDir) else RunDir(out)
        self.agent = agent
        self.user = user or agent
        self.progress = progress
        self.interventions = config.interventions
        agent.capabilities.require(agent.name, self.interventions)

    def run(self) -> RunDir:
        cfg = self.config
        with self.rundir.writing():
            manifest = self._start()
            pairs = pairs_from_manifest(manifest)
            records = self.rundir.records(RECORDS)
            done = {r.key for r in records}
            dialogs = Dialog.from_records(pairs, manifest["conditions"], records)
            total = sum(expected_counts(manifest).values()) - len(done)
            with WorkProgress("self-chat", total, self.progress) as bar:
                for i in range(1, cfg.rounds + 1):
                    # Dependency order: a_i needs rounds < i; b_i and the probes of round i need a_i.
                    self._run_jobs([self._user_job(d, i) for d in dialogs if i > 1 and i not in d.a], dialogs, bar)
                    agent_jobs = [self._agent_job(d, i) for d in dialogs if i not in d.b]
                    agent_jobs += [self._probe_job(d, rec, persona) for d in dialogs
                                   for rec, persona in self._probe_specs(d, i) if _key(rec) not in done]
                    self._run_jobs(agent_jobs, dialogs, bar)
            self.rundir.update_manifest(completed=True)
        return self.rundir

    def _start(self) -> dict[str, Any]:
        """Write the manifest (new run) or check it (resume), before any generation."""
        cfg = self.config
        agent_meta = self.agent.describe()
        max_ctx = agent_meta.get("max_context")
        if max_ctx and cfg.sampling.max_new_tokens >= max_ctx:
            raise DriftlabError(
                f"--max-new-tokens {cfg.sampling.max_new_tokens} does not fit the model's context window "
                f"of {max_ctx} tokens.", hint="Use far fewer tokens per turn; the dialog itself needs room too.",
            )
        hashes = input_hashes(cfg)
        if self.rundir.exists():
            manifest = self.rundir.start(cfg.model_dump(mode="json"), {}, cfg.RESUME_IGNORES)
            changed = [k for k, v in hashes.items() if manifest.get("inputs", {}).get(k) != v]
            if changed and self.progress:
                from driftlab.console import err_console

                err_console().print(
                    f"note: the {' and '.join(changed)} changed since this run started; it continues with the "
                    "plan recorded in its manifest.", highlight=False, markup=False)
            return manifest
        pairs = draw_pairs(cfg)
        plan = {
            "pairs": [p.plan_entry() for p in pairs],
            "conditions": cfg.conditions,
            "probe_rounds": cfg.probe_rounds(),
            "personas": {p.id: p.model_dump() for pair in pairs for p in (pair.agent, pair.user)},
            "inputs": hashes,
            "models": {"agent": agent_meta, "user": self.user.describe()},
            "interventions": self.interventions.specs(),
            "resume": resume_guarantee(agent_meta.get("dtype", "unknown")),
        }
        return self.rundir.start(cfg.model_dump(mode="json"), plan, cfg.RESUME_IGNORES)

    # -- jobs ----------------------------------------------------------------------------------
    def _base(self, d: Dialog, i: int) -> dict[str, Any]:
        return {"pair": d.pair.index, "condition": d.condition, "round": i}

    def _user_job(self, d: Dialog, i: int) -> Job:
        rec = {"kind": "turn", **self._base(d, i), "speaker": "user"}
        conv = d.user_view(i, self.config.fold_first_exchange)
        return Job(rec, conv, item_seed(self.config.seed, d.pair.index, d.condition, i, "user"), "user", True)

    def _agent_job(self, d: Dialog, i: int) -> Job:
        rec = {"kind": "turn", **self._base(d, i), "speaker": "agent"}
        conv = d.agent_view(i, d.a[i])
        return Job(rec, conv, item_seed(self.config.seed, d.pair.index, d.condition, i, "agent"), "agent", True)

    def _probe_specs(self, d: Dialog, i: int) -> list[tuple[dict[str, Any], Persona]]:
        """The probe records due at round i (agent persona, and the user's if asked)."""
        if i not in self.config.probe_rounds():
            return []
        targets = [("agent", d.pair.agent)]
        if self.config.user_probe and d.condition == "persona":  # p_A, scored by f_A
            targets.append(("user", user_probe(d.pair.user, self.config.user_probe_version, seed=self.config.seed)))
        return [
            ({"kind": "probe", **self._base(d, i), "target": target, "persona": persona.id, "repeat": r}, persona)
            for target, persona in targets
            for r in range(self.config.probe_repeats)
        ]

    def _probe_job(self, d: Dialog, rec: dict[str, Any], persona: Persona) -> Job:
        seed = item_seed(self.config.seed, d.pair.index, d.condition, rec["round"], "probe", rec["target"],
                         rec["repeat"])
        return Job(rec, d.agent_view(rec["round"], persona.probe), seed, "agent", False, persona.score)

    def _run_jobs(self, jobs: list[Job], dialogs: list[Dialog], bar: WorkProgress) -> None:
        by_key = {(d.pair.index, d.condition): d for d in dialogs}
        size = self.config.batch_size
        for start in range(0, len(jobs), size):
            chunk = jobs[start : start + size]
            agent_side = chunk[0].role == "agent"
            request = ChatRequest(
                [j.conversation for j in chunk], self.config.sampling, seeds=[j.seed for j in chunk],
                interventions=self.interventions if agent_side else Interventions(),
                cache_store=[j.keep_cache for j in chunk],
            )
            replies = (self.agent if agent_side else self.user).generate(request)
            records = []
            for job, reply in zip(chunk, replies, strict=True):
                fields = {**job.record, "text": reply.text, "n_tokens": reply.n_tokens,
                          "finish_reason": reply.finish_reason, "seed": job.seed}
                if job.score is not None:
                    # A measure that needs a whole reply does not score one cut at the token limit (None).
                    score = job.score(reply.text, truncated=reply.finish_reason == "length")
                    records.append(ProbeRecord(**fields, score=score))
                    continue
                rec = TurnRecord(**fields)
                records.append(rec)
                d = by_key[(rec.pair, rec.condition)]
                (d.a if rec.speaker == "user" else d.b)[rec.round] = reply.text
            self.rundir.append(records)
            bar.advance(len(chunk))


def _key(rec: dict[str, Any]) -> tuple:
    return ("probe", rec["pair"], rec["condition"], rec["round"], rec["target"], rec["repeat"])


def run_selfchat(config: SelfChatConfig, out: str, progress: bool = True) -> RunDir:
    """Check inputs, lock the run directory, load the model(s) named in `config`, run into `out`.

    The lock is taken before the (slow) model load, so a second process on the same `out`
    fails at once instead of duplicating work; a failure before the manifest is written
    leaves no directory behind.
    """
    config.persona_pool()
    rundir = RunDir(out)
    with rundir.writing():
        agent = make_backend(config.backend_spec(), run_dir=rundir.path)
        user = (make_backend(config.backend_spec(user=True), run_dir=rundir.path)
                if config.user_model not in (None, config.model) else None)
        return SelfChat(config, rundir, agent, user, progress=progress).run()
