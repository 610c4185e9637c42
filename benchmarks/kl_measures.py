"""Drift in next-token distributions (`python benchmarks/run.py kl_measures`): what the two KLs cost.

Two comparisons, SmolLM2-135M in float32, greedy, every turn and probe exactly TOKENS long (EOS
ignored, so every variant reads and generates the same tokens), each run into a fresh directory from
an empty prefix cache:

* teacher-forced: `driftlab kl --from-run` against `driftlab project --from-run` on the same recorded
  self-chat (PAIRS pairs x ROUNDS rounds, probes every round). project reads each dialog once; kl
  reads each reply under three contexts. Target (issue): kl at most 2.5x project.
* live: the same self-chat plain, with `--kl`, and with CFG (`cfg:alpha=1.5`, which also runs a twin
  row: the yardstick). Target: `--kl` at most 1.6x plain.

Protocol: a warm-up run of each variant (untimed), then `repeats` rounds in which every variant of a
comparison runs once, the order rotating each round; per variant the best wall time is kept; ratios
are best against best, and per round (paired, back to back).

Sizes (PAIRS x ROUNDS x TOKENS, repeats): --quick 2x2x8 (1), default 8x4x32 (2), --full 16x8x48 (3).
The default size takes about 15 minutes on this project's 2-core CPU (docs/results/bench/kl-cpu.txt;
both targets missed). Why: per reply, kl reads the reply, the user turn and the reply again, and the
restated prompt, the user turn and the reply, about five reply lengths, where project reads the
dialog once and a plain self-chat generates the reply once. The record counts the positions each
teacher-forced variant computes (a forward hook): where a position costs about the same in both (a
CPU, where matrix products dominate a pass), kl's time follows that ratio, whatever the batching.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from common import Result, Table, selfchat_config, size_of

from driftlab.activation.directions import Directions, PersonaDirection
from driftlab.bench import load_personas
from driftlab.chat import BackendSpec, Sampling, make_backend
from driftlab.protocol.kl import KL, KLConfig
from driftlab.protocol.project import Project, ProjectConfig
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat

SIZES = {"quick": (2, 2, 8, 1), "default": (8, 4, 32, 2), "full": (16, 8, 48, 3)}
TARGETS = {"kl": 2.5, "live kl": 1.6}


def _directions(out: str, n_layers: int, d_model: int) -> str:
    """Random unit directions for every built-in persona (made-up statistics): what projecting costs
    does not depend on where a direction points."""
    gen = torch.Generator().manual_seed(0)
    found = [PersonaDirection(id=f"p{i}", system_prompt=p.system_prompt,
                              unit=torch.nn.functional.normalize(torch.randn(n_layers, d_model, generator=gen), dim=-1),
                              norm=torch.full((n_layers,), 4.0), with_proj=2.0 + torch.randn(16, n_layers, generator=gen),
                              without_proj=torch.randn(16, n_layers, generator=gen), auroc=torch.ones(3, n_layers),
                              band=tuple(range(n_layers // 3, n_layers // 3 + 4)))
             for i, p in enumerate(load_personas())]
    Directions({"model": "smollm2-135m", "n_layers": n_layers, "d_model": d_model}, found).save(out)
    return out


def _timed(make, backend) -> float:
    """Wall seconds of one run of `make(out)`'s protocol into a fresh directory, from an empty prefix cache."""
    backend.prefix_cache.clear()
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        run_protocol(make(out), out, progress=False)
        return time.perf_counter() - t


def _positions(make, backend) -> int:
    """Token positions the model computes in one run of `make(out)`'s protocol, from an empty prefix
    cache: the work a variant does, whatever the machine (kl's lower bound against project)."""
    fed: list[int] = []
    hook = backend.model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].numel()), with_kwargs=True)
    try:
        _timed(make, backend)
    finally:
        hook.remove()
    return sum(fed)


def _interleaved(variants: dict, repeats: int) -> dict[str, list[float]]:
    """Each variant once untimed, then `repeats` rounds of all, the order rotating each round."""
    for make, backend in variants.values():
        _timed(make, backend)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            times[name].append(_timed(*variants[name]))
    return times


