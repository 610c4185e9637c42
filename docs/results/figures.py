"""The figures docs/results/README.md quotes, computed from the committed records.

Every number of the generated blocks of docs/results/README.md (between `<!-- figures:NAME -->`
and `<!-- /figures:NAME -->`) is computed here from the run directories committed beside it,
with the statistics the reports use (`driftlab.report.metrics`, `driftlab.report.sweep`,
`driftlab.stats`). The prose around a block quotes it; the README's opening paragraph names
the tables that are still typed by hand.

    python docs/results/figures.py          # rewrite the blocks in place
    python docs/results/figures.py --check  # exit 1 and name the blocks that differ

tests/test_results_figures.py runs the check, so a README whose tables disagree with their
records fails the suite.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"


def _p(p: float) -> str:
    """p-values as the write-up prints them: 2 significant digits, scientific below 0.001."""
    if not np.isfinite(p):
        return ""
    return f"{p:.0e}".replace("e-0", "e-") if p < 1e-3 else f"{p:.2g}"


def _ci(low: float, high: float, digits: int = 2, sign: bool = False) -> str:
    f = f"{{:+.{digits}f}}" if sign else f"{{:.{digits}f}}"
    return f"[{f.format(low)}, {f.format(high)}]"


# -- qwen-paper-20 --------------------------------------------------------------------------
def qwen_paper_rounds() -> str:
    from driftlab.report.metrics import summarize_run

    s = summarize_run(HERE / "qwen-paper-20")
    rows = [("agent stability (f_B), with a user persona", "persona", "agent"),
            ("agent stability, empty-user ablation", "empty-user", "agent"),
            ("user-persona adoption (f_A)", "persona", "user")]
    per, ov = s.per_round, s.overall
    rounds = sorted(per["round"].unique())
    lines = ["| round | " + " | ".join(map(str, rounds)) + " | overall [95% t-interval] |",
             "|---|" + "---|" * len(rounds) + "---|"]
    for label, cond, target in rows:
        cells = per[(per.condition == cond) & (per.target == target) & (per.category == "all")].set_index("round")
        o = ov[(ov.condition == cond) & (ov.target == target) & (ov.category == "all")].iloc[0]
        lines.append(f"| {label} | " + " | ".join(f"{cells.loc[r, 'mean']:.2f}" for r in rounds)
                     + f" | {o['mean']:.2f} {_ci(o.ci_low, o.ci_high)} (n = {int(o.n)}) |")
    cut = s.cut
    lines += ["", "| condition | turns cut at 400 tokens | agent probes cut |", "|---|---|---|"]
    for r in cut.itertuples():
        lines.append(f"| {r.condition} | {round(r.turns_cut * r.turns)} of {r.turns} | "
                     f"{round(r.probes_cut * r.probes)} of {r.probes} |")
    return "\n".join(lines)


def qwen_paper_tests() -> str:
    from driftlab.report.metrics import summarize_run

    s = summarize_run(HERE / "qwen-paper-20")
    lines = ["| comparison (n = 20 conversations) | difference [95% t-interval] | higher / lower / tied | p (Holm) |",
             "|---|---|---|---|"]
    names = {("agent", "persona"): "drift, agent", ("agent", "empty-user"): "drift, agent, empty-user ablation",
             ("user", "persona"): "drift, user-persona adoption"}
    for r in s.drift.itertuples():
        lines.append(f"| {names[(r.target, r.condition)]}: round {r.last} - round {r.first} | {r.diff:+.2f} "
                     f"{_ci(r.diff_ci_low, r.diff_ci_high, sign=True)} | {r.better} / {r.worse} / {r.tied} | "
                     f"{_p(r.p)} ({_p(r.p_holm)}) |")
    for r in s.comparisons[s.comparisons.target == "agent"].itertuples():
        lines.append(f"| ablation - with persona, overall stability | {r.diff:+.2f} "
                     f"{_ci(r.diff_ci_low, r.diff_ci_high, sign=True)} | {r.better} / {r.worse} / {r.tied} | "
                     f"{_p(r.p)} |")
    return "\n".join(lines)


# -- decay runs ------------------------------------------------------------------------------
def _per_dialog(npz: Path) -> dict[int, dict[int, float]]:
    """round -> dialog -> mean pi over the agent's tokens of that round, all layers and heads."""
    from driftlab.protocol.decay import DecayTrace

    trace = DecayTrace.load(npz)
    rounds, dialogs = sorted(set(trace.round.tolist())), sorted(set(trace.dialog.tolist()))
    return {r: {d: float(trace.pi[(trace.round == r) & (trace.dialog == d)].mean()) for d in dialogs} for r in rounds}


def decay_rounds() -> str:
    from driftlab.protocol.decay import DecayTrace
    from driftlab.stats import paired_test

    trace = DecayTrace.load(HERE / "decay-qwen-20" / "decay.npz")
    per = _per_dialog(HERE / "decay-qwen-20" / "decay.npz")
    rounds = sorted(per)
    means = [np.mean(list(per[r].values())) for r in rounds]
    lines = ["| round | " + " | ".join(map(str, rounds)) + " |", "|---|" + "---|" * len(rounds),
             "| mean pi | " + " | ".join(f"{m:.3f}" for m in means) + " |", "",
             "| comparison (n = 20 dialogs, exact Wilcoxon signed-rank) | mean difference | lower / higher | p |",
             "|---|---|---|---|"]
    first, second, last = rounds[0], rounds[1], rounds[-1]
    for a, b in ((last, first), (second, first), (last, second)):
        t = paired_test(per[a], per[b], method="wilcoxon")
        lines.append(f"| round {a} - round {b} | {t.diff.estimate:+.3f} | {t.worse} / {t.better} | {_p(t.p)} |")
    layer, head = trace.steepest_head()
    peaks = {r: float(trace.pi[trace.round == r, layer, head].max()) for r in (first, last)}
    lines += ["", f"Steepest head: layer {layer}, head {head}; its highest pi on one token is "
                  f"{peaks[first]:.3f} in round {first} and {peaks[last]:.3f} in round {last}."]
    return "\n".join(lines)


