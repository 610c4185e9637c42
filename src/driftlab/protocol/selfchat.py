"""The self-chat drift protocol of the persona-drift paper and its revision (section 3.1, Figure 2).

Two chatbots talk: the user LM with system prompt s_A and the agent LM with s_B. The user
LM opens with a conversation starter a_1; then they alternate for N rounds. At round i
the agent is probed, the reply b'_i is scored by f_B (instruction stability), and
optionally by p_A / f_A (does the agent adopt the user's persona?). Probe replies never
enter the dialog. Where the probe goes is `probe_after`:

    "agent"  (default: the reference code likenneth/persona_drift, which produced the paper's
             figures) the probe follows b_i: it sees [s_B, a_1, b_1, ..., a_i, b_i, p_B], so
             round 1's probe already sees one exchange;
    "user"   (the paper's text; driftlab's only behaviour before the option) the probe
             replaces a_i: it sees [s_B, a_1, b_1, ..., a_{i-1}, b_{i-1}, p_B], so round 1's
             probe sees no exchange.

Every generation has its own seed, derived from (run seed, pair, condition, round, what,
repeat), so results do not depend on how work is batched, and a resumed run continues
exactly where the killed one stopped: it continues the plan recorded in its manifest
(pairs, personas, starters as they were), recomputes exactly the records that are
missing, in dependency order, and never writes one twice (`run_protocol`).

Schedule, per round i, batched over all conversations:
    user call    a_i for every dialog (i >= 2; a_1 is the starter)
    agent call   b_i for every dialog + the probes that share its KV prefix: those of round i
                 (probe_after "user"), or of round i - 1 (probe_after "agent"; the last
                 round's probes then run after the dialog)
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from driftlab.bench import (
    JUDGE,
    JudgeParams,
    Persona,
    constraint_personas,
    drift_users,
    load_personas,
    starters,
    user_probe,
)
from driftlab.bench.personas import CONSTRAINT_SUITES
from driftlab.bench.probes import ProbeVersion
from driftlab.bench.starters import StarterSetName
from driftlab.chat.base import MAX_SEED, ChatBackend, ChatRequest, Conversation, Sampling
from driftlab.chat.gate import engine_steer
from driftlab.chat.spec import BackendSpec, ModelName
from driftlab.errors import DriftlabError
from driftlab.protocol import divergence
from driftlab.protocol.context import first_overflow
from driftlab.protocol.dialog import RECORDS, Dialog, Pair, ProbeRecord, TurnRecord, pairs_from_manifest
from driftlab.protocol.judge import Ask, Judges
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState, directions_given
from driftlab.steering.interventions import DialogSteer, Interventions

PAPER_TOKENS = 400  # new tokens per turn and per probe in the reference code (run.py: max_new_tokens=400 in both calls)
# A probe's budget: a number of tokens, or "turn" (the turn's, as runs recorded before --probe-tokens had).
ProbeTokens = int | Literal["turn"]


def probe_budget(value: Any) -> int | str:
    """A probe budget as given (a number, its text, or 'turn'), checked: 1 to 32768 tokens or 'turn'."""
    if value == "turn":
        return value
    try:
        tokens = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        tokens = None
    if isinstance(value, bool) or tokens is None or not 1 <= tokens <= 32768:
        raise ValueError("give the most tokens of a probe reply, 1 to 32768, or 'turn' for a turn's budget")
    return tokens


class SelfChatConfig(ProtocolConfig):
    """Everything that defines a self-chat experiment (recorded in the run's manifest)."""

    user_model: ModelName | None = Field(None, description="a different model for the user LM; default: the agent's")
    pairs: int = Field(10, ge=0, description="random (agent, user) persona pairs to draw")
    pair_ids: list[tuple[str, str]] = Field(default_factory=list, description="explicit (agent, user) pairs")
    categories: list[str] | None = Field(None, description="draw agent personas from these categories only")
    rounds: int = Field(8, ge=1, le=1000)
    probe_every: int = Field(1, ge=1, description="probe rounds i with i % probe_every == 0")
    probe_repeats: int = Field(1, ge=1, le=1000)
    probe_after: Literal["user", "agent"] = Field(
        "agent", description="'agent' (default): the probe follows b_i, as in the reference code that produced "
                             "the paper's figures (its first probe already sees one exchange); 'user': it replaces "
                             "a_i, as the paper's text describes")
    user_probe: bool = False
    user_probe_version: ProbeVersion = Field(
        "own", description="p_A: 'own' (the user persona's own probe, as in the persona-drift paper) or "
                           "'crafted-or-generic' (the instruction-stability paper's crafted or generic probes); "
                           "'000' and '001' are read as these")
    starters: StarterSetName = Field("reference", description="a_1 list: the reference code's topics or driftlab's")
    ablation: bool = Field(False, description="also run every pair with an empty user system prompt")
    fold_first_exchange: bool = True
    sampling: Sampling = Sampling(max_new_tokens=PAPER_TOKENS)
    probe_tokens: ProbeTokens = Field(
        PAPER_TOKENS, description="most new tokens per probe reply, apart from a turn's (sampling.max_new_tokens); "
                                  "the reference code gives probes 400 (run.py); 'turn': the turn's budget")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="run seed: pairs, starters and every sample derive from it")
    steer: DialogSteer = Field(default_factory=Interventions, description="agent-side interventions")
    persona_file: str | None = None
    personas: list[Persona] = Field(default_factory=list, description="personas defined in code (driftlab.Persona), "
                                    "beside the built-ins and persona_file; their measures must be registered")
    agents: list[str] | None = Field(None, description="draw agent personas from these ids only")
    users: Literal["personas", "drift-pushing"] = Field(
        "personas", description="draw user personas from the 100 personas (the papers') or from the drift-pushing "
                                "users (meta-reflection, phenomenology, authorial voices, vulnerable disclosure, "
                                "role-play; `driftlab.bench.drift_users`)")
    batch_size: int = Field(32, ge=1, le=4096, description="most conversations per generate call")
    judge: JudgeParams | None = Field(None, description="also rate every probe reply with this judge model (a model "
                                      "name, or model=...,rubric=...), beside its persona's measure: the report "
                                      "shows how well the two agree")
    kl: bool = Field(False, description="measure each agent reply's drift in next-token distributions as it is "
                                        "generated (`protocol.divergence`): its record's kl holds the reminded KL and "
                                        "the prompt's influence")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size", "persona_file")
    SCORES_TURNS: ClassVar[bool] = False  # whether every agent turn is scored (a replay's are)
    # What a run recorded before the option existed meant: the probe replaced a_i; probes had a turn's budget.
    LEGACY: ClassVar[dict[str, Any]] = {"probe_after": "user", "probe_tokens": "turn", "personas": [], "agents": None,
                                        "judge": None, "kl": False, "users": "personas"}

    _probe_budget = field_validator("probe_tokens", mode="before")(probe_budget)

    @model_validator(mode="after")
    def _a_turns_budget_is_turn(self) -> SelfChatConfig:
        """A probe budget equal to the turn's is "turn": one meaning, one recorded value (so a run
        recorded before --probe-tokens, whose probes had the turn's budget, resumes as it was)."""
        if self.probe_tokens == self.sampling.max_new_tokens:
            object.__setattr__(self, "probe_tokens", "turn")
        directions_given(self.backend, self.steer.items)
        gate = self.steer.get("when-drifting")
        if gate is not None and gate.by == "score" and not self.SCORES_TURNS:
            raise ValueError("when-drifting:by=score steers the turn after a failing one, and a self-chat scores "
                             "its probes only: use driftlab replay, or by=pi / by=projection")
        if self.kl:
            divergence.measured_steer(self.steer)
        return self

    @field_validator("categories")
    @classmethod
    def _known_categories(cls, v):
        from driftlab.bench import CATEGORIES

        known = [*CATEGORIES, *CONSTRAINT_SUITES]
        if v is not None:
            bad = [c for c in v if c not in known]
            if bad:
                raise ValueError(f"unknown categories {bad}; use {known}")
        return v

    @property
    def conditions(self) -> list[str]:
        return ["persona", "empty-user"] if self.ablation else ["persona"]

    def probe_sampling(self) -> Sampling:
        """How probes decode: as turns, with their own token budget (`probe_tokens`)."""
        if self.probe_tokens == "turn":
            return self.sampling
        return self.sampling.model_copy(update={"max_new_tokens": self.probe_tokens})

    def probe_rounds(self) -> list[int]:
        return [i for i in range(1, self.rounds + 1) if i % self.probe_every == 0]

    def user_backend(self) -> BackendSpec:
        """The user LM's backend: the agent's, with `user_model` if one is given."""
        return self.backend.model_copy(update={"model": self.user_model}) if self.user_model else self.backend

    def persona_pool(self) -> tuple[list[Persona], list[Persona]]:
        """(every persona, those agents are drawn from), after checking the named data.

        Cheap (no model): run before anything is loaded or written, so an unknown pair id,
        an empty category or an unreadable persona file fails at once.
        """
        pool = all_personas(self)
        by_id = {p.id: p for p in pool}
        for pid in [pid for ids in self.pair_ids for pid in ids] + list(self.agents or []):
            if pid not in by_id:
                close = difflib.get_close_matches(pid, by_id, n=3)
                raise DriftlabError(f"no persona with id {pid!r}", hint=f"did you mean {', '.join(close)}?" if close
                                    else "`driftlab personas list` shows the built-in ids")
        agents = [p for p in pool if (self.categories is None or p.category in self.categories)
                  and (self.agents is None or p.id in self.agents) and p.category != "drift-pushing"]
        if self.pairs and not agents:
            raise DriftlabError(f"No personas in categories {self.categories}.", hint="See `driftlab personas list`.")
        if not self.pair_ids and not self.pairs:
            raise DriftlabError("No persona pairs to run.", hint="Use --pairs N or --pair AGENT_ID:USER_ID.")
        for suite in CONSTRAINT_SUITES.values():
            suite.ready(agents)
        return pool, agents


