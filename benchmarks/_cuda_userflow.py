"""A GPU probe (not a `run.py` benchmark): a user's flow on a tiny qwen2 (GQA) model: batches of several sizes and steers in one process,
default settings on CUDA (auto kernel, compiled decode). Prints one line per call: ok/error, seconds.
Run from the checkout root on a CUDA machine: `python benchmarks/_cuda_userflow.py` (first written for the
H200 review of 2026-11-28: plain at batch 1, 3, 8, 2 took 15.3, 7.0, 6.1, 8.0 s; split-softmax + trace at
batch 1 and 3 took 28.7 and 35.3 s, each first call compiling)."""
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, "tests")
import driftlab as dl
from driftlab.chat.base import Sampling, chat
from tiny_models import make_tiny_model

d = make_tiny_model("qwen2", Path("/tmp/tinyq"))
be = dl.load(str(d), device="cuda", dtype="bfloat16")
print("loaded", be.describe().get("device"), flush=True)


def convs(n: int) -> list:
    return [[{"role": "system", "content": "Always reply in French. " * (1 + i % 3)},
             {"role": "user", "content": f"Tell me about city number {i} and its food."}] for i in range(n)]



for steer in ([], ["split-softmax:k=0.6", "trace"], ["instaboost:m=5"]):
    for n in (1, 3, 8, 2):
        t = time.time()
        try:
            r = chat(be, convs(n), Sampling(temperature=0.0, max_new_tokens=24), steer=steer)
            print(f"ok steer={'+'.join(steer) or 'plain'} batch={n} {time.time()-t:.1f}s tokens={len(r[0].token_ids) if hasattr(r[0],'token_ids') else '?'}", flush=True)
        except Exception as e:
            print(f"ERROR steer={'+'.join(steer) or 'plain'} batch={n} {time.time()-t:.1f}s {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=6)
            if "illegal memory" in str(e):
                sys.exit(3)
