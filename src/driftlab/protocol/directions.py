"""Persona directions (`driftlab directions`): each system prompt's direction in the residual stream.

For each persona, the same user prompts are answered with its system prompt and without it;
each reply's residual activations are averaged over the positions that generated it (per
layer), and the direction is the difference of the two means over the training prompts
(persona vectors, Chen et al. 2025). The prompts held out (every third) measure how well each
layer's direction separates with from without: AUROC with a bootstrap interval over prompts,
and the same for a shuffled control (labels permuted before the direction is taken), which
should sit near chance. The default layer band is the adjacent layers that separate best on
held-out prompts. With `axis`, one more direction is taken the Assistant Axis way (Lu et al.
2026): every reply without a system prompt (the default assistant) against every reply with
one (the roles); it applies to every row without a direction of its own.

A unit is one persona: its replies are records, its activations a shard (`acts/<i>.safetensors`,
written before its records, so a killed run resumes without losing or mixing any). `finish`
writes `directions.safetensors` and `directions.json` (activation.directions) from the shards.

With `from_file`, one direction comes from another tool's file instead (`activation.formats`): the
axis for an Assistant Axis file, else the one persona or system prompt given. The same replies
calibrate it (its projections, held-out AUROC and band); a capping config's layers are its band.
A copy of the file as read sits in the run directory, so a resumed run needs nothing else.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field, TypeAdapter, field_validator, model_validator

from driftlab.activation.config import Format
from driftlab.activation.directions import (
    AXIS,
    Directions,
    PersonaDirection,
    band_width,
    choose_band,
    difference_of_means,
    project,
)
from driftlab.activation.formats import Imported
from driftlab.bench import load_personas
from driftlab.bench.starters import starters
from driftlab.chat.base import MAX_SEED, ChatRequest, Sampling, token_backend
from driftlab.errors import DriftlabError
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState
from driftlab.stats import auroc_interval

HELD_OUT_EVERY = 3  # prompt i is held out when i % 3 == 2
N_RESAMPLES = 500  # bootstrap resamples of each layer's held-out AUROC


class DirectionsConfig(ProtocolConfig):
    """Which system prompts, answered to which user prompts, how."""

    personas: list[str] = Field(default_factory=list, description="benchmark persona ids")
    systems: list[str] = Field(default_factory=list, description="your own system prompts")
    axis: bool = Field(False, description="also the Assistant Axis: no system prompt vs every prompt given")
    prompts: list[str] | None = Field(None, description="user prompts for every persona (default: its probe question "
                                                         "and `starters` of the reference starters)")
    starters: int = Field(20, ge=0, le=45, description="reference starters added to each persona's probe")
    sampling: Sampling = Sampling(max_new_tokens=48, temperature=1.0, top_p=0.9)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    batch_size: int = Field(32, ge=1, le=4096)
    from_file: str | None = Field(None, description="a direction in another tool's file, calibrated here")
    format: Format | None = Field(None, description="the file's format: assistant-axis, persona-vectors or "
                                                    "steering-vectors")
    capping: str | None = Field(None, description="the Assistant Axis's capping_config.pt: thresholds for cap:q=file")
    experiment: str | None = Field(None, description="which of the capping config's experiments")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")

    @model_validator(mode="before")
    @classmethod
    def _axis_file(cls, data: Any) -> Any:
        """An Assistant Axis file is the axis: importing one takes the axis's replies."""
        if isinstance(data, dict) and data.get("format") == "assistant-axis":
            data = {**data, "axis": True}
        return data

    @field_validator("systems", "prompts")
    @classmethod
    def _non_empty(cls, v):
        if v is not None and any(not str(x).strip() for x in v):
            raise ValueError("an empty prompt cannot be a system or user prompt")
        return v

    @model_validator(mode="after")
    def _something(self) -> DirectionsConfig:
        if not self.personas and not self.systems:
            raise ValueError("give personas (ids) or systems (your own prompts) to take directions of")
        if self.axis and len(self.personas) + len(self.systems) < 2:
            raise ValueError("an Assistant Axis file is judged on the default assistant against roles: give at least 2 "
                             "system prompts (--personas or --system), the roles" if self.format == "assistant-axis" else
                             "an axis needs at least 2 system prompts (the roles) against the default assistant")
        if (self.from_file is None) != (self.format is None):
            raise ValueError("an imported direction needs both its file (from_file) and its format")
        if self.capping is not None and self.format != "assistant-axis":
            raise ValueError("a capping config comes with an Assistant Axis file (format assistant-axis)")
        if self.experiment is not None and self.capping is None:
            raise ValueError("experiment names one of a capping config's experiments: give the capping config too")
        if self.format in ("persona-vectors", "steering-vectors") and len(self.personas) + len(self.systems) != 1:
            raise ValueError(f"a {self.format} file is one system prompt's direction: give exactly one persona or "
                             "system prompt, the one it was made for")
        return self

    def imported_id(self) -> str | None:
        """Which direction the file gives: the axis, or the one persona's (None: nothing imported)."""
        if self.format is None:
            return None
        if self.format == "assistant-axis":
            return AXIS
        return self.personas[0] if self.personas else system_id(self.systems[0])