def measured(reply: Any) -> dict[str, Any]:
    """What a reply carries beside its text, as record fields: pi per layer (mean over heads and
    tokens, from its trace), its projection summary and `when-drifting`'s decision; absent where not
    measured."""
    out: dict[str, Any] = {}
    if reply.trace is not None and reply.trace.decode.shape[0]:
        out["pi"] = [round(float(x), 5) for x in reply.trace.decode.astype("float64").mean(axis=(0, 2))]
    if reply.activation is not None:
        out["activation"] = reply.activation
    if getattr(reply, "gate", None) is not None:  # (replies of other backends have none)
        out["gate"] = reply.gate
    return out


def all_personas(config: SelfChatConfig) -> list[Persona]:
    """The built-in personas, those of `persona_file` and those given in code (ids unique); the
    drift-pushing users where the run draws its users from them; a suite's constraints (IFEval's,
    IFBench's) where the run names them (their category or one of their ids), so other runs' draws and data hashes stay as they were."""
    pool = load_personas(extra=config.persona_file) + (drift_users() if config.users == "drift-pushing" else [])
    named = set(config.agents or []) | {pid for ids in config.pair_ids for pid in ids}
    for category in CONSTRAINT_SUITES:
        constraints = constraint_personas(category)
        if category in (config.categories or []) or named & {p.id for p in constraints}:
            pool += constraints
    taken = {p.id for p in pool}
    for p in config.personas:
        if p.id in taken:
            raise DriftlabError(f"persona id {p.id!r} given in code is already taken (built-in or persona_file).",
                                hint="give your persona another id")
        taken.add(p.id)
    return pool + list(config.personas)


