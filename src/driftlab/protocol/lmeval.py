"""What an intervention costs on an lm-evaluation-harness task: a sweep point priced by `lm-eval:<task>`.

`driftlab sweep --benchmark lm-eval:<task>` prices each point of its grid by an lm-eval task
instead of MMLU. Per point, one run directory (`POINT/benchmark/`) of this protocol, "lm-eval":

* the items: a seeded sample of `n` of the task's evaluation documents (all of them where the
  task has fewer), the same for every point (drawn once, recorded in the sweep's manifest);
* each item is evaluated by lm-eval itself (`lm_eval.simple_evaluate` with `samples=`, its
  prompts, few-shot examples, filters and metrics) on the sweep's local model wrapped in
  `driftlab.integrations.lm_eval.DriftlabLM` under the point's steer, the prompt rendered with
  the model's chat template (`apply_chat_template=True`) and an agent persona's system prompt
  as lm-eval's `system_instruction`: a steer acts on the system prompt, so without one it would
  act on nothing. The personas are the agents of the sweep's first `histories` persona pairs
  (distinct ones), the items spread over them evenly as MMLU spreads its questions over
  dialogs (item i of the plan after persona i mod k), each item recording its persona's pair:
  with the default of one, every item is asked under the first pair's agent, the persona whose
  dialog MMLU would follow; with several, the persona is the unit of the paired test (items
  under one system prompt share it), as MMLU's dialog is. No dialog comes before the item:
  lm-eval builds its own prompt (the cost measured is the steer's on the task with the
  persona's system prompt present, at turn 0);
* one record per item (`ItemRecord`): task, doc_id, the task's 0/1 metric (`acc`,
  `exact_match`, ...: `ACCURACY_LIKE`, the first the task reports), lm-eval's responses, and for
  multiple-choice tasks the option chosen; a unit is one lm-eval call over a batch of items of
  one persona, appended when it returns, so a killed run resumes where it stopped.

The report pairs the items of each point with the plain point's (`answers`, `dialogs_of`)
and tests the drop exactly as MMLU's (`driftlab.protocol.mmlu.drop_test`).

lm-eval is optional: nothing here imports it before a benchmark runs (`require_lm_eval`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from driftlab.chat.base import MAX_SEED
from driftlab.chat.spec import BackendSpec
from driftlab.errors import DriftlabError
from driftlab.protocol.registry import did_you_mean, register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import DialogSteer, Interventions

PREFIX = "lm-eval:"
#: Per-item metrics that are 0 or 1 (right or wrong), in the order one is chosen from a task's.
ACCURACY_LIKE = ("acc", "exact_match", "acc_norm", "em")
Condition = Literal["plain", "steered"]
OFFLINE_HINT = ("Offline, lm-eval reads a task's dataset from the Hugging Face cache: run the task once on a machine "
                "with network access (docs/steering.md, 'Pricing by an lm-eval task'), or give a task of your own "
                "with --benchmark-include DIR.")


def task_of(benchmark: str) -> str | None:
    """The lm-eval task a `--benchmark` names (None for "mmlu")."""
    return benchmark[len(PREFIX):] if benchmark.startswith(PREFIX) else None


def require_lm_eval() -> None:
    """Refuse, in one line, a benchmark run where lm-eval is not installed."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise DriftlabError("--benchmark lm-eval:<task> needs lm-evaluation-harness, which is not installed.",
                            hint="pip install lm-eval")


def require_local(backend: BackendSpec) -> None:
    """Refuse a backend DriftlabLM cannot run: it scores and generates with a model in this process."""
    if backend.remote:
        raise DriftlabError(
            f"--benchmark lm-eval:<task> runs lm-eval on a local model (DriftlabLM); {backend.model} is served.",
            hint="Use a local model; for a served one, run `driftlab serve` with the steer and evaluate it with "
                 "lm-eval's local-completions model (docs/ecosystem.md).")


def lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("lm_eval", "lm-eval"):
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return "unknown"


@functools.cache
def _manager(include: str | None, defaults: bool):
    """lm-eval's TaskManager (indexing every registered task takes seconds: one per process)."""
    from lm_eval.tasks import TaskManager

    if include is None:
        return TaskManager()
    return TaskManager(include_path=include, include_defaults=defaults)


