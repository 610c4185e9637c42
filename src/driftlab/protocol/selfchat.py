"""The self-chat drift protocol of seeds 000/001 (section 3.1, Figure 2).

Two chatbots talk: the user LM with system prompt s_A and the agent LM with s_B. The user
LM opens with a conversation starter a_1; then they alternate for N rounds. At round i
the agent is probed: a_i is replaced by the probe p_B, the reply b'_i is scored by f_B
(instruction stability), and optionally by p_A / f_A (does the agent adopt the user's
persona?). Probe replies never enter the dialog.

Every generation has its own seed, derived from (run seed, pair, condition, round, what,
repeat), so results do not depend on how work is batched, and a resumed run continues
exactly where the killed one stopped.

Schedule, per round i, batched over all conversations:
    user call    a_i for every dialog (i >= 2; a_1 is the starter)
    agent call   b_i for every dialog + all probes of round i, sharing the dialog's KV prefix
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.bench import STARTERS, Persona, get_persona, load_personas
from driftlab.chat.base import ChatBackend, Conversation, Sampling
from driftlab.errors import DriftlabError
from driftlab.records.rundir import RunDir, record_key

Condition = Literal["persona", "empty-user"]

# How the reference implementation (likenneth/persona_drift) shows the user LM the first
# exchange, so the user LM's own dialog starts with a user turn as chat templates expect.
FOLD_TEMPLATE = 'In the last round, you asked me: "{a}" and I answered: "{b}"'


class SelfChatConfig(BaseModel):
    """Everything that defines a self-chat experiment (recorded in the run's manifest)."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    user_model: str | None = Field(None, description="a different model for the user LM; default: same as model")
    pairs: int = Field(10, ge=0, description="random (agent, user) persona pairs to draw")
    pair_ids: list[tuple[str, str]] = Field(default_factory=list, description="explicit (agent, user) pairs")
    categories: list[str] | None = Field(None, description="draw agent personas from these categories only")
    rounds: int = Field(8, ge=1)
    probe_every: int = Field(1, ge=1, description="probe rounds i with i % probe_every == 0")
    probe_repeats: int = Field(1, ge=1)
    user_probe: bool = False
    ablation: bool = Field(False, description="also run every pair with an empty user system prompt")
    fold_first_exchange: bool = True
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    greedy: bool = False
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    span: str = "prefix"
    steer: list[str] = Field(default_factory=list, description="agent-side interventions (--steer specs)")
    persona_file: str | None = None
    batch_size: int = Field(32, ge=1, description="most conversations per generate call")
    ignore_eos: bool = Field(False, description="fixed-length turns of max_new_tokens (benchmarks)")

    @field_validator("categories")
    @classmethod
    def _known_categories(cls, v):
        from driftlab.bench import CATEGORIES

        if v is not None:
            bad = [c for c in v if c not in CATEGORIES]
            if bad:
                raise ValueError(f"unknown categories {bad}; use {list(CATEGORIES)}")
        return v

    @property
    def sampling(self) -> Sampling:
        return Sampling(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            greedy=self.greedy, seed=self.seed, ignore_eos=self.ignore_eos,
        )

    @property
    def conditions(self) -> list[str]:
        return ["persona", "empty-user"] if self.ablation else ["persona"]

    def probe_rounds(self) -> list[int]:
        return [i for i in range(1, self.rounds + 1) if i % self.probe_every == 0]

    # Fields that must match to resume a run; the rest (device, batch size) may change.
    RESUME_KEYS: ClassVar[tuple[str, ...]] = (
        "model", "user_model", "pairs", "pair_ids", "categories", "rounds", "probe_every", "probe_repeats",
        "user_probe", "ablation", "fold_first_exchange", "max_new_tokens", "temperature", "top_p", "greedy",
        "seed", "dtype", "span", "steer", "persona_file", "ignore_eos",
    )


@dataclass
class Pair:
    index: int
    agent: Persona
    user: Persona
    starter: str


def draw_pairs(config: SelfChatConfig) -> list[Pair]:
    """Explicit pairs first, then `pairs` random ones (agent from `categories`, user != agent)."""
    extra = config.persona_file
    pool = load_personas(extra=extra)
    agents = [p for p in pool if config.categories is None or p.category in config.categories]
    rng = random.Random(config.seed)
    out: list[Pair] = []
    for a, u in config.pair_ids:
        out.append(Pair(len(out), get_persona(a, extra), get_persona(u, extra), rng.choice(STARTERS)))
    for _ in range(config.pairs):
        agent = rng.choice(agents)
        user = rng.choice([p for p in pool if p.id != agent.id])
        out.append(Pair(len(out), agent, user, rng.choice(STARTERS)))
    if not out:
        raise DriftlabError("No persona pairs to run.", hint="Use --pairs N or --pair AGENT_ID:USER_ID.")
    return out


def item_seed(seed: int, *parts: Any) -> int:
    """A stable 63-bit seed for one generation, independent of batching and of Python's hash."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class Dialog:
    """One conversation of the self-chat: a pair under a condition, with its turns so far."""

    pair: Pair
    condition: str
    a: list[str] = field(default_factory=list)  # user LM turns a_1..a_n
    b: list[str] = field(default_factory=list)  # agent turns b_1..b_n

    def agent_view(self, round_: int, last_user: str) -> Conversation:
        """What the agent sees at round i: [s_B, a_1, b_1, ..., a_{i-1}, b_{i-1}, last_user]."""
        conv: Conversation = [{"role": "system", "content": self.pair.agent.system_prompt}]
        for j in range(round_ - 1):
            conv += [{"role": "user", "content": self.a[j]}, {"role": "assistant", "content": self.b[j]}]
        conv.append({"role": "user", "content": last_user})
        return conv

    def user_view(self, round_: int, fold: bool) -> Conversation:
        """What the user LM sees before writing a_i (i >= 2): the dialog with roles swapped."""
        conv: Conversation = []
        if self.condition == "persona":
            conv.append({"role": "system", "content": self.pair.user.system_prompt})
        if fold:
            conv.append({"role": "user", "content": FOLD_TEMPLATE.format(a=self.a[0], b=self.b[0])})
        else:
            conv += [{"role": "assistant", "content": self.a[0]}, {"role": "user", "content": self.b[0]}]
        for j in range(1, round_ - 1):
            conv += [{"role": "assistant", "content": self.a[j]}, {"role": "user", "content": self.b[j]}]
        return conv


@dataclass
class Job:
    """One generation to run and the record it becomes."""

    record: dict[str, Any]
    conversation: Conversation
    seed: int
    backend: str  # "agent" or "user"
    keep_cache: bool
    score: Callable[[str], float] | None = None


class SelfChat:
    """Runs (or resumes) a self-chat experiment into a run directory."""

    def __init__(
        self,
        config: SelfChatConfig,
        out: str,
        agent: ChatBackend,
        user: ChatBackend | None = None,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.rundir = RunDir(out)
        self.agent = agent
        self.user = user or agent
        self.progress = progress
        from driftlab.steering import parse_steer

        self.attention = parse_steer(config.steer)
        if self.attention is not None and not hasattr(agent, "generate"):
            raise DriftlabError(
                "Attention interventions (--steer) need a local model.",
                hint="Run the agent on a local Hugging Face model, or drop --steer.",
            )

    def plan(self) -> tuple[list[Pair], list[Dialog]]:
        pairs = draw_pairs(self.config)
        dialogs = [Dialog(p, c) for c in self.config.conditions for p in pairs]
        return pairs, dialogs

    def run(self) -> RunDir:
        cfg = self.config
        pairs, dialogs = self.plan()
        plan = {
            "pairs": [
                {"pair": p.index, "agent": p.agent.id, "user": p.user.id, "starter": p.starter,
                 "agent_category": p.agent.category, "user_category": p.user.category}
                for p in pairs
            ],
            "conditions": cfg.conditions,
            "probe_rounds": cfg.probe_rounds(),
            "personas": {p.id: p.model_dump() for pair in pairs for p in (pair.agent, pair.user)},
            "models": {"agent": _model_meta(self.agent), "user": _model_meta(self.user)},
            "attention": self.attention.model_dump() if self.attention else None,
        }
        self.rundir.start(cfg.model_dump(mode="json"), plan, cfg.RESUME_KEYS)
        done = {record_key(r): r for r in self.rundir.records()}
        for d in dialogs:
            d.a.append(d.pair.starter)
            for i in range(1, cfg.rounds + 1):
                if (key := ("turn", d.pair.index, d.condition, i, "user")) in done and i > 1:
                    d.a.append(done[key]["text"])
                if (key := ("turn", d.pair.index, d.condition, i, "agent")) in done:
                    d.b.append(done[key]["text"])

        total = self._count_todo(dialogs, done)
        with _Progress(self.progress, total) as bar:
            for i in range(1, cfg.rounds + 1):
                user_jobs = [self._user_job(d, i) for d in dialogs if i > 1 and len(d.a) < i]
                self._run_jobs(user_jobs, dialogs, bar)
                agent_jobs = [self._agent_job(d, i) for d in dialogs if len(d.b) < i]
                agent_jobs += [
                    self._probe_job(d, rec, persona)
                    for d in dialogs
                    for rec, persona in self._probe_specs(d, i)
                    if record_key(rec) not in done
                ]
                self._run_jobs(agent_jobs, dialogs, bar)
        self.rundir.update_manifest(completed=True)
        return self.rundir

    # -- jobs ----------------------------------------------------------------------------------
    def _base(self, d: Dialog, i: int) -> dict[str, Any]:
        return {"pair": d.pair.index, "condition": d.condition, "round": i}

    def _user_job(self, d: Dialog, i: int) -> Job:
        rec = {"kind": "turn", **self._base(d, i), "speaker": "user"}
        conv = d.user_view(i, self.config.fold_first_exchange)
        return Job(rec, conv, item_seed(self.config.seed, d.pair.index, d.condition, i, "user"), "user", True)

    def _agent_job(self, d: Dialog, i: int) -> Job:
        rec = {"kind": "turn", **self._base(d, i), "speaker": "agent"}
        conv = d.agent_view(i, d.a[i - 1])
        return Job(rec, conv, item_seed(self.config.seed, d.pair.index, d.condition, i, "agent"), "agent", True)

    def _probe_specs(self, d: Dialog, i: int) -> list[tuple[dict[str, Any], Persona]]:
        """The probe records due at round i (agent persona, and the user's if asked)."""
        if i not in self.config.probe_rounds():
            return []
        targets = [("agent", d.pair.agent)]
        if self.config.user_probe and d.condition == "persona":
            targets.append(("user", d.pair.user))
        return [
            ({"kind": "probe", **self._base(d, i), "target": target, "persona": persona.id, "repeat": r}, persona)
            for target, persona in targets
            for r in range(self.config.probe_repeats)
        ]

    def _probe_job(self, d: Dialog, rec: dict[str, Any], persona: Persona) -> Job:
        seed = item_seed(self.config.seed, d.pair.index, d.condition, rec["round"], "probe", rec["target"],
                         rec["repeat"])
        return Job(rec, d.agent_view(rec["round"], persona.probe), seed, "agent", False, persona.score)

    def _run_jobs(self, jobs: list[Job], dialogs: list[Dialog], bar: _Progress) -> None:
        by_key = {(d.pair.index, d.condition): d for d in dialogs}
        size = self.config.batch_size
        for start in range(0, len(jobs), size):
            chunk = jobs[start : start + size]
            backend = self.user if chunk[0].backend == "user" else self.agent
            extra: dict[str, Any] = {}
            if hasattr(backend, "generate"):
                extra["cache_store"] = [j.keep_cache for j in chunk]
                if chunk[0].backend == "agent" and self.attention is not None:
                    extra["attention"] = self.attention
            replies = backend.chat(
                [j.conversation for j in chunk], self.config.sampling, seeds=[j.seed for j in chunk], **extra
            )
            records = []
            for job, reply in zip(chunk, replies, strict=True):
                rec = {**job.record, "text": reply.text, "n_tokens": reply.n_tokens,
                       "finish_reason": reply.finish_reason, "seed": job.seed}
                if job.score is not None:
                    rec["score"] = job.score(reply.text)
                records.append(rec)
                d = by_key[(rec["pair"], rec["condition"])]
                if rec["kind"] == "turn":
                    (d.a if rec["speaker"] == "user" else d.b).append(reply.text)
            self.rundir.append(records)
            bar.advance(len(chunk))

    def _count_todo(self, dialogs: list[Dialog], done: dict) -> int:
        cfg = self.config
        n = 0
        for d in dialogs:
            n += (cfg.rounds - len(d.a)) + (cfg.rounds - len(d.b))
            for i in cfg.probe_rounds():
                n += sum(record_key(rec) not in done for rec, _ in self._probe_specs(d, i))
        return n


def _model_meta(backend: ChatBackend) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": getattr(backend, "name", type(backend).__name__)}
    model = getattr(backend, "model", None)
    if model is not None:
        meta.update(path=str(getattr(backend, "path", "")), dtype=str(model.dtype).replace("torch.", ""),
                    device=str(model.device), architecture=type(model).__name__)
        from driftlab.assets import pulled_info

        info = pulled_info(meta["name"]) if "/" not in meta["name"] else None
        if info:
            meta["preset"] = info
    return meta


class _Progress:
    """A rich progress bar over generations; plain log lines when stderr is not a terminal."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.done = enabled, total, 0

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            from driftlab.console import err_console

            self._console = err_console()
            self._start = time.monotonic()
            self._p = Progress(TextColumn("self-chat"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                               console=self._console, disable=not self._console.is_terminal)
            self._p.__enter__()
            self._task = self._p.add_task("self-chat", total=self.total)
        return self

    def advance(self, n: int) -> None:
        if not self.enabled:
            return
        self.done += n
        self._p.update(self._task, advance=n)
        if not self._console.is_terminal:  # e.g. a log file: one line per batch
            elapsed = time.monotonic() - self._start
            left = elapsed / self.done * (self.total - self.done)
            self._console.print(f"self-chat: {self.done}/{self.total} generations, "
                                f"{elapsed / 60:.1f} min elapsed, ~{left / 60:.1f} min left", highlight=False)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._p.__exit__(*exc)


def run_selfchat(config: SelfChatConfig, out: str, progress: bool = True) -> RunDir:
    """Load the model(s) named in `config` and run the experiment into `out`."""
    from driftlab.chat.hf import HFChatBackend

    agent = HFChatBackend(config.model, dtype=config.dtype, device=config.device, span_mode=config.span)
    user = None
    if config.user_model and config.user_model != config.model:
        user = HFChatBackend(config.user_model, dtype=config.dtype, device=config.device, span_mode=config.span)
    return SelfChat(config, out, agent, user, progress=progress).run()

