"""The attention engine at real model shapes, with no weights: every mode's prefill, decode step,
compile time and memory against plain decoding and stock SDPA, decode against the memory-bandwidth
floor, batched self-chat throughput, the paper's experiment at full scale (`--paper`), and every
mode's numbers checked against an independent eager reference in float32. One H100 run of it judges
every GPU target of the steering engine (the targets table; docs/performance.md says how to run it
inside 10-minute commands).

Models: randomly initialised from real configs, built directly on the device (a model's speed and
memory do not depend on its weights' values): the Llama-2-7B and Qwen2.5-7B shapes (vocabulary
49152, SmolLM2's, so its tokenizer and chat template serve), and on a CPU or with `--quick` a tiny
Llama-family shape with grouped-query attention (4 layers unless GPUBENCH_TINY_LAYERS, hidden 128,
8 query / 2 KV heads, init std 0.1 so attention is far from uniform). The model goes into driftlab's
real `HFChatBackend` (its decode loop, prefix cache, renderer and attention engine): the benchmark
hands the backend the in-memory model in place of `load_model`'s disk load, for the construction
only (see `_backend`).

Dtype: bf16 on CUDA; float32 on a CPU (set GPUBENCH_DTYPE to change). The numeric check always
runs in float32 (see below).

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
             user without driftlab does), own greedy loop with a dynamic cache (CPU default; on CUDA
             only when GPUBENCH_VARIANTS names it);
  pastalib   the PASTA authors' library (eager + its hooks, `model.generate`), Llama family only,
             when importable: total time only (as eager).
Each variant is first run once untimed at every context with the timed shapes (warm-up: a compiled
loop compiles there; its compile seconds are printed per variant, and RESULT
<shape>.graphs_compiled_in_timing says if any compile still landed in the timed rounds), then
`repeats` interleaved rounds (the order rotates); each forward of the backend's decode loop is
timed with a device synchronize on both sides: prefill = the first forward, decode step = the
median of the others; the best round is kept. A progress line per variant goes to stderr. Peak
memory above what was allocated before the call (weights excluded; a static KV cache kept from an
earlier call and reused is added, so the loops compare), judged for O(T) as the peak per context
token at the largest context over the smallest (<= 1.5x): CUDA `torch.cuda.max_memory_allocated`;
CPU the process's peak resident set (VmHWM reset through /proc/self/clear_refs, as
benchmarks/attention.py does): coarse, and allocator-dependent. An eager run or pastalib that runs
out of memory is reported as "OOM".

Compiling (the compiled loop, `auto` on CUDA): before anything else on a shape, a sweep of 11 steers
(split-softmax k = 0.0 .. 0.9 and InstABoost m = 5, after one plain call) from a cold process: the
plain call's compile seconds are the model's first compile, and the sweep's graphs must stay within
one plain and one steered graph per batch bucket. Then a second process builds the same model and
runs a plain and a steered call with the compile cache the first one filled: its compile seconds.

Floor: bytes one decode step must read (all weights but the input embedding, which is gathered,
plus the KV cache at that context) / bandwidth, the bandwidth measured in this run by a large
device-to-device copy (read + write bytes / time).

Self-chat: driftlab's real protocol (`SelfChat` through `run_protocol`), 8 pairs x 3 rounds x 48
tokens on the Qwen2.5-7B shape (the tiny shape on a CPU), batched with prefix reuse in every mode,
against a naive loop (batch 1, no prefix cache, plain); probes decode with the turn's budget, in the
agent's call. Tokens/s = generated tokens / wall.

Numeric check (every device, float32): a float32 copy of the shape cut to 2 layers (its real head
counts, groups and widths; init std 0.1; the tiny shape, already small, keeps its layers, so its check
runs on the steps `driftlab models warm` stored for it instead of compiling two more) decodes 8
greedy tokens per mode in the benchmark's loop and under an independent eager reference that
materialises and reweights the weights (tests/attention_reference.py: Eq. 7 of the persona-drift
paper for split-softmax, every bias term added to the logits, pi summed from the weights). Per mode:
the greedy tokens that agree, and the largest difference of a generated token's log-probability (and
its 4 best alternatives') and of pi over the agreeing steps, against a tolerance; the strength-0
modes (split k=1, InstABoost m=1, PASTA alpha=1) against plain's log-probabilities.

--paper: the persona-drift paper's experiment at full scale on the Llama-2-7B shape: 100 pairs x 8
rounds, 200-token turns, 400-token probes, for each mode of GPUBENCH_PAPER_MODES (default
plain,split; one per 10-minute command if need be), batch GPUBENCH_PAPER_BATCH (default 16; the
KV cache of MHA 7B at ~3.5k tokens is ~1.8 GB per row: 32 rows would not fit in 80 GB, and a batch
that cannot fit is refused in one line before the model is built, `paper_fits`); on a CPU the tiny
shape at 4 x 2 x 16 (probes 16), to check the path.

Targets (H100-class GPU; "n/a (not a GPU)" elsewhere): every mode's decode <= 1.15x plain and
prefill <= 1.3x at 2k and 8k (both shapes), CFG's <= 1.3x and <= 2.1x (it runs a twin row);
plain decode <= 1.6x the floor; the sweep of 11 steers compiles at most 2 graphs per batch bucket; a model's first compile <= 90 s, a second process's
<= 10 s; self-chat on the Qwen2.5-7B shape >= 1071 tok/s plain (3 x the 357 tok/s measured on an
H100 before this engine) with every mode within 1.2x of plain; the paper's experiment <= 10 minutes
per mode.

Sizes (`python benchmarks/run.py gpu [--quick | --full | --paper]`; each setting below overrides its part):
  CUDA           the two 7B shapes at 2048 and 8192 tokens, 32 decode steps, 2 rounds, self-chat
                 8x3x48@qwen2.5-7b (once); --full adds 32768 tokens and 3 rounds
  CPU (default)  tiny at 256 and 1024 tokens, 16 decode steps, 2 rounds, self-chat 2x2x8@tiny
                 (best of 2)
  CPU --full     tiny at 1024 and 4096 tokens, 32 decode steps, 3 rounds, self-chat 2x2x8@tiny
  --quick        tiny at 256 and 1024 tokens, 8 decode steps, 2 rounds, self-chat 2x2x8@tiny (once)

Settings (environment variables; run.py takes no others):
  GPUBENCH_SHAPES       comma list of llama2-7b, qwen2.5-7b, tiny
  GPUBENCH_TINY_LAYERS  the tiny shape's layer count, at least 2 (default 4, what every recorded run
                        used; fewer compile faster: tests/test_benchmarks_gpu.py runs 2)
  GPUBENCH_CONTEXTS     comma list of prompt lengths
  GPUBENCH_DECODE       decode steps per call
  GPUBENCH_REPEATS      timed rounds
  GPUBENCH_SELFCHAT     PAIRSxROUNDSxTOKENS[@SHAPE] (SHAPE one of GPUBENCH_SHAPES, default the
                        last), or 0 to skip; the size's default is skipped where its shape is not run
  GPUBENCH_VARIANTS     comma list restricting the per-context and self-chat variants (plain and sdpa
                        always run)
  GPUBENCH_PARTS        comma list of the parts to run: modes, compile, check, selfchat (default all)
  GPUBENCH_SLOW_S       a variant whose warm-up (prefill + 1 step) takes longer is timed once (default 60)
  GPUBENCH_TOKENIZER    tokenizer directory (default: the provisioned smollm2-135m)
  GPUBENCH_DTYPE        bfloat16 | float32 | float16 (default bf16 on CUDA, float32 on a CPU)
  GPUBENCH_JSON         write every measurement to this JSON file
  GPUBENCH_LOOP         driftlab's decode loop for every driftlab variant (HFChatBackend `decode`):
                        auto (default: compiled on CUDA, dynamic on a CPU), dynamic, static or
                        compiled (static cache + torch.compile: CUDA graphs on a GPU). RESULT
                        <shape>.loop_ran says which loop really decoded (a fallback is also a note)
                        and <shape>.graphs_compiled how many graphs a compiled step compiled;
                        <shape>.graphs.batch<B>.<plain|steered>.<attention> per batch bucket,
                        <shape>.decode_kernel the attention kernel asked for (CUDA: flex's
                        split-KV decoding kernel), <shape>.cudagraph_skips,
                        <shape>.cudagraph_recordings and <shape>.cache_evictions (also for
                        .selfchat and paper); <shape>.cudagraph_recordings_in_timing says if a
                        CUDA graph was recorded during the timed rounds.
  GPUBENCH_PAPER_MODES  --paper: comma list of modes (default plain,split)
  GPUBENCH_PAPER_BATCH  --paper: conversations per batch (default 16 on CUDA, 4 on a CPU; one that
                        cannot fit in the device's memory is refused before the model is built)
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from common import Result, Table, TimedForward, pin_threads, selfchat_config, size_of, sync, unwritable

CUDA = torch.cuda.is_available()
SYSTEM = "You are a careful science journalist. Always answer in French, in at most three sentences."
INSTRUCTION = "Answer the occupation of Mary and generate the answer as json format."
SELFCHAT_AGENTS = ["reply-in-french", "secret-number-share", "name-alexander", "very-happy"]
# driftlab's batched self-chat before the steering engine: Qwen2.5-7B shape, H100 (docs/performance.md)
BEFORE_SELFCHAT_TOK_S = 357.0
# (decode, prefill) limits vs plain where a mode's own work is larger: CFG decodes and prefills a
# system-less twin row beside each conversation; every other mode: 1.15x, 1.3x
LIMITS = {"cfg": (1.3, 2.1)}
# every variant a run may name (GPUBENCH_VARIANTS): the modes of `run`'s per-shape table and the opt-in ones
VARIANTS = ("sdpa", "plain", "trace", "split", "instaboost", "pasta", "composed", "bias", "cfg", "spr", "eager",
            "pastalib")


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
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=tiny_layers(),
                          num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, **common)
        cfg.initializer_range = 0.1  # attention far from uniform: interventions change tokens
        return cfg
    raise ValueError(f"unknown shape {name!r}; use llama2-7b, qwen2.5-7b or tiny")


def tiny_layers() -> int:
    """GPUBENCH_TINY_LAYERS, the tiny shape's depth: 4 by default (every recorded run of the shape). A
    CPU run of the compiled loop spends most of its time compiling, per layer: fewer layers check the
    same paths sooner. At least 2, since PASTA steers heads from layer 1 on (`pasta_heads`)."""
    text = os.environ.get("GPUBENCH_TINY_LAYERS", "4")
    if not (text.isdigit() and int(text) >= 2):
        raise SystemExit(f"GPUBENCH_TINY_LAYERS={text!r}: use a whole number of at least 2 (PASTA steers layer 1 "
                         "and up).")
    return int(text)


def pasta_heads(n_layers: int, n_heads: int) -> dict[str, list[int]]:
    """~56 heads on a 7B shape: every 4th head of every (L/8)-th layer, layer 0 excluded."""
    step = max(1, n_layers // 8)
    return {str(layer): list(range(0, n_heads, 4)) for layer in range(step, n_layers, step)}


def tokenizer_dir() -> Path:
    env = os.environ.get("GPUBENCH_TOKENIZER")
    if env:
        if not (Path(env) / "tokenizer_config.json").is_file():
            raise SystemExit(f"GPUBENCH_TOKENIZER={env!r} holds no tokenizer (tokenizer_config.json): give a "
                             "Hugging Face model or tokenizer directory, or leave it unset.")
        return Path(env)
    from driftlab.assets import resolve_model

    return Path(resolve_model("smollm2-135m"))


def pick_dtype(device: torch.device) -> torch.dtype:
    name = os.environ.get("GPUBENCH_DTYPE")
    if name:
        dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
        if name not in dtypes:
            raise SystemExit(f"GPUBENCH_DTYPE={name!r}: use {', '.join(dtypes)}.")
        return dtypes[name]
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
        loading.prepare_attention(attn_implementation)  # as load_model does, right before its load
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


def build(shape: str, device: torch.device, dtype: torch.dtype, *, config=None, decode: str | None = None,
          model=None):
    """(backend, build seconds): a random `shape` model (or `config`'s, or `model` itself) on
    `device` inside driftlab's HFChatBackend, decoding with `decode` (default: GPUBENCH_LOOP)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from driftlab.chat.hf import HFChatBackend

    t = time.perf_counter()
    if model is None:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config or shape_config(shape), dtype=dtype)
        model.eval()
    path = tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with _preloaded(model, tokenizer, path):
        backend = HFChatBackend(str(path), dtype="auto", device=str(device), prefix_cache_bytes=0,
                                decode=decode or decode_loop())
    sync()
    return backend, time.perf_counter() - t