def task_manager(task: str, include: str | None = None):
    """The TaskManager that knows `task`: the `include` directory's tasks alone where it has it (no
    index of lm-eval's registered tasks is built), else lm-eval's registered tasks (with `include`'s).
    An unknown name, or a group, is an error that says what exists."""
    require_lm_eval()
    if include is not None:
        if not Path(include).is_dir():
            raise DriftlabError(f"--benchmark-include {include} is not a directory.",
                                hint="Give the folder of the task's YAML files.")
        own = _manager(str(include), False)
        if task in own.all_subtasks:
            return own
    manager = _manager(None if include is None else str(include), True)
    if task in manager.all_subtasks:
        return manager
    if task in manager.all_tasks:  # a group or a tag: several tasks, each its own metric and doc ids
        raise DriftlabError(f"lm-eval's {task!r} is a group of tasks; --benchmark prices a point by one task.",
                            hint="Name one of its tasks (`lm-eval ls tasks` lists them).")
    where = f" (nor in {include})" if include else ""
    raise DriftlabError(f"lm-eval has no task {task!r}{where}{did_you_mean(task, manager.all_subtasks)}.",
                        hint="`lm-eval ls tasks` lists lm-eval's tasks; a task of your own: --benchmark-include "
                             "DIR (the folder of its YAML).")


@functools.cache
def load_task(task: str, include: str | None = None):
    """The lm-eval Task object (its dataset loaded, offline from the cache where HF_DATASETS_OFFLINE
    is set); one per process and task, reused by every lm-eval call."""
    manager = task_manager(task, include)
    try:
        with _quiet():
            return manager.load([task])["tasks"][task]
    except DriftlabError:
        raise
    except Exception as err:  # a dataset that is not in the cache, a task whose YAML is broken
        text = " ".join(str(err).split())
        raise DriftlabError(f"lm-eval cannot load task {task!r}: {type(err).__name__}: {text[:300]}.",
                            hint=OFFLINE_HINT) from None


def accuracy_metric(task_obj) -> tuple[str, str]:
    """(metric, filter) of a task: its first 0/1 per-item metric (`ACCURACY_LIKE`) and the first of its
    filters; a task with none is an error."""
    name = task_obj.config.task
    metrics = list(getattr(task_obj, "_metric_fn_list", {}) or
                   [m["metric"] for m in (task_obj.config.metric_list or []) if isinstance(m.get("metric"), str)])
    metric = next((m for m in ACCURACY_LIKE if m in metrics), None)
    if metric is None:
        raise DriftlabError(
            f"lm-eval task {name!r} reports {', '.join(map(str, metrics)) or 'no metric'}, none of them right or wrong "
            f"per item ({', '.join(ACCURACY_LIKE)}), which the paired drop test needs.",
            hint="Price the sweep by a task scored by accuracy or exact match (or by --benchmark mmlu).")
    filters = [f.name for f in getattr(task_obj, "_filters", [])] or ["none"]
    return metric, filters[0]


def check_task(task: str, include: str | None = None) -> tuple[str, str]:
    """Everything a benchmark needs before a model loads: lm-eval, a known task, its data, a 0/1 metric."""
    return accuracy_metric(load_task(task, include))


def draw_items(n_docs: int, n: int, seed: int) -> list[int]:
    """n doc ids of the task's evaluation docs (all where it has n or fewer): a seeded sample in
    ascending order, the same for a given (docs, n, seed). A sample, not lm-eval's first `--limit`
    documents: many tasks order their documents (by subject, by source), and a cost read off the
    first hundred would be that slice's."""
    if n >= n_docs:
        return list(range(n_docs))
    return sorted(random.Random(seed).sample(range(n_docs), n))


class LMEvalConfig(ProtocolConfig):
    """One point's lm-eval benchmark (recorded in the point's manifest)."""

    task: str = Field(description="the lm-eval task")
    include: str | None = Field(None, description="a folder of task YAMLs passed to lm-eval's TaskManager")
    n: int = Field(100, ge=1, description="items (documents) of the task, a seeded sample")
    steer: DialogSteer = Field(default_factory=Interventions, description="the interventions whose cost is measured")
    histories: int = Field(1, ge=1, le=1000, description="the sweep's first pairs whose agent personas the items "
                                                         "are spread over")
    seed: int = Field(0, ge=0, le=MAX_SEED)
    batch_size: int = Field(32, ge=1, le=4096, description="items per lm-eval call, and DriftlabLM's batch")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")

    @property
    def condition(self) -> Condition:
        return "steered" if self.steer else "plain"