def decay_four_dialogs() -> str:
    """The 4 dialogs of qwen-paper/: content and prefix spans, and the base model beside them."""
    from driftlab.stats import paired_test

    runs = [("qwen2.5-coder-1.5b (chat), `content` (default)", HERE / "decay-qwen-content" / "decay.npz"),
            ("qwen2.5-coder-1.5b (chat), `prefix`", HERE / "decay-qwen-prefix" / "decay.npz"),
            ("gemma3-270m (base), `content`", HERE / "decay-qwen-content" / "decay_gemma3-270m.npz")]
    lines = []
    for i, (label, npz) in enumerate(runs):
        per = _per_dialog(npz)
        rounds = sorted(per)
        if not i:
            lines += ["| model, system span | " + " | ".join(map(str, rounds)) + " | round 8 lower than round 1 |",
                      "|---|" + "---|" * (len(rounds) + 1)]
        t = paired_test(per[rounds[-1]], per[rounds[0]], method="wilcoxon")
        lines.append(f"| {label} | " + " | ".join(f"{np.mean(list(per[r].values())):.3f}" for r in rounds)
                     + f" | {t.worse} of {t.n}, exact Wilcoxon p = {_p(t.p)} |")
    return "\n".join(lines)


# -- sweep-ref-20 ---------------------------------------------------------------------------
LABELS = {"plain": "plain", "split-softmax:k=0.8,heads=all": "split-softmax k=0.8",
          "split-softmax:k=0.3,heads=all": "split-softmax k=0.3", "split-softmax:k=0.1,heads=all": "split-softmax k=0.1",
          "spr:p=0.5,seed=0": "SPR p=0.5", "spr:p=1.0,seed=0": "SPR p=1", "instaboost:m=3.0": "InstABoost m=3",
          "instaboost:m=10.0": "InstABoost m=10", "instaboost:m=100.0": "InstABoost m=100",
          "cfg:alpha=1.5": "CFG alpha=1.5", "cfg:alpha=3.0": "CFG alpha=3",
          "pi-floor:f=0.8": "pi-floor f=0.8", "cap:q=0.25,layers=band": "cap q=0.25",
          "vector:alpha=0.5,layers=band": "vector alpha=0.5"}


def _bold(text: str, p: float) -> str:
    return f"**{text}**" if np.isfinite(p) and p < 0.05 else text


@functools.cache
def _sweep(name: str) -> pd.DataFrame:
    """The sweep's table recomputed from its points' records (never the committed sweep.csv, which
    could be stale: tests/test_results_figures.py checks that file against the records too)."""
    from driftlab.report.sweep import sweep_table

    return sweep_table(HERE / name, write=False)


def sweep_stability(name: str = "sweep-ref-20") -> str:
    t = _sweep(name)
    lines = ["| point | stability [95% t] | gain over plain [95% t]: better / worse / tied, p (Holm) | cut turns / probes "
             "| without cut probes: stability, gain, p (Holm) |", "|---|---|---|---|---|"]
    for r in t.itertuples():
        gain = uncut = ""
        if r.method != "plain":
            gain = (f"{_bold(f'{r.stability_gain:+.2f}', r.gain_p_holm)} "
                    f"{_ci(r.stability_gain_ci_low, r.stability_gain_ci_high, sign=True)}: {r.gain_better} / "
                    f"{r.gain_worse} / {r.gain_tied}, p = {_p(r.gain_p)} ({_bold(_p(r.gain_p_holm), r.gain_p_holm)})")
            uncut = f", {_bold(f'{r.gain_uncut:+.2f}', r.gain_uncut_p_holm)}, p = {_p(r.gain_uncut_p)} " \
                    f"({_bold(_p(r.gain_uncut_p_holm), r.gain_uncut_p_holm)})"
        flag = " (flagged)" if r.cut_flag else ""
        lines.append(f"| {LABELS[r.spec]} | {r.stability:.2f} {_ci(r.stability_ci_low, r.stability_ci_high)} | "
                     f"{gain} | {r.turns_cut:.0%} / {r.probes_cut:.0%}{flag} | {r.stability_uncut:.2f}{uncut} |")
    return "\n".join(lines)


def sweep_mmlu(name: str) -> str:
    t = _sweep(name)
    k = int(t.mmlu_dialogs.max())
    interval = "Newcombe" if k == 1 else "cluster t"
    lines = [f"| point | MMLU acc. | most chosen letter (share) | tied top letters | MMLU drop [95% {interval}]: "
             "lost / gained, p (Holm) |", "|---|---|---|---|---|"]
    for r in t.itertuples():
        drop = ""
        if r.method != "plain":
            drop = (f"{_bold(f'{r.mmlu_drop:+.3f}', r.mmlu_p_holm)} "
                    f"{_ci(r.mmlu_drop_ci_low, r.mmlu_drop_ci_high, 3, sign=True)}: {r.mmlu_lost} / {r.mmlu_gained}, "
                    f"p = {_p(r.mmlu_p)} ({_bold(_p(r.mmlu_p_holm), r.mmlu_p_holm)})")
        collapsed = " (collapsed)" if r.mmlu_collapsed else ""
        lines.append(f"| {LABELS[r.spec]} | {r.mmlu_accuracy:.3f} | {r.mmlu_top_letter} ({r.mmlu_top_share:.0%})"
                     f"{collapsed} | {r.mmlu_tied} | {drop} |")
    test = ("exact McNemar over the 200 questions, all asked after one dialog" if k == 1 else
            f"exact sign-flip test over the {k} dialogs (10 questions each), the dialog as the unit")
    lines += ["", f"Test: {test}; Holm over the {int((t.method != 'plain').sum())} steered points."]
    return "\n".join(lines)


def sweep_context(name: str = "sweep-ref-20") -> str:
    """Per agent persona (category), each point's stability; plain's drift test; the sweep's power."""
    from driftlab.protocol.sweep import point_dir
    from driftlab.records.rundir import RunDir
    from driftlab.report.metrics import summarize_run
    from driftlab.report.sweep import power_notes

    out = HERE / name
    specs = RunDir(out).read_manifest()["points"]
    summaries = {spec or "plain": summarize_run(point_dir(out, spec) / "selfchat") for spec in specs}
    plain = summaries["plain"]
    ov = plain.overall
    personas = {row.category: row.persona for row in plain.scores[plain.scores.target == "agent"].itertuples()}
    cats = [c for c in ov[(ov.target == "agent")].category if c != "all"]
    lines = ["| agent persona (4 conversations each) | " + " | ".join(LABELS[s or "plain"] for s in specs) + " |",
             "|---|" + "---|" * len(specs)]
    for cat in cats:
        cells = []
        for spec in specs:
            o = summaries[spec or "plain"].overall
            cells.append(f"{o[(o.target == 'agent') & (o.category == cat)]['mean'].iloc[0]:.2f}")
        lines.append(f"| `{personas[cat]}` | " + " | ".join(cells) + " |")
    d = next(plain.drift[plain.drift.target == "agent"].itertuples())
    per = plain.per_round
    cell = per[(per.target == "agent") & (per.category == "all")].set_index("round")["mean"]
    lines += ["", f"Plain, round {d.last} - round {d.first}: {cell.iloc[-1]:.2f} - {cell.iloc[0]:.2f} = {d.diff:+.2f} "
                  f"{_ci(d.diff_ci_low, d.diff_ci_high, sign=True)}, {d.better} higher / {d.worse} lower / {d.tied} "
                  f"tied, exact Wilcoxon p = {_p(d.p)} (n = {d.n})."]
    lines += [""] + [f"- Power: {note}" for note in power_notes(_sweep(name))]
    return "\n".join(lines)


