"""PASTA: driftlab's steering vs the authors' pastalib 0.1.3, and vs plain decoding.

Same model (SmolLM2-135M, fp32, CPU), same heads, alpha and emphasised span, one prompt of
about 512 and about 2k tokens (a long biography context, the emphasised instruction at its
end), greedy, `new` tokens with EOS ignored:

* pastalib: eager attention (it needs it: it edits the T x T additive mask) + its hooks,
  `model.generate`;
* driftlab: its fused-SDPA attention function with the PASTA key bias, its decode loop;
* plain: driftlab's decode loop with no steering (the overhead baseline).

Each variant runs in its own process, so its peak memory is its own: the resident-set
high-water mark is reset after the weights are loaded (Linux /proc/self/clear_refs), and
"peak above weights" is the high-water mark minus the resident size right after loading.
Timings are the best of `repeats` after a warm-up; a ratio compares runs of this one
invocation. Targets (issue): >= 3x faster than pastalib and <= 0.2x its peak memory above
the weights at 2k tokens; overhead over plain <= 1.15x.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from common import Result

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


def worker(variant: str, target: int, new: int, repeats: int) -> dict:
    """Run one variant in this process; returns its timings and memory."""
    import torch

    from driftlab.attention import ATTENTION_NAME
    from driftlab.chat import ChatRequest, Sampling
    from driftlab.chat.hf import HFChatBackend
    from driftlab.steering import Interventions, Pasta

    impl = "eager" if variant == "pastalib" else ATTENTION_NAME
    backend = HFChatBackend("smollm2-135m", dtype="float32", device="cpu", prefix_cache_bytes=0,
                            attn_implementation=None if impl == ATTENTION_NAME else impl)
    conv = _prompt(backend.tokenizer, target)
    steer = Interventions.of(Pasta(heads=tuple((int(layer), h) for layer, hs in HEADS.items() for h in hs), alpha=ALPHA))
    rendered = backend.render(conv, interventions=steer)
    sampling = Sampling(greedy=True, max_new_tokens=new, ignore_eos=True)

    if variant == "pastalib":
        from pastalib.pasta import PASTA

        steerer = PASTA(backend.model, backend.tokenizer, head_config=HEADS, alpha=ALPHA, scale_position="exclude")
        inputs, offsets = steerer.inputs_from_batch([rendered.text])

        def once() -> list[int]:
            with steerer.apply_steering(backend.model, strings=[rendered.text], substrings=[INSTRUCTION],
                                        model_input=inputs, offsets_mapping=offsets), torch.inference_mode():
                out = backend.model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                             pad_token_id=backend.pad_id)
            return out[0, inputs["input_ids"].shape[1]:].tolist()
    else:
        request = ChatRequest([conv], sampling, interventions=steer if variant == "driftlab" else Interventions())

        def once() -> list[int]:
            return backend.generate(request)[0].token_ids

    loaded, _ = _rss()
    _reset_peak()
    tokens = once()  # warm-up, and the memory measurement
    _, peak = _rss()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return {"seconds": min(times), "peak_above_weights": peak - loaded, "prompt_tokens": len(rendered.ids),
            "tokens": tokens}


def run(quick: bool = False) -> Result:
    new, repeats = (8, 1) if quick else (32, 2)
    targets = [512] if quick else [512, 2048]
    res = Result(
        title=f"PASTA vs pastalib 0.1.3 and plain: smollm2-135m fp32 CPU, batch 1, {new} new tokens incl. "
        f"prefill, best of {repeats}; {sum(len(h) for h in HEADS.values())} heads, alpha {ALPHA}",
        columns=["prompt tokens", "variant", "wall s", "peak MB above weights", "speedup vs pastalib",
                 "memory vs pastalib", "time vs plain"],
    )
    for target in targets:
        out = {}
        for variant in ("pastalib", "driftlab", "plain"):
            proc = subprocess.run([sys.executable, __file__, variant, str(target), str(new), str(repeats)],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{variant} at {target} tokens failed:\n{proc.stderr[-2000:]}")
            out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        same = out["pastalib"]["tokens"] == out["driftlab"]["tokens"]
        ref = out["pastalib"]
        for variant, r in out.items():
            res.rows.append([
                r["prompt_tokens"], variant, f"{r['seconds']:.2f}", f"{r['peak_above_weights'] / 2**20:.0f}",
                f"{ref['seconds'] / r['seconds']:.2f}x", f"{r['peak_above_weights'] / ref['peak_above_weights']:.3f}",
                f"{r['seconds'] / out['plain']['seconds']:.3f}",
            ])
        res.notes.append(f"{target}: driftlab's greedy tokens {'equal' if same else 'DIFFER FROM'} pastalib's.")
        if target == targets[-1]:
            d = out["driftlab"]
            res.results = {
                "speedup_vs_pastalib": f"{ref['seconds'] / d['seconds']:.2f}",
                "memory_ratio_vs_pastalib": f"{d['peak_above_weights'] / ref['peak_above_weights']:.3f}",
                "pasta_overhead_vs_plain": f"{d['seconds'] / out['plain']['seconds']:.3f}",
                "same_tokens_as_pastalib": str(same).lower(),
            }
    res.notes.append("Targets (issue), at 2k tokens: speedup >= 3, memory ratio <= 0.2, overhead <= 1.15.")
    return res


if __name__ == "__main__":  # one variant, in a fresh process (see `run`)
    variant, target, new, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(worker(variant, target, new, repeats)))
