"""One launch each of the many-query attention on conduit bench's prefill chunk and recompute shapes
(after two warm-up launches): for Nsight Compute (--launch-skip 2 --launch-count 1 per shape)."""
import sys, torch
from conduit_rt.bench.config import KernelSizes
from conduit_rt.bench.kernels import KernelBench
from conduit_rt.bench.timing import Timer
which = sys.argv[1]
bench = KernelBench(Timer(torch.device("cuda")), KernelSizes(), torch.bfloat16)
s = bench.s
if which == "prefill":
    n_keys, q_positions = s.prefill_chunk, list(range(s.prefill_chunk))
else:
    n_keys, q_positions = bench.recompute_positions()
arena = bench.arena(n_keys)
seq, _, _ = bench.filled(arena, n_keys)
q = bench.randn(len(q_positions), s.n_heads, s.head_dim)
q_pos = bench.positions(q_positions)
for _ in range(3):
    seq.attention(0, q, q_pos, bench.scale)
torch.cuda.synchronize()
print(which, "done")