def gate_comparison(always: str, gated: str) -> str:
    """Each point under `when-drifting` against the same point always on, on the same pairs and
    questions (both sweeps share their plain point): stability per conversation (exact Wilcoxon),
    MMLU per question (exact McNemar), and the share of agent turns the gate steered, per round."""
    from driftlab.protocol.dialog import RECORDS
    from driftlab.protocol.mmlu import answers
    from driftlab.protocol.sweep import point_dir
    from driftlab.records.rundir import RunDir
    from driftlab.report.metrics import summarize_run
    from driftlab.report.sweep import _per_conversation
    from driftlab.stats import paired_test

    specs = [s for s in RunDir(HERE / gated).read_manifest()["points"] if s]
    lines = ["| point | stability: always on / gated | gated - always on: better / worse / tied, p | MMLU: always on / "
             "gated | lost / gained, p | agent turns steered, rounds 1..8 |", "|---|---|---|---|---|---|"]
    for spec in specs:
        runs = {k: point_dir(HERE / name, spec) for k, name in (("always", always), ("gated", gated))}
        stab = {k: _per_conversation(summarize_run(d / "selfchat").scores) for k, d in runs.items()}
        right = {k: {i: float(r.correct) for i, r in answers(d / "mmlu")["steered"].items()} for k, d in runs.items()}
        g = paired_test(stab["gated"].to_dict(), stab["always"].to_dict(), method="wilcoxon")
        m = paired_test(right["gated"], right["always"], method="mcnemar")
        turns = [r for r in RunDir(runs["gated"] / "selfchat").records(RECORDS)
                 if r.kind == "turn" and r.speaker == "agent"]
        share = pd.DataFrame([(r.round, r.gate["steered"]) for r in turns], columns=["round", "steered"])
        by_round = " ".join(f"{v:.0%}" for v in share.groupby("round")["steered"].mean())
        lines.append(f"| {LABELS[spec]} | {stab['always'].mean():.2f} / {stab['gated'].mean():.2f} | "
                     f"{g.diff.estimate:+.2f}: {g.better} / {g.worse} / {g.tied}, p = {_p(g.p)} | "
                     f"{np.mean(list(right['always'].values())):.3f} / {np.mean(list(right['gated'].values())):.3f} | "
                     f"{m.worse} / {m.better}, p = {_p(m.p)} | {by_round} |")
    return "\n".join(lines)


def gate_rounds(always: str, gated: str) -> str:
    """Mean probe score per round of plain, each point always on and gated, and the share of
    probes the gate steered: where in the dialog a steer's gain lies, and whether a gate reaches it."""
    from driftlab.protocol.dialog import RECORDS
    from driftlab.protocol.sweep import point_dir
    from driftlab.records.rundir import RunDir

    def probes(run: Path) -> pd.DataFrame:
        rows = [(r.round, r.score, (r.gate or {}).get("steered")) for r in RunDir(run / "selfchat").records(RECORDS)
                if r.kind == "probe"]
        return pd.DataFrame(rows, columns=["round", "score", "steered"]).groupby("round")

    def cells(values: pd.Series, fmt: str) -> str:
        return " | ".join(format(v, fmt) for v in values)

    specs = [s for s in RunDir(HERE / gated).read_manifest()["points"] if s]
    rounds = probes(point_dir(HERE / always, "plain"))["score"].mean()
    lines = ["| probes | " + " | ".join(f"round {i}" for i in rounds.index) + " |", "|---" * (len(rounds) + 1) + "|",
             f"| plain: mean score | {cells(rounds, '.2f')} |"]
    for spec in specs:
        on, gate = probes(point_dir(HERE / always, spec)), probes(point_dir(HERE / gated, spec))
        lines += [f"| {LABELS[spec]} always on: mean score | {cells(on['score'].mean(), '.2f')} |",
                  f"| {LABELS[spec]} gated: mean score | {cells(gate['score'].mean(), '.2f')} |",
                  f"| {LABELS[spec]} gated: probes steered | {cells(gate['steered'].mean(), '.0%')} |"]
    return "\n".join(lines)


# -- llamacpp-smollm2 ------------------------------------------------------------------------
def _jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def llamacpp(name: str = "llamacpp-smollm2") -> str:
    """driftlab's OpenAI backend on llama.cpp's server vs its local backend, from the committed run
    directories and check.json (docs/results/llamacpp-smollm2/check.py)."""
    import json

    out = HERE / name
    facts = json.loads((out / "check.json").read_text(encoding="utf-8"))

    def keyed(run: str) -> dict:
        return {(r["pair"], r["round"], r["kind"], r.get("speaker"), r["condition"]): r
                for r in _jsonl(out / run / "records.jsonl")}

    server, local = keyed("selfchat-server"), keyed("selfchat-local")
    same = sum(server[k]["text"] == local[k]["text"] for k in server)
    answers = {run: {r["index"]: r for r in _jsonl(out / run / "records.jsonl") if r["kind"] == "answer"}
               for run in ("mmlu-server", "mmlu-local")}
    letters = sum(answers["mmlu-server"][i]["predicted"] == answers["mmlu-local"][i]["predicted"]
                  for i in answers["mmlu-local"])
    diff = max(abs(answers["mmlu-server"][i]["logprobs"][x] - r["logprobs"][x])
               for i, r in answers["mmlu-local"].items() for x in "ABCD")
    lines = ["| conversation (last message) | prompt tokens: server / driftlab | server as an OpenAI client gets it "
             "(repeat_penalty 1.1) = its greedy? | server greedy = driftlab greedy? | where they part: server's / "
             "driftlab's top 2 (log-prob) |", "|---|---|---|---|---|"]
    for x in facts["prompts"]:
        last = x["messages"][-1]["content"]
        parted = "-" if "parted_at_token" not in x else (
            f"token {x['parted_at_token']}: " + ", ".join(f"`{t!r}` {lp}" for t, lp in x["server_top2"]) + " / "
            + ", ".join(f"`{t!r}` {lp}" for t, lp in x["driftlab_top2"]))
        lines.append(f"| {last[:48]}{'...' if len(last) > 48 else ''} | {x['server_prompt_tokens']} / "
                     f"{x['driftlab_prompt_tokens']} | {'yes' if x['server_reply_as_client'] == x['server_reply'] else 'no'} "
                     f"| {'yes' if x['server_reply'] == x['driftlab_reply'] else 'no'} | {parted} |")
    lines += ["", f"Self-chat through driftlab's OpenAI backend ({len(server)} records each way, greedy, 24-token "
                  f"turns and probes): {same} of {len(server)} replies identical to the local backend's. MMLU, "
                  f"{len(answers['mmlu-local'])} questions: the same letter {letters} of "
                  f"{len(answers['mmlu-local'])} times, letter log-probabilities at most {diff:.3f} apart.",
              f"Checked on {facts['date']} (commit {facts['commit']}, llama-cpp-python {facts['llama_cpp_python']}, "
              f"{facts['machine']})."]
    return "\n".join(lines)