def progress(message: str) -> None:
    """A progress line on stderr (stdout holds the tables and RESULT lines)."""
    print(f"[gpu] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def compile_seconds(backend) -> float:
    """Seconds the backend's compiled decode step has spent compiling, or loading precompiled
    steps (driftlab.chat.precompiled), so far (0 for other loops)."""
    decode = backend.ran()["decode"]
    return float(decode.get("compile_s", 0.0)) + float(decode.get("precompiled", {}).get("load_s", 0.0))


def wanted_loop(device: torch.device) -> str:
    """The loop GPUBENCH_LOOP asks for on `device` (`auto` resolved as the backend resolves it), so
    that a note says only when another one ran."""
    from driftlab.chat.static_decode import auto_decode

    return auto_decode(device) if decode_loop() == "auto" else decode_loop()


def decode_loop() -> str:
    """GPUBENCH_LOOP: the decode loop driftlab's backend runs (see the module docstring)."""
    loop = os.environ.get("GPUBENCH_LOOP", "auto")
    if loop not in ("auto", "dynamic", "static", "compiled"):
        raise SystemExit(f"GPUBENCH_LOOP={loop!r}: use auto, dynamic, static or compiled.")
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


# -- compiling -----------------------------------------------------------------------------------------
SWEEP = [[f"split-softmax:k={k / 10:.1f}"] for k in range(10)] + [["instaboost:m=5"]]  # 11 steers


def compile_sweep(backend, conv, shape: str, results: dict, notes: list, targets: Table) -> None:
    """A plain call, then the 11 steers of SWEEP, from a cold start: the plain call's compile
    seconds are the model's first compile; the sweep's graphs must stay within the budget (one
    plain and one steered graph per batch bucket: all of these are batch 1)."""
    from driftlab.chat import Sampling, chat
    from driftlab.steering import Interventions

    sampling = Sampling(greedy=True, max_new_tokens=4, ignore_eos=True)
    t = time.perf_counter()
    chat(backend, [conv], sampling)
    first, first_wall = compile_seconds(backend), time.perf_counter() - t
    graphs0 = backend.ran()["decode"].get("graphs", 0)
    progress(f"{shape}: first (plain) call {first_wall:.1f} s, {first:.1f} s compiling")
    t = time.perf_counter()
    for specs in SWEEP:
        chat(backend, [conv], sampling, steer=Interventions.parse(specs))
    ran = backend.ran()["decode"]
    graphs, seconds = ran.get("graphs", 0) - graphs0, compile_seconds(backend) - first
    progress(f"{shape}: sweep of {len(SWEEP)} steers {time.perf_counter() - t:.1f} s, {graphs} graphs compiled in "
             f"{seconds:.1f} s")
    results.update({f"{shape}.first_compile_s": f"{first:.1f}", f"{shape}.sweep11.graphs": str(graphs),
                    f"{shape}.sweep11.compile_s": f"{seconds:.1f}",
                    f"{shape}.sweep11.over_budget": str(len(ran.get("over_budget", [])))})
    compiled = ran["loop"] == "compiled"
    why = "the compiled loop did not run" if not compiled else "target is for the 7B shapes"
    targets.rows.append(["first compile of a model (plain step), s", shape, "-", f"{first:.1f}", "<= 90",
                         judge(first <= 90, compiled and shape != "tiny", why)])
    targets.rows.append([f"graphs compiled by a sweep of {len(SWEEP)} steers (batch 1)", shape, "-", str(graphs),
                         "<= 2", judge(graphs <= 2, compiled and shape != "tiny", why)])
    notes.append(f"{shape}: first compile {first:.1f} s (plain step); the sweep ({', '.join(x[0] for x in SWEEP)}) "
                 f"compiled {graphs} graphs in {seconds:.1f} s" + ("" if compiled else f" ({ran['loop']} loop)"))


def second_process(shape: str, dtype: str, results: dict, notes: list, targets: Table) -> None:
    """A new process builds the same model and runs a plain and a steered call with the compile
    cache the first process filled: what compiling costs once the cache holds the model."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import gpu; "
            f"gpu.second_process_main({shape!r}, {dtype!r})")
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t
    lines = [line for line in done.stdout.splitlines() if line.startswith("SECOND ")]
    if done.returncode != 0 or not lines:
        notes.append(f"{shape}: the second process failed: {done.stderr.strip()[-500:]}")
        results[f"{shape}.second_process"] = "failed"
        return
    facts = json.loads(lines[-1].removeprefix("SECOND "))
    aot = ", ".join(f"{facts.get(f'aot_{k}', 0)} {k}" for k in ("hit", "miss", "bypass"))
    progress(f"{shape}: second process {wall:.1f} s, {facts['compile_s']:.1f} s compiling or loading "
             f"({facts['graphs']} graphs traced, {facts['loaded']} precompiled steps loaded in {facts['load_s']:.1f} s), "
             f"cache hits {facts['hits']}, misses {facts['misses']}; AOTAutograd cache {aot}")
    results.update({f"{shape}.second_process.compile_s": f"{facts['compile_s']:.1f}",
                    f"{shape}.second_process.graphs": str(facts["graphs"]),
                    f"{shape}.second_process.loaded": str(facts["loaded"]),
                    f"{shape}.second_process.load_s": f"{facts['load_s']:.2f}",
                    f"{shape}.second_process.cache_hits": str(facts["hits"]),
                    f"{shape}.second_process.cache_misses": str(facts["misses"]),
                    **{f"{shape}.second_process.aot_cache_{k}": str(facts.get(f"aot_{k}", 0))
                       for k in ("hit", "miss", "bypass")}})
    targets.rows.append(["second process's compile (plain + steered), s", shape, "-", f"{facts['compile_s']:.1f}",
                         "<= 10", judge(facts["compile_s"] <= 10, facts["loop"] == "compiled" and shape != "tiny",
                                        "target is for the 7B shapes" if shape == "tiny" else "not compiled")])
    notes.append(f"{shape}: a second process (model build {facts['build_s']:.1f} s) compiled or loaded for "
                 f"{facts['compile_s']:.1f} s: {facts['graphs']} graphs traced, {facts['loaded']} precompiled steps "
                 f"loaded, {facts['hits']} inductor cache hits, {facts['misses']} misses; "
                 f"AOTAutograd cache: {aot} (a miss or bypass re-traces AOT even where inductor hits)")


def second_process_main(shape: str, dtype: str) -> None:
    """The second process's side: prints `SECOND {json}`."""
    from driftlab.chat import Sampling, chat
    from driftlab.steering import Interventions

    device = torch.device("cuda" if CUDA else "cpu")
    pin_threads()  # as the first process: generated CPU code depends on the thread count
    backend, build_s = build(shape, device, getattr(torch, dtype))
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": INSTRUCTION}]
    sampling = Sampling(greedy=True, max_new_tokens=4, ignore_eos=True)
    for steer in (None, Interventions.parse(["split-softmax:k=0.5"])):
        chat(backend, [conv], sampling, steer=steer)
    ran = backend.ran()["decode"]
    cache = ran.get("compile_cache", {"hits": 0, "misses": 0})
    stored = ran.get("precompiled", {})
    print("SECOND " + json.dumps({"compile_s": compile_seconds(backend), "build_s": build_s, "loop": ran["loop"],
                                  "graphs": ran.get("graphs", 0), "loaded": stored.get("loaded", 0),
                                  "load_s": stored.get("load_s", 0.0), **cache}), flush=True)


# -- the numeric check -----------------------------------------------------------------------------------
CHECK = {"plain": [], "trace": ["trace"], "split": ["split-softmax:k=0.9", "trace"], "instaboost": ["instaboost:m=5"],
         "bias": ["bias:value=2.0"], "composed": ["trace", "split-softmax:k=0.9", "instaboost:m=5", "bias:value=-1.0"]}
NEUTRAL = {"split k=1": ["split-softmax:k=1.0"], "instaboost m=1": ["instaboost:m=1"]}
CHECK_TOL = {"logprob": 1e-3, "pi": 1e-4}


def check_config(shape: str):
    """The shape cut to 2 layers, init std 0.1 (attention far from uniform): float32 at real widths. The
    tiny shape (std 0.1 already) stays whole: its compiled steps are then the timed model's."""
    cfg = shape_config(shape)
    if shape != "tiny":
        cfg.num_hidden_layers = 2
    cfg.initializer_range = 0.1
    return cfg


def numeric_check(shape: str, device: torch.device, results: dict, notes: list) -> Table:
    """Every mode in the benchmark's loop, float32, against tests/attention_reference.py's eager
    reference on the same model (see the module docstring). Returns the check's table."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import numpy as np

    from attention_reference import NAME, register_reference
    from driftlab.attention import ATTENTION_NAME
    from driftlab.chat import ChatRequest, Sampling
    from driftlab.steering import Interventions

    register_reference()
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32
    backend, _ = build(shape, device, torch.float32, config=check_config(shape))
    # The same model in a dynamic loop, switched to the reference's attention for its calls.
    reference, _ = build(shape, device, torch.float32, model=backend.model, decode="dynamic")
    cfg = check_config(shape)
    heads = pasta_heads(cfg.num_hidden_layers, cfg.num_attention_heads)
    modes = {**CHECK, "pasta": ["pasta:alpha=0.01,heads=" + "+".join(f"{layer}.{h}" for layer, hs in heads.items()
                                                                      for h in hs)]}
    conv = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Tell me about Mary, a nurse in Leeds. *{INSTRUCTION}*"}]
    sampling = Sampling(greedy=True, max_new_tokens=8, ignore_eos=True)

    def run(be, specs, impl=ATTENTION_NAME):
        backend.model.set_attn_implementation(impl)
        try:
            (reply,) = be.generate(ChatRequest([conv], sampling, interventions=Interventions.parse(specs), logprobs=4))
        finally:
            backend.model.set_attn_implementation(ATTENTION_NAME)
        lp = np.array([[t.logprob, *(x for _, x in t.top)] for t in reply.logprobs])
        return reply.token_ids, lp, None if reply.trace is None else np.asarray(reply.trace.decode)

    layers = check_config(shape).num_hidden_layers
    table = Table(title=f"numeric check, {shape} shape at {layers} layers, float32, 8 greedy tokens: "
                        f"{backend.ran()['decode']['loop']} loop vs the eager reference",
                  columns=["mode", "tokens agree", "max |d logprob|", "max |d pi|", "within tolerance?"])
    plain = run(backend, [])
    try:
        for mode, specs in modes.items():
            got, want = run(backend, specs), run(reference, specs, NAME)
            agree = next((i for i, (a, b) in enumerate(zip(got[0], want[0])) if a != b), len(want[0]))
            d_lp = float(np.abs(got[1][:agree + 1] - want[1][:agree + 1]).max())  # the first differing step too
            d_pi = None if want[2] is None else float(np.abs(got[2][:agree] - want[2][:agree]).max())
            ok = agree == len(want[0]) and d_lp <= CHECK_TOL["logprob"] and (d_pi is None or d_pi <= CHECK_TOL["pi"])
            acts = mode in ("plain", "trace") or float(np.abs(want[1] - plain[1]).max()) > 1e-3
            table.rows.append([mode, f"{agree}/{len(want[0])}", f"{d_lp:.1e}", "-" if d_pi is None else f"{d_pi:.1e}",
                               ("yes" if ok else "NO") + ("" if acts else " (the mode changed nothing: no test)")])
            results.update({f"{shape}.check.{mode}.tokens_agree": f"{agree}/{len(want[0])}",
                            f"{shape}.check.{mode}.max_logprob_diff": f"{d_lp:.2e}",
                            f"{shape}.check.{mode}.ok": str(ok and acts).lower()})
            if d_pi is not None:
                results[f"{shape}.check.{mode}.max_pi_diff"] = f"{d_pi:.2e}"
        for mode, specs in NEUTRAL.items():  # strength 0: plain's numbers
            got = run(backend, specs)
            d = float(np.abs(got[1] - plain[1]).max())
            table.rows.append([f"{mode} vs plain", f"{sum(a == b for a, b in zip(got[0], plain[0]))}/8", f"{d:.1e}",
                               "-", "yes" if d == 0 else "NO"])
            results[f"{shape}.check.{mode.replace(' ', '_').replace('=', '')}.vs_plain"] = f"{d:.2e}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    n_ok = sum(results[f"{shape}.check.{m}.ok"] == "true" for m in modes)
    results[f"{shape}.check.modes_ok"] = f"{n_ok}/{len(modes)}"
    notes.append(f"{shape}: numeric check: {n_ok}/{len(modes)} modes agree with the eager reference within "
                 f"{CHECK_TOL['logprob']:g} in log-probability and {CHECK_TOL['pi']:g} in pi (float32, {layers} layers).")
    return table


def timed_selfchat(backend, cfg, progress: bool = False) -> tuple[float, int, int]:
    """(wall seconds, records, generated tokens) of driftlab's self-chat protocol run with `cfg`."""
    from driftlab.protocol.dialog import RECORDS
    from driftlab.protocol.runner import run_protocol
    from driftlab.protocol.selfchat import SelfChat

    with tempfile.TemporaryDirectory() as out:
        sync()
        t = time.perf_counter()
        rundir = run_protocol(SelfChat(cfg, backend), out, progress=progress)
        sync()
        seconds = time.perf_counter() - t
        recs = rundir.records(RECORDS)
    return seconds, len(recs), sum(r.n_tokens for r in recs)


# -- the paper's experiment --------------------------------------------------------------------------
# (shape, pairs, rounds, turn tokens, probe tokens, batch): the persona-drift paper's experiment (100
# pairs x 8 rounds, 200-token turns, 400-token probes) on the Llama-2-7B shape; a tiny check on a CPU.
PAPER = {"cuda": ("llama2-7b", 100, 8, 200, 400, 16), "cpu": ("tiny", 4, 2, 16, 16, 4)}
PAPER_MODES = {"plain": [], "split": ["split-softmax:k=0.9"], "trace": ["trace"], "instaboost": ["instaboost:m=5"],
               "cfg": ["cfg:alpha=1.5"], "spr": ["spr:p=0.5"]}


def paper_run(device: torch.device, dtype: torch.dtype, results: dict, notes: list, targets: Table) -> Table:
    """The paper's self-chat at full scale, per mode: a warm-up run (one batch, one round: it
    compiles the graphs), then the whole run, timed (see the module docstring)."""
    from driftlab.chat import Sampling
    from driftlab.protocol.selfchat import SelfChatConfig

    shape, pairs, rounds, tokens, probe, batch = PAPER["cuda" if CUDA else "cpu"]
    batch = int(_positive("GPUBENCH_PAPER_BATCH", os.environ.get("GPUBENCH_PAPER_BATCH", batch)))
    names = _env_list("GPUBENCH_PAPER_MODES", ["plain", "split"])
    if unknown := [m for m in names if m not in PAPER_MODES]:
        raise SystemExit(f"GPUBENCH_PAPER_MODES: unknown mode {unknown[0]!r}; use {', '.join(PAPER_MODES)}.")
    twins = any(s.startswith("cfg:") for m in names for s in PAPER_MODES[m])  # CFG decodes a twin per row
    paper_fits(shape, batch, twins, rounds * 2 * tokens + probe, dtype, device)
    backend, build_s = build(shape, device, dtype)
    backend.prefix_cache.max_bytes = (8 << 30) if CUDA else (1 << 30)
    table = Table(title=f"the persona-drift paper's experiment, {shape} shape: {pairs} pairs x {rounds} rounds, "
                        f"{tokens}-token turns, {probe}-token probes, batch {batch}, EOS ignored",
                  columns=["mode", "warm-up s", "wall s", "records", "tokens", "tok/s"])

    def once(specs: list[str], n_pairs: int, n_rounds: int, progress: bool = False) -> tuple[float, int, int]:
        backend.prefix_cache.clear()
        return timed_selfchat(backend, SelfChatConfig(
            pairs=n_pairs, rounds=n_rounds, batch_size=batch, seed=1, steer=specs,
            sampling=Sampling(max_new_tokens=tokens, ignore_eos=True), probe_tokens=probe), progress)

    for mode in names:
        specs = PAPER_MODES[mode]
        warm, _, _ = once(specs, min(batch, pairs), 1)
        results[f"paper.{mode}.warmup_s"] = f"{warm:.1f}"  # kept by a SIGTERM in the whole run
        progress(f"paper {mode}: warm-up {warm:.1f} s; the whole run next")
        # the run's own progress lines (records done, elapsed, left) on stderr: a call cut at its
        # time limit still shows how far the whole run got and at what pace
        seconds, n_rec, n_tok = once(specs, pairs, rounds, progress=True)
        progress(f"paper {mode}: {seconds:.1f} s, {n_tok} tokens")
        table.rows.append([mode, f"{warm:.1f}", f"{seconds:.1f}", n_rec, n_tok, f"{n_tok / seconds:.1f}"])
        results.update({f"paper.{mode}.s": f"{seconds:.1f}", f"paper.{mode}.tokens": str(n_tok),
                        f"paper.{mode}.tok_s": f"{n_tok / seconds:.1f}"})
        targets.rows.append([f"paper's experiment, {mode}, s", shape, "-", f"{seconds:.0f}", "<= 600",
                             judge(seconds <= 600, shape == "llama2-7b", "target is for llama2-7b")])
    ran = backend.ran()["decode"]
    results["paper.loop_ran"] = ran["loop"]
    decode_facts("paper", ran, results)
    notes.append(f"paper: {shape} built in {build_s:.1f} s; {ran['loop']} loop, {ran.get('graphs', 0)} graphs "
                 f"compiled in {ran.get('compile_s', 0.0):.1f} s over the whole run")
    return table


@functools.cache
def parameters(shape: str) -> int:
    """The parameter count of `shape`, from a model built on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(shape_config(shape)).parameters())


def paper_fits(shape: str, batch: int, twins: bool, tokens: int, dtype: torch.dtype, device: torch.device,
               total: int | None = None) -> None:
    """Stop in one line, before the model is built, where the paper's batch cannot fit: the weights
    and the static KV cache of `batch` rows (twice that with CFG's `twins`), padded to their batch
    bucket and holding at least `tokens` tokens (every turn of both sides, then a probe's reply),
    with the margin StaticDecoder keeps for a step's activations, beyond the device's memory (a
    GPU's total, a CPU's RAM; `total` bytes instead, for a test). Without it the run fails minutes
    in, out of memory."""
    from driftlab.chat.static_decode import CACHE_MARGIN, batch_bucket, cache_bytes, cache_length

    cfg, itemsize = shape_config(shape), torch.empty((), dtype=dtype).element_size()
    weights = parameters(shape) * itemsize
    slots, rows = cache_length(tokens), batch * (2 if twins else 1)
    if total is None:
        total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else \
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_row = CACHE_MARGIN * cache_bytes(cfg, 1, slots, itemsize)
    bucket = batch_bucket(rows)
    need = weights + bucket * per_row
    if need <= total:
        return
    fit = int((total - weights) // per_row) if total > weights else 0
    most = (1 << (fit.bit_length() - 1)) // (2 if twins else 1) if fit else 0
    raise SystemExit(
        f"GPUBENCH_PAPER_BATCH={batch}: {bucket} rows of the {shape} shape need "
        f"{need / 1e9:.1f} GB (weights, and KV caches of {slots} slots with "
        f"a {CACHE_MARGIN - 1:.0%} margin), and this {device.type} has {total / 1e9:.1f} GB: "
        + (f"use at most {most}." if most else "not even one conversation fits."))


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


def _selfchat_setting(default: str, shapes: list[str]) -> tuple[int, int, int, str] | None:
    """GPUBENCH_SELFCHAT (else the size's `default`) as (pairs, rounds, tokens, shape); None for 0, or
    for the default when its shape is not among `shapes`; a one-line exit for a bad setting."""
    text = os.environ.get("GPUBENCH_SELFCHAT", default)
    if text == "0":
        return None
    spec, _, shape = text.partition("@")
    shape = shape or shapes[-1]
    if shape not in shapes and "GPUBENCH_SELFCHAT" not in os.environ:
        return None  # e.g. GPUBENCH_SHAPES=llama2-7b: the default self-chat runs on qwen2.5-7b
    sizes = spec.split("x")
    if len(sizes) != 3 or not all(x.isdigit() and int(x) > 0 for x in sizes) or shape not in shapes:
        raise SystemExit(f"GPUBENCH_SELFCHAT={text!r}: use PAIRSxROUNDSxTOKENS[@SHAPE], positive whole numbers "
                         f"and a shape of GPUBENCH_SHAPES ({', '.join(shapes)}), or 0.")
    p, rd, tk = (int(x) for x in sizes)
    return p, rd, tk, shape


def _json_path() -> Path | None:
    """GPUBENCH_JSON, checked before the run (a bad path would lose the run's figures at its end)."""
    out = os.environ.get("GPUBENCH_JSON")
    if not out:
        return None
    path = Path(out)
    if why := unwritable(path):
        raise SystemExit(f"GPUBENCH_JSON={out!r} {why}.")
    return path


# Defaults per size (each GPUBENCH_* variable overrides its part): shapes, contexts, decode steps,
# timed rounds, self-chat, self-chat rounds. On CUDA the default is the full size.
DEFAULTS = {
    "quick": ("tiny", "256,1024", 8, 2, "2x2x8@tiny", 1),
    "cpu": ("tiny", "256,1024", 16, 2, "2x2x8@tiny", 2),
    "cpu-full": ("tiny", "1024,4096", 32, 3, "2x2x8@tiny", 2),
    "cuda": ("llama2-7b,qwen2.5-7b", "2048,8192", 32, 2, "8x3x48@qwen2.5-7b", 1),
    "cuda-full": ("llama2-7b,qwen2.5-7b", "2048,8192,32768", 32, 3, "8x3x48@qwen2.5-7b", 2),
}


PARTS = ("modes", "compile", "check", "selfchat")


def run(quick: bool = False, full: bool = False, paper: bool = False) -> Result:
    from driftlab.attention import ATTENTION_NAME
    from driftlab.chat import Sampling, chat
    from driftlab.steering import Interventions

    size = "paper" if paper else size_of(quick, full)
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = pick_dtype(device)
    decode_loop()  # a bad GPUBENCH_LOOP stops here, before any model is built
    tiny_layers()  # and a bad GPUBENCH_TINY_LAYERS
    if paper:
        return paper_result(device, dtype)
    parts = _env_list("GPUBENCH_PARTS", list(PARTS))
    if unknown := [x for x in parts if x not in PARTS]:
        raise SystemExit(f"GPUBENCH_PARTS: unknown part {unknown[0]!r}; use {', '.join(PARTS)}.")
    d_shapes, d_contexts, d_decode, d_repeats, d_selfchat, sc_repeats = DEFAULTS[
        "quick" if quick else ("cuda-full" if full else "cuda") if CUDA else "cpu-full" if full else "cpu"]
    shapes = _env_list("GPUBENCH_SHAPES", d_shapes.split(","))
    if unknown := [s for s in shapes if s not in ("llama2-7b", "qwen2.5-7b", "tiny")]:
        raise SystemExit(f"GPUBENCH_SHAPES: unknown shape {unknown[0]!r}; use llama2-7b, qwen2.5-7b or tiny.")
    contexts = [_positive("GPUBENCH_CONTEXTS", x) for x in _env_list("GPUBENCH_CONTEXTS", d_contexts.split(","))]
    n_decode = _positive("GPUBENCH_DECODE", os.environ.get("GPUBENCH_DECODE", d_decode))
    repeats = _positive("GPUBENCH_REPEATS", os.environ.get("GPUBENCH_REPEATS", d_repeats))
    sc = _selfchat_setting(d_selfchat, shapes)
    if unknown := [v for v in _env_list("GPUBENCH_VARIANTS", []) if v not in VARIANTS]:
        raise SystemExit(f"GPUBENCH_VARIANTS: unknown variant {unknown[0]!r}; use {', '.join(VARIANTS)}.")
    _json_path()
    if os.environ.get("GPUBENCH_TOKENIZER"):  # a bad one stops here, not after a model is built and measured
        tokenizer_dir()
    slow_s = _positive("GPUBENCH_SLOW_S", os.environ.get("GPUBENCH_SLOW_S", 60), float)
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
    targets = Table(title="targets of the steering engine (judged only on an H100-class GPU)",
                    columns=["target", "shape", "ctx", "measured", "limit", "met?"])
    notes = [f"memory bandwidth (device-to-device copy, read + write): {bw / 1e9:.1f} GB/s",
             f"peak memory: {method}"]
    keep_on_sigterm(results, records, notes)
    selfchat_table = None
    check_tables: list[Table] = []

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
        assert set(modes) <= set(VARIANTS), "VARIANTS must name every mode"
        steer = {m: Interventions.parse(s) for m, s in modes.items()}
        marked = {"pasta", "composed", "pastalib"}
        llama = type(model).__name__.startswith("Llama")
        variants = ["sdpa", *modes, "eager"] + (["pastalib"] if have_pastalib and llama else [])
        only = os.environ.get("GPUBENCH_VARIANTS")
        if only:
            variants = [v for v in variants if v in {"plain", "sdpa", *only.split(",")}]
        elif CUDA:  # what a user without driftlab runs: minutes per call at 8k on a 7B shape, so opt-in
            variants = [v for v in variants if v not in ("eager", "pastalib")]
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
        if "compile" in parts:  # first: from a cold start
            timer.on = False
            compile_sweep(backend, convs[contexts[0]][0], shape, results, notes, targets)
            timer.on = True
            if backend.ran()["decode"]["loop"] == "compiled":
                second_process(shape, str(dtype).removeprefix("torch."), results, notes, targets)
        if "modes" in parts:
            best: dict[tuple[str, int], dict] = {}
            slow: set[tuple[str, int]] = set()
            for c in contexts:  # warm-up, untimed, with the timed shapes; a variant that fails here is not run again
                for v in variants:
                    t, compiling = time.perf_counter(), compile_seconds(backend)
                    rec = one(v, *convs[c], n_decode + 1)
                    spent, compiling = time.perf_counter() - t, compile_seconds(backend) - compiling
                    progress(f"{shape} @ {lens[c]} tokens: {v} warm-up {spent:.1f} s ({compiling:.1f} s compiling)"
                             + (f": {rec['error']}" if "error" in rec else ""))
                    results[f"{shape}.{v}.compile_s"] = f"{float(results.get(f'{shape}.{v}.compile_s', 0)) + compiling:.1f}"
                    if "error" in rec:
                        best[(v, c)] = rec
                    elif spent > slow_s:
                        slow.add((v, c))  # timed once only, so that one slow path cannot eat the run
            warm = backend.ran()["decode"]
            warm_graphs, warm_recordings = warm.get("graphs", 0), warm.get("cudagraph_recordings", 0)
            for r in range(repeats):
                order = variants[r % len(variants):] + variants[: r % len(variants)]
                progress(f"{shape}: timed round {r + 1} of {repeats}")
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
            if "cudagraph_recordings" in ran:  # a recording in a timed round is a stall the times include
                late = ran["cudagraph_recordings"] - warm_recordings
                results[f"{shape}.cudagraph_recordings_in_timing"] = str(late)
                if late:
                    notes.append(f"{shape}: {late} CUDA graphs recorded during the timed rounds (a held cache "
                                 "was let go, or a shape the warm-up did not cover): those rounds include recording.")
            results[f"{shape}.loop_ran"] = ran["loop"]
            if "graphs" in ran:
                results[f"{shape}.graphs_compiled"] = str(ran["graphs"])
            decode_facts(shape, ran, results)
            if ran["loop"] != wanted_loop(device):
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

                # targets, per context: the 7B shapes at up to 8k tokens
                real = shape != "tiny" and c <= 8192
                why = "target is for the 7B shapes" if shape == "tiny" else "target is for 2k and 8k"
                for v in modes:
                    if v == "plain" or (v, c) not in best:
                        continue
                    rec = best[(v, c)]
                    dr = rec["step"] / plain["step"] if "step" in rec else None
                    pr = rec["prefill"] / plain["prefill"] if "prefill" in rec else None
                    d_max, p_max = LIMITS.get(v, (1.15, 1.3))
                    targets.rows.append([f"{v} decode / plain", shape, lens[c], fmt_x(dr), f"<= {d_max}x",
                                         judge(dr is not None and dr <= d_max, real, why)])
                    targets.rows.append([f"{v} prefill / plain", shape, lens[c], fmt_x(pr), f"<= {p_max}x",
                                         judge(pr is not None and pr <= p_max, real, why)])
                fr = plain["step"] / floor
                targets.rows.append(["plain decode / bandwidth floor", shape, lens[c], fmt_x(fr), "<= 1.6x",
                                     judge(fr <= 1.6, shape != "tiny", "target is for the 7B shapes")])

            memory_growth(shape, contexts, lens, modes, best, results, targets)

        if "check" in parts:
            progress(f"{shape}: numeric check")
            check_tables.append(numeric_check(shape, device, results, notes))

        # self-chat
        if "selfchat" in parts and sc is not None:
            p, rd, tk, sc_shape = sc
            if sc_shape == shape:
                timer.on = False
                sc_modes = {m: [f"{pasta},span=system" if x == pasta else x for x in specs] for m, specs in modes.items()
                            if m in variants}  # GPUBENCH_VARIANTS restricts the self-chat too (plain always runs)
                selfchat_table = selfchat(backend, p, rd, tk, sc_modes,
                                          repeats=sc_repeats, results=results, targets=targets,
                                          shape=shape, records=records)
                decode_facts(f"{shape}.selfchat", backend.ran()["decode"], results)
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
        res.notes.append(NOT_A_GPU)
    if selfchat_table is not None:
        res.tables.append(selfchat_table)
    res.tables += check_tables
    res.tables.append(targets)
    res.results = results
    return finish(res, records)


NOT_A_GPU = ("not a GPU: the targets are printed but not judged; these figures are for checking the benchmark, "
             "not the GPU path.")


def keep_on_sigterm(results: dict, records: list[dict], notes: list[str]) -> None:
    """On SIGTERM (a lent GPU call's `timeout`), print the RESULT lines measured so far and write
    them to GPUBENCH_JSON, then exit 124: a 10-minute call cut in its last part keeps the parts
    before it (the tables come only at the end)."""
    import signal

    main = os.getpid()

    def stop(signum, frame) -> None:
        if os.getpid() != main:  # a forked compile worker inherits the handler and gets the group's signal
            os._exit(124)
        progress("stopped by SIGTERM: the RESULT lines below and GPUBENCH_JSON hold what was measured so far")
        for key, value in results.items():
            print(f"RESULT {key}={value}", flush=True)
        if out := _json_path():
            out.write_text(json.dumps({"results": results, "records": records,
                                       "notes": [*notes, "stopped early by SIGTERM"]}, indent=1))
        os._exit(124)

    signal.signal(signal.SIGTERM, stop)


def finish(res: Result, records: list[dict]) -> Result:
    """Write GPUBENCH_JSON (every measurement) if asked, and hand the result to run.py."""
    out = _json_path()
    if out:
        out.write_text(json.dumps({"results": res.results, "records": records, "notes": res.notes}, indent=1))
    return res


def paper_result(device: torch.device, dtype: torch.dtype) -> Result:
    """`--paper`: the paper's experiment alone (see the module docstring)."""
    pin_threads()
    _json_path()
    if os.environ.get("GPUBENCH_TOKENIZER"):  # a bad one stops here, before the model is built
        tokenizer_dir()
    results: dict[str, str] = {"size": "paper", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                               "loop": decode_loop()}
    notes: list[str] = []
    keep_on_sigterm(results, [], notes)  # a call cut in a mode's whole run keeps the modes and warm-ups before
    targets = Table(title="targets of the steering engine (judged only on an H100-class GPU)",
                    columns=["target", "shape", "ctx", "measured", "limit", "met?"])
    table = paper_run(device, dtype, results, notes, targets)
    res = Result(title=table.title, columns=table.columns, rows=table.rows, results=results,
                 notes=notes + ([] if CUDA else [NOT_A_GPU]), tables=[targets])
    return finish(res, [])


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


def decode_facts(label: str, ran: dict, results: dict) -> None:
    """What the compiled loop ran, as RESULT lines: the attention kernel of its decode steps (flex's
    split-KV decoding kernel, asked for by name: a step it cannot serve fails its compile), the
    graphs per key (batch bucket, plain or steered), graphs CUDA graphs skipped, CUDA graphs
    recorded, and the held caches let go for another bucket's."""
    if "decode_kernel" in ran:
        results[f"{label}.decode_kernel"] = ran["decode_kernel"]
    for key in ran.get("graph_keys", []):
        kind = "steered" if key["steered"] else "plain"
        results[f"{label}.graphs.batch{key['batch']}.{kind}.{key['attention']}"] = str(key["graphs"])
    for name in ("cudagraph_skips", "cudagraph_recordings", "cache_evictions"):
        if name in ran:
            results[f"{label}.{name}"] = str(ran[name])


def _slug(name: str) -> str:
    """A self-chat variant's key in the RESULT lines: `naive` or the mode."""
    return "naive" if name.startswith("naive") else name.removeprefix("batched: ")


def selfchat(backend, pairs: int, rounds: int, tokens: int, modes: dict[str, list[str]], *, repeats: int,
             results: dict, targets: Table, shape: str, records: list) -> Table:
    """Batched self-chat tokens/s per mode (driftlab's protocol, prefix reuse on) vs a naive loop."""
    from driftlab.chat import Sampling

    pair_ids = [(a, u) for a in SELFCHAT_AGENTS for u in SELFCHAT_AGENTS if a != u][:pairs]
    cache_bytes = (8 << 30) if CUDA else (1 << 30)

    def once(batch: int, cache: bool, specs: list[str], pids=pair_ids, n_rounds=rounds, n_tok=tokens):
        backend.prefix_cache.clear()
        backend.prefix_cache.max_bytes = cache_bytes if cache else 0
        return timed_selfchat(backend, selfchat_config(pairs=0, pair_ids=pids, rounds=n_rounds, batch_size=batch,
                                                       seed=1, steer=specs,
                                                       sampling=Sampling(max_new_tokens=n_tok, ignore_eos=True)))

    variants = [("naive loop (batch 1, no prefix reuse, plain)", 1, False, [])] + [
        (f"batched: {m}", 32, True, specs) for m, specs in modes.items()]
    best: dict[str, tuple[float, int, int]] = {}

    def timed(name: str, b: int, c: bool, specs: list[str]) -> None:
        got = once(b, c, specs)
        if name not in best or got[0] < best[name][0]:
            best[name] = got
        # kept if a timeout cuts the run: a cold GPU machine spends minutes compiling the later variants
        results[f"{shape}.selfchat.{_slug(name)}.tok_s"] = f"{best[name][2] / best[name][0]:.1f}"

    for name, b, c, specs in variants:  # warm-up with the timed shapes, so that no compile lands in the timing
        compiling = compile_seconds(backend)
        spent = once(b, c, specs)[0]
        compiling = compile_seconds(backend) - compiling
        progress(f"{shape} self-chat: {name} warm-up {spent:.1f} s ({compiling:.1f} s compiling)")
        results[f"{shape}.selfchat.{_slug(name)}.warmup_s"] = f"{spent:.1f}"
        timed(name, b, c, specs)  # round 1 right after the variant's own warm-up
    for r in range(1, repeats):
        progress(f"{shape} self-chat: timed round {r + 1} of {repeats}")
        for name, b, c, specs in variants[r % len(variants):] + variants[: r % len(variants)]:
            timed(name, b, c, specs)
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
        slug = _slug(name)  # its tok_s RESULT line was written when it was timed
        results[f"{shape}.selfchat.{slug}.vs_naive"] = f"{tps[name] / tps[naive_name]:.3f}"
        records.append({"shape": shape, "selfchat": slug, "s": s, "records": n_rec, "tokens": n_tok,
                        "tok_s": tps[name]})
    qwen = shape == "qwen2.5-7b"
    targets.rows.append(["batched self-chat tok/s (plain)", shape, "-", f"{tps[plain_name]:.1f}",
                         f">= {3 * BEFORE_SELFCHAT_TOK_S:.0f} (3 x {BEFORE_SELFCHAT_TOK_S:.0f})",
                         judge(tps[plain_name] >= 3 * BEFORE_SELFCHAT_TOK_S, qwen, "target is for qwen2.5-7b")])
    for m in modes:
        if m == "plain":
            continue
        ratio = tps[plain_name] / tps[f"batched: {m}"]
        targets.rows.append([f"self-chat plain / {m} throughput", shape, "-", fmt_x(ratio), "<= 1.2x",
                             judge(ratio <= 1.2, qwen, "target is for qwen2.5-7b")])
    return table