def draw_pairs(config: SelfChatConfig) -> list[Pair]:
    """Explicit pairs first, then `pairs` random ones (agent from `categories`, user != agent, from
    the run's user set)."""
    pool, agents = config.persona_pool()
    users = drift_users() if config.users == "drift-pushing" else pool
    by_id = {p.id: p for p in pool}
    rng = random.Random(config.seed)
    topics = starters(config.starters)
    out: list[Pair] = []
    for a, u in config.pair_ids:
        out.append(Pair(len(out), by_id[a], by_id[u], rng.choice(topics)))
    for _ in range(config.pairs):
        agent = rng.choice(agents)
        user = rng.choice([p for p in users if p.id != agent.id])
        out.append(Pair(len(out), agent, user, rng.choice(topics)))
    return out


def input_hashes(config: SelfChatConfig) -> dict[str, str]:
    """sha256 of the data a plan is drawn from, so a changed data set is noticed on resume."""
    pool = [p.model_dump() for p in all_personas(config)]
    return {"personas": digest(pool), "starters": digest(starters(config.starters))}


def digest(obj: Any) -> str:
    """sha256 of a JSON value (keys sorted): what a plan's `inputs` record."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def item_seed(seed: int, *parts: Any) -> int:
    """A stable 63-bit seed for one generation, independent of batching and of Python's hash."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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
    persona: Persona | None = None  # a probe's: whose measure scores the reply