def _rows(times: dict[str, list[float]], base: str) -> tuple[list[list[str]], dict[str, float]]:
    best = {name: min(ts) for name, ts in times.items()}
    rows, ratios = [], {}
    for name, ts in times.items():
        ratio = best[name] / best[base]
        target = TARGETS.get(name)
        ratios[name] = ratio
        paired = " ".join(f"{a / b:.2f}" for a, b in zip(ts, times[base], strict=True))
        rows.append([name, f"{best[name]:.1f}", " ".join(f"{t:.1f}" for t in ts), f"{ratio:.2f}", paired,
                     "" if target is None else f"<= {target:g}",
                     "" if target is None else ("yes" if ratio <= target else "no")])
    return rows, ratios


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    pairs, rounds, tokens, repeats = SIZES[size]
    columns = ["variant", "best s", "s per round", "x {}", "paired x", "target", "met"]
    with tempfile.TemporaryDirectory() as tmp:
        plain_spec = BackendSpec(model="smollm2-135m", dtype="float32")
        projecting = plain_spec.model_copy(update={"directions": _directions(str(Path(tmp) / "dirs"), 30, 576)})
        plain, with_dirs = make_backend(plain_spec), make_backend(projecting)
        sampling = Sampling(max_new_tokens=tokens, ignore_eos=True, greedy=True)
        chat = dict(pairs=pairs, rounds=rounds, sampling=sampling, batch_size=pairs, seed=1, backend=plain_spec)
        recorded = str(Path(tmp) / "recorded")
        run_protocol(SelfChat(selfchat_config(**chat), plain), recorded, progress=False)
        teacher = {
            "project": (lambda out: Project(ProjectConfig(backend=projecting, from_run=recorded), with_dirs), with_dirs),
            "kl": (lambda out: KL(KLConfig(backend=plain_spec, from_run=recorded), plain), plain),
        }
        live = {name: (lambda out, cfg=selfchat_config(**chat, **extra): SelfChat(cfg, plain), plain)
                for name, extra in (("plain", {}), ("live kl", {"kl": True}), ("cfg", {"steer": ["cfg:alpha=1.5"]}))}
        teacher_times, live_times = _interleaved(teacher, repeats), _interleaved(live, repeats)
        positions = {name: _positions(*variant) for name, variant in {**teacher, **live}.items() if name != "cfg"}
    threads = torch.get_num_threads()
    res = Result(title=f"driftlab kl against driftlab project on one recorded self-chat: SmolLM2-135M float32, "
                       f"{threads} torch thread(s), {pairs} pairs x {rounds} rounds x {tokens} tokens; best of "
                       f"{repeats} interleaved round(s) ({size} size)", columns=[c.format("project") for c in columns])
    res.rows, teacher_ratio = _rows(teacher_times, "project")
    live_rows, live_ratio = _rows(live_times, "plain")
    res.tables = [Table("live --kl and CFG against the plain self-chat (the same size, batch of all pairs)",
                        [c.format("plain") for c in columns], live_rows)]
    res.results = {"size": f"{pairs}x{rounds}x{tokens}", "threads": str(threads),
                   "kl_over_project": f"{teacher_ratio['kl']:.3f}",
                   "kl_target_met": str(teacher_ratio["kl"] <= TARGETS["kl"]).lower(),
                   "live_kl_over_plain": f"{live_ratio['live kl']:.3f}",
                   "live_kl_target_met": str(live_ratio["live kl"] <= TARGETS["live kl"]).lower(),
                   "cfg_over_plain": f"{live_ratio['cfg']:.3f}",
                   "project_positions": str(positions["project"]), "kl_positions": str(positions["kl"]),
                   "kl_positions_over_project": f"{positions['kl'] / positions['project']:.3f}",
                   "plain_positions": str(positions["plain"]), "live_kl_positions": str(positions["live kl"]),
                   "live_kl_positions_over_plain": f"{positions['live kl'] / positions['plain']:.3f}"}
    res.notes = [f"positions the model computes: project {positions['project']}, kl {positions['kl']} "
                 f"({positions['kl'] / positions['project']:.2f}x): kl's three contexts each read a turn anew.",
                 f"positions live: plain {positions['plain']}, live kl {positions['live kl']} "
                 f"({positions['live kl'] / positions['plain']:.2f}x): the reminded and prompt-free contexts read "
                 "each reply again; the dialog as it was comes from generation.",
                 "x = best time over the base variant's best (project; plain); paired x = the same, round by round.",
                 "every variant of a comparison reads or generates the same tokens (greedy, EOS ignored)."]
    return res