class ItemRecord(BaseModel):
    """One item under one condition: its 0/1 metric, lm-eval's responses, and the persona (pair) whose
    system prompt it was asked under."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["item"] = "item"
    condition: Condition
    task: str
    doc_id: int = Field(ge=0)
    metric: str
    value: float  # 0 or 1
    filter: str = "none"
    target: Any = None
    resps: Any = None  # lm-eval's responses, unfiltered: (log-likelihood, greedy) per option, or the generation
    filtered: Any = None  # after the task's filter: what the metric read
    predicted: int | None = None  # multiple choice: the option with the highest log-likelihood
    tied: int = 1  # multiple choice: options sharing the top log-likelihood
    dialog: int = 0  # the pair whose agent's system prompt the item was asked under
    doc_hash: str | None = None

    @property
    def correct(self) -> bool:
        return self.value == 1.0

    @property
    def key(self) -> tuple:
        return ("item", self.condition, self.doc_id)


RECORDS: TypeAdapter = TypeAdapter(ItemRecord)


def personas_plan(selfchat_plan: dict[str, Any], histories: int) -> list[dict[str, Any]]:
    """The system prompts the items are asked under: the agents of the first `histories` pairs of a
    self-chat plan, each once (pair, agent id, system prompt), in pair order."""
    from driftlab.protocol.dialog import pairs_from_manifest

    out: list[dict[str, Any]] = []
    for pair in pairs_from_manifest(selfchat_plan)[:histories]:
        if all(p["agent"] != pair.agent.id for p in out):
            out.append({"pair": pair.index, "agent": pair.agent.id, "system": pair.agent.system_prompt})
    return out


@register
class LMEvalBench(Protocol[LMEvalConfig]):
    """An lm-eval task on a local model under one condition; a unit is one lm-eval call over a batch of
    one persona's items. Its plan (items, personas, metric) comes from its parent sweep."""

    name = "lm-eval"
    records = RECORDS
    unit = "items"

    def check(self) -> None:
        require_lm_eval()
        require_local(self.config.backend)
        check_task(self.config.task, self.config.include)

    def require(self) -> None:
        require_lm_eval()
        require_local(self.config.backend)
        from driftlab.chat.hf import HFChatBackend

        if not isinstance(self.backend, HFChatBackend):
            raise DriftlabError(f"--benchmark lm-eval:<task> runs lm-eval on a model in this process (DriftlabLM); "
                                f"{self.backend.name} is a {type(self.backend).__name__}.",
                                hint="Use a local model without --runtime ray, or price it by --benchmark mmlu.")
        self.backend.capabilities.require(self.backend.name, self.config.steer)

    def plan(self) -> dict[str, Any]:
        """The items and the metric; the parent adds the personas ("systems")."""
        cfg = self.config
        task = load_task(cfg.task, cfg.include)
        metric, filter_ = accuracy_metric(task)
        items = draw_items(len(task.eval_docs), cfg.n, cfg.seed)
        return {"benchmark": {"task": cfg.task, "metric": metric, "filter": filter_, "output_type": task.OUTPUT_TYPE,
                              "docs": len(task.eval_docs), "lm_eval": lm_eval_version()},
                "items": items}

    def inputs(self) -> dict[str, str]:
        """sha256 of the task's config (where it was read from left out) and its planned documents."""
        cfg = self.config
        task = load_task(cfg.task, cfg.include)
        config = {k: v for k, v in task.dump_config().items() if k != "metadata"}
        docs = task.eval_docs
        items = draw_items(len(docs), cfg.n, cfg.seed)
        text = json.dumps({"config": config, "docs": [docs[i] for i in items]}, sort_keys=True, default=str)
        return {"lm-eval": hashlib.sha256(text.encode()).hexdigest()}

    def describe(self) -> dict[str, Any]:
        return {"conditions": [self.config.condition], "interventions": self.config.steer.specs(),
                "models": {"agent": self.backend.describe()}}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"item": len(manifest.get("items", [])) * len(manifest.get("conditions", []))}

    def units(self, state: RunState) -> Iterator[tuple[dict[str, Any], list[int]]]:
        """Per persona, batches of its items not yet recorded, in plan order."""
        systems = state.manifest.get("systems") or []
        if not systems:
            raise DriftlabError(f"{self.run_dir} records no system prompt to ask its items under.",
                                hint="Run it through `driftlab sweep --benchmark lm-eval:<task>`.")
        self._plan = state.manifest
        condition = self.config.condition
        items = state.manifest["items"]
        for slot, system in enumerate(systems):
            todo = [d for i, d in enumerate(items) if i % len(systems) == slot and ("item", condition, d) not in state.done]
            for start in range(0, len(todo), self.config.batch_size):
                yield system, todo[start : start + self.config.batch_size]

    def run_unit(self, unit: tuple[dict[str, Any], list[int]]) -> list[ItemRecord]:
        import lm_eval

        system, doc_ids = unit
        cfg, bench = self.config, self._plan["benchmark"]
        task = load_task(cfg.task, cfg.include)
        with _quiet(not self.progress):
            out = lm_eval.simple_evaluate(
                model=self._lm(), tasks=[task], task_manager=task_manager(cfg.task, cfg.include),
                samples={cfg.task: list(doc_ids)}, log_samples=True,
                apply_chat_template=True, system_instruction=system["system"], bootstrap_iters=0)
        samples = [s for s in out["samples"][cfg.task] if s.get("filter", "none") == bench["filter"]]
        got = sorted(int(s["doc_id"]) for s in samples)
        if got != sorted(doc_ids):
            raise DriftlabError(f"lm-eval answered documents {got} of {cfg.task}, asked for {sorted(doc_ids)}.")
        return [self._record(s, bench, system["pair"]) for s in sorted(samples, key=lambda s: doc_ids.index(s["doc_id"]))]

    def _lm(self):
        if getattr(self, "_model", None) is None:
            from driftlab.integrations.lm_eval import DriftlabLM

            self._model = DriftlabLM(model=self.backend, steer=self.config.steer, system="chat",
                                     batch_size=self.config.batch_size, seed=self.config.seed)
        return self._model

    def _record(self, sample: dict[str, Any], bench: dict[str, Any], pair: int) -> ItemRecord:
        metric = bench["metric"]
        value = float(sample[metric])
        if value not in (0.0, 1.0):
            raise DriftlabError(f"lm-eval scored document {sample['doc_id']} of {self.config.task} {metric} = {value}, "
                                "not 0 or 1: the paired drop test needs right or wrong per item.",
                                hint="Price the sweep by a task scored by accuracy or exact match.")
        filtered = _jsonable(sample.get("filtered_resps"))
        predicted, tied = None, 1
        if bench.get("output_type") == "multiple_choice" and filtered:
            scores = [r[0] if isinstance(r, list) else r for r in filtered]
            top = max(scores)
            predicted, tied = scores.index(top), scores.count(top)
        return ItemRecord(condition=self.config.condition, task=self.config.task, doc_id=int(sample["doc_id"]),
                          metric=metric, value=value, filter=str(sample.get("filter", "none")),
                          target=_jsonable(sample.get("target")), resps=_jsonable(sample.get("resps")),
                          filtered=filtered, predicted=predicted, tied=tied, dialog=pair,
                          doc_hash=sample.get("doc_hash"))


