"""Head sets for PASTA: pastalib's JSON head configs, profiles (rankings), and selection.

A head config is pastalib's format, `{"layer": [head, ...], ...}` (a bare list of layers
means every head of those layers), so configs move between pastalib and driftlab both
ways. A profile is what `driftlab pasta profile` writes: one task's score when steering each
single head, ranked best first. The PASTA paper (Sec. 3.2) builds the steered set from several
tasks' profiles: the intersection of their top-k (PASTA's default), their union, or one
task's own top-k ("task-specific", Sec. 5.3).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from driftlab.attention.config import Heads
from driftlab.errors import DriftlabError

SELECTIONS = ("intersection", "union", "task-specific")


class Profile(BaseModel):
    """One task's head profile: `scores` = [layer, head, score] ranked best first."""

    model_config = ConfigDict(extra="forbid")

    driftlab_profile: int = 1
    model: str
    task: str
    metric: str
    alpha: float
    n: int
    baseline: float | None = None  # the task metric with no steering, for comparison
    scores: list[tuple[int, int, float]]

    def top(self, k: int) -> list[tuple[int, int]]:
        return [(layer, head) for layer, head, _ in self.scores[:k]]


@dataclass(frozen=True)
class HeadSources:
    """Where `pasta:heads=` may take its head sets from.

    `named`: head sets registered under a name (a head config's heads, or a profile to take a
    top-k from), e.g. by `driftlab serve --heads json=heads.json`. `files`: whether a spec may
    name a file itself; False for specs that arrive in requests, which must never make a
    server open a path it chose.
    """

    named: Mapping[str, Heads | Profile] = field(default_factory=dict)
    files: bool = True

    def resolve(self, value: str, topk: int | None) -> Heads | None:
        """The heads `value` names (a registered name, or a file where files are allowed); None
        when it names neither, so it is read as a head selection ('3.1+5.2')."""
        name = value.strip()
        if name in self.named:
            return _heads_of(self.named[name], topk, f"head set '{name}'")
        if not _looks_like_a_file(name):
            return None
        if not self.files:
            known = ", ".join(sorted(self.named)) or "none registered"
            raise DriftlabError(f"heads={name}: a request cannot name a file.",
                                hint=f"Use a head set this server registered ({known}), or give heads inline, "
                                     "e.g. heads=3.1+5.2.")
        return load_heads(name, topk)


def _looks_like_a_file(value: str) -> bool:
    return value.lower().endswith(".json") or "/" in value or "\\" in value


def load_head_source(path: str | Path) -> Heads | Profile:
    """A file's head set as registered: a head config's heads, or a whole profile (top-k chosen later)."""
    data = _read_json(path)
    if isinstance(data, dict) and "driftlab_profile" in data:
        return _profile(data, path)
    return _from_pastalib(data, path)


def _heads_of(source: Heads | Profile, topk: int | None, what: str) -> Heads:
    """A registered head set's heads; `topk` picks them from a profile (and only from one)."""
    if isinstance(source, Profile):
        if topk is None:
            raise DriftlabError(f"{what} is a head profile (a ranking of {len(source.scores)} heads); "
                                "say how many to steer.", hint="Add topk=K, e.g. heads=NAME,topk=20.")
        return tuple(source.top(topk))
    if topk is not None:
        raise DriftlabError(f"topk is for head profiles, but {what} is a head config.", hint="Drop topk=.")
    return source


def load_heads(path: str | Path, topk: int | None = None) -> Heads:
    """Heads from a file: a pastalib head config, or a driftlab profile's top `topk`."""
    return _heads_of(load_head_source(path), topk, str(path))


def load_profile(path: str | Path) -> Profile:
    data = _read_json(path)
    if not (isinstance(data, dict) and "driftlab_profile" in data):
        raise DriftlabError(f"{path} is not a head profile (a ranking of heads); it looks like a head config.",
                            hint="Give the profile.json that `driftlab pasta profile` writes; a head config is "
                                 "used as it is, with --heads.")
    return _profile(data, path)


