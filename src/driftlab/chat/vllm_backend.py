"""A model in vLLM's engine as a driftlab backend (`--model vllm:NAME`), steered and traced per request.

Why: people who outgrow one GPU serve with vLLM (tensor parallelism, paged attention, prefix
caching, continuous batching). This backend runs vLLM's engine in the driftlab process and keeps
every contract the transformers engine keeps (ChatBackend, ScoringBackend, TokenBackend), so
`run`, `mmlu`, `sweep`, `calibrate`, `directions`, `project` and `decay` work on it unchanged.

driftlab renders each conversation itself (the same renderer, hence the same tokens and system
span as the transformers engine) and sends token prompts; a request's steer travels as data in
its sampling parameters (`vllm_engine.payload`), and the engine's worker
(`vllm_engine.worker.DriftlabWorker`) applies it with driftlab's own math. pi, projections and
activations come back from the worker per request (`collective_rpc("driftlab_take")`).

A steered request's KV cache is kept apart from plain requests' and other steers' (a cache salt
of its steer), so prefix caching stays on: a cached system prompt still counts in pi and in the
split, and a steer never reads KV computed under another.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from driftlab.chat import gate
from driftlab.chat.base import (
    Capabilities,
    ChatRequest,
    Conversation,
    LogLikelihood,
    Rendered,
    Reply,
    Sampling,
    TokenLogprob,
    model_shape,
    scored_pairs,
    system_of,
    validate_conversation,
)
from driftlab.chat.directions import row_directions
from driftlab.chat.spec import VLLM_PREFIX, VLLM_REFUSED, Runtime
from driftlab.chat.templates import Renderer
from driftlab.chat.trace import Trace
from driftlab.chat.vllm_engine.install import load_vllm
from driftlab.chat.vllm_engine.payload import SteerPayload
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import KINDS, Interventions
from driftlab.steering.interventions import Trace as TraceIntervention

logger = logging.getLogger(__name__)

WORKER = "driftlab.chat.vllm_engine.worker.DriftlabWorker"
# Head sizes vLLM 0.32's CPU attention kernel takes (CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_KV_CACHE_BYTES = 2 << 30  # a CPU host's default KV cache: vLLM's default takes 92% of the machine
# vLLM keeps its parallel state per process: two live engines in one process break each other.
_live: weakref.ref | None = None
class VLLMChatBackend:
    """A model in vLLM's engine: a `ChatBackend`, `ScoringBackend` and `TokenBackend`, steered per request."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(interventions=frozenset(KINDS) - set(VLLM_REFUSED), loglikelihood=True, tokens=True,
                            distributions=True)

    def __init__(self, model: str, *, dtype: str = "auto", span_mode: str = "content", decode: str = "auto",
                 directions: str | None = None, runtime: Runtime = Runtime(), seed: int = 0) -> None:
        """`model` is what follows `vllm:` (a preset, a local HF directory or a Hub id). `decode`
        `compiled` runs vLLM's compiled mode (torch.compile of the forward pass; minutes to start on
        a CPU), anything else eager. `runtime` holds the engine's options (tensor-parallel size,
        memory fraction, longest context, prefix caching)."""
        from driftlab.assets import resolve_model
        from driftlab.chat.loading import pick_dtype

        self.name = VLLM_PREFIX + model
        self._closed = True  # until the engine stands
        vllm = load_vllm()
        path = Path(resolve_model(model))
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.path, self.shape = path, model_shape(config)
        text = config.get_text_config()
        self.d_model = int(text.hidden_size)
        head_dim = int(getattr(text, "head_dim", None) or self.d_model // self.shape.heads)
        if torch.cuda.is_available():
            raise DriftlabError("driftlab's vLLM adapter maps vLLM's CPU backend only; on a GPU its attention backend "
                                "and worker would need their own mapping (docs/vllm.md, 'On a GPU').",
                                hint="On a GPU, serve with `vllm serve` and measure it as openai:NAME, or run the "
                                     "transformers engine (drop 'vllm:').")
        if head_dim not in CPU_HEAD_SIZES:
            raise DriftlabError(f"{model} has attention heads of size {head_dim}, which vLLM's CPU attention kernel "
                                f"does not take (it takes {', '.join(map(str, CPU_HEAD_SIZES))}).",
                                hint="Run it on the transformers engine (drop 'vllm:').")
        torch_dtype = pick_dtype(dtype, torch.device("cpu"))
        self.renderer = Renderer(self.tokenizer, span_mode)
        try:
            generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:
            generation = None
        self.eos_ids = self.renderer.eos_ids(config, generation)
        self.stop_ids = frozenset(self.eos_ids)
        self.stop_strings = self.renderer.stop_strings
        self.runtime, self.decode_mode, self.dtype = runtime, decode, torch_dtype
        if runtime.tensor_parallel > 1:
            _cpu_binding(runtime.tensor_parallel)
        global _live
        held = _live() if _live is not None else None
        if held is not None and not held._closed:
            raise DriftlabError(f"{held.name} already runs in vLLM's engine in this process, and vLLM keeps one engine "
                                "per process.", hint="Close it first (backend.close()), or run the other in its own process.")
        memory = ({"gpu_memory_utilization": runtime.memory_fraction} if runtime.memory_fraction is not None else
                  {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES})
        self.llm = vllm.LLM(
            model=str(path), tokenizer=str(path), dtype=str(torch_dtype).removeprefix("torch."), seed=seed,
            enforce_eager=decode != "compiled", max_model_len=runtime.max_model_len,
            enable_prefix_caching=runtime.prefix_caching, tensor_parallel_size=runtime.tensor_parallel,
            worker_cls=WORKER, disable_log_stats=True, **memory)
        self._closed = False
        _live = weakref.ref(self)
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        self.directions = None
        self.cached_prompt_tokens = 0  # prompt tokens served from vLLM's prefix cache, over every call
        self._pi_firsts: dict[tuple, list[list[float]]] = {}
        self.use_directions(directions)

    def close(self) -> None:
        """Shut the engine down (its memory and vLLM's per-process state), so that another may start. Idempotent."""
        if not self._closed:
            self._closed = True
            self.llm.llm_engine.engine_core.shutdown()

    def __enter__(self) -> VLLMChatBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the contracts ----------------------------------------------------------------------------------
    def use_directions(self, directions) -> None:
        """Take persona directions (a path to a `driftlab directions` output, or None): the worker loads
        the same file, so requests name a direction by its persona id."""
        from driftlab.activation.directions import Directions

        if directions is not None and not isinstance(directions, Directions):
            directions = Directions.load(directions)
        if directions is not None:
            directions.check_model(self.name, self.shape.layers, self.d_model)
            if directions.path is None:
                raise DriftlabError("The vLLM engine reads persona directions from disk, and these are in memory.",
                                    hint="Save them (Directions.save(DIR)) and pass the directory.")
        self.llm.collective_rpc("driftlab_use_directions", args=(str(directions.path) if directions else None,))
        self.directions = directions

    def describe(self) -> dict[str, Any]:
        from driftlab.assets import pulled_info
        from driftlab.chat.vllm_engine.install import installed_version

        name = self.name[len(VLLM_PREFIX):]
        meta: dict[str, Any] = {"name": self.name, "backend": "vllm", "vllm": installed_version(), "path": str(self.path),
                                "dtype": str(self.dtype).removeprefix("torch."), "span_mode": self.renderer.span_mode,
                                "max_context": self.max_context,
                                "compiled": not self.llm.llm_engine.vllm_config.model_config.enforce_eager}
        info = pulled_info(name) if "/" not in name and "@" not in name else None
        if info:
            meta["preset"] = info
        if self.directions is not None:
            meta["directions"] = self.directions.describe()
        return meta

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def render(self, conversation: Conversation, add_generation_prompt: bool = True,
               interventions: Interventions | None = None) -> Rendered:
        """The tokens the model is given, exactly as the transformers engine renders them (`Renderer.render_for`)."""
        return self.renderer.render_for(conversation, add_generation_prompt, interventions)

    def generate(self, request: ChatRequest) -> list[Reply]:
        """The next assistant turn of each conversation; conversation edits (SPR) as the transformers
        engine makes them, every other steer inside vLLM's batch. The serving callbacks (on_token,
        on_logprob, on_finish, cancelled, admit) work as ChatRequest says: rows stream, leave when
        cancelled, and join the running batch between steps."""
        hooks = {name: getattr(request, name) for name in ("on_token", "on_logprob", "on_finish", "cancelled")}
        admit = request.admit
        rendered, sampling, ivs, systems, gates = self._rows_of(request)
        return self._run(rendered, sampling, ivs, systems, gates=gates, seeds=request.row_seeds(),
                         logprobs=request.logprobs,
                         row_max_tokens=request.row_max_tokens,
                         admit=(lambda: self._admitted(admit(), request.logprobs)) if admit is not None else None,
                         **hooks)

    def _rows_of(self, request: ChatRequest) -> tuple[list[Rendered], Sampling, list[Interventions], list[str | None],
                                                      list[dict | None]]:
        """A request's rows: rendered, each with its own steer (`when-drifting` decides per row) and
        system prompt, and the gate's decisions."""
        iv = request.interventions
        self._require(iv)
        convs = [c if isinstance(c, Rendered) else iv.model_view(c) for c in request.conversations]
        rendered = [c if isinstance(c, Rendered) else self.render(c, interventions=iv) for c in convs]
        systems = [system_of(c) for c in convs]
        ivs, gates = gate.gated(self, rendered, iv, systems)
        return rendered, request.sampling, ivs, systems, gates

    def _admitted(self, more: ChatRequest | None, logprobs: int | None) -> list[_Row]:
        """The rows of a request joining a running batch (continuous batching): any sampling and steer,
        the batch's log-probs setting."""
        if more is None or not more.conversations:
            return []
        if more.logprobs != logprobs:
            raise DriftlabError("Rows joining a running batch must share its log-probs setting.")
        rendered, sampling, ivs, systems, gates = self._rows_of(more)
        limits = more.row_max_tokens or [sampling.max_new_tokens] * len(rendered)
        return [self._row(r, sampling, iv, system, seed, logprobs, limit, gate=g, unique=False, keep_prefill=False,
                          capture=False)
                for r, iv, system, seed, limit, g in zip(rendered, ivs, systems, more.row_seeds(), limits, gates,
                                                         strict=True)]

    def generate_tokens(self, prompts: Sequence[Rendered], sampling: Sampling, *, seeds: Sequence[int] | None = None,
                        interventions: Interventions | Sequence[Interventions] = Interventions(),
                        cache_store: Sequence[bool] | None = None, logprobs: int | None = None,
                        on_token=None, cancelled=None) -> list[Reply]:
        """Continue rendered prompts, one steer for all rows or one per row (`on_token` and `cancelled`
        as in ChatRequest)."""
        rows = [interventions] * len(prompts) if isinstance(interventions, Interventions) else list(interventions)
        if len(rows) != len(prompts):
            raise DriftlabError(f"{len(rows)} interventions given for {len(prompts)} prompts.")
        for iv in rows:
            self._require(iv)
            if "when-drifting" in iv.kinds:
                raise DriftlabError("when-drifting compares a conversation's turns, which token prompts do not mark.",
                                    hint="Use generate() with conversations for when-drifting.")
        seeds = list(seeds) if seeds is not None else list(range(len(prompts)))
        return self._run(list(prompts), sampling, rows, [None] * len(prompts), seeds=seeds, logprobs=logprobs,
                         on_token=on_token, cancelled=cancelled)

    def generate_activations(self, request: ChatRequest) -> tuple[list[Reply], torch.Tensor]:
        """`generate`, and each row's mean residual activation per layer over the positions that generated
        its reply ([B, L, d] float32): what the directions protocol takes differences of means over."""
        rendered, sampling, ivs, systems, gates = self._rows_of(request)
        replies, taken = self._run(rendered, sampling, ivs, systems, gates=gates, seeds=request.row_seeds(),
                                   capture=True)
        acts = [t["acts"][: max(1, len(r.token_ids) + (r.finish_reason == "stop"))].mean(0)
                for r, t in zip(replies, taken, strict=True)]
        return replies, torch.stack(acts)

    def loglikelihood(self, contexts: Sequence[Conversation], continuations: Sequence[str],
                      interventions: Interventions = Interventions(), *, batch_size: int = 8) -> list[LogLikelihood]:
        """log p(continuation | context) for each pair, under the steer, from vLLM's prompt log-probs (one
        prefill per pair; the continuation's tokens are scored as the prompt's last tokens)."""
        if len(contexts) != len(continuations):
            raise DriftlabError(f"{len(contexts)} contexts but {len(continuations)} continuations.")
        self._require(interventions)
        if interventions.gated() is not None:
            return gate.gated_loglikelihood(self, contexts, continuations, interventions, batch_size)
        iv = interventions.without("trace")
        from vllm import SamplingParams

        prompts, params, n_cont = [], [], []
        for view, rendered, cont_ids in scored_pairs(self, contexts, continuations, iv):
            ids = rendered.ids + cont_ids
            self._check_context(len(ids), 1)
            payload = self._payload(rendered, iv, system_of(view), prompt_len=len(rendered.ids))
            prompts.append(self._prompt(ids, payload, iv))
            extra = payload.extra_args() if payload is not None else None
            params.append(SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False,
                                         extra_args=extra))
            n_cont.append(len(cont_ids))
        if self._closed:
            raise DriftlabError(f"The vLLM engine of {self.name} is closed.", hint="Start a new backend to generate again.")
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        self._take([p.extra_args["driftlab"]["id"] for p in params if p.extra_args])
        out = []
        for output, n in zip(outputs, n_cont, strict=True):
            ids = output.prompt_token_ids
            entries = output.prompt_logprobs[-n:]
            total, greedy = 0.0, True
            for token, entry in zip(ids[-n:], entries, strict=True):
                total += entry[token].logprob
                greedy = greedy and entry[token].rank == 1
            out.append(LogLikelihood(total, n, greedy))
        return out

    def trace(self, conversation: Conversation, *, interventions: Interventions | None = None,
              add_generation_prompt: bool | None = None) -> Trace:
        """pi over a conversation as the model reads it (one prefill, traced at every prompt token)."""
        iv = interventions if interventions is not None else Interventions()
        self._require(iv)
        validate_conversation(conversation, 0)
        iv = Interventions.of(*iv.without("trace").items, TraceIntervention(prefill=True))
        conv = iv.model_view(conversation)
        if add_generation_prompt is None:
            add_generation_prompt = conv[-1]["role"] != "assistant"
        rendered = self.render(conv, add_generation_prompt, interventions=iv)
        (reply,) = self._run([rendered], Sampling(greedy=True, max_new_tokens=1), [iv], [system_of(conv)], seeds=[0],
                             prefill=True)
        return replace(reply.trace, decode=reply.trace.decode[:0], generated_tokens=())

    def project_prompts(self, prompts: Sequence[Rendered], systems: Sequence[str | None], *,
                        compute_from: Sequence[int] | None = None,
                        cache_store: Sequence[bool] | None = None) -> list[tuple[int, torch.Tensor]]:
        """Teacher-forced projections of rendered prompts onto their personas' directions: per row, (0,
        [T, L] float32) normalised (0: like without the system prompt, 1: like with it)."""
        if self.directions is None:
            raise DriftlabError(f"Projections need persona directions, and {self.name} was given none.",
                                hint="Pass --directions DIR (from driftlab directions).")
        found = row_directions(self.directions, systems, Interventions(), self.name)
        missing = [i for i, d in enumerate(found) if d is None]
        if missing:
            raise DriftlabError(f"Prompt {missing[0]} has a system prompt the directions at {self.directions.path} "
                                "hold no direction for.", hint="Compute directions for it (driftlab directions).")
        _, taken = self._run(list(prompts), Sampling(greedy=True, max_new_tokens=1), [Interventions()] * len(prompts),
                             list(systems), seeds=[0] * len(prompts), keep_prefill=True)
        out = []
        for direction, t in zip(found, taken, strict=True):
            values = t["prefill_proj"]
            out.append((0, (values - direction.low) / (direction.high - direction.low)))
        return out

    def drift_ratio(self, rendered: Rendered) -> float:
        """pi_t / pi_1 (`when-drifting`'s gauge, as the transformers engine defines it): the mean pi over
        layers and heads, plain attention, at the conversation's last token over that at its first
        turn's last token. Each is one traced token of vLLM's; the first turn's is kept."""
        first = self._pi_last(_first_turn(rendered, gate.first_turn_end(rendered.spans())), Interventions())
        now = self._pi_last(rendered, Interventions(), keep=False)
        return float(torch.tensor(now).mean() / torch.tensor(first).mean())

    def projection_drift(self, rendered: Rendered, system: str | None) -> tuple[float, float]:
        """The persona's normalised projection, mean over its band, at the first turn's last token and
        at the conversation's last (`when-drifting:by=projection`'s gauge): one teacher-forced prefill."""
        end = gate.first_turn_end(rendered.spans())
        band = list(gate.gate_direction(self.directions, system, self.name).band)
        ((_, values),) = self.project_prompts([rendered], [system])
        return float(values[end - 1, band].mean()), float(values[-1, band].mean())

    def prompt_logprobs(self, prompts: Sequence[Rendered], keep: Sequence[int], *,
                        interventions: Interventions = Interventions(), **_: Any) -> list[torch.Tensor]:
        """Teacher-forced next-token log-probabilities [keep[b], V] (float32) at the last keep[b] positions of
        each rendered prompt, as the transformers engine's `prompt_logprobs` (what `--kl` and `driftlab kl`
        read). vLLM hands out a prompt's top log-probabilities only, so the worker keeps the whole
        distributions of those positions (`SteerPayload.keep_logits`) and the engine generates one token.
        These reads share a cache salt of their own, so a dialog's next turn reuses the blocks its last
        read left; a prompt whose kept positions the cache already held (the same prompt read again) is
        read once more under a salt of its own, since a cached position is never computed."""
        if any(not 1 <= k <= len(p.ids) for k, p in zip(keep, prompts, strict=True)):
            raise DriftlabError("Each prompt's positions must lie within it.")
        self._require(interventions)
        steer = interventions.without("spr")
        if not prompts:
            return []
        kept = self._kept_logits(list(prompts), list(keep), steer, unique=False)
        again = [b for b, (lp, k) in enumerate(zip(kept, keep, strict=True)) if lp is None or lp.shape[0] != k]
        if again:
            for b, lp in zip(again, self._kept_logits([prompts[b] for b in again], [keep[b] for b in again], steer,
                                                      unique=True), strict=True):
                kept[b] = lp
        for lp, k in zip(kept, keep, strict=True):
            if lp is None or lp.shape[0] != k:  # a worker that never saw those positions computed
                raise DriftlabError(f"vLLM's worker kept {0 if lp is None else lp.shape[0]} of a prompt's last {k} "
                                    "positions.", hint="Run the KLs on the transformers engine (drop 'vllm:').")
        return kept

    def _kept_logits(self, prompts: list[Rendered], keep: list[int], steer: Interventions, *,
                     unique: bool) -> list[torch.Tensor | None]:
        """One token generated after each prompt; each prompt's kept log-distributions as the worker recorded
        them (None: none). `unique`: salts of their own (nothing read from vLLM's prefix cache)."""
        _, taken = self._run(prompts, Sampling(greedy=True, max_new_tokens=1), [steer] * len(prompts),
                             [None] * len(prompts), seeds=[0] * len(prompts), keep_logits=keep, prefill=unique)
        return [t.get("logprobs") for t in taken]

    def check_steer(self, conversation: Conversation, interventions: Interventions) -> None:
        """One-line errors, before any work, for a conversation a steer cannot act on (a kind vLLM cannot
        apply, a residual steer without a direction for its system prompt, a pi floor without a first
        turn): what a server asks of each request, so that one request never fails a batch."""
        self._require(interventions)
        row_directions(self.directions, [system_of(conversation)], interventions, self.name)
        if interventions.kinds & {"pi-floor", "when-drifting"}:
            spans = self.render(interventions.model_view(conversation), interventions=interventions).spans()
            if "pi-floor" in interventions.kinds:
                _floor_turn(spans)
            if "when-drifting" in interventions.kinds:
                gate.engine_reads(interventions.get("when-drifting"))
                gate.first_turn_end(spans)
                if interventions.get("when-drifting").by == "projection":
                    gate.gate_direction(self.directions, system_of(conversation), self.name)

    def residual_rows(self, systems: Sequence[str | None], interventions: Interventions) -> list:
        """Each row's residual-stream state (as the transformers engine's `residual_rows`)."""
        config = interventions.residual()
        return [None if found is None else found.row(config)
                for found in row_directions(self.directions, systems, interventions, self.name)]

    # -- internals ------------------------------------------------------------------------------------------
    def _require(self, iv: Interventions) -> None:
        for kind in sorted(iv.kinds & set(VLLM_REFUSED)):
            raise DriftlabError(f"{self.name} cannot apply --steer {kind}: {VLLM_REFUSED[kind]}.",
                                hint="Run it on the transformers engine (drop 'vllm:').")
        self.capabilities.require(self.name, iv)

    def _check_context(self, prompt_len: int, new_tokens: int) -> None:
        if prompt_len + new_tokens > self.max_context:
            raise DriftlabError(f"Prompt of {prompt_len} tokens plus {new_tokens} new tokens exceeds the engine's "
                                f"context of {self.max_context}.", hint="Use fewer rounds or fewer --max-new-tokens.")

    def _payload(self, rendered: Rendered, iv: Interventions, system: str | None, *, prompt_len: int | None = None,
                 prefill: bool = False, keep_prefill: bool = False, capture: bool = False,
                 keep_logits: int = 0) -> SteerPayload | None:
        """The request's steer as data, or None for a plain request (nothing to apply or record)."""
        (direction,) = row_directions(self.directions, [system], iv, self.name)
        steer = iv.without("spr")
        config = steer.attention()
        if not steer and direction is None and not (keep_prefill or capture or keep_logits):
            return None
        spans = rendered.spans()
        floors, first = None, 0
        if config is not None and config.floors:
            floors, first = self._floors(rendered, steer, spans)
        return SteerPayload(id=uuid.uuid4().hex, steer=tuple(steer.specs()), spans=spans,
                            prompt_len=prompt_len or len(rendered.ids),
                            direction=direction.id if direction is not None else None, floors=floors,
                            first_query=first, keep_prefill=keep_prefill, capture=capture, keep_logits=keep_logits)

    def _prompt(self, ids: list[int], payload: SteerPayload | None, iv: Interventions, *,
                unique: bool = False, reads: bool = False) -> dict[str, Any]:
        """vLLM's token prompt; a steer that changes the KV cache gets a salt of its own (prefix caching
        then never mixes its KV with another's), and so does a request that must compute every token.
        `reads`: a teacher-forced read (`prompt_logprobs`), whose blocks are kept apart from generation's,
        so that a reply's own cached blocks never stand in for the positions the read must compute."""
        prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        steer = iv.without("spr").fingerprint()
        direction = payload.direction if payload is not None else None
        if unique or (payload is not None and _prompt_scoped(iv)):
            return prompt | {"cache_salt": uuid.uuid4().hex}  # its KV as a prompt differs from its KV as generated
        if steer or (direction is not None and iv.residual() is not None and iv.residual().steers):
            prompt["cache_salt"] = f"{steer}|{direction}|{self.directions.digest if self.directions else ''}"
        if reads:
            prompt["cache_salt"] = f"reads|{prompt.get('cache_salt', '')}"
        return prompt

    def _floors(self, rendered: Rendered, steer: Interventions, spans) -> tuple[list[list[float]], int]:
        """pi-floor's values [L][H] (F times pi at the first turn's last prompt token, under the steer
        without its floor) and the first query it acts on, as the transformers engine sets them."""
        end = _floor_turn(spans)
        floor = steer.get("pi-floor").f
        held = self._pi_last(_first_turn(rendered, end), steer.without("pi-floor", "trace"))
        return [[floor * x for x in row] for row in held], end

    def _pi_last(self, rendered: Rendered, steer: Interventions, *, keep: bool = True) -> list[list[float]]:
        """[L][H] pi at the last token of `rendered` under `steer` (one traced token of vLLM's); with
        `keep`, kept per tokens and steer (a first turn: a dialog's later turns ask again)."""
        key = (tuple(rendered.ids), tuple(steer.specs()))
        held = self._pi_firsts.get(key)
        if held is None:
            traced = Interventions.of(*steer.items, TraceIntervention())
            (reply,) = self._run([rendered], Sampling(greedy=True, max_new_tokens=1), [traced], [None], seeds=[0])
            held = reply.trace.decode[0].tolist()
            if keep:
                self._pi_firsts[key] = held
        return held

    def _run(self, rendered: Sequence[Rendered], sampling: Sampling, ivs: Sequence[Interventions],
             systems: Sequence[str | None], *, seeds: Sequence[int], gates: Sequence[dict | None] | None = None,
             logprobs: int | None = None,
             row_max_tokens: Sequence[int] | None = None, prefill: bool = False, keep_prefill: bool = False,
             capture: bool = False, keep_logits: Sequence[int] | None = None, **hooks: Any):
        """Rows through vLLM's engine, step by step: the replies (with pi and projections), and with
        `keep_prefill`, `capture` or `keep_logits` (per row) also each row's raw record. `hooks` are
        ChatRequest's serving callbacks (on_token, on_logprob, on_finish, cancelled, admit): vLLM batches
        continuously, so a row admitted between steps joins the running batch whatever its sampling or steer."""
        run = _Run(self, sampling.ignore_eos, logprobs, **hooks)
        run.add([self._row(r, sampling, iv, system, int(seed), logprobs,
                           row_max_tokens[b] if row_max_tokens is not None else sampling.max_new_tokens,
                           gate=gates[b] if gates is not None else None,
                           unique=prefill or keep_prefill, keep_prefill=keep_prefill,
                           capture=capture, keep_logits=keep_logits[b] if keep_logits is not None else 0)
                 for b, (r, iv, system, seed) in enumerate(zip(rendered, ivs, systems, seeds, strict=True))])
        run.until_done()
        replies = [row.reply for row in run.rows]
        return (replies, [row.taken for row in run.rows]) if keep_prefill or capture or keep_logits else replies

    def _row(self, rendered: Rendered, sampling: Sampling, iv: Interventions, system: str | None, seed: int,
             logprobs: int | None, limit: int, gate: dict | None = None, **record: Any) -> _Row:
        """One request: its token prompt (salted by its steer), sampling parameters and payload; `gate`
        the `when-drifting` decision its reply reports."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not rendered.ids:
            raise DriftlabError("A prompt rendered to zero tokens.", hint="Give a non-empty conversation.")
        self._check_context(len(rendered.ids), limit)
        unique = record.pop("unique")
        payload = self._payload(rendered, iv, system, **record)
        params = SamplingParams(**_sampling(sampling, limit, seed, logprobs), detokenize=bool(self.stop_strings),
                                stop_token_ids=None if sampling.ignore_eos else sorted(self.stop_ids),
                                stop=list(self.stop_strings) or None,
                                output_kind=RequestOutputKind.DELTA, structured_outputs=_json(sampling),
                                extra_args=payload.extra_args() if payload is not None else None)
        prompt = self._prompt(rendered.ids, payload, iv, unique=unique, reads=bool(record.get("keep_logits")))
        return _Row(rendered, payload, prompt, params, gate)

    def _take(self, ids: Sequence[str | None]) -> list[dict[str, Any]]:
        """The worker's records of these payload ids ({} for a row without one)."""
        wanted = [i for i in ids if i is not None]
        shards = self.llm.collective_rpc("driftlab_take", args=(wanted,)) if wanted else []  # one list per worker
        got = {i: _joined([shard[n] for shard in shards]) for n, i in enumerate(wanted)}
        return [got.get(i) or {} if i is not None else {} for i in ids]

    def _reply(self, row: _Row, finish: str, ignore_eos: bool, logprobs: int | None) -> Reply:
        """A finished row's Reply: its text, trace and projections from the first n steps recorded."""
        sampled, taken, rendered = row.tokens, row.taken, row.rendered
        ended = not ignore_eos and bool(sampled) and sampled[-1] in self.eos_ids
        toks = sampled[:-1] if ended else sampled
        text = self.renderer.cut_stop(self.tokenizer.decode(toks, skip_special_tokens=True))
        trace = None
        if "pi" in taken or "prefill_pi" in taken:
            spans = rendered.spans()
            texts = lambda ids: tuple(self.tokenizer.batch_decode([[int(t)] for t in ids])) if ids else ()  # noqa: E731
            decode = taken.get("pi", torch.zeros(0, self.shape.layers, self.shape.heads))
            trace = Trace(decode=decode[: len(sampled)], prefill=taken.get("prefill_pi"), prompt_length=len(rendered.ids),
                          system_spans=tuple(spans.get("system", ())), prompt_tokens=texts(rendered.ids),
                          generated_tokens=texts(sampled))
        activation = None
        direction = row.payload.direction if row.payload is not None else None
        if direction is not None and "proj" in taken:
            from driftlab.activation.state import projection_summary

            d, proj = self.directions.personas[direction], taken["proj"][: max(1, len(sampled))]
            activation = projection_summary(proj.sum(0), proj[0], proj[-1], len(proj), d.low, d.high, d.id, d.band)
        scored = row.scored if logprobs is not None else None
        return Reply(text=text.strip(), n_tokens=len(toks), finish_reason=finish, token_ids=toks, trace=trace,
                     n_prompt_tokens=len(rendered.ids), activation=activation, gate=row.gate,
                     logprobs=scored[: len(toks)] if scored is not None else None,
                     end=scored[len(toks)] if ended and scored is not None else None)