# -- PASTA: Table 4's wordings -------------------------------------------------------------------
PAPER_TABLE4 = {"original": "71.8 -> 96.4", "shortened": "49.2 -> 89.0", "rephrased": "82.3 -> 89.6"}


def _p_up(p: float) -> str:
    """An exact test's p as the PASTA tables print it: 2 significant digits, halves rounded up
    (0.625 -> 0.63, as the hand-typed PASTA tables beside these blocks have it)."""
    from decimal import ROUND_HALF_UP, Decimal

    if not np.isfinite(p) or p < 1e-3:
        return _p(p)
    d = Decimal(repr(p))
    q = str(d.quantize(Decimal(10) ** (d.adjusted() - 1), rounding=ROUND_HALF_UP))
    q = q.rstrip("0") if "." in q else q
    return q + "0" if q.endswith(".") else q


def _examples(run: Path) -> dict[str, dict[str, dict[str, float]]]:
    """baseline -> example id -> its metrics, from a `driftlab pasta eval` run directory."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in _jsonl(run / "records.jsonl"):
        if r.get("kind") == "example":
            out.setdefault(r["baseline"], {})[r["id"]] = r["metrics"]
    return out


def pasta_wordings(name: str, original: tuple[str, str]) -> str:
    """Pronoun changing under the three wordings of the PASTA paper's Table 4: zero-shot and PASTA
    on the same test bios, each PASTA row tested against zero-shot example by example (exact
    McNemar for Acc and they_acc, Wilcoxon for tf-idf consistency). `original` names the run
    directories of the original wording's zero-shot and PASTA rows (the same examples)."""
    from driftlab.stats import paired_test

    runs = {"original": (original[0], original[1]), "shortened": ("eval-pronouns-shortened",) * 2,
            "rephrased": ("eval-pronouns-rephrased",) * 2}
    rows = {w: (_examples(HERE / name / z)["zero-shot"], _examples(HERE / name / p)["pasta"])
            for w, (z, p) in runs.items()}

    def cell(examples: dict[str, dict[str, float]]) -> str:
        return " / ".join(f"{np.mean([m[k] for m in examples.values()]):.2f}" for k in ("acc", "they_acc", "fluency"))

    def test(a, b, metric: str) -> str:
        t = paired_test({i: m[metric] for i, m in a.items()}, {i: m[metric] for i, m in b.items()})
        return f"{t.better} / {t.worse}, p = {_p_up(t.p)}"

    n = {len(z) for z, _ in rows.values()} | {len(p) for _, p in rows.values()}
    lines = [f"| wording (n = {'/'.join(map(str, sorted(n)))} bios) | zero-shot: Acc / they_acc / fluency | "
             "PASTA: Acc / they_acc / fluency | PASTA vs zero-shot, better / worse rows, exact McNemar p | "
             "paper, LLaMA-7B Acc zero-shot -> PASTA |", "|---|---|---|---|---|"]
    for w, (z, p) in rows.items():
        lines.append(f"| {w} | {cell(z)} | {cell(p)} | Acc {test(p, z, 'acc')}; they_acc {test(p, z, 'they_acc')} "
                     f"| {PAPER_TABLE4[w]} |")
    consistency, methods = [], set()
    for w, (z, p) in rows.items():
        t = paired_test({i: m["consistency"] for i, m in p.items()}, {i: m["consistency"] for i, m in z.items()})
        methods.add(t.method)
        consistency.append(f"{w} {np.mean([m['consistency'] for m in z.values()]):.2f} -> "
                           f"{np.mean([m['consistency'] for m in p.values()]):.2f} ({t.better} / {t.worse}, "
                           f"p = {_p_up(t.p)})")
    base = rows["original"][0]
    shifts = [f"{w} {test(z, base, 'acc')}" for w, (z, _) in rows.items() if w != "original"]
    lines += ["", f"Consistency with the bio (tf-idf), zero-shot -> PASTA (better / worse rows, "
                  f"{', '.join(sorted(methods))} p): " + "; ".join(consistency) + ".",
              "Zero-shot Acc against the original wording's (better / worse rows, exact McNemar p): "
              + "; ".join(shifts) + "."]
    return "\n".join(lines)


# -- judge-smollm2-qwen-20 --------------------------------------------------------------------
def judge(name: str = "judge-smollm2-qwen-20") -> str:
    """The judge against the personas' measures on the same probe replies (`driftlab report`'s
    `judge_agreement`), and how their pass/fail calls at 0.5 split."""
    from collections import Counter

    from driftlab.report.metrics import judge_agreement

    records = _jsonl(HERE / name / "records.jsonl")
    a = judge_agreement(records).iloc[0]
    both = [r for r in records if r.get("kind") == "probe" and r.get("score") is not None
            and r.get("judge") is not None]
    calls = Counter((r["score"] >= 0.5, r["judge"] >= 0.5) for r in both)
    verdicts = Counter(r["judge"] for r in both)
    lines = ["| n | measure mean | judge mean | Spearman rho | same side of 0.5 | Cohen's kappa | mean abs. difference |",
             "|---|---|---|---|---|---|---|",
             f"| {a.n} | {a.measure_mean:.3f} | {a.judge_mean:.3f} | {a.spearman:.2f} (p = {_p(a.spearman_p)}) | "
             f"{a.agree:.0%} [{a.agree_low:.0%}, {a.agree_high:.0%}] ({a.agree_method.capitalize()}) | "
             f"{a.kappa:.2f} | {a.mad:.2f} |", "",
             "The judge's scores: " + ", ".join(f"{v:.1f} ({k} replies)" for v, k in sorted(verdicts.items())) + ". "
             f"Pass/fail at 0.5: both fail {calls[(False, False)]}, both pass {calls[(True, True)]}, measure pass / "
             f"judge fail {calls[(True, False)]}, the reverse {calls[(False, True)]}; judge errors {a.judge_errors}."]
    return "\n".join(lines)


