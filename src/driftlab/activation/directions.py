"""Persona directions in the residual stream: computed, stored, looked up per row.

A persona's direction at layer l is the difference of the mean residual activations of its
replies generated with its system prompt and without it (persona vectors, Chen et al. 2025):
averaged over each reply's positions, then over replies. Stored unit-norm, with the norm of the
difference (so `vector:alpha=1` adds exactly the mean difference) and the projections of the
replies it came from (so a projection can be normalised, 0 = like without the prompt, 1 = like
with it, and capping can take a quantile of the with-prompt distribution). The Assistant Axis
(Lu et al. 2026) is the same construction with the default assistant as "with" and the many
role prompts as "without"; it has no system prompt of its own and applies to every row without a
direction of its own.

On disk: `directions.safetensors` (tensors `p<i>.unit` [L, d], `p<i>.norm` [L], `p<i>.with` and
`p<i>.without` [n, L] projections, `p<i>.auroc` [3, L] held-out AUROC with its interval, and for a
direction imported with a capping config `p<i>.caps` [L], its thresholds) beside `directions.json`
(model, layers, width, dtype, seed, prompts, and per persona its id, system prompt, n and layer
band; an imported one's source).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from driftlab.activation.config import ResidualConfig
from driftlab.activation.state import ResidualRow
from driftlab.errors import DriftlabError

TENSORS = "directions.safetensors"
MANIFEST = "directions.json"
AXIS = "axis"  # the id of the Assistant Axis: the direction of every row without one of its own


@dataclass(frozen=True)
class PersonaDirection:
    """One persona's direction per layer and the statistics it came with."""

    id: str
    system_prompt: str | None  # None: an axis, for every row
    unit: torch.Tensor  # [L, d] float32, unit norm per layer
    norm: torch.Tensor  # [L] norm of mean(with) - mean(without)
    with_proj: torch.Tensor  # [n, L] projections of the with-prompt replies it was computed from
    without_proj: torch.Tensor  # [m, L]
    auroc: torch.Tensor  # [3, L] held-out AUROC of with vs without: estimate, low, high
    band: tuple[int, ...]  # the default layers, chosen on held-out data
    info: dict[str, Any] = field(default_factory=dict)  # n, held-out n, ...
    caps: torch.Tensor | None = None  # [L] thresholds that came with an imported direction (NaN: none)

    @property
    def low(self) -> torch.Tensor:
        """[L] mean projection without the prompt (normalised 0)."""
        return self.without_proj.mean(0)

    @property
    def high(self) -> torch.Tensor:
        """[L] mean projection with it (normalised 1)."""
        return self.with_proj.mean(0)

    def quantile(self, q: float) -> torch.Tensor:
        """[L] the q-quantile of the with-prompt projections (capping's threshold)."""
        return torch.quantile(self.with_proj, q, dim=0)

    def thresholds(self, layers: list[int]) -> torch.Tensor:
        """The thresholds an imported capping config gave at `layers` (`cap:q=file`)."""
        given = [] if self.caps is None else [layer for layer in layers if not self.caps[layer].isnan()]
        if len(given) < len(layers):
            where = "none" if self.caps is None else \
                "layers " + ",".join(str(int(i)) for i in torch.nonzero(~self.caps.isnan()).flatten())
            raise DriftlabError(f"cap:q=file takes the thresholds imported with {self.id}'s direction, and it has "
                                f"{where}, not layers {','.join(map(str, layers))}.",
                                hint="Import a capping config (driftlab directions --from-file AXIS --capping FILE), "
                                     "or cap at a quantile: cap:q=0.25.")
        return self.caps[layers]

    def row(self, config: ResidualConfig | None) -> ResidualRow:
        """This direction as one batch row's state under `config` (None: monitored only)."""
        L = self.unit.shape[0]
        add, tau = torch.zeros(L), torch.full((L,), float("-inf"))
        if config is not None and config.alpha:
            layers = list(config.vector_layers or self.band)
            add[layers] = config.alpha * self.norm[layers]
        if config is not None and config.cap_q is not None:
            layers = list(config.cap_layers or self.band)
            tau[layers] = self.thresholds(layers) if config.cap_q == "file" else self.quantile(config.cap_q)[layers]
        return ResidualRow(unit=self.unit, add=add, tau=tau, low=self.low, high=self.high, direction=self.id,
                           band=self.band)


