"""Directions in other tools' files, read into driftlab's layer convention and written back out.

driftlab's layer l is the output of decoder layer l (`model.layers[l]`), and a direction there is the
raw difference of means (unit vector times its norm, `activation.directions`). Each tool stores it its
own way (docs/activation.md has the sources):

* `assistant-axis` (Lu et al. 2026): `assistant_axis.pt`, a tensor [L, d] (or `{"axis": T, ...}`, as
  its `save_axis` writes), row l = layer l, pointing from the mean role towards the default assistant.
  Its `capping_config.pt` holds per-layer vectors that point the other way (towards role-play) and,
  per experiment, thresholds c with `h -= relu(<h, v/|v|> - c) v/|v|`. Along the axis that is a
  floor, `<h, a/|a|> >= -c`: driftlab's cap from below, at tau = -c.
* `persona-vectors` (Chen et al. 2025): `{trait}_response_avg_diff.pt`, a float32 tensor [L + 1, d]
  indexed like transformers' `hidden_states`: row 0 is the embeddings, row l + 1 is layer l (its last
  row is read after the final norm, so driftlab's last layer differs there).
* `steering-vectors` (the library): `{"layer_activations": {l: [d]}, "layer_type": "decoder_block"}`,
  the bare `{l: [d]}` dict, or a pickled `SteeringVector`; key l = layer l, any subset of layers.

A file carries no projections of replies, so an imported direction is calibrated on the model's own
replies before use (`driftlab directions --from-file`): that gives the normalisation of a recorded
projection, the quantiles of `cap:q`, and a held-out AUROC that shows the layers line up.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from driftlab.activation.config import FORMATS, Format
from driftlab.errors import DriftlabError

ALIGNED = 0.999  # least cosine between a capping vector and minus the axis at its layer
HINT = "docs/activation.md#directions-from-other-tools says what each format holds."


@dataclass(frozen=True)
class Imported:
    """A direction from a file: `vectors` [L, d] float32, the raw difference per layer (zeros at
    layers the file leaves out); `layers` the layers it gives; `caps` [L] thresholds from below in
    driftlab's frame (NaN where none) and `cap_layers` the experiment's layers, from a capping config;
    `source` what it was read from (recorded in directions.json)."""

    vectors: torch.Tensor
    layers: tuple[int, ...]
    caps: torch.Tensor | None
    cap_layers: tuple[int, ...]
    source: dict[str, Any]

    def fit(self, model: str, n_layers: int, d_model: int) -> Imported:
        """This direction on a model of `n_layers` x `d_model`: a one-line error where the file is
        for another shape; a partial file (steering-vectors) padded with zeros."""
        L, d = self.vectors.shape
        partial = self.source["format"] == "steering-vectors"
        if d != d_model or L > n_layers or (L < n_layers and not partial):
            rows = f"{L + 1} rows ({L} layers after the embeddings')" if self.source["format"] == "persona-vectors" \
                else f"{L} layers"
            raise DriftlabError(f"{self.source['file']} holds {rows} x {d}, and {model} has {n_layers} layers x "
                                f"{d_model}: it was made for another model.", hint=HINT)
        if L == n_layers:
            return self
        pad = torch.zeros(n_layers - L, d)
        caps = None if self.caps is None else torch.cat([self.caps, torch.full((n_layers - L,), float("nan"))])
        return Imported(torch.cat([self.vectors, pad]), self.layers, caps, self.cap_layers, self.source)

    def unit_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(unit [L, d], norm [L]): the form `PersonaDirection` stores (zero rows stay zero)."""
        norm = self.vectors.norm(dim=-1)
        return self.vectors / norm.clamp_min(1e-12)[:, None], norm

    # -- a run directory's copy (a resumed run reads it, whatever became of the file) -------------
    def save(self, path: Path) -> None:
        import json

        from safetensors.torch import save_file

        tensors = {"vectors": self.vectors.contiguous()}
        if self.caps is not None:
            tensors["caps"] = self.caps.contiguous()
        meta = {"layers": json.dumps(list(self.layers)), "cap_layers": json.dumps(list(self.cap_layers)),
                "source": json.dumps(self.source)}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path) -> Imported:
        import json

        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        return cls(tensors["vectors"], tuple(json.loads(meta["layers"])), tensors.get("caps"),
                   tuple(json.loads(meta["cap_layers"])), json.loads(meta["source"]))


