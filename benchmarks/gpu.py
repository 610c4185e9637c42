"""The attention engine at real model shapes, with no weights: every mode's prefill, decode step and
memory against plain decoding, stock SDPA, eager `output_attentions` and pastalib, decode against the
memory-bandwidth floor, and batched self-chat throughput (issue 21, point 4).

Models: randomly initialised from real configs, built directly on the device (a model's speed and
memory do not depend on its weights' values): the Llama-2-7B and Qwen2.5-7B shapes (vocabulary
49152, SmolLM2's, so its tokenizer and chat template serve), and on a CPU or with `--quick` a tiny
Llama-family shape with grouped-query attention (4 layers, hidden 128, 8 query / 2 KV heads, init
std 0.1 so attention is far from uniform). The model goes into driftlab's
real `HFChatBackend` (its decode loop, prefix cache, renderer and attention engine): the benchmark
hands the backend the in-memory model in place of `load_model`'s disk load, for the construction
only (see `_backend`).

Dtype: bf16 on CUDA; float32 on a CPU (exact comparisons; set GPUBENCH_DTYPE=bfloat16 to change).

Per shape and context, batch 1, greedy, EOS ignored, one system prompt + a user turn of real prose
cut to the context, ending in an instruction (marked `*...*` for PASTA, whose markers are stripped
before tokenising, so every mode sees the same token ids):
  sdpa       stock transformers SDPA (attn_implementation "sdpa"), no driftlab attention code;
  plain      driftlab's attention function, no intervention (what every ratio is against);
  trace      pi tracing, every layer and head;
  split      split-softmax k = 0.9, every layer and head;
  instaboost InstABoost m = 5 (a key bias log 5 on the system span, every layer and head);
  pasta      PASTA alpha = 0.01 on ~56 heads (every 4th head of every L/8-th layer), marked span;
  composed   trace + split + instaboost + pasta together (the key biases add up);
  bias       the generic key bias (bias:value=2.0 on the system span, every layer and head);
  cfg        classifier-free guidance alpha = 1.5 (each row decodes beside its system-less twin);
  spr        system-prompt repetition p = 0.5 (the system prompt repeated in the conversation:
             a longer prompt, so its prefill ratio includes the extra tokens);
  eager      eager attention with `output_attentions=True`, pi summed from the weights (what a
             user without driftlab does), own greedy loop with a dynamic cache;
  pastalib   the PASTA authors' library (eager + its hooks, `model.generate`), Llama family only,
             when importable: total time only.
Timing: every variant runs once untimed at every context with the timed shapes (warm-up: a
compiled loop compiles there, and RESULT <shape>.graphs_compiled_in_timing says if any compile
still landed in the timed rounds), then `repeats` interleaved
rounds (the order rotates); each forward of the backend's decode loop is timed with a device
synchronize on both sides: prefill = the first forward, decode step = the median of the others;
the best round is kept. Peak memory above what was allocated before the call (weights excluded;
a static KV cache kept from an earlier call and reused is added, so the loops compare), judged
for O(T) as the peak per context token at the largest context over the smallest (<= 1.5x):
CUDA `torch.cuda.max_memory_allocated`; CPU the process's peak resident set (VmHWM reset through
/proc/self/clear_refs, as benchmarks/attention.py does): coarse, and allocator-dependent.
An eager run or pastalib that runs out of memory is reported as "OOM".

Floor: bytes one decode step must read (all weights but the input embedding, which is gathered,
plus the KV cache at that context) / bandwidth, the bandwidth measured in this run by a large
device-to-device copy (read + write bytes / time).

Self-chat: driftlab's real protocol (`SelfChat` through `run_protocol`), 8 pairs x 3 rounds x 48
tokens on the Qwen2.5-7B shape (the tiny shape on a CPU), batched with prefix reuse in every
mode, against a naive loop (batch 1, no prefix cache, plain); probes decode with the turn's
budget, in the agent's call. Tokens/s = generated tokens / wall.

Correctness: at the smallest context the split-softmax mode's greedy tokens are compared with an
independent eager reference that materialises and reweights the weights (Eq. 7 of the persona-drift
paper, Li et al. 2024) on the same model; trace's tokens, and those of split k=1, InstABoost m=1 and
PASTA alpha=1 (strength 0), with plain's (they must change nothing).

Targets of issue 21 (H100-class GPU, Llama-2-7B shape; self-chat on the Qwen2.5-7B shape) are
printed beside the measured ratios; they are judged only on CUDA ("n/a (not a GPU)" elsewhere).

Sizes (`python benchmarks/run.py gpu [--quick | --full]`; each setting below overrides its part):
  CUDA           the two 7B shapes at 2048, 8192 and 32768 tokens, 32 decode steps, 3 rounds,
                 self-chat 8x3x48@qwen2.5-7b (best of 2); --full is the same
  CPU (default)  tiny at 256 and 1024 tokens, 16 decode steps, 2 rounds, self-chat 2x2x8@tiny
                 (best of 2): 1 min 29 s (`time python benchmarks/run.py gpu`) on this
                 project's 2-core CPU, shared with other jobs (load average ~4, this run
                 included), float32, 1 torch thread; --quick 1 min 13 s
  CPU --full     tiny at 1024 and 4096 tokens, 32 decode steps, 3 rounds, self-chat 2x2x8@tiny
  --quick        tiny at 256 and 1024 tokens, 8 decode steps, 2 rounds, self-chat 2x2x8@tiny (once)

Settings (environment variables; run.py takes no others):
  GPUBENCH_SHAPES     comma list of llama2-7b, qwen2.5-7b, tiny
  GPUBENCH_CONTEXTS   comma list of prompt lengths
  GPUBENCH_DECODE     decode steps per call
  GPUBENCH_REPEATS    timed rounds
  GPUBENCH_SELFCHAT   PAIRSxROUNDSxTOKENS[@SHAPE], or 0 to skip
  GPUBENCH_VARIANTS   comma list restricting the per-context variants (plain and sdpa always run)
  GPUBENCH_SLOW_S     a variant whose warm-up (prefill + 1 step) takes longer is timed once (default 60)
  GPUBENCH_TOKENIZER  tokenizer directory (default: the provisioned smollm2-135m)
  GPUBENCH_DTYPE      bfloat16 | float32 | float16 (default bf16 on CUDA, float32 on a CPU)
  GPUBENCH_JSON       write every measurement to this JSON file
  GPUBENCH_LOOP       driftlab's decode loop for every driftlab variant (HFChatBackend `decode`):
                      dynamic (default), static or compiled (static cache + torch.compile: CUDA graphs
                      on a GPU); run once with each to compare them (the stock sdpa variant uses the same).
                      RESULT <shape>.loop_ran says which loop really decoded (a fallback is also a note:
                      a model the static cache cannot serve, a step that cannot compile, the recompile
                      limit) and <shape>.graphs_compiled how many graphs a compiled step compiled.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from common import Result, Table, TimedForward, pin_threads, selfchat_config, size_of, sync

CUDA = torch.cuda.is_available()
SYSTEM = "You are a careful science journalist. Always answer in French, in at most three sentences."
INSTRUCTION = "Answer the occupation of Mary and generate the answer as json format."
SELFCHAT_AGENTS = ["reply-in-french", "secret-number-share", "name-alexander", "very-happy"]
ISSUE_SELFCHAT_TOK_S = 357.0  # driftlab's batched self-chat before issue 21, Qwen2.5-7B shape, H100


# -- shapes ------------------------------------------------------------------------------------------
def shape_config(name: str):
    """A transformers config of a real (or the tiny) shape, SmolLM2's vocabulary and special ids."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                  max_position_embeddings=65536)
    if name == "llama2-7b":
        return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=32, rope_theta=10000.0, **common)
    if name == "qwen2.5-7b":
        return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                           num_key_value_heads=4, rope_theta=1e6, **common)
    if name == "tiny":
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=16, rope_theta=10000.0, **common)
        cfg.initializer_range = 0.1  # attention far from uniform: interventions change tokens
        return cfg
    raise ValueError(f"unknown shape {name!r}; use llama2-7b, qwen2.5-7b or tiny")