# -- drift side by side: the demo, the projection study, directions ----------------------------------
def _markdown(table) -> str:
    """A report's TextTable as a markdown table."""
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table.rows])


def three_ways(name: str) -> str:
    """Every measure a run took per round (probe score, pi, projection, the KLs), how far they agree, and
    the projection's three checks (a self-chat with --directions, --steer trace or --kl, or a `driftlab
    project` run)."""
    from driftlab.report.activation import measure_tables, measures_frame

    return "\n\n".join(_markdown(table) for table in measure_tables(measures_frame(HERE / name)))


def replay_block(name: str) -> str:
    """A replay's compliance per turn and its drift (`driftlab report`), its measures per round, and which
    of them warns (`driftlab warn`, default settings)."""
    from driftlab.report.replay import _drift_note, compliance_frame, per_round
    from driftlab.report.warn import analyse, table, turns_frame

    frame = compliance_frame(HERE / name)
    rows = ["| round | compliance | 95% interval | n |", "|---|---|---|---|"]
    rows += [f"| {r.round} | {r.mean:.3f} | {_ci(r.ci_low, r.ci_high, 3)} {r.ci_method} | {r.n} |"
             for r in per_round(frame).itertuples()]
    turns = turns_frame(HERE / name)
    warned = table(analyse(turns))
    return ("\n".join(rows) + f"\n\n{_drift_note(frame)}.\n\n{_persistence(turns)}\n\n" + three_ways(name) + "\n\n"
            + _markdown(warned))


def replay_conditions(*names: str, upto: int | None = None) -> str:
    """Replays of the same dialogs under different steers (the first is the baseline): compliance at some
    turns, each dialog's mean compliance over turns 2..T against the baseline's (paired over dialogs, exact
    Wilcoxon), and the share of turns a gate steered. T: the last round every run completed (or `upto`)."""
    from driftlab.report.replay import compliance_frame
    from driftlab.stats import paired_test

    frames = {name: compliance_frame(HERE / name) for name in names}
    last = min(int(f.groupby("pair")["round"].max().min()) for f in frames.values()) if upto is None else upto
    turns = sorted({1, *range(5, last + 1, 5), last})
    means = {name: f[(f["round"] >= 2) & (f["round"] <= last)].groupby("pair")["score"].mean().to_dict()
             for name, f in frames.items()}
    rows = ["| run | " + " | ".join(f"turn {t}" for t in turns) + f" | turns 2-{last}, per dialog | minus "
            f"{names[0]}: better / worse, p | a turn after a failing one passes | turns steered |",
            "|---" * (len(turns) + 5) + "|"]
    for name, f in frames.items():
        at = [f.loc[f["round"] == t, "score"].mean() for t in turns]
        test = paired_test(means[name], means[names[0]]) if name != names[0] else None
        vs = "" if test is None else (f"{test.diff.estimate:+.2f} {_ci(test.diff.low, test.diff.high, sign=True)}: "
                                      f"{test.better} / {test.worse}, p = {_p(test.p)}")
        steered = f[f["round"] <= last]["steered"].dropna()
        rows.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in at)
                    + f" | {np.nanmean(list(means[name].values())):.2f} | {vs} | {_rescued(f, last)} | "
                    + (f"{steered.mean():.0%} of {len(steered)}" if len(steered) else "") + " |")
    return "\n".join(rows)