class ReplyRecord(BaseModel):
    """One reply to one user prompt, with or without the persona's system prompt."""

    kind: Literal["reply"] = "reply"
    persona: str
    prompt: int = Field(ge=0)
    condition: Literal["with", "without"]
    text: str
    n_tokens: int = Field(ge=0)
    finish_reason: str

    @property
    def key(self) -> tuple:
        return ("reply", self.persona, self.prompt, self.condition)


def system_id(text: str) -> str:
    """The id of a system prompt given as text: `system-` and 8 hex digits of its sha256."""
    return "system-" + hashlib.sha256(text.encode()).hexdigest()[:8]


@register
class DirectionsProtocol(Protocol[DirectionsConfig]):
    name = "directions"
    records = TypeAdapter(ReplyRecord)
    unit = "replies"
    imported: Imported | None = None  # set by `require`: the direction on this model
    _file: Imported | None = None  # the imported file as read (`_read`)

    def check(self) -> None:
        self._personas()
        self._read()

    def require(self) -> None:
        token_backend(self.backend, "driftlab directions")
        self.imported = self._imported()

    def _read(self) -> Imported | None:
        """The imported direction as its file holds it (one line on any problem, before a model loads);
        read once per protocol (check, then require)."""
        from driftlab.activation import formats

        c = self.config
        if c.from_file is not None and self._file is None:
            self._file = formats.read(c.from_file, c.format, capping=c.capping, experiment=c.experiment)
        return self._file

    def _imported(self) -> Imported | None:
        """The imported direction on this model: the run directory's copy, else the file, checked
        against the model's shape and copied there."""
        copy = self.run_dir / "imported.safetensors"
        if self.config.from_file is None:
            return None
        if copy.is_file():
            return Imported.load(copy)
        backend = token_backend(self.backend, "driftlab directions")
        found = self._read().fit(self.config.backend.model, backend.shape.layers, backend.d_model)
        copy.parent.mkdir(parents=True, exist_ok=True)
        found.save(copy)
        return found

    def inputs(self) -> dict[str, str]:
        from driftlab.activation.formats import file_sha256

        return {} if self.config.from_file is None else {"imported": file_sha256(self.config.from_file)}

    def _personas(self) -> list[dict[str, Any]]:
        """(id, system prompt, user prompts) of every persona asked, checked against the benchmark."""
        known = {p.id: p for p in load_personas()}
        out, topics = [], starters("reference")
        rng = random.Random(self.config.seed)
        for pid in self.config.personas:
            if pid not in known:
                raise DriftlabError(f"No persona with id {pid!r}.", hint="`driftlab personas list` shows the ids.")
        chosen: list[tuple[str, str, str | None]] = [(p, known[p].system_prompt, known[p].probe)
                                                     for p in self.config.personas]
        chosen += [(system_id(s), s, None) for s in self.config.systems]
        for pid, system, probe in chosen:
            prompts = list(self.config.prompts) if self.config.prompts is not None else \
                [probe or "Tell me about yourself."] + rng.sample(topics, self.config.starters)
            if len(prompts) < HELD_OUT_EVERY:
                raise DriftlabError(f"{len(prompts)} user prompts leave none held out for {pid}.",
                                    hint=f"Give at least {HELD_OUT_EVERY} prompts (or --starters 2 or more).")
            out.append({"id": pid, "system_prompt": system, "prompts": prompts})
        return out

    def plan(self) -> dict[str, Any]:
        return {"personas": self._personas()}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"reply": sum(2 * len(p["prompts"]) for p in manifest["personas"])}

    def units(self, state: RunState) -> Iterable[tuple[int, dict[str, Any]]]:
        for i, persona in enumerate(state.manifest["personas"]):
            if ("reply", persona["id"], 0, "with") not in state.done or not self._shard(i).is_file():
                yield i, persona

    def _shard(self, i: int):
        return self.run_dir / "acts" / f"{i}.safetensors"

    def run_unit(self, unit: tuple[int, dict[str, Any]]) -> list[ReplyRecord]:
        """Both conditions of one persona's prompts; the activations go to its shard first."""
        from safetensors.torch import save_file

        i, persona = unit
        acts, records = {}, []
        for condition in ("with", "without"):
            system = [{"role": "system", "content": persona["system_prompt"]}] if condition == "with" else []
            convs = [system + [{"role": "user", "content": text}] for text in persona["prompts"]]
            replies, mean = self._generate(convs, persona["id"], condition)
            acts[condition] = mean.to(torch.float16)
            records += [ReplyRecord(persona=persona["id"], prompt=j, condition=condition, text=r.text,
                                    n_tokens=r.n_tokens, finish_reason=r.finish_reason)
                        for j, r in enumerate(replies)]
        self._shard(i).parent.mkdir(parents=True, exist_ok=True)
        save_file(acts, str(self._shard(i)))
        return records

    def _generate(self, convs, pid: str, condition: str):
        """Replies and mean activations of `convs`, in batches; seeds from the run seed, persona,
        condition and prompt, so a resumed unit draws what it drew."""
        replies, means = [], []
        size = self.config.batch_size
        for start in range(0, len(convs), size):
            chunk = convs[start : start + size]
            seeds = [_seed(self.config.seed, pid, condition, start + j) for j in range(len(chunk))]
            out, mean = self.backend.generate_activations(
                ChatRequest(chunk, self.config.sampling, seeds=seeds, cache_store=[False] * len(chunk)))
            replies += out
            means.append(mean)
        return replies, torch.cat(means)

    def finish(self, state: RunState) -> None:
        from safetensors.torch import load_file

        manifest = state.manifest
        shards = [load_file(str(self._shard(i))) for i in range(len(manifest["personas"]))]
        given = {self.config.imported_id(): self.imported} if self.imported is not None else {}
        found = [persona_direction(p["id"], p["system_prompt"], s["with"], s["without"], self.config.seed,
                                   given.get(p["id"]))
                 for p, s in zip(manifest["personas"], shards, strict=True)]
        if self.config.axis:  # the default assistant (no system prompt) against every role
            found.append(persona_direction(AXIS, None, torch.cat([s["without"] for s in shards]),
                                           torch.cat([s["with"] for s in shards]), self.config.seed, given.get(AXIS)))
        agent = manifest.get("models", {}).get("agent", {})
        meta = {"model": agent.get("name", self.config.backend.model), "n_layers": int(found[0].unit.shape[0]),
                "d_model": int(found[0].unit.shape[1]), "dtype": agent.get("dtype"), "seed": self.config.seed,
                "sampling": self.config.sampling.model_dump(), "held_out_every": HELD_OUT_EVERY,
                "definition": "difference of mean residual activations (decoder layer outputs) over the positions "
                              "that generated each reply, with minus without the system prompt; unit-norm"}
        Directions(meta, found).save(self.run_dir)

    def describe(self) -> dict[str, Any]:
        return {"models": {"agent": self.backend.describe()}}