def pasta_heads(n_layers: int, n_heads: int) -> dict[str, list[int]]:
    """~56 heads on a 7B shape: every 4th head of every (L/8)-th layer, layer 0 excluded."""
    step = max(1, n_layers // 8)
    return {str(layer): list(range(0, n_heads, 4)) for layer in range(step, n_layers, step)}


def tokenizer_dir() -> Path:
    env = os.environ.get("GPUBENCH_TOKENIZER")
    if env:
        return Path(env)
    from driftlab.assets import resolve_model

    return Path(resolve_model("smollm2-135m"))


def pick_dtype(device: torch.device) -> torch.dtype:
    name = os.environ.get("GPUBENCH_DTYPE")
    if name:
        return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@contextmanager
def _preloaded(model, tokenizer, path: Path):
    """While constructing an HFChatBackend, hand it `model` instead of loading one from disk.

    HFChatBackend's only loading step is `load_model(name, dtype, device, attn, ...)`; this swaps
    that function (in the module that calls it, and in chat.loading) for one that returns the
    in-memory model with the attention implementation the backend asks for, and restores it after.
    """
    import driftlab.chat.hf as hf
    import driftlab.chat.loading as loading

    def load(name, dtype="auto", device="auto", attn_implementation="sdpa", **kwargs):
        model.set_attn_implementation(attn_implementation)
        return model, tokenizer, path

    saved = {mod: mod.load_model for mod in (hf, loading)}
    for mod in saved:
        mod.load_model = load
    try:
        yield
    finally:
        for mod, fn in saved.items():
            mod.load_model = fn


def build(shape: str, device: torch.device, dtype: torch.dtype):
    """(backend, build seconds): a random `shape` model on `device` inside driftlab's HFChatBackend."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from driftlab.chat.hf import HFChatBackend

    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype)
    model.eval()
    path = tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with _preloaded(model, tokenizer, path):
        backend = HFChatBackend(str(path), dtype="auto", device=str(device), prefix_cache_bytes=0,
                                decode=decode_loop())
    sync()
    return backend, time.perf_counter() - t


def decode_loop() -> str:
    """GPUBENCH_LOOP: the decode loop driftlab's backend runs (see the module docstring)."""
    loop = os.environ.get("GPUBENCH_LOOP", "dynamic")
    if loop not in ("dynamic", "static", "compiled"):
        raise SystemExit(f"GPUBENCH_LOOP={loop!r}: use dynamic, static or compiled.")
    return loop


# -- measuring ---------------------------------------------------------------------------------------
def peak_memory(device: torch.device):
    """(method name, measure(fn) -> (result, peak extra MiB)): benchmarks/attention.py's PeakMemory."""
    from attention import PeakMemory

    mem = PeakMemory(device)
    where = "CPU approximation: " if device.type == "cpu" else ""
    return f"{where}{mem.method}, above the allocation before the call", mem.measure


def bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write), median of 5 after a warm-up."""
    n = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for i in range(6):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        if i:
            times.append(time.perf_counter() - t)
    del src, dst
    return 2 * n / statistics.median(times)


def static_cache(backend) -> tuple[int, int] | None:
    """(identity, bytes) of the static KV cache the backend holds between calls, or None: a call
    that reuses it allocates nothing for its keys and values, so its peak must add them to be
    comparable with the dynamic loop's, which allocates its cache inside the call."""
    static = getattr(backend, "_static", None)
    cache = None if static is None else static.cache
    if cache is None:
        return None
    tensors = [t for layer in getattr(cache, "layers", []) for t in (getattr(layer, "keys", None),
                                                                    getattr(layer, "values", None))
               if isinstance(t, torch.Tensor)]
    return id(cache), sum(t.numel() * t.element_size() for t in tensors)