@dataclass(eq=False)
class _Row:
    """One request in the engine: what was sent, what came back."""

    rendered: Rendered
    payload: SteerPayload | None
    prompt: dict[str, Any]
    params: Any  # vllm.SamplingParams
    gate: dict | None = None  # the `when-drifting` decision (Reply.gate)
    tokens: list[int] = field(default_factory=list)
    scored: list[TokenLogprob] = field(default_factory=list)
    taken: dict[str, Any] = field(default_factory=dict)
    reply: Reply | None = None


class _Run:
    """Rows through vLLM's engine step by step (`LLMEngine.add_request`, `step`, `abort_request`), with
    ChatRequest's serving callbacks: tokens streamed as they come, a cancelled row aborted, a finished
    row's reply handed over at once, rows admitted between steps."""

    def __init__(self, backend: VLLMChatBackend, ignore_eos: bool, logprobs: int | None, *, on_token=None,
                 on_logprob=None, on_finish=None, cancelled=None, admit=None) -> None:
        self.backend, self.engine = backend, backend.llm.llm_engine
        self.ignore_eos, self.logprobs = ignore_eos, logprobs
        self.on_token, self.on_logprob, self.on_finish, self.cancelled = on_token, on_logprob, on_finish, cancelled
        self.admit = admit  # () -> rows joining the running batch (`VLLMChatBackend._admitted`), or none
        self.rows: list[_Row] = []
        self.live: dict[str, int] = {}  # engine request id -> row

    def add(self, rows: list[_Row]) -> None:
        if self.backend._closed:
            raise DriftlabError(f"The vLLM engine of {self.backend.name} is closed.",
                                hint="Start a new backend to generate again.")
        for row in rows:
            rid = uuid.uuid4().hex
            self.engine.add_request(rid, row.prompt, row.params)
            self.live[rid] = len(self.rows)
            self.rows.append(row)

    def until_done(self) -> None:
        while self.live:
            self._cancel()
            if not self.live:
                break
            done = []
            for out in self.engine.step():
                b = self.live.get(out.request_id)
                if b is not None:
                    self._tokens(b, out.outputs[0])
                    if out.finished:
                        self.backend.cached_prompt_tokens += out.num_cached_tokens or 0
                        done.append((out.request_id, b, "stop" if out.outputs[0].finish_reason == "stop" else "length"))
            self._finish(done)
            if self.admit is not None and (joining := self.admit()):
                self.add(joining)

    def _tokens(self, b: int, completion) -> None:
        row = self.rows[b]
        entries = _logprobs(completion, list(completion.token_ids), self.logprobs) if self.logprobs is not None else []
        for i, token in enumerate(completion.token_ids):
            row.tokens.append(token)
            if entries:
                row.scored.append(entries[i])
                if self.on_logprob is not None:
                    self.on_logprob(b, entries[i])
            if self.on_token is not None:
                self.on_token(b, token)

    def _cancel(self) -> None:
        if self.cancelled is None:
            return
        gone = [(rid, b) for rid, b in self.live.items() if self.cancelled(b)]
        if gone:
            self.engine.abort_request([rid for rid, _ in gone])
            self._finish([(rid, b, "cancelled") for rid, b in gone])

    def _finish(self, done: list[tuple[str, int, str]]) -> None:
        """Rows that ended: their records taken from the worker, their replies built and handed over."""
        if not done:
            return
        rows = [self.rows[b] for _, b, _ in done]
        for row, taken in zip(rows, self.backend._take([r.payload.id if r.payload else None for r in rows]), strict=True):
            row.taken = taken
        for rid, b, finish in done:
            del self.live[rid]
            row = self.rows[b]
            row.reply = self.backend._reply(row, finish, self.ignore_eos, self.logprobs)
            if self.on_finish is not None:
                self.on_finish(b, row.reply)


