"""User-persona probes p_A: does the agent adopt the simulated user's system prompt s_A?

Both drift papers (the persona-drift paper and its revision, the instruction-stability paper;
README, "Papers") measure it the same way (section 3.3): "we swap a_i with p_A and check
f_A(b'_i | a_i = p_A)", i.e. the agent is asked p_A at round i and its reply is scored by the
user persona's measure f_A. They differ in what p_A is (`user_probe`'s `version`; ``"000"`` and
``"001"``, the names earlier driftlab versions gave them, are accepted: `PROBE_VERSION_ALIASES`):

* ``"own"``: p_A is the persona's own probe (the persona-drift paper, section 3.3 with Table 2 /
  Appendix E, where every system prompt comes with one probe question). `user_probe` returns the
  persona as is.
* ``"crafted-or-generic"``: the instruction-stability paper, section 3.2: "For system prompts like
  s_A in Table 1, specific probe questions are crafted to guide the model to break the instruction;
  for the rest, neutral ones like s_B, a generic probe question is sampled randomly from a set of
  them." That paper prints exactly one crafted probe (Table 1: p_A "Describe the most
  disappointing experience you had." for s_A "You are very happy! Always respond with lots of
  joy.", scored by f_A = VADER ``polarity_scores(text)[sentiment]``, the persona's own measure)
  and one member of the generic set (Table 1's p_B "What do you do in London as a tourist?"); the
  set itself is not published. The rule followed here, with that data
  (``data/user_probes_001.json``):

  1. a persona with a crafted probe in the paper gets it (only ``very-happy``);
  2. a persona whose own probe is a generic one (the London question, 58 of the 100) gets a
     generic probe drawn from the set, reproducibly from (seed, persona id); with the paper's
     one-question set that is the London question again. Pass ``generic=[...]`` to draw from a
     larger set of your own; personas whose system prompt or measure depends on the exact London
     question (``probe_bound``, driftlab's list, not the paper's) keep it;
  3. every other persona keeps its own probe: it already is a question crafted for its prompt.

The measure f_A is never changed. The paper states its rule for every system prompt of the
benchmark (p_B as well); this module offers it for the user side, where its Table 1 shows it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator

from driftlab.bench.personas import Persona, load_personas
from driftlab.errors import DriftlabError

ProbeVersionName = Literal["own", "crafted-or-generic"]
#: The versions `user_probe` accepts: "own" follows the persona-drift paper (section 3.3),
#: "crafted-or-generic" the instruction-stability paper (sections 3.2 and 3.3).
USER_PROBE_VERSIONS: tuple[str, ...] = get_args(ProbeVersionName)
#: The names earlier driftlab versions gave the versions (and recorded in run manifests): accepted
#: everywhere a version is, and read as today's name (a run recorded with "000" resumes as "own").
PROBE_VERSION_ALIASES: Mapping[str, str] = MappingProxyType({"000": "own", "001": "crafted-or-generic"})


def probe_version(version: Any) -> Any:
    """Today's name of a user-probe version ("000" -> "own"); any other value as given."""
    return PROBE_VERSION_ALIASES.get(version, version) if isinstance(version, str) else version


#: A config field's type: one of `USER_PROBE_VERSIONS`, an old name read as today's.
ProbeVersion = Annotated[ProbeVersionName, BeforeValidator(probe_version)]


@dataclass(frozen=True)
class UserProbeData:
    """What the instruction-stability paper publishes on p_A (``data/user_probes_001.json``), plus
    driftlab's `probe_bound`."""

    crafted: Mapping[str, str]  # persona id -> crafted p_A (the paper's Table 1)
    crafted_prompts: Mapping[str, str]  # persona id -> the s_A that p_A was crafted for
    generic: tuple[str, ...]  # the paper's generic probes (Table 1's p_B: the only one shown)
    probe_bound: frozenset[str]  # ids whose generic probe must stay the London question (driftlab)


@functools.cache
def user_probe_data() -> UserProbeData:
    """The instruction-stability paper's probe data, checked against the built-in personas."""
    raw = json.loads((resources.files("driftlab.bench") / "data" / "user_probes_001.json").read_text("utf-8"))
    data = UserProbeData(
        crafted=MappingProxyType({k: v["probe"] for k, v in raw["crafted"].items()}),
        crafted_prompts=MappingProxyType({k: v["system_prompt"] for k, v in raw["crafted"].items()}),
        generic=tuple(raw["generic"]["probes"]),
        probe_bound=frozenset(raw["probe_bound"]["ids"]),
    )
    builtin = {p.id: p.system_prompt for p in load_personas()}
    stale = [pid for pid, prompt in data.crafted_prompts.items() if builtin.get(pid) != prompt]
    stale += sorted(data.probe_bound - builtin.keys())
    if stale or not data.generic:
        raise RuntimeError(f"user_probes_001.json does not match the built-in personas: {stale or 'no generic'}")
    return data


def user_probe(
    persona: Persona, version: str = "crafted-or-generic", *, generic: Sequence[str] | None = None,
    seed: int = 0,
) -> Persona:
    """`persona` as the simulated user's s_A is probed: ``.probe`` is p_A, ``.score`` is f_A.

    `version` "own" returns `persona` unchanged; "crafted-or-generic" applies the
    instruction-stability paper's rule (module docstring); "000" and "001" are their old names.
    `generic` replaces the paper's generic probe set ("crafted-or-generic" only); `seed` picks from it.
    """
    version = probe_version(version)
    if version not in USER_PROBE_VERSIONS:
        raise DriftlabError(f"unknown user-probe version {version!r}",
                            hint=f"use one of: {', '.join(USER_PROBE_VERSIONS)}")
    if version == "own":
        if generic is not None:
            raise DriftlabError(
                "a generic probe set applies to version 'crafted-or-generic' only",
                hint="version 'own' asks each persona its own probe, as the persona-drift paper does")
        return persona
    data = user_probe_data()
    pool = tuple(data.generic if generic is None else generic)
    if not pool or not all(isinstance(q, str) and q.strip() for q in pool):
        raise DriftlabError("the generic probe set must be non-empty questions", hint="e.g. generic=['How are you?']")
    if data.crafted_prompts.get(persona.id) == persona.system_prompt:
        probe = data.crafted[persona.id]
    elif persona.probe in data.generic + pool and persona.id not in data.probe_bound:
        digest = hashlib.sha256(f"{seed}\0{persona.id}".encode()).digest()
        probe = pool[int.from_bytes(digest[:8], "big") % len(pool)]
    else:
        probe = persona.probe
    return persona if probe == persona.probe else persona.model_copy(update={"probe": probe})


def user_probes(
    version: str = "crafted-or-generic", *, generic: Sequence[str] | None = None, seed: int = 0
) -> dict[str, str]:
    """p_A for each of the 100 built-in personas, by id (see `user_probe`)."""
    return {p.id: user_probe(p, version, generic=generic, seed=seed).probe for p in load_personas()}