# -- reading ----------------------------------------------------------------------------------------
def read(path: str | Path, fmt: Format, *, capping: str | Path | None = None,
         experiment: str | None = None) -> Imported:
    """The direction in `path`, written in `fmt`, with a capping config's thresholds (assistant-axis
    only): every problem is a one-line error, before any model loads."""
    path = Path(path)
    if fmt not in FORMATS:
        raise DriftlabError(f"Unknown directions format {fmt!r}.", hint=f"Known: {', '.join(FORMATS)}.")
    if capping is not None and fmt != "assistant-axis":
        raise DriftlabError(f"A capping config comes with an Assistant Axis file, not with {fmt}.",
                            hint="Drop --capping, or import the axis with --format assistant-axis.")
    data = _load(path)
    source: dict[str, Any] = {"format": fmt, "file": str(path), "sha256": file_sha256(path)}
    if fmt == "assistant-axis":
        vectors = _tensor(data.get("axis") if isinstance(data, dict) else data, path, "a tensor [layers, d] "
                          "or {'axis': tensor}")
        layers = tuple(range(len(vectors)))
    elif fmt == "persona-vectors":
        rows = _tensor(data, path, "a tensor [layers + 1, d]")
        if len(rows) < 2:
            raise DriftlabError(f"{path} has {len(rows)} row: persona vectors have the embeddings' and one per layer.",
                                hint=HINT)
        vectors, layers = rows[1:], tuple(range(len(rows) - 1))
    else:
        vectors, layers = _layer_dict(data, path)
    caps, cap_layers = None, ()
    if capping is not None:
        caps, cap_layers, chosen = _capping(Path(capping), experiment, vectors)
        source.update(capping=str(capping), capping_sha256=file_sha256(capping), experiment=chosen)
    return Imported(vectors.float(), layers, caps, cap_layers, source)