def _first_turn(rendered: Rendered, end: int) -> Rendered:
    """The first `end` tokens of a rendered conversation (its first turn), with its system span."""
    return Rendered(ids=rendered.ids[:end], text="", system_span=rendered.system_span)


def _joined(shards: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One request's records from every tensor-parallel worker, in rank order: pi per head joined over
    the workers' head shards; the residual stream's (projections, activations) is every worker's, the
    first one's kept."""
    first = shards[0]
    if first is None or len(shards) == 1:
        return first
    return {**first, **{name: torch.cat([s[name] for s in shards], dim=-1) for name in ("pi", "prefill_pi")
                        if name in first}}


def _cpu_binding(tensor_parallel: int) -> None:
    """vLLM's CPU workers bind their threads one NUMA node each unless told otherwise, and refuse to start
    with fewer nodes than workers. There, unless the user set VLLM_CPU_OMP_THREADS_BIND, the CPUs this
    process may use are shared out: a slice each, or (fewer CPUs than workers) one each, round robin."""
    import os

    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or nodes >= tensor_parallel:
        return
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    shares = [cpus[i * n // tensor_parallel : (i + 1) * n // tensor_parallel] for i in range(tensor_parallel)] \
        if n >= tensor_parallel else [[cpus[i % n]] for i in range(tensor_parallel)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, share)) for share in shares)
    logger.info("tensor parallelism %d over %d NUMA node(s): vLLM's CPU workers bound to CPUs %s", tensor_parallel,
                nodes, os.environ["VLLM_CPU_OMP_THREADS_BIND"])


def _floor_turn(spans: dict[str, list[tuple[int, int]]]) -> int:
    """Where a row's first turn ends (pi-floor's reference); a one-line error without one or a system prompt."""
    turn, system = spans.get("first_turn"), spans.get("system")
    if not turn or not system:
        raise DriftlabError("pi-floor raises the system prompt's attention to a share of its first turn's, and "
                            f"this row has {'no system prompt' if turn else 'no first turn to read it at'}.",
                            hint="Give conversations with a system prompt and a user turn.")
    return turn[0][1]


def _json(sampling: Sampling):
    """vLLM's structured outputs for a reply constrained to a JSON schema: the grammar the transformers
    engine builds (`chat.constrain.grammar_text`), handed over as EBNF; None when unconstrained."""
    if sampling.json_schema is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    from driftlab.chat.constrain import grammar_text

    return StructuredOutputsParams(grammar=grammar_text(sampling.json_schema))


def _prompt_scoped(iv: Interventions) -> bool:
    config = iv.attention()
    return config is not None and config.prompt_scoped


def _sampling(sampling: Sampling, limit: int, seed: int, logprobs: int | None) -> dict[str, Any]:
    """vLLM's SamplingParams fields for a driftlab Sampling (the same meanings: chat.base.Sampling)."""
    return {"max_tokens": limit, "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "top_p": 1.0 if sampling.greedy else sampling.top_p, "top_k": sampling.top_k or -1, "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty, "frequency_penalty": sampling.frequency_penalty,
            "presence_penalty": sampling.presence_penalty, "logit_bias": dict(sampling.logit_bias) or None,
            "ignore_eos": sampling.ignore_eos, "seed": seed, "logprobs": logprobs}


def _logprobs(out, sampled: list[int], k: int) -> list[TokenLogprob]:
    """Each generated token's log-probability and its k most likely alternatives (vLLM's entries hold the
    top k by rank and the sampled token)."""
    entries = []
    for token, entry in zip(sampled, out.logprobs or [], strict=True):
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k)
        entries.append(TokenLogprob(token, entry[token].logprob, [(t, v) for _, t, v in top]))
    return entries
