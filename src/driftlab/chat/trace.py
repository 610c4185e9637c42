"""pi traces as a typed object: what a traced reply (or a traced conversation) carries.

pi = the attention mass a query puts on the system-prompt keys, per layer and head. The
attention engine records it as raw tensors per forward pass (`AttentionState.row_traces`);
`Trace` is what leaves a backend: one immutable object per conversation, holding pi for the
prompt tokens (`prefill`) and for the generated ones (`decode`), the system span(s) it was
measured against, and the token strings, so that a user can tabulate, average, plot and
store it without knowing the engine's layout.

`trace(backend, messages, steer=None)` measures pi over a conversation without generating
anything (one prefill pass of a local model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from driftlab.errors import DriftlabError
from driftlab.messages import Conversation
from driftlab.steering.interventions import Interventions

if TYPE_CHECKING:
    import pandas
    from matplotlib.axes import Axes

__all__ = ["FORMAT", "Trace", "Tracer", "trace"]

FORMAT = "driftlab.trace"  # the `format` field of `Trace.to_dict()`
VERSION = 1
AXES = ("token", "layer", "head")
Phase = Literal["prefill", "decode"]


def _frozen(values: Any, name: str) -> np.ndarray:
    """A read-only float32 [tokens, layers, heads] copy of an array or a (CPU or device) tensor."""
    if hasattr(values, "detach"):  # a torch tensor: no torch import needed to read it
        values = values.detach().float().cpu().numpy()
    array = np.array(values, dtype=np.float32)  # a copy: the caller's buffer may change later
    if array.ndim != 3:
        raise DriftlabError(f"Trace.{name} must be [tokens, layers, heads]; got shape {array.shape}.")
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class Trace:
    """pi, the attention mass on the system prompt, per token x layer x head of one conversation.

    Why a type and not a dict of tensors: a trace is read far from where it was made (a
    notebook, a record, the decay protocol), and its meaning depends on facts the raw arrays
    do not carry: which tokens were "the system prompt", where the prompt ends, which token
    each row belongs to. Those travel with it here, and the arrays are read-only (numpy,
    float32), so a trace handed to several consumers cannot be changed by one of them.

    * `prefill` [prompt_length, L, H]: pi at each prompt query, i.e. while the model reads
      prompt token p (None when only decoding was traced: `trace` without `prefill=true`).
    * `decode` [generated, L, H]: pi at the query that predicted generated token i (the last
      prompt token's query for i = 0, so `decode[0] == prefill[-1]`); a stop token that ended
      the reply has its row too. Empty when nothing was generated (`HFChatBackend.trace`).
    * `system_spans`: the [start, end) prompt token ranges pi is the mass on (the renderer's
      span mode decides whether the template's header belongs to it).
    * `prompt_tokens`, `generated_tokens`: each token's text, where a tokenizer was at hand.
    """

    decode: np.ndarray
    prefill: np.ndarray | None = None
    prompt_length: int
    system_spans: tuple[tuple[int, int], ...] = ()
    prompt_tokens: tuple[str, ...] | None = None
    generated_tokens: tuple[str, ...] | None = None
    _shape: tuple[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        put("decode", _frozen(self.decode, "decode"))
        shape = self.decode.shape[1:]
        if self.prefill is not None:
            put("prefill", _frozen(self.prefill, "prefill"))
            if self.prefill.shape[1:] != shape:
                raise DriftlabError(f"Trace: prefill has {self.prefill.shape[1:]} (layers, heads), decode {shape}.")
            if self.prefill.shape[0] != self.prompt_length:
                raise DriftlabError(f"Trace: {self.prefill.shape[0]} prefill rows for a prompt of "
                                    f"{self.prompt_length} tokens.")
        put("prompt_length", int(self.prompt_length))
        put("system_spans", tuple((int(s), int(e)) for s, e in self.system_spans))
        for s, e in self.system_spans:
            if not 0 <= s < e <= self.prompt_length:
                raise DriftlabError(f"Trace: system span [{s}, {e}) is not inside the prompt's "
                                    f"{self.prompt_length} tokens.")
        for name, n in (("prompt_tokens", self.prompt_length), ("generated_tokens", self.decode.shape[0])):
            tokens = getattr(self, name)
            if tokens is not None:
                tokens = tuple(str(t) for t in tokens)
                if len(tokens) != n:
                    raise DriftlabError(f"Trace: {len(tokens)} {name} for {n} rows.")
                put(name, tokens)
        put("_shape", (int(shape[0]), int(shape[1])))

    # -- facts -----------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self._shape[0]

    @property
    def n_heads(self) -> int:
        return self._shape[1]

    @property
    def n_generated(self) -> int:
        return int(self.decode.shape[0])

    def phase(self, phase: Phase) -> np.ndarray:
        """The [tokens, L, H] array of one phase, or a one-line error if it was not traced."""
        if phase == "decode":
            return self.decode
        if phase == "prefill":
            if self.prefill is None:
                raise DriftlabError("This trace has no prefill (prompt) part.",
                                    hint="Trace with --steer trace:prefill=true, or use backend.trace(conversation).")
            return self.prefill
        raise DriftlabError(f"Unknown trace phase {phase!r}.", hint="Use 'prefill' or 'decode'.")

    def mean(self, over: Sequence[str] | str = ("layer", "head"), phase: Phase = "decode") -> np.ndarray:
        """pi averaged over some of the axes ("token", "layer", "head") of one phase.

        The default, pi per generated token averaged over all layers and heads, is the one
        number per token a drift curve plots (and what `driftlab chat --steer trace` prints);
        `over=("head",)` gives [tokens, layers], `over="token"` a [layers, heads] map.
        """
        names = (over,) if isinstance(over, str) else tuple(over)
        unknown = [n for n in names if n not in AXES]
        if unknown:
            raise DriftlabError(f"Trace.mean(over={names!r}): unknown axis {unknown[0]!r}.",
                                hint=f"Axes are {', '.join(AXES)}.")
        values = self.phase(phase)
        axes = tuple(sorted({AXES.index(n) for n in names}))
        return values.mean(axis=axes) if axes else values.copy()

    # -- views -----------------------------------------------------------------------------------
    def to_pandas(self) -> pandas.DataFrame:
        """Long format, one row per value: phase, position, token, layer, head, pi.

        `position` is the token's place in the whole sequence (prompt tokens 0..T-1, generated
        tokens T, T+1, ...); a prefill row holds pi while that prompt token is read, a decode
        row pi while that generated token was predicted (see the class docstring). `token` is
        its text (None without a tokenizer). Long format because that is what groupby, seaborn
        and CSV/parquet export take without reshaping.
        """
        try:
            import pandas as pd
        except ImportError:  # a declared dependency; only a broken environment lacks it
            raise DriftlabError("Trace.to_pandas needs pandas, which is not installed.",
                                hint="pip install pandas (a dependency of driftlab).") from None
        L, H = self._shape
        parts = []
        for name, values, start, tokens in (
            ("prefill", self.prefill, 0, self.prompt_tokens),
            ("decode", self.decode, self.prompt_length, self.generated_tokens),
        ):
            if values is None or not len(values):
                continue
            n = values.shape[0]
            positions = np.arange(start, start + n)
            parts.append(pd.DataFrame({
                "phase": name,
                "position": np.repeat(positions, L * H),
                "token": np.repeat(np.array(tokens if tokens is not None else [None] * n, dtype=object), L * H),
                "layer": np.tile(np.repeat(np.arange(L), H), n),
                "head": np.tile(np.arange(H), n * L),
                "pi": values.reshape(-1),
            }))
        if not parts:
            return pd.DataFrame({"phase": [], "position": [], "token": [], "layer": [], "head": [], "pi": []})
        out = pd.concat(parts, ignore_index=True)
        out["phase"] = out["phase"].astype("category")
        return out

    def plot(self, ax: Axes | None = None, layers: Sequence[int] | None = None,
             phase: Phase | None = None) -> Axes:
        """pi per token averaged over heads: one line per layer of `layers`, or (None) the mean
        over all layers. Returns the Axes (a new Agg figure's when `ax` is None).

        `phase` defaults to the generated tokens, or to the prompt for a trace without any (a
        conversation traced by `HFChatBackend.trace`), where the system span is shaded.
        Drawn like the decay report's figures (report/decay_figures.py): matplotlib without
        pyplot, so it works headless and in threads; `ax.figure.savefig(...)` writes it.
        """
        from matplotlib import colormaps
        from matplotlib.figure import Figure

        if phase is None:
            phase = "decode" if self.n_generated or self.prefill is None else "prefill"
        values = self.mean("head", phase)  # [tokens, layers]
        tokens = self.generated_tokens if phase == "decode" else self.prompt_tokens
        if ax is None:
            ax = Figure(figsize=(7, 3.6), layout="constrained").subplots()
        x = np.arange(values.shape[0])
        if layers is None:
            series = [(values.mean(axis=1), "mean over layers and heads", "#1f77b4")]
        else:
            layers = [int(layer) for layer in layers]
            bad = [layer for layer in layers if not 0 <= layer < self.n_layers]
            if bad or not layers:
                raise DriftlabError(f"Trace.plot(layers={layers}): layers are 0..{self.n_layers - 1}.")
            cmap = colormaps["viridis_r"]
            series = [(values[:, layer], f"layer {layer}", cmap(0.15 + 0.75 * i / max(1, len(layers) - 1)))
                      for i, layer in enumerate(layers)]
        for y, label, color in series:
            ax.plot(x, y, color=color, lw=1.1, label=label)
        if phase == "prefill":
            for i, (s, e) in enumerate(self.system_spans):
                ax.axvspan(s - 0.5, e - 0.5, color="0.85", zorder=0, label="system span" if i == 0 else None)
        if tokens is not None and 0 < len(tokens) <= 48:  # few enough to read each token
            ax.set_xticks(x, [repr(t)[1:-1] for t in tokens], rotation=90, fontsize=7)
        ax.set_xlabel("generated token" if phase == "decode" else "prompt token")
        ax.set_ylabel(r"$\pi$: attention on system prompt")
        top = max((float(np.nanmax(y)) for y, _, _ in series if len(y)), default=0.0)
        ax.set_ylim(0, min(1.0, max(0.05, top * 1.1)))
        ax.grid(alpha=0.25)
        ax.legend(fontsize=8, loc="upper right")
        ax.set_title(f"attention on the system prompt per {'generated' if phase == 'decode' else 'prompt'} token, "
                     "mean over heads", fontsize=9, loc="left")
        return ax

    # -- storage ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (lists, numbers, strings): what a record or a server writes.

        The arrays go as nested lists of float32 values (exact through JSON, so `from_dict`
        gives an equal trace); the shape is stated, so an empty decode part keeps it.
        """
        return {
            "format": FORMAT, "version": VERSION, "prompt_length": self.prompt_length,
            "n_layers": self.n_layers, "n_heads": self.n_heads,
            "system_spans": [list(s) for s in self.system_spans],
            "prefill": self.prefill.tolist() if self.prefill is not None else None,
            "decode": self.decode.tolist(),
            "prompt_tokens": list(self.prompt_tokens) if self.prompt_tokens is not None else None,
            "generated_tokens": list(self.generated_tokens) if self.generated_tokens is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        """The trace `to_dict` wrote (a one-line error for anything else)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise DriftlabError("Not a driftlab trace (no 'format': 'driftlab.trace').")
        if data.get("version") != VERSION:
            raise DriftlabError(f"driftlab trace version {data.get('version')!r} is not readable here "
                                f"(this driftlab reads version {VERSION}).")
        try:
            shape = (-1, int(data["n_layers"]), int(data["n_heads"]))
            grid = lambda v: np.asarray(v, dtype=np.float32).reshape(shape)  # noqa: E731
            return cls(
                decode=grid(data["decode"]),
                prefill=grid(data["prefill"]) if data.get("prefill") is not None else None,
                prompt_length=int(data["prompt_length"]),
                system_spans=tuple(tuple(s) for s in data.get("system_spans", ())),
                prompt_tokens=data.get("prompt_tokens"), generated_tokens=data.get("generated_tokens"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise DriftlabError(f"A malformed driftlab trace: {type(err).__name__}: {err}.") from None

    # -- comparisons and the earlier dict form ---------------------------------------------------
    def __repr__(self) -> str:  # the arrays would fill a screen
        return (f"Trace(prompt_length={self.prompt_length}, generated={self.n_generated}, layers={self.n_layers}, "
                f"heads={self.n_heads}, prefill={self.prefill is not None}, system_spans={list(self.system_spans)})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        same_prefill = (self.prefill is None and other.prefill is None) or (
            self.prefill is not None and other.prefill is not None and np.array_equal(self.prefill, other.prefill))
        return (same_prefill and np.array_equal(self.decode, other.decode)
                and (self.prompt_length, self.system_spans, self.prompt_tokens, self.generated_tokens)
                == (other.prompt_length, other.system_spans, other.prompt_tokens, other.generated_tokens))

    __hash__ = None  # type: ignore[assignment]  (arrays: equal by value, not hashable)

    def __getitem__(self, key: str):
        """`trace["decode"]` / `trace["prefill"]`: a torch tensor, as the dict `Reply.trace` was
        before this type; kept so that code written against it (benchmarks, scripts) still runs.
        New code reads `.decode` / `.prefill` (numpy)."""
        if key not in ("decode", "prefill") or (key == "prefill" and self.prefill is None):
            raise KeyError(key)
        import torch

        return torch.from_numpy(np.array(getattr(self, key)))  # a writable copy


def trace_of(tokenizer: Any, row: dict[str, Any], prompt: Sequence[int], generated: Sequence[int],
             spans: dict[str, list[tuple[int, int]]]) -> Trace | None:
    """The typed Trace of one row of `AttentionState.row_traces` (None where nothing was traced),
    with the token texts (one decode per token: what each row of pi belongs to)."""
    if not row:
        return None

    def texts(ids: Sequence[int]) -> tuple[str, ...]:  # (batch_decode([]) is [""], not [])
        return tuple(tokenizer.batch_decode([[int(t)] for t in ids])) if len(ids) else ()

    return Trace(decode=row["decode"], prefill=row.get("prefill"), prompt_length=len(prompt),
                 system_spans=tuple(spans.get("system", ())), prompt_tokens=texts(prompt),
                 generated_tokens=texts(generated))


@runtime_checkable
class Tracer(Protocol):
    """A backend that measures pi over a conversation without generating (a local model)."""

    name: str

    def trace(self, conversation: Conversation, *, interventions: Interventions | None = None) -> Trace:
        ...


def trace(backend: Any, messages: Conversation, steer: Interventions | Sequence[str] | str | None = None) -> Trace:
    """pi over `messages` as the model reads them, under the interventions of `steer`.

    One prefill pass, no token generated: the way to ask how much a model attends to its
    system prompt at every position of a conversation (a replayed dialog ends with the
    assistant's turn and is traced as it stands; otherwise the generation prompt is added,
    as the model would see it before replying). `steer` takes `--steer` specs or
    `Interventions` (what pi is under split-softmax, PASTA, ...).
    """
    interventions = steer if isinstance(steer, Interventions) else Interventions.parse(
        [steer] if isinstance(steer, str) else steer)
    # (chat.base's `token_backend` says the same for token work; base imports this module.)
    if not isinstance(backend, Tracer):
        raise DriftlabError(f"{getattr(backend, 'name', type(backend).__name__)} is not a local model; "
                            "tracing pi needs its attention.",
                            hint="Use a preset name or a local Hugging Face model directory.")
    return backend.trace(messages, interventions=interventions)