def save_heads(heads: Sequence[tuple[int, int]], path: str | Path) -> Path:
    """Write pastalib's format: {"layer": [heads...]}, layers and heads sorted."""
    config: dict[str, list[int]] = {}
    for layer, head in sorted(set(heads)):
        config.setdefault(str(layer), []).append(head)
    path = Path(path)
    try:
        path.write_text(json.dumps(config, indent=1) + "\n")
    except OSError as err:
        raise DriftlabError(f"Cannot write the head config {path}: {err.strerror or err}.",
                            hint="Give --out a file path in a directory you can write to.") from None
    return path


def select(profiles: Sequence[Profile], how: str, topk: int) -> list[tuple[int, int]]:
    """The PASTA paper's head selection over several tasks' profiles (sorted (layer, head) pairs).

    intersection = heads in every task's top-k (PASTA's default); union = in any task's
    top-k; task-specific = the top-k of the one profile given.
    """
    check_selection(how)
    if not profiles:
        raise DriftlabError("No head profiles given.", hint="Pass the profile.json files of `driftlab pasta profile`.")
    if topk < 1:
        raise DriftlabError(f"topk must be at least 1, got {topk}.")
    models = {p.model for p in profiles}
    if len(models) > 1:
        raise DriftlabError(f"The profiles come from different models ({', '.join(sorted(models))}).",
                            hint="Select heads from profiles of one model.")
    if how == "task-specific":
        if len(profiles) != 1:
            raise DriftlabError(f"task-specific selection takes one profile, got {len(profiles)}.",
                                hint="Pass the profile of the task you will evaluate.")
        return sorted(profiles[0].top(topk))
    sets = [set(p.top(topk)) for p in profiles]
    chosen = set.intersection(*sets) if how == "intersection" else set.union(*sets)
    return sorted(chosen)


def check_selection(how: str) -> None:
    if how not in SELECTIONS:
        raise DriftlabError(f"Unknown head selection '{how}'.", hint=f"Use one of {', '.join(SELECTIONS)}.")


def _read_json(path: str | Path):
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise DriftlabError(f"Head file {path} {what}.", hint="Give the path of a head config or profile JSON.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DriftlabError(f"Head file {path} is not valid JSON ({err}).",
                            hint='A head config looks like {"12": [3, 7], "14": [0]}.') from None


def _from_pastalib(data, path) -> Heads:
    hint = 'pastalib\'s format maps layer -> list of heads, e.g. {"12": [3, 7], "14": [0]}, or lists layers: [12, 14].'
    out: list[tuple[int, int | None]] = []
    if isinstance(data, list):
        for layer in data:
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise DriftlabError(f"Head file {path}: layer {layer!r} is not a non-negative integer.", hint=hint)
            out.append((layer, None))
    elif isinstance(data, dict):
        for key, heads in data.items():
            try:
                layer = int(key)
            except (TypeError, ValueError):
                raise DriftlabError(f"Head file {path}: key {key!r} is not a layer number.", hint=hint) from None
            if layer < 0 or not isinstance(heads, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads
            ):
                raise DriftlabError(
                    f"Head file {path}: layer {key} must map to a list of non-negative head numbers, got {heads!r}.",
                    hint=hint)
            out.extend((layer, h) for h in heads)
    else:
        raise DriftlabError(f"Head file {path} holds a {type(data).__name__}, not a head config.", hint=hint)
    if not out:
        raise DriftlabError(f"Head file {path} selects no heads.", hint=hint)
    return tuple(sorted(set(out), key=lambda x: (x[0], -1 if x[1] is None else x[1])))


def _profile(data, path) -> Profile:
    try:
        profile = Profile.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise DriftlabError(f"Head profile {path}: {where}: {e['msg']}.",
                            hint="Profiles are written by `driftlab pasta profile`.") from None
    if not profile.scores:
        raise DriftlabError(f"Head profile {path} ranks no heads.", hint="Re-run `driftlab pasta profile`.")
    return profile
