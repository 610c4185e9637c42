"""What the residual stream does on one forward call, per batch row: `ResidualState`.

A row may carry its persona's direction (unit vectors, one per layer). Then at every decoder
layer's output h (the residual stream after layer l):

    h += add[b, l] * v          (activation steering: alpha times the persona's mean difference)
    p  = <h, v>                 (the projection, in float32)
    h += relu(tau[b, l] - p) v  (capping from below: p becomes max(p, tau); the part of h
                                 orthogonal to v is untouched)

and the state sums p over the positions that generate the row's reply (the last prompt
position, then every fed token while the row runs), keeps the last prompt position's p, and
the last reply position's. With `capture` it also sums h itself (the directions protocol's
difference of means). Rows without a direction have v = 0: nothing changes, nothing counts.

The dynamic path skips layers with nothing to do (flags on the host). A static layout
(`static_layout`) holds every tensor at a fixed address and every layer does the same work
(zeros where nothing acts), so one compiled decode step serves every steer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

KWARG = "driftlab_residual"  # the forward keyword the state rides on, to every decoder layer


@dataclass(frozen=True)
class ResidualRow:
    """One row's direction and knobs: `unit` [L, d] unit vectors (float32); `add` [L] what to add
    along them (0: nothing); `tau` [L] the cap (-inf: none); `low`, `high` [L] the mean projections
    without and with the system prompt (a recorded projection is normalised against them);
    `direction` and `band` name the direction and its default layers."""

    unit: torch.Tensor
    add: torch.Tensor
    tau: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    direction: str = ""  # whose direction (a persona id, or "axis"): recorded with the projections
    band: tuple[int, ...] = ()  # the direction's default layers: what a summary's band mean averages


class ResidualState:
    """Per-call, per-row state read by the decoder-layer hooks (`activation.hooks`)."""

    def __init__(self, rows: Sequence[ResidualRow | None], n_layers: int, d_model: int, device: torch.device,
                 dtype: torch.dtype, *, capture: bool = False, keep_prefill: bool = False) -> None:
        """`rows[b]` None: row b has no direction (unchanged, not recorded). `capture`: also sum the
        hidden states themselves over the reply positions (every row). `keep_prefill`: keep every
        prefill position's projection (a teacher-forced transcript)."""
        B, L = len(rows), n_layers
        self.n_layers, self.d_model, self.device, self.dtype = L, d_model, device, dtype
        unit = torch.zeros(B, L, d_model)
        add, tau = torch.zeros(B, L), torch.full((B, L), float("-inf"))
        self.low, self.high = torch.zeros(B, L), torch.ones(B, L)
        for b, row in enumerate(rows):
            if row is None:
                continue
            unit[b], add[b], tau[b], self.low[b], self.high[b] = row.unit, row.add, row.tau, row.low, row.high
        self.has = [row is not None for row in rows]
        self.named = [(row.direction, list(row.band)) if row is not None else None for row in rows]
        self.unit = unit.to(device)
        self.unit_h = self.unit.to(dtype)  # what is added to h, in its dtype
        self.add = add.to(device=device, dtype=dtype)
        self.tau = tau.to(device)
        self.capture, self.keep_prefill = capture, keep_prefill
        # Host flags: which layers add or cap in some row (the dynamic path skips the others).
        self._adds = (add != 0).any(0).tolist()
        self._caps = torch.isfinite(tau).any(0).tolist()
        self._reads = any(self.has) or capture
        self.static = False
        self.prefilling = True
        self._calls = 0
        # Batch position -> the row it holds (rows leave a dynamic batch when they are done).
        self.index = torch.arange(B, device=device)
        self.running = torch.ones(B, device=device)  # 1 while a position's row generates, else 0
        self.proj_sum = torch.zeros(B, L, device=device)
        self.proj_prompt = torch.zeros(B, L, device=device)
        self.proj_last = torch.zeros(B, L, device=device)
        self.step_proj = torch.zeros(B, L, device=device)  # this pass's last-position projections
        self.positions = torch.zeros(B, device=device)  # how many positions were summed
        self.act_sum = torch.zeros(B, L, d_model, device=device) if capture else None
        self.prefill_proj: list[torch.Tensor | None] = [None] * L

    # -- set by the decode loop -------------------------------------------------------------------
    def forward_kwargs(self) -> dict:
        """Called before each forward pass of the call (the first is the prefill)."""
        self.prefilling = self._calls == 0
        self._calls += 1
        return {KWARG: self}

    def stop(self, positions: Sequence[int]) -> None:
        """The rows at these batch positions are done: their later positions count no more."""
        if positions:
            self.running[torch.tensor(list(positions), device=self.device)] = 0.0

    def select_rows(self, keep: Sequence[int]) -> None:
        """Keep only the batch positions `keep`, in order (a dynamic batch drops finished rows);
        what was summed stays with each row."""
        if self.static:
            raise RuntimeError("rows cannot leave a static layout")
        index = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        self.unit, self.unit_h = self.unit[index], self.unit_h[index]
        self.add, self.tau, self.running = self.add[index], self.tau[index], self.running[index]
        self.step_proj, self.index = self.step_proj[index], self.index[index]

    def resume(self) -> None:
        """This state takes over a running batch: its next pass is a decode step, not a prefill."""
        self._calls = max(self._calls, 1)

    def extend(self, other: ResidualState) -> None:
        """Take `other`'s rows after these (continuous batching: rows joined the batch): what each
        row summed stays with it; other's rows become rows len(has), ... here."""
        if self.static or other.static or self.capture or other.capture or self.keep_prefill or other.keep_prefill:
            raise RuntimeError("rows join only a dynamic, uncaptured residual state")
        R = len(self.has)
        self.has, self.named = self.has + other.has, self.named + other.named
        self.low, self.high = torch.cat([self.low, other.low]), torch.cat([self.high, other.high])
        for name in ("proj_sum", "proj_prompt", "proj_last", "positions"):  # per row
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        for name in ("unit", "unit_h", "add", "tau", "running", "step_proj"):  # per batch position
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.index = torch.cat([self.index, other.index + R])
        self._adds = [a or b for a, b in zip(self._adds, other._adds, strict=True)]
        self._caps = [a or b for a, b in zip(self._caps, other._caps, strict=True)]
        self._reads = self._reads or other._reads

    def static_layout(self, arena: dict[str, torch.Tensor]) -> None:
        """Hold every tensor a decode step reads at a fixed address (`arena`: those of earlier calls
        of the same shapes, refilled in place), so a compiled or captured step reads this call's."""
        self.static = True

        def put(name: str, value: torch.Tensor) -> torch.Tensor:
            held = arena.get(f"residual.{name}")
            if held is None or held.shape != value.shape or held.dtype != value.dtype or held.device != value.device:
                held = arena[f"residual.{name}"] = value.clone()
                torch._dynamo.mark_static_address(held)
            else:
                held.copy_(value)
            return held

        for name in ("unit", "unit_h", "add", "tau", "running", "proj_sum", "proj_prompt", "proj_last", "step_proj",
                     "positions"):
            setattr(self, name, put(name, getattr(self, name)))
        if self.act_sum is not None:
            self.act_sum = put("act_sum", self.act_sum)

    # -- the hook's arithmetic ----------------------------------------------------------------------
    def apply(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s output h [B, q, d], steered; what it projects to is recorded.

        A layer that only reads projects the last position alone and files it for the pass's end
        (`_fold`): a served row pays a few small ops per layer, not a dozen (telemetry's cost)."""
        adds, caps = self.static or self._adds[layer], self.static or self._caps[layer]
        if not (adds or caps or self._reads):
            return h
        h, p = steer_stream(h, self.unit[:, layer], self.unit_h[:, layer], self.add[:, layer], self.tau[:, layer],
                            adds=adds, caps=caps, every=caps or self.keep_prefill)
        if self.prefilling and self.keep_prefill:
            self.prefill_proj[layer] = p
        if self.static or self._reads:
            self._record(layer, h, p[:, -1])
        return h

    def _record(self, layer: int, h: torch.Tensor, last: torch.Tensor) -> None:
        """File layer `layer`'s last-position projection `last` [B] (and with `capture` sum h there);
        after the last layer, fold the pass's projections into each running row's sums."""
        self.step_proj[:, layer] = last
        if self.act_sum is not None:
            self.act_sum[:, layer].index_add_(0, self.index, h[:, -1].float() * self.running[:, None])
        if layer == self.n_layers - 1:
            self._fold()

    def _fold(self) -> None:
        """The pass's projections [B, L] into each row's sums: its prompt's (on the prefill), the sum
        and the last over its reply positions (running rows only), and the positions counted."""
        p, running = self.step_proj, self.running[:, None]
        if self.prefilling:
            self.proj_prompt.index_copy_(0, self.index, p)
        self.proj_sum.index_add_(0, self.index, p * running)
        self.proj_last.index_copy_(0, self.index, torch.where(running > 0, p, self.proj_last[self.index]))
        self.positions.index_add_(0, self.index, self.running)

    # -- results -------------------------------------------------------------------------------------
    def summaries(self, rows: Sequence[int] | None = None) -> list[dict[str, Any] | None]:
        """Per row (of the call as given; all, or `rows`): `projection_summary` of what it summed;
        None for rows without a direction."""
        rows = list(range(len(self.has))) if rows is None else list(rows)
        at = torch.tensor(rows, dtype=torch.long, device=self.device)
        pick = {name: getattr(self, name)[at].cpu() for name in ("proj_sum", "proj_prompt", "proj_last", "positions")}
        return [projection_summary(pick["proj_sum"][i], pick["proj_prompt"][i], pick["proj_last"][i],
                                   pick["positions"][i], self.low[b], self.high[b], *self.named[b])
                if self.has[b] else None for i, b in enumerate(rows)]

    def mean_activations(self) -> torch.Tensor:
        """[B, L, d] each row's mean hidden state over its reply positions (`capture`)."""
        return (self.act_sum / self.positions.clamp_min(1.0)[:, None, None]).cpu()


def steer_stream(h: torch.Tensor, unit: torch.Tensor, unit_h: torch.Tensor, add: torch.Tensor, tau: torch.Tensor,
                 *, adds: bool, caps: bool, every: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual steers' arithmetic, one definition for every engine: rows' streams h [B, q, d]
    (the transformers engine: batch rows and their positions; vLLM's: one token per row), each
    row's unit direction `unit` [B, d] (float32) and `unit_h` (in h's dtype), `add` [B] (h's dtype)
    and the cap `tau` [B] (float32; -inf: none). `adds` and `caps` say whether to do each (a
    layer where no row does skips the ops). Returns (h steered, p): p [B, q] every position's
    projection after steering with `every` (capping needs them anyway), else [B, 1] the last's."""
    v = unit_h[:, None, :]
    if adds:
        h = h + add[:, None, None] * v
    if not (caps or every):
        return h, torch.linalg.vecdot(h[:, -1].float(), unit)[:, None]
    p = torch.einsum("bqd,bd->bq", h.float(), unit)
    if caps:
        lift = (tau[:, None] - p).clamp_min(0.0)
        h = h + lift[..., None].to(h.dtype) * v
        p = p + lift
    return h, p


def projection_summary(proj_sum: torch.Tensor, proj_prompt: torch.Tensor, proj_last: torch.Tensor,
                       positions: torch.Tensor | float, low: torch.Tensor, high: torch.Tensor, direction: str,
                       band: Sequence[int]) -> dict[str, Any]:
    """A reply's projections per layer, normalised (0: like without the system prompt, 1: like with
    it): `reply` the mean over the positions that generated it, `prompt` the last prompt position's,
    `last` the last reply position's; with the direction's id and band (`Reply.activation`)."""
    span = high - low
    n = torch.as_tensor(positions, dtype=torch.float32).clamp_min(1.0)
    values = {"reply": (proj_sum / n - low) / span, "prompt": (proj_prompt - low) / span, "last": (proj_last - low) / span}
    return {"direction": direction, "band": list(band), **{k: _round(v) for k, v in values.items()}}


def _round(values: torch.Tensor) -> list[float]:
    return [round(float(x), 5) for x in values]