def _seed(run_seed: int, pid: str, condition: str, prompt: int) -> int:
    digest = hashlib.sha256(f"{run_seed}|{pid}|{condition}|{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (MAX_SEED + 1)


def persona_direction(pid: str, system: str | None, with_acts: torch.Tensor, without_acts: torch.Tensor,
                      seed: int, imported: Imported | None = None) -> PersonaDirection:
    """The direction of [n, L, d] with-prompt activations against [m, L, d] without: taken on the
    training prompts, judged on the held-out ones (AUROC per layer with its interval; a shuffled
    control), its band chosen there. Prompt i is held out when i % HELD_OUT_EVERY == 2 (of each set).
    An `imported` direction is taken as given and only judged (no shuffled control: nothing was
    trained); a capping config's layers are then its band."""
    train_w, held_w = _split(with_acts)
    train_o, held_o = _split(without_acts)
    unit, norm = difference_of_means(train_w, train_o) if imported is None else imported.unit_norm()
    on_held = project(torch.cat([held_w, held_o]), unit).numpy()
    labels = np.r_[np.ones(len(held_w), bool), np.zeros(len(held_o), bool)]
    auroc = np.array([auroc_interval(on_held[:, layer], labels, n_resamples=N_RESAMPLES, rng=seed).as_tuple()
                      for layer in range(unit.shape[0])]).T  # [3, L]
    effect = _effect(on_held[labels], on_held[~labels])
    band = imported.cap_layers if imported is not None and imported.cap_layers else \
        choose_band(torch.from_numpy(auroc[0]), torch.from_numpy(effect), band_width(unit.shape[0]))
    control = _shuffled_control(train_w, train_o, held_w, held_o, band, seed) if imported is None else None
    info = {"n_with": len(with_acts), "n_without": len(without_acts), "n_held_out": len(held_w),
            "band_auroc": round(float(auroc[0][list(band)].mean()), 4),
            "control_auroc": None if control is None else round(control, 4),
            **({"imported": imported.source} if imported is not None else {})}
    return PersonaDirection(id=pid, system_prompt=system, unit=unit, norm=norm,
                            with_proj=project(train_w, unit), without_proj=project(train_o, unit),
                            auroc=torch.from_numpy(auroc).float(), band=band, info=info,
                            caps=None if imported is None else imported.caps)


def _split(acts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    held = torch.tensor([i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(acts))])
    return acts[~held].float(), acts[held].float()


def _effect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Standardised mean difference per layer (pooled SD), the band's tie-break."""
    pooled = np.sqrt((a.var(0, ddof=1) + b.var(0, ddof=1)) / 2) if min(len(a), len(b)) > 1 else np.ones(a.shape[1])
    return (a.mean(0) - b.mean(0)) / np.where(pooled > 0, pooled, 1.0)


def _shuffled_control(train_w, train_o, held_w, held_o, band, seed: int, shuffles: int = 20) -> float:
    """Mean held-out AUROC over the band of directions taken after shuffling the training labels
    (`shuffles` times): what separation by chance looks like on these few prompts."""
    from sklearn.metrics import roc_auc_score

    pooled = torch.cat([train_w, train_o])
    labels = np.r_[np.ones(len(held_w), bool), np.zeros(len(held_o), bool)]
    gen, values = torch.Generator().manual_seed(seed), []
    for _ in range(shuffles):
        order = torch.randperm(len(pooled), generator=gen)
        unit, _ = difference_of_means(pooled[order[: len(train_w)]], pooled[order[len(train_w):]])
        on_held = project(torch.cat([held_w, held_o]), unit).numpy()[:, list(band)].mean(1)
        values.append(roc_auc_score(labels, on_held))
    return float(np.mean(values))
