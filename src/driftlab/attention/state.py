"""What the attention function should do on one generate call, per batch row.

`AttentionConfig` (driftlab.attention.config) is the serialisable description compiled
from `Interventions`; `AttentionState` is its per-call instantiation: key masks laid out
in the batch's padded key slots, head masks, and the pi traces it collects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from driftlab.attention.config import AttentionConfig, Heads, Span, heads_spec, parse_heads
from driftlab.errors import DriftlabError

__all__ = ["AttentionConfig", "AttentionState", "Heads", "Span", "head_mask", "heads_spec", "parse_heads"]


def head_mask(heads: Heads, n_layers: int, n_heads: int) -> torch.Tensor:
    """Boolean [n_layers, n_heads] mask of a head selection, with a range check."""
    if heads is None:
        return torch.ones(n_layers, n_heads, dtype=torch.bool)
    mask = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    for layer, head in heads:
        if not 0 <= layer < n_layers or (head is not None and not 0 <= head < n_heads):
            raise DriftlabError(
                f"Head selection ({layer}, {head}) is outside this model ({n_layers} layers x {n_heads} heads).",
                hint=f"Layers are 0..{n_layers - 1}, heads 0..{n_heads - 1}.",
            )
        if head is None:
            mask[layer] = True
        else:
            mask[layer, head] = True
    return mask


# Key blocks of a decode step's FlexAttention block masks (flex's default block size).
DECODE_BLOCK = 128


def system_blocks(system_keys: torch.Tensor, block: int = DECODE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The block mask rows of a decode step's system-only pass: ([B, 1, 1] int32 number of key
    blocks holding a system key of the row, [B, 1, 1, n] int32 their indices first, then the
    others), so the pass reads only those blocks, whatever the cache length."""
    B, K = system_keys.shape
    n = -(-K // block)
    padded = torch.zeros(B, n * block, dtype=torch.bool, device=system_keys.device)
    padded[:, :K] = system_keys
    has = padded.view(B, n, block).any(-1)  # [B, n]
    order = torch.argsort((~has).to(torch.int8), dim=-1, stable=True)  # system blocks first, in order
    return has.sum(-1).to(torch.int32).view(B, 1, 1), order.to(torch.int32).view(B, 1, 1, n)


def every_block(B: int, n_keys: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The block mask rows of a decode step that visits every key block of `n_keys`: ([B, 1, 1]
    int32 block count, [B, 1, 1, n] int32 block indices in order), each row its own memory
    (`flex.decode_block_mask` says why a shared, expanded row would not do)."""
    n = -(-n_keys // DECODE_BLOCK)
    order = torch.arange(n, dtype=torch.int32, device=device).repeat(B, 1).view(B, 1, 1, n)
    return torch.full((B, 1, 1), n, dtype=torch.int32, device=device), order


def bias_logits(keys: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """[B, H, 1, K] additive logits of one layer's key-bias slots: `keys` [J, B, K] per slot,
    `heads` [J, B, H] the heads each slot acts on, summed over the slots."""
    return (keys[:, :, None, None, :] * heads[:, :, :, None, None]).sum(0)


class AttentionState:
    """Per-call, per-row state handed to the attention function through forward kwargs."""

    def __init__(
        self,
        configs: AttentionConfig | Sequence[AttentionConfig],
        spans: Sequence[dict[str, list[Span]]],
        n_layers: int,
        n_heads: int,
        device: torch.device,
        shard: tuple[int, int] | None = None,
    ) -> None:
        """`configs` is one config for every row, or one per row (head profiling batches many
        single-head steerings at once; a server decodes requests of different steers together).
        Rows may differ in everything but prefill tracing, which is one setting per call. Where
        some rows trace pi, every row's is computed (the same attention calls serve all rows) and
        only the traced rows' is kept (`row_traces`; the decode loop's `_cut_traces`).
        `shard` = (first, end): this process holds only query heads [first, end) of the model's
        `n_heads` (tensor parallelism): head selections are read against the whole model, and every
        per-head tensor, floors and pi included, holds this shard's heads alone."""
        rows = [configs] * len(spans) if isinstance(configs, AttentionConfig) else list(configs)
        if len(rows) != len(spans):
            raise DriftlabError(f"{len(rows)} attention configs given for {len(spans)} rows.")
        if any(c.shared() != rows[0].shared() for c in rows):
            raise DriftlabError("The rows of one batch ask for different prefill tracing settings.",
                                hint="Trace every prompt of a batch or none (trace:prefill=true); run the others "
                                     "as separate requests.")
        self.config = rows[0]  # the shared settings (prefill tracing)
        self.rows = rows
        self.spans = spans
        self.shard, self.model_heads = slice(*(shard or (0, n_heads))), n_heads
        self.n_layers, self.n_heads, self.device = n_layers, self.shard.stop - self.shard.start, device
        self.trace = any(c.trace for c in rows)
        # Split-softmax as a strength per (row, layer, head): k on the row's selected heads, 1
        # (unchanged) elsewhere.
        split = torch.zeros(len(rows), n_layers, self.n_heads, dtype=torch.bool)
        table = torch.ones(len(rows), n_layers, self.n_heads)
        for b, c in enumerate(rows):
            if c.splits:
                split[b] = head_mask(c.split_heads, n_layers, n_heads)[:, self.shard]
                table[b] = torch.where(split[b], c.split_k, 1.0)
        self.split_table = table.to(device)
        # Key biases, grouped per row by head selection: slot j of row b holds the heads its terms
        # of one selection act on ([J, B, L, H], 0/1) and, once laid out, the sum of their key
        # biases ([J, B, slots]). Terms sharing a selection (InstABoost and a bias on every head)
        # share a slot, so a composed steer needs few: the static layout pads J to a fixed count.
        self._slot_of: list[list[int]] = []
        groups: list[list] = []
        for c in rows:
            heads = list(dict.fromkeys(term.heads for term in c.biases))
            groups.append(heads)
            self._slot_of.append([heads.index(term.heads) for term in c.biases])
        n_slots = max((len(g) for g in groups), default=0)
        bias_heads = torch.zeros(n_slots, len(rows), n_layers, self.n_heads)
        for b, heads in enumerate(groups):
            for j, selection in enumerate(heads):
                bias_heads[j, b] = head_mask(selection, n_layers, n_heads)[:, self.shard].float()
        self.bias_heads = bias_heads.to(device) if n_slots else None
        # Per-layer flags on the host: asking the device tensors would sync a GPU every layer.
        self._split_layers = split.any(dim=(0, 2)).tolist()
        self._bias_layers = bias_heads.any(dim=(0, 1, 3)).tolist() if n_slots else [False] * n_layers
        # pi-floor (`set_floors`): the floor per (row, layer, head) and each row's first floor slot;
        # zeros until set. Host-side: which rows have a floor on which layer, and their first slots.
        self.floor_table: torch.Tensor | None = None  # [B, L, H] float32
        self.floor_first: torch.Tensor | None = None  # [B] long: the absolute slot of each row's first floor query
        self.floor_queries: list[int] | None = None  # first_query as given (token index in the unpadded prompt)
        self._floor_rows: list[list[bool]] = []  # [B][L]: a floor > 0 on some head of that row and layer
        self._floor_layers = [False] * n_layers
        self._floor_from: int | None = None  # the first slot at which any floor acts
        self._acts = [self.trace or sp or bi for sp, bi in zip(self._split_layers, self._bias_layers)]
        self.system_keys: torch.Tensor | None = None
        self.system_slots: tuple[int, int] | None = None  # [first, last + 1) slot of any row's system key
        self.bias_keys: torch.Tensor | None = None  # [J, B, slots] additive logits per head-selection slot
        self.kv_len = 0
        self.records: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        # Static layout (a static KV cache, see `static_layout`): every call covers all key slots,
        # every layer of a decode step runs the steered step, and pi goes to `trace_buf` [L, B, H,
        # slots] at the index held in `step`.
        self.static = False
        # A plain decode on a static cache (`lean_layout`): only the key pattern's tensors, one pass.
        self.lean = False
        # The compiled step asks flex for its split-KV decoding kernel by name (a concrete batch).
        self.decode_kernel = False
        self.trace_buf: torch.Tensor | None = None
        self.step: torch.Tensor | None = None
        self.first: torch.Tensor | None = None  # [B] each row's first real slot (its padding)
        self.last_slot: torch.Tensor | None = None  # [] the slot of the current call's last query
        self.system_blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # decode block mask of system keys
        self.filled_blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # decode block mask of filled keys
        self.prompt_len = 0
        self.prefilling = True  # the current forward pass is the call's first (the prefill)
        self._calls = 0
        self.mask_memo: dict = {}  # the engine's per-mask facts, for the layers sharing a mask
        # Copies of the state on other devices: a model spread by a device map runs each layer
        # where its weights are, and the state must meet it there (one copy per device and call).
        self._copies: dict[tuple[str, torch.device], torch.Tensor] = {}

    @classmethod
    def lean_layout(cls, pads: list[int], prompt_len: int, max_len: int, n_layers: int, n_heads: int,
                    device: torch.device) -> AttentionState:
        """The state of a plain decode on a static cache: no steer, only where each row's keys
        start and which key blocks are filled, so the decode step attends over the filled blocks
        alone (attention.decode's lean step) instead of every allocated slot."""
        state = cls(AttentionConfig(), [{}] * len(pads), n_layers, n_heads, device)
        state.lean = True
        state.on_layout(pads, prompt_len, max_len)
        return state

    def on(self, name: str, device: torch.device) -> torch.Tensor | None:
        """The state tensor `name` (system_keys, bias_keys, bias_heads, split_table, floor_table,
        floor_first) on `device`."""
        tensor = getattr(self, name)
        if tensor is None or tensor.device == device:
            return tensor
        copy = self._copies.get((name, device))
        if copy is None:
            copy = self._copies[(name, device)] = tensor.to(device)
        return copy

    def first_keys(self, device: torch.device) -> torch.Tensor:
        """[B] each row's first key slot (its left padding) on `device`: the static layout's
        tensor, or one built once per layout (rows leaving the batch rebuild it), so a decode step
        masked from it copies nothing from the host."""
        if self.static:
            return self.on("first", device)
        held = self._copies.get(("first", device))
        if held is None:
            held = self._copies[("first", device)] = torch.tensor(self.pads, dtype=torch.long, device=device)
        return held

    # -- layout, set by the decode loop ------------------------------------------------------
    def on_layout(self, pads: list[int], prompt_len: int, max_len: int, ends: Sequence[int] | None = None) -> None:
        """Lay the row spans out in padded key slots: row b's token j sits at pads[b] + j.

        `ends[b]` is the slot after row b's prompt (default `prompt_len`): a teacher-forced
        continuation after it counts as generated for a bias with `scope="prompt"`.
        """
        B = len(pads)
        ends = list(ends) if ends is not None else [prompt_len] * B
        self.ends = ends
        self.pads = list(pads)
        if len(self.spans) != B:
            raise DriftlabError(f"{len(self.spans)} span sets given for a batch of {B}.")
        system = torch.zeros(B, max_len, dtype=torch.bool)
        for b, spans in enumerate(self.spans):
            for s, e in spans.get("system", []):
                system[b, pads[b] + s : pads[b] + e] = True
        self.system_keys = system.to(self.device)
        slots = torch.nonzero(system.any(dim=0)).flatten().tolist()
        self.system_slots = (slots[0], slots[-1] + 1) if slots else None
        if self.bias_heads is not None:
            keys = torch.zeros(self.bias_heads.shape[0], B, max_len)
            for b, (config, spans) in enumerate(zip(self.rows, self.spans, strict=True)):
                for slot, term in zip(self._slot_of[b], config.biases, strict=True):
                    if not spans.get(term.span):
                        continue  # nothing to emphasise or boost in this row
                    target = torch.zeros(max_len, dtype=torch.bool)
                    for s, e in spans[term.span]:
                        target[pads[b] + s : pads[b] + e] = True
                    end = ends[b] if term.scope == "prompt" else max_len
                    if term.invert:
                        target[pads[b] : end] = ~target[pads[b] : end]
                    target[end:] = False
                    keys[slot, b] += target.float() * term.value
            self.bias_keys = keys.to(self.device)
        self.kv_len = self.prompt_len = prompt_len
        self.records = [[] for _ in range(self.n_layers)]
        self._copies = {}
        if self.floor_queries is None or len(self.floor_queries) != B:  # no floor (yet): zeros
            self.floor_table = torch.zeros(B, self.n_layers, self.n_heads, device=self.device)
            self.floor_queries = [0] * B
            self._floor_rows = [[False] * self.n_layers for _ in range(B)]
        # The same rows laid out again (more slots): their floors stay, at slots of these pads.
        self.floor_first = torch.tensor([p + f for p, f in zip(self.pads, self.floor_queries, strict=True)],
                                        dtype=torch.long, device=self.device)
        self._floor_flags()

    def set_floors(self, values: torch.Tensor, first_query: Sequence[int]) -> None:
        """pi-floor: `values` [B, L, H] the floor of each row, layer and head of the model (0: none; the backend
        gives F * pi_1), `first_query[b]` the token index in row b's unpadded prompt of the first
        query the floor acts on (the queries before it are left alone). From there on, where the
        system keys get less than the floor (after any key bias and split-softmax's pi^k), they get
        the floor exactly, the other keys the rest, each part keeping its proportions.

        After `on_layout` (and before `static_layout`; after it, the values go into the static
        tensors in place). Reads the values on the host once, for the per-layer flags that let
        layers without a floor skip its work."""
        if self.system_keys is None:
            raise DriftlabError("set_floors needs the batch layout: call on_layout first.")
        B = len(self.pads)
        values = torch.as_tensor(values)
        if self.n_heads != self.model_heads and values.shape[-1] == self.model_heads:  # the model's: this shard's
            values = values[..., self.shard]
        first = [int(f) for f in first_query]
        if tuple(values.shape) != (B, self.n_layers, self.n_heads) or len(first) != B:
            raise DriftlabError(
                f"Floors of shape {tuple(values.shape)} for {len(first)} rows given to a batch of {B} rows "
                f"on a model of {self.n_layers} layers x {self.n_heads} heads.",
                hint="Give values [rows, layers, heads] and one first query per row.")
        host = values.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(host).all()) or bool((host < 0).any()) or bool((host > 1).any()):
            raise DriftlabError("A pi floor is not a finite attention mass in [0, 1].",
                                hint="Floors are F * pi_1 with 0 <= F <= 1.")
        if any(f < 0 for f in first):
            raise DriftlabError(f"First floor queries {first} include a negative token index.")
        self.floor_queries = first
        self._floor_rows = (host > 0).any(dim=2).tolist()
        table = host.to(self.device)
        first_slots = torch.tensor([p + f for p, f in zip(self.pads, first, strict=True)], dtype=torch.long,
                                   device=self.device)
        if self.static:  # the arena's tensors, which a captured step reads at their addresses
            self.floor_table.copy_(table)
            self.floor_first.copy_(first_slots)
        else:
            self.floor_table, self.floor_first = table, first_slots
        self._copies = {}
        self.mask_memo.clear()  # the engine's memo of which queries the floor is on
        self._floor_flags()

    @property
    def has_floors(self) -> bool:
        """Whether some row has a pi floor: floors are set after a layout (`set_floors`), so laying
        the rows out again would lose them."""
        return any(self._floor_layers)

    def _floor_flags(self) -> None:
        """The host-side flags of the floors: per layer, and the first slot any floor acts at."""
        rows = [b for b, on in enumerate(self._floor_rows) if any(on)]
        self._floor_layers = [any(self._floor_rows[b][layer] for b in rows) for layer in range(self.n_layers)]
        self._floor_from = min((self.pads[b] + self.floor_queries[b] for b in rows), default=None)
        self._acts = [self.trace or sp or bi or fl
                      for sp, bi, fl in zip(self._split_layers, self._bias_layers, self._floor_layers, strict=True)]

    def select_rows(self, keep: Sequence[int]) -> None:
        """Keep only the batch positions `keep`, in that order (the decode loop drops rows that
        are done). The dynamic layout only: a static one keeps its shapes; pi records are kept per
        batch position, so the decode loop cuts them per row first."""
        if self.static or (self.trace and self.records[0]):
            raise DriftlabError("Rows cannot leave a batch laid out statically, or one whose pi records are "
                                "not yet cut per row (Decoding._cut_traces).")
        index = torch.tensor(list(keep), dtype=torch.long, device=self.system_keys.device)
        self.rows = [self.rows[i] for i in keep]
        self.spans = [self.spans[i] for i in keep]
        self.pads = [self.pads[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        self.system_keys = self.system_keys[index]
        self.split_table = self.split_table[index]
        self.floor_table, self.floor_first = self.floor_table[index], self.floor_first[index]
        self.floor_queries = [self.floor_queries[i] for i in keep]
        self._floor_rows = [self._floor_rows[i] for i in keep]
        self.trace = any(c.trace for c in self.rows)  # once the last traced row leaves, pi costs nothing
        self._floor_flags()
        if self.bias_keys is not None:
            self.bias_keys = self.bias_keys[:, index]
            self.bias_heads = self.bias_heads[:, index]
        self.mask_memo, self._copies = {}, {}

    def static_layout(self, arena: dict[str, torch.Tensor] | None = None, bias_slots: int = 4) -> None:
        """Switch to a static KV cache's layout (after `on_layout`, whose `max_len` is the cache length).

        Why: a compiled or CUDA-graph-captured decode step is specialised on every Python value
        it reads (dynamo guards on them: a changing int or list means a recompile), and a
        captured graph reads tensors at fixed addresses. So a decode step here reads tensors
        only, of shapes that do not depend on the steer, and does the same work whatever it is
        (every layer of a decode step runs `attention.decode.steered_step`): key biases as
        `bias_slots` head-selection slots (zeros where unused), split-softmax as a strength per
        (layer, head) (1: unchanged), pi written in place into `trace_buf` [L, B, H, slots] at the
        step index held in `step` (a list append would change per step, and a graph's outputs are
        overwritten by its next replay), the query's slot in `last_slot`, the rows' first slots in
        `first`, each row's system-key blocks in `system_blocks` (the decode block mask of the
        system-only pass), and pi-floor's table [B, L, H] and first slots [B] in `floor_table` and
        `floor_first` (zeros without a floor: a floor of 0 never binds). A new strength, span, head
        set, kind or floor is new values in the same tensors: nothing compiles again. `arena` holds
        the tensors of earlier calls of the same shapes: the values are copied into them, so a
        captured graph sees this call's state.
        """
        self.static = True
        arena = {} if arena is None else arena

        def put(name: str, value: torch.Tensor) -> torch.Tensor:
            held = arena.get(name)
            if held is None or held.shape != value.shape or held.dtype != value.dtype or held.device != value.device:
                held = arena[name] = value.clone()
                torch._dynamo.mark_static_address(held)
            else:
                held.copy_(value)
            return held

        B, K = self.system_keys.shape
        count, every = every_block(B, K, self.device)
        # The all-keys block mask of a decode step: its filled blocks, counted in `forward_kwargs`.
        self.filled_blocks = (put("filled", torch.zeros_like(count)), put("every", every))
        self.step = put("step", torch.zeros(1, dtype=torch.long, device=self.device))
        self.first = put("first", torch.tensor(self.pads, dtype=torch.long, device=self.device))
        self.last_slot = put("last_slot", torch.zeros((), dtype=torch.long, device=self.device))
        if self.lean:
            return
        J = max(bias_slots, 0 if self.bias_heads is None else self.bias_heads.shape[0])
        keys = torch.zeros(J, B, K, device=self.device)
        heads = torch.zeros(J, B, self.n_layers, self.n_heads, device=self.device)
        if self.bias_heads is not None:
            keys[: self.bias_keys.shape[0]] = self.bias_keys
            heads[: self.bias_heads.shape[0]] = self.bias_heads
        self.bias_keys, self.bias_heads = put("bias_keys", keys), put("bias_heads", heads)
        self.system_keys = put("system_keys", self.system_keys)
        self.split_table = put("split_table", self.split_table)
        self.floor_table = put("floor_table", self.floor_table)
        self.floor_first = put("floor_first", self.floor_first)
        self.system_blocks = tuple(put(f"system_blocks.{i}", t) for i, t in enumerate(system_blocks(self.system_keys)))
        self.trace_buf = put("trace", torch.zeros(self.n_layers, B, self.n_heads, K, device=self.device))

    def resume(self) -> None:
        """This state takes over a running batch (rows joined it): its next pass is a decode step."""
        self._calls = max(self._calls, 1)

    def forward_kwargs(self, kv_len: int) -> dict:
        """Called by the decode loop before each forward pass: `kv_len` is the number of key slots."""
        self.kv_len = kv_len
        self.prefilling = self._calls == 0
        # Masks are shared by the layers of one forward pass only (each pass gets its own from
        # transformers): the memo holds this pass's, so it stays bounded over a long decode.
        self.mask_memo.clear()
        if self.step is not None:  # outside any compiled region: the graph reads them
            slot = self.prompt_len - 1 + self._calls  # the prefill ends at the prompt's last slot
            self.step.fill_(self._calls)
            self.last_slot.fill_(slot)
            self.filled_blocks[0].fill_(slot // DECODE_BLOCK + 1)
        self._calls += 1
        return {"driftlab": self}

    # -- queried by the attention function ---------------------------------------------------
    def acts_on(self, layer: int) -> bool:
        return self._acts[layer]

    def query_end(self) -> int:
        """The slot after the current call's last query: its queries are the last q before it (a
        static layout's calls end at the prompt's end, then one slot further per decode step)."""
        return self.prompt_len + self._calls - 1 if self.static else self.kv_len

    def layer_floor(self, layer: int, q: int, device: torch.device | None = None) -> torch.Tensor | None:
        """[B, H, q, 1] float32 pi floor of each head and query of the current call at `layer` (0 on
        the queries before their row's first floor slot), or None where no floor acts on the call."""
        if not self._floor_layers[layer] or self.query_end() <= self._floor_from:
            return None
        device = device or self.device
        tag = ("floor", self.query_end(), q, str(device))  # which queries are on: shared by the layers of a pass
        on = self.mask_memo.get(tag)
        if on is None:
            slots = torch.arange(self.query_end() - q, self.query_end(), device=device)
            on = self.mask_memo[tag] = (slots[None, :] >= self.on("floor_first", device)[:, None])[:, None, :, None]
        return torch.where(on, self.on("floor_table", device)[:, layer, :, None, None], 0.0)

    def split_strength(self, layer: int, device: torch.device | None = None) -> torch.Tensor | None:
        """[B, H] split-softmax strength of each row and head of `layer` (1: unchanged), or None
        where no head of the layer splits in any row."""
        if not self._split_layers[layer]:
            return None
        return self.on("split_table", device or self.device)[:, layer]

    def system_range(self, lo: int, hi: int) -> tuple[int, int] | None:
        """[a, b) relative to a call whose keys are absolute slots [lo, hi): the slots that
        may hold system keys (any row's), or None when none of them is among these keys."""
        if self.system_slots is None:
            return None
        a, b = max(self.system_slots[0], lo), min(self.system_slots[1], hi)
        return (a - lo, b - lo) if a < b else None

    def layer_bias(self, layer: int, lo: int, hi: int, device: torch.device | None = None) -> torch.Tensor | None:
        """[B, H, 1, K] additive logits for this layer's keys (the sum of the slots), or None."""
        if not self._bias_layers[layer]:
            return None
        device = device or self.device
        return bias_logits(self.on("bias_keys", device)[:, :, lo:hi], self.on("bias_heads", device)[:, :, layer])

    def biases_on(self, layer: int) -> bool:
        """Whether some key bias acts on `layer` (a host-side flag: no device sync)."""
        return self._bias_layers[layer]

    def lifted(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's key biases as one set of keys lifted against all the others (where they are that:
        `AttentionConfig.boosts_system` or `spares_one_span`, what `attention.kernels.boost_keys` serves):
        the set [B, K] bool (the system keys, or the keys a PASTA bias spares) and the lift [B, L, H]
        float32, a logit per layer and head (None without a bias). A bias is the same on every key of its
        set, so one slot of each row tells it: the first system key, or the first key PASTA lowers."""
        system = self.system_keys
        if self.bias_heads is None or self.bias_keys is None:
            return system, None
        spares = torch.tensor([c.spares_one_span for c in self.rows], device=system.device)
        lowered = self.bias_keys[0] != 0  # [B, K]: a PASTA row's one term (0 where its span is missing)
        keys = torch.where(spares[:, None], ~lowered, system)
        probe = torch.where(spares, lowered.to(torch.uint8).argmax(1), system.to(torch.uint8).argmax(1))
        values = self.bias_keys[:, torch.arange(len(probe), device=probe.device), probe]  # [J, B]
        values = torch.where(spares, -values, values)
        return keys, torch.einsum("jb,jblh->blh", values, self.bias_heads)

    def record(self, layer: int, pi: torch.Tensor) -> None:
        """Keep pi [B, H, q]: all queries on the prefill if asked, else only the last."""
        if self.trace_buf is not None:  # static layout: in place, at the step index (see static_layout)
            self.trace_buf[layer].index_copy_(-1, self.step, pi[..., -1:].to(self.trace_buf.dtype))
            if self.prefilling and self.config.trace_prefill:
                self.records[layer].append(pi.float())
            return
        keep = pi if (self.config.trace_prefill and not self.records[layer]) else pi[..., -1:]
        self.records[layer].append(keep.float())

    # -- results -------------------------------------------------------------------------------
    def row_traces(self, n_steps: Sequence[int], pads: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Per row: `decode` [n_tokens, L, H] (pi when predicting each generated token) and,
        with trace_prefill, `prefill` [prompt_tokens, L, H] (pi at each prompt query)."""
        if not self.trace or (not self.records[0] and (self.trace_buf is None or not self._calls)):
            return [{} for _ in n_steps]
        if self.trace_buf is not None:
            stacked = self.trace_buf[..., : self._calls]  # [L, B, H, F]
        else:
            # Layers of a device-mapped model record where they ran: gather them on the state's device.
            per_layer_last = [torch.cat([r[..., -1:] for r in recs], dim=-1).to(self.device)
                              for recs in self.records]  # [B,H,F]
            stacked = torch.stack(per_layer_last, dim=0)  # [L, B, H, F]
        out = []
        for b, n in enumerate(n_steps):
            if not self.rows[b].trace:  # computed alongside traced rows, not asked for
                out.append({})
                continue
            row = {"decode": stacked[:, b, :, :n].permute(2, 0, 1).cpu()}
            if self.config.trace_prefill:
                pre = torch.stack([recs[0][b].to(self.device) for recs in self.records], dim=0)  # [L, H, q0]
                row["prefill"] = pre[:, :, pads[b] :].permute(2, 0, 1).cpu()
            out.append(row)
        return out
