"""A CUDA probe (not a `run.py` benchmark) of hypothesis H-A (docs/performance.md, "The CUDA fault and the torch 2.11 failures").

flex's Triton kernels read a BlockMask's kv_indices at (b * heads + h) * stride(1), never the batch
stride, so an expanded block order (batch stride 0) would send row b >= 1 past its storage. The
probe frees a buffer of junk (1, then 10^6) so that the order tensor reuses its memory, then compares
each row of a compiled flex call with a float64 reference: contiguous order, expanded over junk 1
(a wrong block in range), expanded over junk 10^6 (out of range, last: it may fault).
On the H200, 2026-11-28, with a static compile (`dynamic=False`) every row was right (docs/results/
gpu-tests-h200-2026-11-28.txt); the next run tries `dynamic=None` after a call of another key length.
`python benchmarks/_cuda_block_layout.py` on a CUDA machine (CUDA_LAUNCH_BLOCKING=1 names a fault).
"""
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

dev = "cuda"
torch.manual_seed(0)
B, H, Hkv, K, d, at = 2, 4, 2, 260, 16, 140
q = torch.randn(B, H, 1, d, device=dev)
k, v = torch.randn(B, Hkv, K, d, device=dev), torch.randn(B, Hkv, K, d, device=dev)
first, slot = torch.tensor([0, 9], device=dev), torch.tensor(at, device=dev)
pos = torch.arange(K, device=dev)
allowed = (pos[None] >= first[:, None]) & (pos[None] <= at)
kk, vv = k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double()
logits = (q.double() @ kk.transpose(-1, -2) * 0.25).masked_fill(~allowed[:, None, None], float("-inf"))
want = torch.softmax(logits, -1) @ vv
f = torch.compile(flex_attention, dynamic=False)

def vis(b, h, qi, kv):
    return (kv >= first[b]) & (kv <= slot)

def order_tensor(contiguous, junk_value):
    junk = torch.full((1024,), junk_value, dtype=torch.int32, device=dev)
    del junk  # its block goes back to the caching allocator; the next small tensor reuses it
    base = torch.arange(3, dtype=torch.int32, device=dev).view(1, 1, 1, 3)
    return base.expand(B, 1, 1, 3).contiguous() if contiguous else base.expand(B, 1, 1, 3)

for name, junk_value in (("contiguous", 1000000), ("expanded", 1), ("expanded", 1000000)):
    order = order_tensor(name == "contiguous", junk_value)
    mask = BlockMask.from_kv_blocks(torch.full((B, 1, 1), at // 128 + 1, dtype=torch.int32, device=dev), order,
                                    BLOCK_SIZE=128, mask_mod=vis, seq_lengths=(1, K), compute_q_blocks=False)
    print(f"{name} junk={junk_value}: kv_indices stride {tuple(mask.kv_indices.stride())}", flush=True)
    out = f(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)
    torch.cuda.synchronize()
    err = (out.double() - want).abs().amax(dim=(1, 2, 3)).tolist()
    print(f"RESULT {name} junk={junk_value} max error per row {err}", flush=True)
