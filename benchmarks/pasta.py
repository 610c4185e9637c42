"""PASTA: driftlab's steering vs the authors' pastalib 0.1.3, and vs plain decoding.

Same model (SmolLM2-135M, fp32, CPU), same heads, alpha and emphasised span, one prompt of
about 512 and about 2k tokens (a long biography context, the emphasised instruction at its
end), greedy, `new` tokens with EOS ignored:

* pastalib: eager attention (it needs it: it edits the T x T additive mask) + its hooks,
  `model.generate`;
* driftlab: its fused-SDPA attention function with the PASTA key bias, its decode loop;
* plain: driftlab's decode loop with no steering (the overhead baseline).

Each variant runs in its own process, so its peak memory is its own: the resident-set
high-water mark is reset before the first timed call (Linux /proc/self/clear_refs), and
"peak above weights" is the high-water mark over that call minus the resident size before it
(the weights and what the warm-up left, freed heap handed back with malloc_trim first). The
three processes load and warm up at once; then `repeats` rounds each make one timed call per
variant, the order rotating between rounds, so a shared machine's slow drift hits all three
alike; the best time is kept. A ratio compares runs of this one invocation. Targets (issue):
>= 3x faster than pastalib and <= 0.2x its peak memory above the weights at 2k tokens;
overhead over plain <= 1.15x.

Sizes (prompts; new tokens; rounds; warm-up): --quick ~512; 8; 1; the same call. Default ~2k;
16; 2; a short prompt (~100 tokens) and 4 new tokens (kernels and allocator; the long prompt's
cost is what is timed). --full ~512 and ~2k; 32; 2; the same call (the size of the figures in
docs/pasta.md). Measured with `time python benchmarks/run.py pasta` on this project's 2-core CPU,
shared with other jobs (load average ~3, this run included), 1 torch thread per process: the
default size took 2 min 43 s (1990 prompt tokens: 2.45x pastalib's speed, 0.110x its peak memory
above the weights, 0.88x plain's time, the same greedy tokens), --quick 44 s to 1 min 20 s.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

from common import Result, pin_threads, size_of

HEADS = {"3": [1, 4], "7": [0], "10": [2, 3, 5], "14": [6], "20": [8], "25": [2]}
ALPHA = 0.01
INSTRUCTION = "Answer the occupation of Mary and generate the answer as json format."
BIO = ("Mary Jones is a registered nurse who has worked in the intensive care unit of a large hospital in "
       "Columbus, Ohio, for twelve years. She studied at Ohio State University and later trained young nurses "
       "in emergency care. Outside work she volunteers at a local shelter and likes long hikes with her dog. ")


def _prompt(tokenizer, target: int) -> list[dict]:
    """A user message of about `target` tokens: repeated context, then the *instruction*."""
    per = len(tokenizer(BIO)["input_ids"])
    context = BIO * max(1, (target - 40) // per)
    return [{"role": "user", "content": f"{context}*{INSTRUCTION}*"}]


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def worker(variant: str, target: int, new: int, warm_target: int) -> None:
    """Serve one variant from this process: load it, warm it up on a prompt of `warm_target`
    tokens, print a ready line, then run one timed call per "run" line read from stdin and print
    its result as one JSON line. The first call also measures the peak memory above the
    resident set before it (the weights and the warm-up)."""
    import torch

    pin_threads()  # BENCH_THREADS, set by the parent to its own count

    from driftlab.attention import ATTENTION_NAME
    from driftlab.chat import ChatRequest, Sampling
    from driftlab.chat.hf import HFChatBackend
    from driftlab.steering import Interventions, Pasta

    impl = "eager" if variant == "pastalib" else ATTENTION_NAME
    backend = HFChatBackend("smollm2-135m", dtype="float32", device="cpu", prefix_cache_bytes=0,
                            attn_implementation=None if impl == ATTENTION_NAME else impl)
    steer = Interventions.of(Pasta(heads=tuple((int(layer), h) for layer, hs in HEADS.items() for h in hs), alpha=ALPHA))

    def call(n_tokens: int, n_new: int) -> tuple[int, object]:
        """(prompt tokens, a function generating n_new greedy tokens and returning their ids)."""
        conv = _prompt(backend.tokenizer, n_tokens)
        rendered = backend.render(conv, interventions=steer)
        if variant == "pastalib":
            from pastalib.pasta import PASTA

            steerer = PASTA(backend.model, backend.tokenizer, head_config=HEADS, alpha=ALPHA,
                            scale_position="exclude")
            inputs, offsets = steerer.inputs_from_batch([rendered.text])

            def once() -> list[int]:
                with steerer.apply_steering(backend.model, strings=[rendered.text], substrings=[INSTRUCTION],
                                            model_input=inputs, offsets_mapping=offsets), torch.inference_mode():
                    out = backend.model.generate(**inputs, max_new_tokens=n_new, min_new_tokens=n_new,
                                                 do_sample=False, pad_token_id=backend.pad_id)
                return out[0, inputs["input_ids"].shape[1]:].tolist()
        else:
            request = ChatRequest([conv], Sampling(greedy=True, max_new_tokens=n_new, ignore_eos=True),
                                  interventions=steer if variant == "driftlab" else Interventions())

            def once() -> list[int]:
                return backend.generate(request)[0].token_ids
        return len(rendered.ids), once

    _, warm = call(warm_target, min(new, 4) if warm_target != target else new)
    warm()  # kernels, allocator, lazy imports: untimed
    prompt_tokens, once = call(target, new)
    print(json.dumps({"ready": True, "prompt_tokens": prompt_tokens}), flush=True)
    first = True
    for line in sys.stdin:
        if line.strip() != "run":
            break
        if first:
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the warm-up's cannot hide a peak
            loaded, _ = _rss()
            _reset_peak()
        t = time.perf_counter()
        tokens = once()
        seconds = time.perf_counter() - t
        out = {"seconds": seconds, "tokens": tokens}
        if first:
            out["peak_above_weights"] = _rss()[1] - loaded
            first = False
        print(json.dumps(out), flush=True)


class Worker:
    """A worker process (see `worker`), driven one timed call at a time."""

    def __init__(self, variant: str, target: int, new: int, warm_target: int, threads: int) -> None:
        self.variant, self.target = variant, target
        self.log = tempfile.TemporaryFile(mode="w+")  # its stderr, for an error message
        env = {**os.environ, "BENCH_THREADS": str(threads)}  # the workers run on the parent's count
        self.proc = subprocess.Popen([sys.executable, __file__, variant, str(target), str(new), str(warm_target)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"{self.variant} at {self.target} tokens failed:\n{self.log.read()[-2000:]}")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self.log.close()


VARIANTS = ("pastalib", "driftlab", "plain")
SIZES = {  # new tokens, timed rounds, prompt lengths, warm-up prompt length (None: the timed prompt)
    "quick": (8, 1, [512], None),
    "default": (16, 2, [2048], 64),
    "full": (32, 2, [512, 2048], None),
}


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    new, repeats, targets, warm_target = SIZES[size]
    threads, _ = pin_threads()
    res = Result(
        title=f"PASTA vs pastalib 0.1.3 and plain: smollm2-135m fp32 CPU ({threads} torch threads), batch 1, "
        f"{new} new tokens incl. prefill, best of {repeats} interleaved round{'s' if repeats > 1 else ''} after "
        f"warm-up; {sum(len(h) for h in HEADS.values())} heads, alpha {ALPHA} ({size} size)",
        columns=["prompt tokens", "variant", "wall s", "s per round", "peak MB above weights", "speedup vs pastalib",
                 "memory vs pastalib", "time vs plain"],
    )
    for target in targets:
        workers = {v: Worker(v, target, new, warm_target or target, threads) for v in VARIANTS}  # load at once
        try:
            ready = {v: w.read() for v, w in workers.items()}
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            out: dict[str, dict] = {}
            for rep in range(repeats):
                for v in VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]:
                    got = workers[v].run()
                    times[v].append(got["seconds"])
                    out.setdefault(v, got)  # the first call: memory and tokens
                    assert len(got["tokens"]) == new, (v, len(got["tokens"]))
        finally:
            for w in workers.values():
                w.close()
        best = {v: min(ts) for v, ts in times.items()}
        same = out["pastalib"]["tokens"] == out["driftlab"]["tokens"]
        ref_mem = out["pastalib"]["peak_above_weights"]
        for v in VARIANTS:
            res.rows.append([
                ready[v]["prompt_tokens"], v, f"{best[v]:.2f}", " ".join(f"{t:.2f}" for t in times[v]),
                f"{out[v]['peak_above_weights'] / 2**20:.0f}", f"{best['pastalib'] / best[v]:.2f}x",
                f"{out[v]['peak_above_weights'] / ref_mem:.3f}", f"{best[v] / best['plain']:.3f}",
            ])
        res.notes.append(f"{target}: driftlab's greedy tokens {'equal' if same else 'DIFFER FROM'} pastalib's.")
        if target == targets[-1]:
            res.results = {
                "size": size,
                "torch_threads": str(threads),
                "speedup_vs_pastalib": f"{best['pastalib'] / best['driftlab']:.2f}",
                "memory_ratio_vs_pastalib": f"{out['driftlab']['peak_above_weights'] / ref_mem:.3f}",
                "pasta_overhead_vs_plain": f"{best['driftlab'] / best['plain']:.3f}",
                "same_tokens_as_pastalib": str(same).lower(),
            }
    res.notes.append("Targets (issue), at 2k tokens: speedup >= 3, memory ratio <= 0.2, overhead <= 1.15.")
    return res


if __name__ == "__main__":  # one variant, in its own process (see `run`)
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