def mmlu_prices(*names: str) -> str:
    """MMLU runs asked after the same dialogs, each with its plain answers and one steer's (a gate's, SPR always
    on): accuracy, the steered minus plain difference, and each later run against the first's steered answers
    (all paired by question, clustered by dialog: `clustered_paired_test`, exact sign-flip over dialogs).
    The runs must share their plain answers (same questions, dialogs and model), or the comparison is void."""
    from driftlab.records.rundir import RunDir
    from driftlab.stats import clustered_paired_test

    runs = {}
    for name in names:
        records = [r for r in RunDir(HERE / name).records() if r["kind"] == "answer"]
        runs[name] = {c: {r["index"]: r for r in records if r["condition"] == c} for c in ("plain", "steered")}
    plain = runs[names[0]]["plain"]
    assert all({k: r["predicted"] for k, r in run["plain"].items()} == {k: r["predicted"] for k, r in plain.items()}
               for run in runs.values()), "the runs' plain answers differ"
    dialogs = {k: r["dialog"] for k, r in plain.items()}
    correct = lambda answers: {k: float(r["correct"]) for k, r in answers.items()}  # noqa: E731

    def vs(a: dict, b: dict) -> str:
        t = clustered_paired_test(correct(a), correct(b), dialogs)
        return f"{t.diff.estimate:+.3f} {_ci(t.diff.low, t.diff.high, 3, sign=True)}: {t.better} / {t.worse}, p = {_p(t.p)}"

    first = runs[names[0]]["steered"]
    rows = [f"| run | plain | steered | steered minus plain: gained / lost, p | minus {names[0]}'s steered | "
            "questions steered |", "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        steered = run["steered"]
        gates = [r["gate"]["steered"] for r in steered.values() if r.get("gate")]
        assert all(r["logprobs"] == plain[k]["logprobs"] for k, r in steered.items()
                   if r.get("gate") and not r["gate"]["steered"]), "a question the gate left plain differs from plain"
        share = f"{sum(gates)} of {len(gates)}" if gates else f"all {len(steered)}"
        rows.append(f"| {name} | {np.mean(list(correct(run['plain']).values())):.3f} | "
                    f"{np.mean(list(correct(steered).values())):.3f} | {vs(steered, run['plain'])} | "
                    f"{vs(steered, first) if name != names[0] else ''} | {share} |")
    return "\n".join(rows)


def _rescued(frame: pd.DataFrame, last: int) -> str:
    """How often an agent turn passes after a failing one (rounds 2..last), with a 95% interval from a bootstrap
    over dialogs: what a steer does for a dialog that already slipped."""
    from driftlab.stats import percentile_interval, resample_counts

    f = frame.sort_values(["pair", "round"]).assign(prev=lambda x: x.groupby("pair")["score"].shift())
    f = f[(f["round"] <= last) & f.prev.notna() & f.score.notna() & (f.prev < 0.5)].reset_index(drop=True)
    passed = (f.score >= 0.5).to_numpy()
    counts = resample_counts(len(f), f.pair.to_numpy(), 2000, 0)
    low, high = percentile_interval((counts * passed).sum(1) / counts.sum(1), 2000, 0.95)
    return f"{passed.mean():.2f} {_ci(low, high)} (n = {len(f)})"


def _persistence(turns: pd.DataFrame) -> str:
    """How often the next turn fails after a failing turn and after a passing one, with 95% intervals from a
    bootstrap over dialogs (`driftlab warn`'s turns)."""
    from driftlab.stats import percentile_interval, resample_counts

    turns = turns.dropna(subset=["score"]).reset_index(drop=True)
    failed, fails = (turns.score < 0.5).to_numpy(), turns.fails_next.to_numpy(bool)
    counts = resample_counts(len(turns), turns.pair.to_numpy(), 2000, 0)
    cells = []
    for now in (failed, ~failed):
        share = (counts * (now & fails)).sum(1) / (counts * now).sum(1)
        low, high = percentile_interval(share, 2000, 0.95)
        cells.append(f"{(now & fails).sum() / now.sum():.2f} [{low:.2f}, {high:.2f}] (n = {now.sum()} turns)")
    return (f"The next turn fails after a failing turn {cells[0]}, after a passing one {cells[1]} "
            f"({turns.pair.nunique()} dialogs; intervals: bootstrap over dialogs).")


def replay_projected(replay: str, projected: str) -> str:
    """A replay with its agent turns projected afterwards (`driftlab project --from-run`): the measures per
    round of both runs together, and which of them warns (`driftlab warn --from-run REPLAY --from-run
    PROJECTED`, default settings)."""
    from driftlab.report.activation import measure_tables, measures_frame
    from driftlab.report.warn import analyse, table, turns_frame

    frame = measures_frame(HERE / replay, HERE / projected)
    warned = table(analyse(turns_frame(HERE / replay, HERE / projected)))
    return "\n\n".join(_markdown(t) for t in measure_tables(frame)) + "\n\n" + _markdown(warned)


def separation(name: str) -> str:
    """Each direction's band, held-out AUROC and shuffled control (`driftlab directions`)."""
    from driftlab.report.directions import separation_table

    return _markdown(separation_table(HERE / name))


def engines(vllm: str = "vllm-qwen-selfchat", hf: str = "hf-qwen-selfchat") -> str:
    """The same greedy self-chat on vLLM and on the transformers engine: per kind of record, how many texts
    are the same, and how far pi and the projections of the records with the same text lie apart."""
    a = {_key(r): r for r in _jsonl(HERE / vllm / "records.jsonl")}
    b = {_key(r): r for r in _jsonl(HERE / hf / "records.jsonl")}
    lines = ["| records | same text | largest pi gap (same text) | largest projection gap (same text) |",
             "|---|---|---|---|"]
    for label, kinds in (("agent turns", {("turn", "agent")}), ("user turns", {("turn", "user")}),
                         ("probe replies", {("probe", None)})):
        keys = sorted(k for k in a if (k[0], k[3]) in kinds and k in b)
        same = [k for k in keys if a[k]["text"] == b[k]["text"]]
        pi = max((abs(x - y) for k in same if a[k].get("pi") for x, y in zip(a[k]["pi"], b[k]["pi"], strict=True)),
                 default=float("nan"))
        proj = max((abs(x - y) for k in same if a[k].get("activation")
                    for x, y in zip(a[k]["activation"]["reply"], b[k]["activation"]["reply"], strict=True)),
                   default=float("nan"))
        gap = lambda x: "not recorded" if x != x else f"{x:.1e}"  # noqa: E731 (NaN: nothing traced)
        lines.append(f"| {label} | {len(same)} of {len(keys)} | {gap(pi)} | {gap(proj)} |")
    return "\n".join(lines)


#: The long-dialog study: per condition, its self-chat, `driftlab kl`, `driftlab project` and `driftlab
#: decay` runs (the blocks need the first two finished; the others show once finished). The decay replay
#: reads a dialog without steers, so the SPR condition's pi was not measured.
LONG = {"plain": ("long-qwen-smollm2-user", "long-qwen-smollm2-user-kl", "long-qwen-smollm2-user-project",
                  "long-qwen-smollm2-user-decay"),
        "SPR p = 0.5": ("long-qwen-smollm2-user-spr", "long-qwen-smollm2-user-spr-kl",
                        "long-qwen-smollm2-user-spr-project", None)}
LONG_ROUNDS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 25, 30, 35, 40)


def long_selfchats() -> str:
    """Both conditions' self-chats over 40 rounds: per probe round, the mean probe score and the share of
    agent turns repeating an earlier one (plain on all its dialogs and on SPR's pairs, SPR); then the
    drift tests (last probe round against the first, per conversation) and SPR against plain on the
    same pairs (each pair's mean probe score over its rounds)."""
    from driftlab.report.activation import measures_frame
    from driftlab.stats import mean_interval, paired_test

    plain, spr = (measures_frame(HERE / LONG[label][0]) for label in LONG)
    same = plain[plain.pair.isin(spr.pair.unique())]
    runs = [("plain", plain), (f"plain, SPR's {spr.pair.nunique()} pairs", same), ("SPR p = 0.5", spr)]
    score = {name: f[f.what == "probe"].groupby(["round", "pair"]).score.mean() for name, f in runs}
    rep = {name: f[f.what == "turn"].groupby(["round", "pair"]).repeated.mean() for name, f in runs}
    rounds = sorted(score["plain"].index.get_level_values("round").unique())
    lines = ["| round | " + " | ".join(f"probe score, {name} (n = {f.pair.nunique()})" for name, f in runs)
             + " | " + " | ".join(f"repeated, {name}" for name, _ in runs) + " |",
             "|---|" + "---|" * (2 * len(runs))]
    for r in rounds:
        cells = [mean_interval(score[name].loc[r]).cell(2) for name, _ in runs]
        cells += [f"{rep[name].loc[r].mean():.2f}" for name, _ in runs]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    first, last = rounds[0], rounds[-1]
    lines += ["", "| question | estimate [95% CI] | higher / lower / tied | test |", "|---|---|---|---|"]
    for name, _ in runs:
        test = paired_test(score[name].loc[last].to_dict(), score[name].loc[first].to_dict())
        lines.append(f"| {name}: probe score, round {last} minus round {first} | {test.diff.cell(2, sign=True)} | "
                     f"{test.better} / {test.worse} / {test.tied} | p = {_p(test.p)} ({test.method}, n = {test.n}) |")
    mean = {name: score[name].groupby(level="pair").mean().to_dict() for name, _ in runs}
    test = paired_test(mean["SPR p = 0.5"], mean[runs[1][0]])
    lines.append(f"| SPR minus plain, mean probe score over rounds {first}-{last}, same pairs | "
                 f"{test.diff.cell(2, sign=True)} | {test.better} / {test.worse} / {test.tied} | "
                 f"p = {_p(test.p)} ({test.method}, n = {test.n}) |")
    return "\n".join(lines)


