"""What `driftlab directions` found: each persona's held-out separation per layer, as a table and a figure."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from driftlab.activation.directions import Directions
from driftlab.report.figures import save_png
from driftlab.report.tables import TextTable, fmt_cell

FIGURE = "separation.png"


def separation_table(run_dir: str | Path) -> TextTable:
    """One row per direction: its band, the band's held-out AUROC, and a shuffled control's."""
    found = Directions.load(run_dir)
    rows = []
    for p in found.personas.values():
        band = list(p.band)
        est, low, high = (float(p.auroc[i, band].mean()) for i in range(3))
        control = p.info.get("control_auroc")
        name = f"{p.id} (from {p.info['imported']['format']})" if "imported" in p.info else p.id
        rows.append([name, f"{band[0]}-{band[-1]}", fmt_cell(est, low, high),
                     "-" if control is None else f"{control:.2f}", str(p.info.get("n_held_out", ""))])
    return TextTable("held-out separation of each direction (with vs without its system prompt)",
                     ["direction", "band (layers)", "AUROC [95% CI]", "shuffled control", "held-out prompts"], rows,
                     "AUROC of the projections of held-out replies, averaged over the band's layers (interval: "
                     "bootstrap over prompts, averaged likewise); the control shuffles the training labels first. An "
                     "imported direction is only judged here (no control: nothing was trained).")


def separation_figure(run_dir: str | Path) -> Path:
    """Held-out AUROC per layer for each direction (band shaded), beside chance."""
    found = Directions.load(run_dir)
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    for p in found.personas.values():
        layers = range(p.auroc.shape[1])
        line, = ax.plot(layers, p.auroc[0].numpy(), lw=1.2, label=p.id)
        ax.fill_between(layers, p.auroc[1].numpy(), p.auroc[2].numpy(), color=line.get_color(), alpha=0.12)
        ax.axvspan(p.band[0] - 0.5, p.band[-1] + 0.5, color=line.get_color(), alpha=0.06)
    ax.axhline(0.5, color="0.5", ls="--", lw=0.8, label="chance")
    ax.set(xlabel="layer", ylabel="held-out AUROC (with vs without)", ylim=(0.0, 1.02),
           title=f"{found.meta.get('model')}: how well each layer's direction separates")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    return save_png(fig, Path(run_dir) / FIGURE)