def memory_growth(shape: str, contexts: list[int], lens: dict[int, int], modes: dict, best: dict, results: dict,
                  targets: Table) -> None:
    """Memory O(T), judged: each mode's peak above the weights per token of context, at the
    largest context over the smallest. O(T) memory keeps it near 1 (fixed costs only lower it);
    a T x T tensor makes it grow with the context ratio."""
    if len(contexts) < 2:
        return
    small, large = min(contexts), max(contexts)
    for v in modes:
        a, b = best.get((v, small), {}), best.get((v, large), {})
        if not all(math.isfinite(r.get("mb", math.nan)) and r.get("mb", 0) > 0 for r in (a, b)):
            continue
        growth = (b["mb"] / lens[large]) / (a["mb"] / lens[small])
        results[f"{shape}.{v}.memory_per_token_growth"] = f"{growth:.3f}"
        targets.rows.append([f"{v} peak MiB per context token, {lens[large]} / {lens[small]} tokens", shape, "-",
                             fmt_x(growth), "<= 1.5x (O(T))", judge(growth <= 1.5, True)])


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


# -- workload ----------------------------------------------------------------------------------------
def conversation(backend, n_tokens: int, marked: bool = False) -> list[dict]:
    """System prompt + a user turn of real prose ending in the instruction, about `n_tokens` long."""
    from attention import _prose

    tok = backend.tokenizer
    prose = _prose().replace("*", " ")  # PASTA's marker: only the instruction may carry it
    text_ids = tok(prose * (n_tokens // 8000 + 1), add_special_tokens=False)["input_ids"]

    def conv(take: int, mark: bool) -> list[dict]:
        instr = f"*{INSTRUCTION}*" if mark else INSTRUCTION
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{tok.decode(text_ids[:max(take, 0)])}\n{instr}"}]

    take = n_tokens - len(backend.render(conv(0, False)).ids)
    for _ in range(4):  # decoding and re-encoding may merge tokens: nudge to the target length
        got = len(backend.render(conv(take, False)).ids)
        if got == n_tokens:
            break
        take += n_tokens - got
    return conv(take, marked)


def eager_greedy(backend, conv, n_new: int, calls: list[float]) -> list[int]:
    """Greedy decode with the model's current attention implementation and a dynamic cache, asking
    for `output_attentions` and summing pi over the system keys (what a user without driftlab does)."""
    from transformers import DynamicCache

    model = backend.model
    rendered = backend.render(conv)
    s, e = rendered.system_span
    ids = torch.tensor([rendered.ids], device=backend.device)
    cache = DynamicCache(config=model.config)
    tokens = []
    with torch.inference_mode():
        for _ in range(n_new):
            sync()
            t = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, output_attentions=True,
                        logits_to_keep=1)
            if out.attentions and out.attentions[0] is not None:
                torch.stack([a[0, :, -1, s:e].float().sum(-1) for a in out.attentions])
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            calls.append(time.perf_counter() - t)
            tokens.append(int(ids))
            del out
    return tokens


REFERENCE = "gpubench_eager_split_softmax"


def split_reference(backend, conv, n_new: int, k: float) -> list[int]:
    """Greedy tokens under an independent eager split-softmax (Eq. 7 of the persona-drift paper,
    Li et al. 2024): the weights are materialised in float64, pi summed over the rendered system
    span, then reweighted (pi^k / pi on system keys, (1 - pi^k) / (1 - pi) on the others) before
    multiplying V."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    s, e = backend.render(conv).system_span

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n_rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(n_rep, 1).double()
        value = value.repeat_interleave(n_rep, 1).double()
        q, K = query.shape[2], key.shape[2]
        logits = query.double() @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        if attention_mask is None:
            allowed = torch.ones(q, K, dtype=torch.bool, device=query.device).tril(K - q)
        else:
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > -1e30
            allowed = allowed[..., :K]
        w = logits.masked_fill(~allowed, -math.inf).softmax(-1)
        system = torch.zeros(K, dtype=torch.bool, device=query.device)
        system[s:e] = True
        pi = (w * system).sum(-1, keepdim=True)
        up = torch.where(pi > 0, pi.pow(k) / pi.clamp_min(1e-300), torch.ones_like(pi))
        down = torch.where(pi < 1, (1 - pi.pow(k)) / (1 - pi).clamp_min(1e-300), torch.zeros_like(pi))
        w = torch.where(system, w * up, w * down)
        return (w @ value).to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register(REFERENCE, attend)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)
    model = backend.model
    impl = model.config._attn_implementation
    model.set_attn_implementation(REFERENCE)
    try:
        return eager_greedy(backend, conv, n_new, [])
    finally:
        model.set_attn_implementation(impl)


# -- targets -----------------------------------------------------------------------------------------
def judge(ok: bool | None, applies: bool, why_not: str = "") -> str:
    if not CUDA:
        return "n/a (not a GPU)"
    if not applies:
        return f"n/a ({why_not})" if why_not else "n/a"
    if ok is None:
        return "n/a (not measured)"
    return "met" if ok else "missed"


def fmt_ms(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else (f"{1000 * x:.2f}" if x < 1 else f"{1000 * x:.0f}")


def fmt_x(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}x"


# -- the benchmark -----------------------------------------------------------------------------------
def _env_list(name: str, default: list[str]) -> list[str]:
    v = os.environ.get(name)
    return [x.strip() for x in v.split(",") if x.strip()] if v else default


def _positive(name: str, text: str | float, kind: type = int) -> float:
    """A positive number from an env setting, or a one-line exit naming the setting."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise SystemExit(f"{name}={text!r}: expected a positive {kind.__name__}.")
    return value


# Defaults per size (each GPUBENCH_* variable overrides its part): shapes, contexts, decode steps,
# timed rounds, self-chat, self-chat rounds. On CUDA the default is the full size.
DEFAULTS = {
    "quick": ("tiny", "256,1024", 8, 2, "2x2x8@tiny", 1),
    "cpu": ("tiny", "256,1024", 16, 2, "2x2x8@tiny", 2),
    "cpu-full": ("tiny", "1024,4096", 32, 3, "2x2x8@tiny", 2),
    "cuda": ("llama2-7b,qwen2.5-7b", "2048,8192,32768", 32, 3, "8x3x48@qwen2.5-7b", 2),
}


def run(quick: bool = False, full: bool = False) -> Result:
    from driftlab.attention import ATTENTION_NAME
    from driftlab.chat import Sampling, chat
    from driftlab.steering import Interventions

    size = size_of(quick, full)
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = pick_dtype(device)
    d_shapes, d_contexts, d_decode, d_repeats, d_selfchat, sc_repeats = DEFAULTS[
        "quick" if quick else "cuda" if CUDA else "cpu-full" if full else "cpu"]
    shapes = _env_list("GPUBENCH_SHAPES", d_shapes.split(","))
    if unknown := [s for s in shapes if s not in ("llama2-7b", "qwen2.5-7b", "tiny")]:
        raise SystemExit(f"GPUBENCH_SHAPES: unknown shape {unknown[0]!r}; use llama2-7b, qwen2.5-7b or tiny.")
    contexts = [_positive("GPUBENCH_CONTEXTS", x) for x in _env_list("GPUBENCH_CONTEXTS", d_contexts.split(","))]
    n_decode = _positive("GPUBENCH_DECODE", os.environ.get("GPUBENCH_DECODE", d_decode))
    repeats = _positive("GPUBENCH_REPEATS", os.environ.get("GPUBENCH_REPEATS", d_repeats))
    sc = os.environ.get("GPUBENCH_SELFCHAT", d_selfchat)
    slow_s = _positive("GPUBENCH_SLOW_S", os.environ.get("GPUBENCH_SLOW_S", 60), float)
    decode_loop()  # a bad GPUBENCH_LOOP stops here, before any model is built
    threads = torch.get_num_threads()
    pin_threads()  # on a CPU: 1 thread unless BENCH_THREADS (a shared CPU stalls multi-threaded regions)
    try:
        import pastalib.pasta  # noqa: F401

        have_pastalib = True
    except Exception:
        have_pastalib = False

    bw = bandwidth(device)
    method, measure_peak = peak_memory(device)
    records: list[dict] = []
    results: dict[str, str] = {"size": size, "torch_threads": str(torch.get_num_threads()),
                               "device": str(device), "dtype": str(dtype).removeprefix("torch."), "loop": decode_loop(),
                               "bandwidth_gb_s": f"{bw / 1e9:.1f}"}
    res = Result(
        title=(f"driftlab attention modes at real shapes, random weights ({device}, "
               f"{str(dtype).removeprefix('torch.')}, {decode_loop()} decode loop), batch 1, greedy, {n_decode} decode steps, best of "
               f"{repeats} interleaved rounds; times in ms"),
        columns=["shape", "ctx", "variant", "prefill ms", "vs plain", "vs sdpa", "decode ms/step", "vs plain",
                 "vs sdpa", "total ms", f"peak MiB{' (RSS)' if device.type == 'cpu' else ''}"],
    )
    targets = Table(title="issue 21 targets (judged only on an H100-class GPU)",
                    columns=["target", "shape", "ctx", "measured", "limit", "met?"])
    notes = [f"memory bandwidth (device-to-device copy, read + write): {bw / 1e9:.1f} GB/s",
             f"peak memory: {method}"]
    selfchat_table = None

    def do_shape(shape: str) -> None:
        nonlocal selfchat_table
        backend, build_s = build(shape, device, dtype)
        model = backend.model
        cfg = model.config
        L, H, KV = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        elem = torch.finfo(dtype).bits // 8
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        emb = model.get_input_embeddings().weight
        tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
        read_bytes = weight_bytes - (0 if tied else emb.numel() * emb.element_size())
        heads = pasta_heads(L, H)
        heads_spec = "+".join(f"{layer}.{h}" for layer, hs in heads.items() for h in hs)
        n_pasta = sum(len(hs) for hs in heads.values())
        pasta = f"pasta:heads={heads_spec},alpha=0.01"
        modes: dict[str, list[str]] = {
            "plain": [], "trace": ["trace"], "split": ["split-softmax:k=0.9"], "instaboost": ["instaboost:m=5"],
            "pasta": [pasta], "composed": ["trace", "split-softmax:k=0.9", "instaboost:m=5", pasta],
            "bias": ["bias:value=2.0"], "cfg": ["cfg:alpha=1.5"], "spr": ["spr:p=0.5"],
        }
        steer = {m: Interventions.parse(s) for m, s in modes.items()}
        marked = {"pasta", "composed", "pastalib"}
        llama = type(model).__name__.startswith("Llama")
        variants = ["sdpa", *modes, "eager"] + (["pastalib"] if have_pastalib and llama else [])
        only = os.environ.get("GPUBENCH_VARIANTS")
        if only:
            variants = [v for v in variants if v in {"plain", "sdpa", *only.split(",")}]
        notes.append(
            f"{shape}: {type(model).__name__}, {L} layers, {H} heads / {KV} KV, {weight_bytes / 1e9:.2f} GB of "
            f"weights ({read_bytes / 1e9:.2f} GB read per decode step), built in {build_s:.1f} s; PASTA on "
            f"{n_pasta} heads" + ("" if have_pastalib or not llama else "; pastalib not importable: skipped")
            + ("" if llama or not have_pastalib else "; pastalib: Llama family only (it refuses Qwen2)"))
        timer = TimedForward(backend)

        def one(variant: str, conv_plain, conv_marked, n_new: int) -> dict:
            """One call of `variant`: per-forward times, total, peak MiB and tokens (or error)."""
            conv = conv_marked if variant in marked else conv_plain
            timer.calls = []
            rec: dict = {}
            held = static_cache(backend)  # a static cache the call reuses is its memory too
            try:
                if variant == "pastalib":
                    t = time.perf_counter()
                    (n_out, toks), mb = measure_peak(lambda: pastalib_run(backend, conv, heads, n_new))
                    rec.update(total=time.perf_counter() - t, mb=mb, tokens=toks)
                    assert n_out == n_new, ("pastalib", n_out)
                    return rec
                impl = {"sdpa": "sdpa", "eager": "eager"}.get(variant, ATTENTION_NAME)
                model.set_attn_implementation(impl)
                try:
                    if variant == "eager":
                        calls: list[float] = []
                        toks, mb = measure_peak(lambda: eager_greedy(backend, conv, n_new, calls))
                    else:
                        sampling = Sampling(greedy=True, max_new_tokens=n_new, ignore_eos=True)
                        (reply,), mb = measure_peak(
                            lambda: chat(backend, [conv], sampling, steer=steer.get(variant)))
                        toks, calls = list(reply.token_ids), list(timer.calls)
                finally:
                    model.set_attn_implementation(ATTENTION_NAME)
                assert len(calls) == n_new == len(toks), (variant, len(calls), len(toks), n_new)
                if variant != "eager" and held is not None and static_cache(backend) == held:  # kept, reused
                    mb += held[1] / 2**20
                rec.update(prefill=calls[0], step=statistics.median(calls[1:]) if n_new > 1 else math.nan,
                           total=sum(calls), mb=mb, tokens=toks)
            except Exception as err:  # noqa: BLE001 - OOM and unsupported paths are reported, not fatal
                if not is_oom(err) and variant in ("plain", "sdpa"):
                    raise  # every ratio needs these two
                if not is_oom(err):  # reported in the table; the other variants still run
                    import traceback

                    traceback.print_exc()
                rec["error"] = "OOM" if is_oom(err) else f"{type(err).__name__}: {str(err)[:120]}"
                gc.collect()
                if CUDA:
                    torch.cuda.empty_cache()
            return rec

        convs = {c: (conversation(backend, c), conversation(backend, c, marked=True)) for c in contexts}
        lens = {c: len(backend.render(convs[c][0]).ids) for c in contexts}
        assert all(len(backend.render(convs[c][1], interventions=steer["pasta"]).ids) == lens[c] for c in contexts)
        best: dict[tuple[str, int], dict] = {}
        slow: set[tuple[str, int]] = set()
        for c in contexts:  # warm-up, untimed, with the timed shapes; a variant that fails here is not run again
            for v in variants:
                t = time.perf_counter()
                rec = one(v, *convs[c], n_decode + 1)
                if "error" in rec:
                    best[(v, c)] = rec
                elif time.perf_counter() - t > slow_s:
                    slow.add((v, c))  # timed once only, so that one slow path cannot eat the run
        warm_graphs = backend.ran()["decode"].get("graphs", 0)
        for r in range(repeats):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for c in contexts:
                for v in order:
                    if (v, c) in best and "error" in best[(v, c)] or (v, c) in slow and r > 0:
                        continue
                    rec = one(v, *convs[c], n_decode + 1)
                    old = best.get((v, c))
                    if old is None or "error" in old:
                        best[(v, c)] = rec
                    elif "error" not in rec:
                        for key in ("prefill", "step", "total"):
                            if key in rec:
                                old[key] = min(old[key], rec[key])
                        old["mb"] = max(old["mb"], rec["mb"])
                        old["tokens"] = rec["tokens"]

        ran = backend.ran()["decode"]  # the loop that decoded, which a fallback may have changed
        if "graphs" in ran:  # compiles after the warm-up landed in the timing
            results[f"{shape}.graphs_compiled_in_timing"] = str(ran["graphs"] - warm_graphs)
            if ran["graphs"] > warm_graphs:
                notes.append(f"{shape}: {ran['graphs'] - warm_graphs} graphs compiled during the timed rounds (the "
                             "warm-up did not cover their shapes): those rounds include compile time.")
        results[f"{shape}.loop_ran"] = ran["loop"]
        if "graphs" in ran:
            results[f"{shape}.graphs_compiled"] = str(ran["graphs"])
        if ran["loop"] != decode_loop():
            notes.append(f"{shape}: the {decode_loop()} decode loop was asked for and the {ran['loop']} loop ran: "
                         f"{ran.get('eager_after') or ran.get('refused')}")
        for c in contexts:
            plain, sdpa = best[("plain", c)], best[("sdpa", c)]
            kv_bytes = 2 * L * KV * head_dim * c * elem
            floor = (read_bytes + kv_bytes) / bw
            for v in variants:
                rec = best[(v, c)]
                pre, step = rec.get("prefill"), rec.get("step")
                row = [shape, lens[c], v + (" (1 run: slow)" if (v, c) in slow else "")]
                if "error" in rec:
                    res.rows.append(row + [rec["error"]] + [""] * 7)
                    results[f"{shape}.{c}.{v}"] = rec["error"].split(":")[0]
                    records.append({"shape": shape, "ctx": c, "variant": v, "error": rec["error"]})
                    continue
                ratios = {
                    "prefill_vs_plain": pre / plain["prefill"] if pre and "prefill" in plain else None,
                    "prefill_vs_sdpa": pre / sdpa["prefill"] if pre and "prefill" in sdpa else None,
                    "decode_vs_plain": step / plain["step"] if step and "step" in plain else None,
                    "decode_vs_sdpa": step / sdpa["step"] if step and "step" in sdpa else None,
                }
                res.rows.append(row + [fmt_ms(pre), fmt_x(ratios["prefill_vs_plain"]), fmt_x(ratios["prefill_vs_sdpa"]),
                                       fmt_ms(step), fmt_x(ratios["decode_vs_plain"]), fmt_x(ratios["decode_vs_sdpa"]),
                                       fmt_ms(rec["total"]), "n/a" if not math.isfinite(rec["mb"]) else f"{rec['mb']:.0f}"])
                key = f"{shape}.{c}.{v}"
                results[f"{key}.total_ms"] = f"{1000 * rec['total']:.3f}"
                if pre is not None:
                    results[f"{key}.prefill_ms"] = f"{1000 * pre:.3f}"
                    results[f"{key}.decode_ms"] = f"{1000 * step:.3f}"
                    for rk, rv in ratios.items():
                        results[f"{key}.{rk}"] = "n/a" if rv is None else f"{rv:.3f}"
                results[f"{key}.peak_mib"] = f"{rec['mb']:.0f}" if math.isfinite(rec["mb"]) else "n/a"
                records.append({"shape": shape, "ctx": c, "prompt_tokens": lens[c], "variant": v,
                                **{k: rec[k] for k in ("prefill", "step", "total", "mb") if k in rec},
                                **{k: v2 for k, v2 in ratios.items() if v2 is not None}})
            results[f"{shape}.{c}.floor_ms"] = f"{1000 * floor:.3f}"
            if "step" not in plain:  # plain ran out of memory: no ratio at this context
                continue
            results[f"{shape}.{c}.plain_decode_vs_floor"] = f"{plain['step'] / floor:.3f}"
            notes.append(f"{shape} @ {lens[c]} tokens: decode floor {1000 * floor:.2f} ms = ({read_bytes / 1e9:.2f} GB "
                         f"weights + {kv_bytes / 1e9:.2f} GB KV cache) / {bw / 1e9:.0f} GB/s; plain decode "
                         f"{1000 * plain['step']:.2f} ms = {plain['step'] / floor:.2f}x the floor; weights alone "
                         f"{1000 * read_bytes / bw:.2f} ms")

            # targets, per context
            is_llama7 = shape == "llama2-7b"
            limit_pre = 1.6 if c > 16384 else 1.3
            for v in modes:
                if v == "plain" or (v, c) not in best:
                    continue
                rec = best[(v, c)]
                dr = rec["step"] / plain["step"] if "step" in rec else None
                pr = rec["prefill"] / plain["prefill"] if "prefill" in rec else None
                targets.rows.append([f"{v} decode / plain", shape, lens[c], fmt_x(dr), "<= 1.15x",
                                     judge(dr is not None and dr <= 1.15, is_llama7, "target is for llama2-7b")])
                targets.rows.append([f"{v} prefill / plain", shape, lens[c], fmt_x(pr), f"<= {limit_pre}x",
                                     judge(pr is not None and pr <= limit_pre, is_llama7, "target is for llama2-7b")])
            fr = plain["step"] / floor
            targets.rows.append(["plain decode / bandwidth floor", shape, lens[c], fmt_x(fr), "<= 2x",
                                 judge(fr <= 2.0, is_llama7, "target is for llama2-7b")])

        memory_growth(shape, contexts, lens, modes, best, results, targets)

        # correctness at the smallest context: split vs eager reference, trace vs plain
        c0 = contexts[0]
        n_check = min(n_decode + 1, 16)
        sampling = Sampling(greedy=True, max_new_tokens=n_check, ignore_eos=True)
        neutral = {"split k=1": ["split-softmax:k=1.0"], "instaboost m=1": ["instaboost:m=1"],
                   "pasta alpha=1": [pasta.replace("alpha=0.01", "alpha=1.0")]}
        timer.on = False
        got = {m: list(chat(backend, [convs[c0][1] if m.startswith("pasta") else convs[c0][0]], sampling,
                            steer=steer[m] if m in steer else Interventions.parse(neutral[m]))[0].token_ids)
               for m in ("plain", "trace", "split", *neutral)}
        timer.on = True
        n_neutral = sum(got[m] == got["plain"] for m in neutral)
        results[f"{shape}.neutral_matches_plain"] = f"{n_neutral}/{len(neutral)}"
        ref = split_reference(backend, convs[c0][0], n_check, 0.9)
        same = sum(a == b for a, b in zip(got["split"], ref))
        first_diff = next((i for i, (a, b) in enumerate(zip(got["split"], ref)) if a != b), None)
        results[f"{shape}.split_matches_eager_reference"] = f"{same}/{n_check}"
        results[f"{shape}.split_first_divergence"] = str(first_diff) if first_diff is not None else "none"
        results[f"{shape}.trace_matches_plain"] = f"{sum(a == b for a, b in zip(got['trace'], got['plain']))}/{n_check}"
        results[f"{shape}.split_changes_plain"] = str(got["split"] != got["plain"]).lower()
        notes.append(f"{shape} check @ {lens[c0]} tokens, {n_check} greedy tokens: split-softmax vs independent eager "
                     f"reference {same}/{n_check} identical (first divergence: {first_diff}); trace vs plain "
                     f"{results[f'{shape}.trace_matches_plain']}; strength-0 modes ({', '.join(neutral)}) give plain's "
                     f"tokens: {n_neutral}/{len(neutral)}; split-softmax k=0.9 changes plain's tokens: "
                     f"{got['split'] != got['plain']}" + (" (bf16: a near-tie may flip a token)"
                                                          if dtype != torch.float32 else ""))

        # self-chat
        if sc != "0":
            spec, _, sc_shape = sc.partition("@")
            if (sc_shape or shapes[-1]) == shape:
                p, rd, tk = (int(x) for x in spec.split("x"))
                timer.on = False
                sc_modes = {m: [f"{pasta},span=system" if x == pasta else x for x in specs] for m, specs in modes.items()}
                selfchat_table = selfchat(backend, p, rd, tk, sc_modes,
                                          repeats=sc_repeats, results=results, targets=targets,
                                          shape=shape, records=records)
                timer.on = True

    for shape in shapes:
        do_shape(shape)  # its model is freed on return
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()

    torch.set_num_threads(threads)
    res.notes = notes + [
        "prefill = first forward (the whole prompt), decode = median forward of the others; 'vs plain' and "
        "'vs sdpa' divide by driftlab's attention without interventions / stock transformers SDPA at the same "
        "context; total = prefill + all decode forwards (pastalib: its generate call).",
        "variants: split = split-softmax k=0.9; instaboost m=5; pasta alpha=0.01 on the marked instruction; "
        "composed = trace + split + instaboost + pasta; eager = output_attentions=True with pi summed from the "
        "weights; self-chat's pasta emphasises the system prompt (dialogs have no markup).",
    ]
    if not CUDA:
        res.notes.append("not a GPU: the issue's targets are printed but not judged; these figures are for "
                         "checking the benchmark, not the GPU path.")
    if selfchat_table is not None:
        res.tables.append(selfchat_table)
    res.tables.append(targets)
    res.results = results
    out = os.environ.get("GPUBENCH_JSON")
    if out:
        Path(out).write_text(json.dumps({"results": results, "records": records, "notes": res.notes}, indent=1))
    return res


def pastalib_run(backend, conv, heads: dict[str, list[int]], n_new: int) -> tuple[int, list[int]]:
    """The authors' pastalib on the same model (eager attention, its hooks, model.generate)."""
    from pastalib.pasta import PASTA

    from driftlab.attention import ATTENTION_NAME
    from driftlab.steering import Interventions

    model, tok = backend.model, backend.tokenizer
    spec = "+".join(f"{layer}.{h}" for layer, hs in heads.items() for h in hs)
    rendered = backend.render(conv, interventions=Interventions.parse([f"pasta:heads={spec},alpha=0.01"]))
    model.set_attn_implementation("eager")
    try:
        p = PASTA(model, tok, head_config=heads, alpha=0.01, scale_position="exclude")
        inputs, offsets = p.inputs_from_batch([rendered.text])
        inputs = {k: v.to(backend.device) for k, v in inputs.items()}
        with p.apply_steering(model, strings=[rendered.text], substrings=[INSTRUCTION], model_input=inputs,
                              offsets_mapping=offsets), torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 pad_token_id=backend.pad_id)
        sync()
        n_in = inputs["input_ids"].shape[1]
        return out.shape[1] - n_in, out[0, n_in:].tolist()
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def selfchat(backend, pairs: int, rounds: int, tokens: int, modes: dict[str, list[str]], *, repeats: int,
             results: dict, targets: Table, shape: str, records: list) -> Table:
    """Batched self-chat tokens/s per mode (driftlab's protocol, prefix reuse on) vs a naive loop."""
    from driftlab.chat import Sampling
    from driftlab.protocol.dialog import RECORDS
    from driftlab.protocol.runner import run_protocol
    from driftlab.protocol.selfchat import SelfChat

    pair_ids = [(a, u) for a in SELFCHAT_AGENTS for u in SELFCHAT_AGENTS if a != u][:pairs]
    cache_bytes = (8 << 30) if CUDA else (1 << 30)

    def once(batch: int, cache: bool, specs: list[str], pids=pair_ids, n_rounds=rounds, n_tok=tokens):
        backend.prefix_cache.clear()
        backend.prefix_cache.max_bytes = cache_bytes if cache else 0
        cfg = selfchat_config(pairs=0, pair_ids=pids, rounds=n_rounds, batch_size=batch, seed=1, steer=specs,
                              sampling=Sampling(max_new_tokens=n_tok, ignore_eos=True))
        with tempfile.TemporaryDirectory() as out:
            sync()
            t = time.perf_counter()
            rundir = run_protocol(SelfChat(cfg, backend), out, progress=False)
            sync()
            s = time.perf_counter() - t
            recs = rundir.records(RECORDS)
        return s, len(recs), sum(r.n_tokens for r in recs)

    variants = [("naive loop (batch 1, no prefix reuse, plain)", 1, False, [])] + [
        (f"batched: {m}", 32, True, specs) for m, specs in modes.items()]
    for _, b, c, specs in variants:  # warm-up with the timed shapes, so that no compile lands in the timing
        once(b, c, specs)
    best: dict[str, tuple[float, int, int]] = {}
    for r in range(repeats):
        for name, b, c, specs in variants[r % len(variants):] + variants[: r % len(variants)]:
            got = once(b, c, specs)
            if name not in best or got[0] < best[name][0]:
                best[name] = got
    work = {v[1:] for v in best.values()}
    assert len(work) == 1, f"self-chat variants did different work: {best}"
    naive_name = variants[0][0]
    plain_name = "batched: plain"
    tps = {name: t / s for name, (s, _, t) in best.items()}
    table = Table(title=f"self-chat, {shape} shape: {pairs} pairs x {rounds} rounds x {tokens} tokens (+ probes), "
                  f"driftlab's protocol, best of {repeats}",
                  columns=["variant", "wall s", "records", "tokens", "tok/s", "vs naive", "vs batched plain"])
    for name, (s, n_rec, n_tok) in best.items():
        table.rows.append([name, f"{s:.2f}", n_rec, n_tok, f"{tps[name]:.1f}", fmt_x(tps[name] / tps[naive_name]),
                           fmt_x(tps[name] / tps[plain_name])])
        slug = "naive" if name == naive_name else name.removeprefix("batched: ")
        results[f"{shape}.selfchat.{slug}.tok_s"] = f"{tps[name]:.1f}"
        results[f"{shape}.selfchat.{slug}.vs_naive"] = f"{tps[name] / tps[naive_name]:.3f}"
        records.append({"shape": shape, "selfchat": slug, "s": s, "records": n_rec, "tokens": n_tok,
                        "tok_s": tps[name]})
    qwen = shape == "qwen2.5-7b"
    targets.rows.append(["batched self-chat tok/s (plain)", shape, "-", f"{tps[plain_name]:.1f}",
                         f">= {3 * ISSUE_SELFCHAT_TOK_S:.0f} (3 x {ISSUE_SELFCHAT_TOK_S:.0f})",
                         judge(tps[plain_name] >= 3 * ISSUE_SELFCHAT_TOK_S, qwen, "target is for qwen2.5-7b")])
    for m in modes:
        if m == "plain":
            continue
        ratio = tps[plain_name] / tps[f"batched: {m}"]
        targets.rows.append([f"self-chat plain / {m} throughput", shape, "-", fmt_x(ratio), "<= 1.2x",
                             judge(ratio <= 1.2, qwen, "target is for qwen2.5-7b")])
    return table