def _load(path: Path) -> Any:
    """A torch file's contents, plain tensors and containers first (`weights_only`); a pickled
    SteeringVector needs its class, which is allowed when the steering-vectors package is there."""
    if not path.is_file():
        raise DriftlabError(f"No file at {path}.", hint="Give the .pt file the tool wrote.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (torch raises several kinds for a foreign pickle)
        try:
            from steering_vectors import SteeringVector
        except ImportError:
            raise DriftlabError(f"{path} cannot be read as tensors ({type(err).__name__}: {str(err)[:120]}).",
                                hint="A pickled SteeringVector needs the steering-vectors package; or save its "
                                     "layer_activations dict instead.") from None
        with torch.serialization.safe_globals([SteeringVector]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
        return {"layer_activations": obj.layer_activations, "layer_type": obj.layer_type}


def _tensor(value: Any, path: Path, expected: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.ndim != 2 or not value.is_floating_point():
        got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise DriftlabError(f"{path} holds {got}, not {expected}.", hint=HINT)
    if not torch.isfinite(value).all():
        raise DriftlabError(f"{path} holds NaN or infinite values.", hint=HINT)
    return value


def _layer_dict(data: Any, path: Path) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A steering-vectors file as [max layer + 1, d] (zeros at the layers it leaves out)."""
    if hasattr(data, "layer_activations"):  # a SteeringVector loaded another way
        data = {"layer_activations": data.layer_activations, "layer_type": data.layer_type}
    if isinstance(data, dict) and "layer_activations" in data:
        if data.get("layer_type", "decoder_block") != "decoder_block":
            raise DriftlabError(f"{path} steers {data['layer_type']} outputs; driftlab steers decoder layer outputs "
                                "(layer_type decoder_block).", hint=HINT)
        data = data["layer_activations"]
    if not isinstance(data, dict) or not data:
        raise DriftlabError(f"{path} holds {type(data).__name__}, not steering vectors ({{layer: tensor}}).", hint=HINT)
    try:
        acts = {int(k): v for k, v in data.items()}
    except (TypeError, ValueError):
        raise DriftlabError(f"{path}: steering vectors are keyed by layer number.", hint=HINT) from None
    if min(acts) < 0 or any(not isinstance(v, torch.Tensor) or v.ndim != 1 for v in acts.values()) \
            or len({v.shape[0] for v in acts.values()}) != 1:
        raise DriftlabError(f"{path}: each layer needs one vector [d] of the same d, at a layer >= 0.", hint=HINT)
    d = next(iter(acts.values())).shape[0]
    vectors = torch.zeros(max(acts) + 1, d)
    for layer, v in acts.items():
        vectors[layer] = v.float()
    return vectors, tuple(sorted(acts))


def _capping(path: Path, experiment: str | None, axis: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], str]:
    """One capping experiment's thresholds as floors along the axis: ([L] tau, NaN elsewhere; its
    layers; its id). Its vectors must point along minus the axis, or the thresholds mean nothing here."""
    config = _load(path)
    if not isinstance(config, dict) or "vectors" not in config or "experiments" not in config:
        raise DriftlabError(f"{path} is not a capping config ({{'vectors': ..., 'experiments': ...}}).", hint=HINT)
    ids = [e.get("id", str(i)) for i, e in enumerate(config["experiments"])]
    if experiment is None and len(ids) != 1:
        raise DriftlabError(f"{path} holds {len(ids)} capping experiments; name one with --experiment.",
                            hint=f"For example: --experiment {_example(ids)}")
    chosen = experiment if experiment is not None else ids[0]
    if chosen not in ids:
        raise DriftlabError(f"No capping experiment {chosen!r} in {path}.", hint=f"Ids look like {_example(ids)}.")
    caps = torch.full((len(axis),), float("nan"))
    for intervention in config["experiments"][ids.index(chosen)]["interventions"]:
        if "cap" not in intervention:
            continue  # the upstream steerer skips these too
        entry = config["vectors"][intervention["vector"]]
        layer, vector = int(entry["layer"]), entry["vector"].float()
        if not 0 <= layer < len(axis):
            raise DriftlabError(f"{path} caps layer {layer}, outside the axis's {len(axis)} layers.", hint=HINT)
        cos = float(torch.nn.functional.cosine_similarity(-vector, axis[layer].float(), dim=0))
        if cos < ALIGNED:
            raise DriftlabError(f"{path}'s vector at layer {layer} is not minus the axis there (cosine {cos:+.3f}): "
                                "its thresholds would not mean a floor along the axis.", hint=HINT)
        caps[layer] = -float(intervention["cap"])
    layers = tuple(int(i) for i in torch.nonzero(~caps.isnan()).flatten())
    if not layers:
        raise DriftlabError(f"Capping experiment {chosen!r} in {path} caps no layer.", hint=HINT)
    return caps, layers, chosen


def _example(ids: list[str]) -> str:
    return next((i for i in ids if re.fullmatch(r"layers_\d+:\d+-p0\.25", i)), ids[0] if ids else "0")


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (what directions.json and a run's inputs record of an imported file)."""
    path = Path(path)
    if not path.is_file():
        raise DriftlabError(f"No file at {path}.", hint="Give the .pt file the tool wrote.")
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- writing ----------------------------------------------------------------------------------------
def write(vectors: torch.Tensor, fmt: Format, out: str | Path, *, caps: torch.Tensor | None = None,
          label: str = "driftlab") -> list[Path]:
    """Write the raw per-layer directions `vectors` [L, d] in `fmt` at `out` (a file; for
    assistant-axis with `caps` [L] (NaN where none) also `capping_config.pt` beside it, one
    experiment named `label`). Returns the files written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    vectors = vectors.float().contiguous()
    if fmt == "assistant-axis":
        torch.save(vectors.clone(), out)
        if caps is None:
            return [out]
        key = "layer_{}/driftlab".format
        config = {"vectors": {key(layer): {"vector": (-vectors[layer]).clone(), "layer": layer}
                              for layer in range(len(vectors))},
                  "experiments": [{"id": label, "interventions": [
                      {"vector": key(layer), "cap": -float(caps[layer])} for layer in range(len(vectors))
                      if not caps[layer].isnan()]}]}
        torch.save(config, out.parent / "capping_config.pt")
        return [out, out.parent / "capping_config.pt"]
    if fmt == "persona-vectors":  # row 0, the embeddings', is not a decoder layer's: zeros
        torch.save(torch.cat([torch.zeros(1, vectors.shape[1]), vectors]), out)
    elif fmt == "steering-vectors":
        torch.save({"layer_activations": {layer: vectors[layer].clone() for layer in range(len(vectors))
                                          if vectors[layer].any()}, "layer_type": "decoder_block"}, out)
    else:
        raise DriftlabError(f"Unknown directions format {fmt!r}.", hint=f"Known: {', '.join(FORMATS)}.")
    return [out]