def _long_frame(label: str) -> pd.DataFrame:
    """A condition's measures on the dialogs its KLs were read on (every column the same dialogs)."""
    from driftlab.report.activation import measures_frame

    _, kl, *more = LONG[label]
    frame = measures_frame(HERE / kl, *(HERE / run for run in more if run and finished(run)))
    return frame[frame.pair.isin(frame[frame.reminded.notna()].pair.unique())]


def _reminded(label: str) -> set[tuple[int, int]]:
    """The (pair, round) agent turns a condition's SPR reminded: the system prompt stands right before
    their user turn, so their reminded KL is 0 by construction (none in the plain condition)."""
    from driftlab.protocol.decay import agent_conversation
    from driftlab.protocol.divergence import remind
    from driftlab.protocol.project import recorded_dialogs
    from driftlab.protocol.runner import config_of
    from driftlab.records.rundir import RunDir
    from driftlab.steering.interventions import Interventions

    run = HERE / LONG[label][0]
    steer = Interventions.parse(config_of(RunDir(run).read_manifest()).get("steer") or [])
    out = set()
    for d in recorded_dialogs(run):
        dialog = agent_conversation(d["system"], d["a"], d["b"])
        out |= {(d["pair"], i) for i in range(2, len(d["a"]) + 1)
                if steer.kinds & {"spr"} and remind(steer.model_view(dialog[: 1 + 2 * i])) is None}
    return out


def long_rounds(label: str) -> str:
    """A condition's measures per round (the rounds of `LONG_ROUNDS`), on the dialogs its KLs were read on."""
    from driftlab.report.activation import round_table
    from driftlab.report.tables import TextTable

    table = round_table(_long_frame(label))
    shown = {str(r) for r in LONG_ROUNDS}
    return _markdown(TextTable(table.title, table.columns, [r for r in table.rows if r[0] in shown], table.note))


def long_equilibria() -> str:
    """The equilibrium fits of both KLs, plain against SPR; and the reminded KL at the turns SPR did not
    remind (its reminded turns are 0 by construction) and the projection, against plain's same rounds,
    paired by pair."""
    from driftlab.report.equilibrium import equilibrium_table
    from driftlab.stats import paired_test

    runs = [HERE / LONG[label][1] for label in LONG]
    tables = [f"{name}:\n\n" + _markdown(equilibrium_table(runs, measure)).replace(str(HERE) + "/", "")
              for measure, name in (("reminded", "Reminded KL"), ("influence", "Prompt influence"))]
    frames = [_long_frame(label).query("what == 'turn' and round >= 2").set_index(["pair", "round"])
              for label in LONG]
    unreminded = frames[1].index.difference(pd.MultiIndex.from_tuples(sorted(_reminded("SPR p = 0.5"))))
    rows = []
    for column, turns, what in (("reminded", unreminded, "reminded KL at the turns SPR did not remind"),
                                ("projection", frames[1].index, "projection, every turn")):
        kept = turns.intersection(frames[0].index)
        plain, spr = (f.loc[kept, column].groupby(level="pair").mean().to_dict() for f in frames)
        test = paired_test(spr, plain)
        rows.append(f"| {what} ({len(kept)} of {len(frames[1])} turns, rounds 2-40): SPR minus plain, mean per "
                    f"pair | {test.diff.cell(3, sign=True)} ({test.worse} lower / {test.better} higher) | "
                    f"p = {_p(test.p)} ({test.method}, n = {test.n} pairs) |")
    tables.append("\n".join(["| question | estimate [95% CI] | test |", "|---|---|---|", *rows]))
    return "\n\n".join(tables)


#: Round bands of the loop table: before the loops, while they start, and once nearly every turn repeats.
LONG_BANDS = ((1, 5), (6, 10), (11, 20), (21, 40))


def long_loops() -> str:
    """Each turn measure of both conditions split by whether the turn repeats an earlier one, per band of
    rounds (mean over turns, their number; the reminded KL from round 2, at the turns SPR did not
    remind); then each measure's change over the rounds before any dialog of the condition repeats a
    turn (each dialog's least-squares slope per round, tested against 0): what a measure says while
    the text still moves, apart from what it says about a loop."""
    from driftlab.report.activation import TURN_MEASURES
    from driftlab.stats import paired_test

    head = "| condition | measure | " + " | ".join(f"rounds {a}-{b}: new / repeated" for a, b in LONG_BANDS) + " |"
    lines, tests = [head, "|---|---|" + "---|" * len(LONG_BANDS)], []
    for label in LONG:
        turns = _long_frame(label).query("what == 'turn'")
        first_repeat = int(turns[turns.repeated > 0]["round"].min())
        spr = _reminded(label)
        reminded = pd.Series([(p, r) in spr for p, r in zip(turns.pair, turns["round"], strict=True)],
                             index=turns.index)
        for column, name, _ in TURN_MEASURES:
            f = turns[turns[column].notna() & (((turns["round"] >= 2) & ~reminded) if column == "reminded" else True)]
            if f.empty:
                continue
            cells = []
            for a, b in LONG_BANDS:
                band = f[f["round"].between(a, b)]
                cells.append(" / ".join(f"{g[column].mean():.4f} ({len(g)})" if len(g) else "-"
                                        for g in (band[band.repeated == 0], band[band.repeated > 0])))
            lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
            early = f[f["round"] < first_repeat]
            slopes = {pair: np.polyfit(g["round"], g[column], 1)[0] for pair, g in early.groupby("pair")
                      if g["round"].nunique() >= 2}
            test = paired_test(slopes, dict.fromkeys(slopes, 0.0))
            tests.append(f"| {label} | {name}, rounds {int(early['round'].min())}-{first_repeat - 1} | "
                         f"{test.diff.cell(4, sign=True)} | {test.better} / {test.worse} / {test.tied} | "
                         f"p = {_p(test.p)} ({test.method}, n = {test.n}) |")
    return "\n".join([*lines, "", "| condition | change per round before any turn repeats: measure, rounds | "
                       "mean slope [95% CI] | up / down / flat | test |", "|---|---|---|---|---|", *tests])