def _jsonable(value: Any) -> Any:
    """lm-eval's responses as JSON values (tuples as lists, numpy numbers as Python's)."""
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


@contextmanager
def _quiet(on: bool = True) -> Iterator[None]:
    """lm-eval's info and warnings (one per call: "Custom kwargs can be passed ...") held back."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    if on:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def answers(run_dir: str | Path) -> dict[str, dict[int, ItemRecord]]:
    """condition -> doc_id -> its item record, from a run's records."""
    out: dict[str, dict[int, ItemRecord]] = defaultdict(dict)
    for r in RunDir(run_dir).records(RECORDS):
        out[r.condition][r.doc_id] = r
    return out


def dialogs_of(run_dir: str | Path) -> dict[int, int]:
    """doc_id -> the pair whose agent persona it was asked under (the cluster of the paired test)."""
    return {i: r.dialog for rows in answers(run_dir).values() for i, r in rows.items()}


COLLAPSE = 0.6  # as MMLU's: one option chosen for more than this share of items
COLLAPSE_MIN_N = 20


def answer_health(rows: dict[int, ItemRecord]) -> dict[str, Any]:
    """As `driftlab.protocol.mmlu.answer_health`, for multiple-choice items: the option (0-based) chosen
    most and its share (`collapsed` above COLLAPSE from COLLAPSE_MIN_N items on), the items whose top
    options tied, and the personas the items were asked under. Generated answers have no option:
    top_letter '' and share NaN."""
    predicted = [r.predicted for r in rows.values() if r.predicted is not None]
    top = max(set(predicted), key=lambda p: (predicted.count(p), -p)) if predicted else None
    share = predicted.count(top) / len(predicted) if predicted else float("nan")
    return {"top_letter": "" if top is None else str(top), "top_share": share,
            "collapsed": len(predicted) >= COLLAPSE_MIN_N and share > COLLAPSE,
            "tied": sum(r.tied > 1 for r in rows.values()), "dialogs": len({r.dialog for r in rows.values()})}