class Directions:
    """Every direction of one file, for one model; `for_system` finds a row's."""

    def __init__(self, meta: dict[str, Any], personas: list[PersonaDirection], path: Path | None = None,
                 digest: str | None = None) -> None:
        self.meta, self.personas, self.path, self.digest = meta, {p.id: p for p in personas}, path, digest
        self._by_system = {p.system_prompt: p for p in personas if p.system_prompt is not None}

    @property
    def n_layers(self) -> int:
        return int(self.meta["n_layers"])

    @property
    def d_model(self) -> int:
        return int(self.meta["d_model"])

    @property
    def axis(self) -> PersonaDirection | None:
        return self.personas.get(AXIS)

    def for_system(self, system: str | None) -> PersonaDirection | None:
        """The direction of a row whose system prompt is `system`: the persona computed for exactly
        that prompt, else the file's axis (it applies to every other row), else None."""
        own = self._by_system.get(system) if system is not None else None
        return own if own is not None else self.axis

    def check_model(self, name: str, n_layers: int, d_model: int) -> None:
        """A one-line error when these directions were computed on another model's shape."""
        if (n_layers, d_model) != (self.n_layers, self.d_model):
            raise DriftlabError(
                f"The directions in {self.path or 'memory'} are for {self.meta.get('model')} "
                f"({self.n_layers} layers x {self.d_model}), not {name} ({n_layers} layers x {d_model}).",
                hint=f"Compute them for this model: driftlab directions --model {name} --out DIR")

    def check_layers(self, config: ResidualConfig) -> None:
        """A one-line error for a steer's layers outside this model."""
        for layers in (config.vector_layers, config.cap_layers):
            if layers and max(layers) >= self.n_layers:
                raise DriftlabError(f"Layer {max(layers)} is outside {self.meta.get('model')} ({self.n_layers} layers).",
                                    hint=f"Layers are 0..{self.n_layers - 1}; leave layers out for the band.")

    def describe(self) -> dict[str, Any]:
        """What a run's manifest records of the directions it used."""
        return {"path": str(self.path) if self.path else None, "sha256": self.digest, "model": self.meta.get("model"),
                "personas": sorted(self.personas), "axis": self.axis is not None}

    def export(self, fmt: str, out: str | Path, *, persona: str | None = None, cap_q: float | None = None) -> list[Path]:
        """Write one direction (`persona`; default the axis, else the only one) in another tool's
        format (`activation.formats`); with `cap_q` (assistant-axis) also a capping config that caps
        its band at that quantile, or at its imported thresholds where it has them."""
        from driftlab.activation import formats

        chosen = persona or (AXIS if self.axis is not None else None)
        if chosen is None and len(self.personas) == 1:
            chosen = next(iter(self.personas))
        if chosen not in self.personas:
            raise DriftlabError(f"{'No direction ' + repr(chosen) if chosen else 'Several directions'} in "
                                f"{self.path or 'memory'}: it holds {', '.join(sorted(self.personas))}.",
                                hint="Name one with --persona.")
        if cap_q is not None and fmt != "assistant-axis":
            raise DriftlabError(f"Only the Assistant Axis format has a capping config, not {fmt}.",
                                hint="Drop --cap-q, or export with --format assistant-axis.")
        p = self.personas[chosen]
        caps, label = None, None
        if cap_q is not None:
            band = list(p.band)
            caps = torch.full((self.n_layers,), float("nan"))
            if p.caps is not None:  # the thresholds it was imported with, under their experiment's name
                caps[band], label = p.thresholds(band), p.info.get("imported", {}).get("experiment")
            else:  # named the way the Assistant Axis names its experiments (layers_46:54-p0.25)
                caps[band] = p.quantile(cap_q)[band]
                label = f"layers_{band[0]}:{band[-1] + 1}-p{cap_q}" if band == list(range(band[0], band[-1] + 1)) \
                    else f"layers_{'+'.join(map(str, band))}-p{cap_q}"
        return formats.write(p.unit * p.norm[:, None], fmt, out, caps=caps, label=label or "driftlab")

    # -- disk ------------------------------------------------------------------------------------
    def save(self, out: str | Path) -> Path:
        """Write `directions.safetensors` and `directions.json` into the directory `out`."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        tensors, entries = {}, []
        for i, p in enumerate(self.personas.values()):
            tensors.update({f"p{i}.unit": p.unit.float().contiguous(), f"p{i}.norm": p.norm.float().contiguous(),
                            f"p{i}.with": p.with_proj.float().contiguous(),
                            f"p{i}.without": p.without_proj.float().contiguous(),
                            f"p{i}.auroc": p.auroc.float().contiguous()})
            if p.caps is not None:
                tensors[f"p{i}.caps"] = p.caps.float().contiguous()
            entries.append({"id": p.id, "system_prompt": p.system_prompt, "band": list(p.band), **p.info})
        save_file(tensors, str(out / TENSORS))
        (out / MANIFEST).write_text(json.dumps({**self.meta, "personas": entries}, indent=1) + "\n")
        return out / TENSORS

    @classmethod
    def load(cls, path: str | Path) -> Directions:
        """Directions from a directory (or its safetensors file) that `driftlab directions` wrote."""
        from safetensors.torch import load_file

        path = Path(path)
        folder = path if path.is_dir() else path.parent
        tensors_path, manifest_path = folder / TENSORS, folder / MANIFEST
        if not tensors_path.is_file() or not manifest_path.is_file():
            raise DriftlabError(f"No directions at {path}: {TENSORS} and {MANIFEST} are expected there.",
                                hint="Make them with: driftlab directions --model MODEL --out DIR")
        try:
            meta = json.loads(manifest_path.read_text())
            tensors = load_file(str(tensors_path))
            personas = [PersonaDirection(
                id=e["id"], system_prompt=e["system_prompt"], unit=tensors[f"p{i}.unit"], norm=tensors[f"p{i}.norm"],
                with_proj=tensors[f"p{i}.with"], without_proj=tensors[f"p{i}.without"], auroc=tensors[f"p{i}.auroc"],
                band=tuple(e["band"]), info={k: v for k, v in e.items() if k not in ("id", "system_prompt", "band")},
                caps=tensors.get(f"p{i}.caps"))
                for i, e in enumerate(meta.pop("personas"))]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DriftlabError(f"The directions at {folder} cannot be read ({type(err).__name__}: {err}).",
                                hint="Compute them again with driftlab directions.") from None
        digest = hashlib.sha256(tensors_path.read_bytes()).hexdigest()
        return cls(meta, personas, folder, digest)


# -- the arithmetic ------------------------------------------------------------------------------------
def difference_of_means(with_acts: torch.Tensor, without_acts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit [L, d], norm [L]) of mean(with) - mean(without), from [n, L, d] and [m, L, d]."""
    diff = with_acts.float().mean(0) - without_acts.float().mean(0)
    norm = diff.norm(dim=-1)
    return diff / norm.clamp_min(1e-12)[:, None], norm


def project(acts: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """[n, L] projections of activations [n, L, d] onto unit directions [L, d]."""
    return torch.einsum("nld,ld->nl", acts.float(), unit.float())


def choose_band(auroc: torch.Tensor, effect: torch.Tensor, width: int) -> tuple[int, ...]:
    """The `width` adjacent layers with the best held-out separation: highest mean AUROC, ties
    (AUROC saturates at 1 on few prompts) broken by the mean standardised difference `effect`."""
    L = auroc.shape[0]
    width = max(1, min(width, L))
    best = max(range(L - width + 1),
               key=lambda s: (round(float(auroc[s : s + width].mean()), 4), float(effect[s : s + width].mean())))
    return tuple(range(best, best + width))


def band_width(n_layers: int) -> int:
    """How many layers the default band spans: about a seventh of the model (4 of 28)."""
    return max(1, round(n_layers / 7))