@register
class SelfChat(Protocol[SelfChatConfig]):
    """A self-chat experiment on an agent backend (and a user one, by default the same).

    Backends may be passed in (a sweep reuses one loaded model for every point); otherwise
    `run_protocol` loads the ones the config names. Each unit is one batch of generations:
    user turns of a round, then the agent turns and probes of that round.
    """

    name = "selfchat"
    records = RECORDS
    unit = "generations"

    def __init__(self, config: SelfChatConfig, agent: ChatBackend | None = None,
                 user: ChatBackend | None = None) -> None:
        super().__init__(config, agent)
        self.user = user

    @property
    def label(self) -> str:
        return "self-chat"

    def check(self) -> None:
        self.config.persona_pool()
        for params in self._judge_params():
            Judges.spec(params, self.config.backend)

    def _judge_params(self) -> list[JudgeParams]:
        """Every judge of this run: the run's own and those of personas whose measure is a judge."""
        found = [self.config.judge] if self.config.judge else []
        found += [JudgeParams(**p.params) for p in all_personas(self.config) if p.measure == JUDGE]
        return list(dict.fromkeys(found))

    def connect(self, run_dir: Path) -> None:
        super().connect(run_dir)
        self.judges = Judges(self.config.backend, self.backend, run_dir)
        if self.user is None:
            spec = self.config.user_backend()
            if spec == self.config.backend:
                self.user = self.backend
            else:
                from driftlab.chat.factory import make_backend

                self.user = make_backend(spec, run_dir=run_dir)

    def require(self) -> None:
        cfg = self.config
        self.backend.capabilities.require(self.backend.name, engine_steer(cfg.steer))
        if cfg.kl:
            divergence.require(self.backend, "--kl")
        if self.backend.capabilities.tokens:
            self._fits_context()

    def _fits_context(self) -> None:
        """One line, before any work, where a dialog could pass the model's context window (`protocol.context`)."""
        cfg = self.config
        probes = lambda p: [p.agent.probe] + ([user_probe(p.user, cfg.user_probe_version, seed=cfg.seed).probe]  # noqa: E731
                                              if cfg.user_probe else [])
        found = first_overflow(self.backend, [(p.agent.system_prompt, p.starter, probes(p)) for p in draw_pairs(cfg)],
                               cfg.rounds, cfg.sampling.max_new_tokens, cfg.probe_sampling().max_new_tokens,
                               cfg.probe_rounds())
        if found is not None:
            raise DriftlabError(
                f"--rounds {cfg.rounds} can pass the model's context window of {found.window} tokens at round "
                f"{found.round} ({found.tokens} tokens where every turn reaches --max-new-tokens "
                f"{cfg.sampling.max_new_tokens}).",
                hint=f"Use --rounds {found.round - 1} or fewer, or shorter turns.")
        max_ctx = self.backend.describe().get("max_context")
        for option, tokens in (("--max-new-tokens", cfg.sampling.max_new_tokens),
                               ("--probe-tokens", cfg.probe_sampling().max_new_tokens)):
            if max_ctx and tokens >= max_ctx:
                raise DriftlabError(
                    f"{option} {tokens} does not fit the model's context window of {max_ctx} tokens.",
                    hint="Use far fewer tokens per reply; the dialog itself needs room too.",
                )

    def plan(self) -> dict[str, Any]:
        pairs = draw_pairs(self.config)
        return {"pairs": [p.plan_entry() for p in pairs],
                "personas": {p.id: p.model_dump() for pair in pairs for p in (pair.agent, pair.user)}}

    def inputs(self) -> dict[str, str]:
        return input_hashes(self.config)

    def describe(self) -> dict[str, Any]:
        agent = self.backend.describe()
        judges = self._judge_params()
        return {"conditions": self.config.conditions, "probe_rounds": self.config.probe_rounds(),
                "models": {"agent": agent, "user": self.user.describe()},
                "interventions": self.config.steer.specs(), "resume": resume_guarantee(agent.get("dtype", "unknown")),
                **({"judges": self.judges.describe(judges)} if judges else {})}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
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

    # -- the work ----------------------------------------------------------------------------
    def units(self, state: RunState) -> Iterator[list[Job]]:
        """Batches in dependency order: a_i needs rounds < i; b_i and the probes of round i need a_i."""
        pairs = pairs_from_manifest(state.manifest)
        self.dialogs = Dialog.from_records(pairs, state.manifest["conditions"], state.records)
        self._by_key = {(d.pair.index, d.condition): d for d in self.dialogs}
        lag = 1 if self.config.probe_after == "agent" else 0  # probes of round i - lag go with b_i
        for i in range(1, self.config.rounds + 1 + lag):
            if i <= self.config.rounds:
                yield from self._batches([self._user_job(d, i) for d in self.dialogs
                                          if 1 < i <= self._rounds(d) and i not in d.a])
            jobs = [self._agent_job(d, i) for d in self.dialogs if i <= self._rounds(d) and i not in d.b]
            probes = [self._probe_job(d, rec, persona) for d in self.dialogs
                      for rec, persona in self._probe_specs(d, i - lag) if _key(rec) not in state.done]
            if self.config.probe_tokens == "turn":  # one budget: turns and probes share calls
                yield from self._batches(jobs + probes)
            else:  # two budgets are two calls anyway: a chunk of both would make two small ones
                yield from self._batches(jobs)
                yield from self._batches(probes)

    def _rounds(self, d: Dialog) -> int:
        """A dialog's rounds: the run's, or a replayed dialog's own where it has fewer user turns."""
        return min(self.config.rounds, d.length or self.config.rounds)

    def _batches(self, jobs: list[Job]) -> Iterator[list[Job]]:
        """`jobs` in the fewest chunks of at most batch_size, their sizes within one of each other:
        100 jobs at 16 are 7 chunks of 14-15, not 6 of 16 and a tail of 4. The passes are as many,
        but a compiled decode loop then needs one batch bucket's graph, not a second one compiled
        mid-run for the tail (on an H200, 36-42 s each in the paper-size run)."""
        n_chunks = -(-len(jobs) // self.config.batch_size)
        for k in range(n_chunks):
            yield jobs[k * len(jobs) // n_chunks : (k + 1) * len(jobs) // n_chunks]

    def run_unit(self, chunk: list[Job]) -> list[TurnRecord | ProbeRecord]:
        records: list[TurnRecord | ProbeRecord] = []
        turns, probes = [j for j in chunk if j.persona is None], [j for j in chunk if j.persona is not None]
        if self.config.probe_tokens == "turn":  # one budget: one call, as before the option
            turns, probes = chunk, []
        for jobs, sampling in ((turns, self.config.sampling), (probes, self.config.probe_sampling())):
            if jobs:
                records += self._generate(jobs, sampling)
        return records

    def _generate(self, chunk: list[Job], sampling: Sampling,
                  steer: Interventions | None = None) -> list[TurnRecord | ProbeRecord]:
        """The chunk's replies as records, the agent's under `steer` (the run's by default)."""
        agent_side = chunk[0].role == "agent"
        request = ChatRequest(
            [j.conversation for j in chunk], sampling, seeds=[j.seed for j in chunk],
            interventions=(self.config.steer if steer is None else steer) if agent_side else Interventions(),
            cache_store=[j.keep_cache for j in chunk], distributions=agent_side and self.config.kl,
        )
        replies = (self.backend if agent_side else self.user).generate(request)
        records: list[TurnRecord | ProbeRecord] = []
        scores = iter(self._scores([(j, r) for j, r in zip(chunk, replies, strict=True) if j.persona is not None]))
        kls = iter(self._divergences(chunk, replies) if agent_side and self.config.kl else [{}] * len(chunk))
        for job, reply in zip(chunk, replies, strict=True):
            fields = {**job.record, "text": reply.text, "n_tokens": reply.n_tokens,
                      "finish_reason": reply.finish_reason, "seed": job.seed,
                      **(measured(reply) if agent_side else {}), **({"kl": kl} if (kl := next(kls)) else {})}
            if job.persona is not None:
                records.append(ProbeRecord(**fields, **next(scores)))
                continue
            rec = TurnRecord(**fields, **(self._turn_score(job, reply) if agent_side else {}))
            records.append(rec)
            d = self._by_key[(rec.pair, rec.condition)]
            (d.a if rec.speaker == "user" else d.b)[rec.round] = reply.text
        return records

    def _turn_score(self, job: Job, reply: Any) -> dict[str, Any]:
        """Fields an agent turn's record gets beside its text: none in a self-chat, where probes are
        what is scored (a replay scores every turn)."""
        return {}

    def _divergences(self, chunk: list[Job], replies: list[Any]) -> list[dict[str, float | int]]:
        """Each agent reply's reminded KL and prompt influence, read teacher-forced right after it was
        generated (its dialog's KV is still in the prefix cache); the dialog as it was is not read
        again where the generation kept its distributions."""
        found = divergence.divergences(
            self.backend, [(j.conversation + [{"role": "assistant", "content": r.text}], r.finish_reason)
                           for j, r in zip(chunk, replies, strict=True)], divergence.measured_steer(self.config.steer),
            keep_as_is=False, generated=[r.distributions for r in replies])
        return [d.fields() for d in found]

    def _scores(self, probes: list[tuple[Job, Any]]) -> list[dict[str, Any]]:
        """Each probe reply's score fields: its persona's measure (a judge's rating for a judge
        measure) and, with the run's `judge`, that judge's rating beside it; judges asked in one batch."""
        out: list[dict[str, Any]] = []
        asks: list[tuple[int, str, Ask]] = []
        for k, (job, reply) in enumerate(probes):
            p = job.persona
            judged = p.measure == JUDGE
            out.append({} if judged else _scored(p.score, reply.text, reply.finish_reason))
            for field, params in (("score", JudgeParams(**p.params) if judged else None),
                                  ("judge", None if judged else self.config.judge)):
                if params is not None:
                    asks.append((k, field, Ask(params, p.system_prompt, p.probe, reply.text)))
        for (k, field, _), rated in zip(asks, self.judges.rate([a for *_, a in asks]), strict=True):
            out[k].update({field: rated["score"], "error" if field == "score" else "judge_error": rated["error"]})
        return out

    def finish(self, state: RunState) -> None:
        self.judges.close()

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
        if i < 1 or i not in self.config.probe_rounds() or i > self._rounds(d):
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
        after = rec["round"] + (self.config.probe_after == "agent")  # after b_i: the view of round i + 1
        return Job(rec, d.agent_view(after, persona.probe), seed, "agent", False, persona)


def _scored(score: Callable[..., float | None], text: str, finish_reason: str) -> dict[str, Any]:
    """A probe reply's score, or why there is none. A measure that needs a whole reply does not
    score one cut at the token limit (None); a measure that raises or returns no score in [0, 1]
    (a user's own code, a judge) is recorded as that record's error, and the run goes on."""
    try:
        return {"score": score(text, truncated=finish_reason == "length")}
    except Exception as err:  # noqa: BLE001 - any failure of a scorer is data about that record
        return {"score": None, "error": f"{type(err).__name__}: {err}"[:500]}


def _key(rec: dict[str, Any]) -> tuple:
    return ("probe", rec["pair"], rec["condition"], rec["round"], rec["target"], rec["repeat"])