def _key(r: dict) -> tuple:
    return (r["kind"], r["pair"], r["round"], r.get("speaker"), r.get("target"), r.get("repeat"))


BLOCKS: dict[str, Callable[[], str]] = {
    "llamacpp-smollm2": llamacpp,
    "qwen-paper-20-rounds": qwen_paper_rounds,
    "qwen-paper-20-tests": qwen_paper_tests,
    "decay-qwen-20": decay_rounds,
    "decay-qwen-4": decay_four_dialogs,
    "sweep-ref-20-stability": sweep_stability,
    "sweep-ref-20-context": sweep_context,
    "sweep-ref-20-mmlu": lambda: sweep_mmlu("sweep-ref-20"),
    "pasta-qwen-wordings": lambda: pasta_wordings("pasta-qwen", ("eval-pronouns", "eval-pronouns")),
    "pasta-smollm2-wordings": lambda: pasta_wordings("pasta-smollm2", ("eval-pronouns", "eval-pronouns-tuned")),
    "judge-smollm2-qwen-20": judge,
}


def finished(name: str) -> bool:
    """A committed run directory whose run completed (one still being computed has no figures yet)."""
    import json

    path = HERE / name / "manifest.json"
    return path.exists() and json.loads(path.read_text()).get("completed") is True


for run in ("replay-qwen-plain", "replay-smollm2-plain", "replay-qwen-spr", "replay-qwen-gate-spr", "replay-qwen-instaboost",
            "replay-smollm2-spr", "replay-smollm2-instaboost", "replay-qwen-constraints"):
    if finished(run):
        BLOCKS[run] = functools.partial(replay_block, run)
# Each model's replay conditions side by side (plain first): once plain and SPR have finished, the block
# names every condition that has.
CONDITIONS = {"qwen": ("plain", "spr", "gate-spr", "instaboost"), "smollm2": ("plain", "spr", "instaboost")}
for model, conditions in CONDITIONS.items():
    names = [f"replay-{model}-{c}" for c in conditions]
    if all(finished(name) for name in names[:2]):
        BLOCKS[f"replay-{model}-conditions"] = functools.partial(replay_conditions, *filter(finished, names))
if finished("mmlu-qwen-gate-spr-gated"):  # the gate's price, then always-on SPR's once it has finished
    BLOCKS["mmlu-qwen-gate-spr"] = functools.partial(mmlu_prices, *filter(finished, ("mmlu-qwen-gate-spr-gated",
                                                                                     "mmlu-qwen-gate-spr-always")))
for model in ("qwen", "smollm2"):
    if finished(f"replay-{model}-plain") and finished(f"project-replay-{model}-plain"):
        BLOCKS[f"project-replay-{model}-plain"] = functools.partial(replay_projected, f"replay-{model}-plain",
                                                                    f"project-replay-{model}-plain")
if finished("vllm-qwen-selfchat") and finished("hf-qwen-selfchat"):
    BLOCKS["vllm-qwen-engines"] = engines
for run, block in (("demo-smollm2", three_ways), ("project-qwen-paper-20", three_ways),
                   ("directions-qwen-sweep", separation), ("directions-qwen-paper", separation),
                   ("directions-qwen-replay", separation), ("directions-smollm2-replay", separation)):
    if finished(run):
        BLOCKS[run] = functools.partial(block, run)
if all(finished(names[0]) for names in LONG.values()):
    BLOCKS["long-qwen-selfchats"] = long_selfchats
if all(finished(name) for names in LONG.values() for name in names[:2]):
    for label in LONG:
        BLOCKS[LONG[label][0] + "-rounds"] = functools.partial(long_rounds, label)
    BLOCKS["long-qwen-equilibria"] = long_equilibria
    BLOCKS["long-qwen-loops"] = long_loops
if finished("sweep-activation-20"):
    BLOCKS["sweep-activation-20-stability"] = lambda: sweep_stability("sweep-activation-20")
    BLOCKS["sweep-activation-20-mmlu"] = lambda: sweep_mmlu("sweep-activation-20")
# Each gate comparison: a steer always on, and the same under when-drifting (one shared plain point).
GATES = {model: (f"sweep-gate-{model}-always", f"sweep-gate-{model}-when") for model in ("smollm2", "qwen")}
for pair_name, pair in GATES.items():
    for name in pair:
        if finished(name):
            BLOCKS[f"{name}-stability"] = functools.partial(sweep_stability, name)
            BLOCKS[f"{name}-mmlu"] = functools.partial(sweep_mmlu, name)
    if all(finished(name) for name in pair):
        BLOCKS[f"sweep-gate-{pair_name}"] = functools.partial(gate_comparison, *pair)
        BLOCKS[f"sweep-gate-{pair_name}-rounds"] = functools.partial(gate_rounds, *pair)
SWEEPS = [name for name in ("sweep-ref-20", "sweep-ref-20-h20", "sweep-activation-20", *sum(GATES.values(), ()))
          if finished(name)]
if finished("sweep-ref-20-h20"):
    BLOCKS["sweep-ref-20-h20-mmlu"] = lambda: sweep_mmlu("sweep-ref-20-h20")
BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(\n<!-- /figures:(?P=name) -->)", re.S)


def render(text: str, only: list[str] | None = None) -> str:
    """`text` with every generated block recomputed (those named in `only`, if given)."""
    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in BLOCKS:
            raise SystemExit(f"{README}: unknown figures block {name!r}; known: {', '.join(BLOCKS)}")
        body = BLOCKS[name]() if only is None or name in only else m["body"]
        return m[1] + body + m[4]
    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting; exit 1 on a difference")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        stale = [m["name"] for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new), strict=True) if m[0] != n[0]]
        if stale:
            print(f"{README}: these generated blocks differ from their records: {', '.join(stale)}; "
                  f"run `python {Path(__file__).relative_to(Path.cwd()) if Path.cwd() in Path(__file__).parents else __file__}`")
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
