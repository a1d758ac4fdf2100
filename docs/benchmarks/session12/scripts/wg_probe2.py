"""(call 31: a 2048-query case added; run with CONDUIT_MMA_WARPS=8 for the two-warpgroup CTAs) Which half of the wgmma attention is wrong, if any: lse depends only on S = Q K^T, out on P V too."""
import math, sys, torch
from conduit_rt.bench.config import KernelSizes
from conduit_rt.bench.kernels import KernelBench
from conduit_rt.bench.timing import Timer
bench = KernelBench(Timer(torch.device("cuda")), KernelSizes(), torch.bfloat16)
s = bench.s
for n_keys, n_q in ((256, 256), (1000, 300), (2048, 2048)):
    arena = bench.arena(n_keys)
    seq, ks, vs = bench.filled(arena, n_keys)
    k, v = ks[0].float(), vs[0].float()
    q = bench.randn(n_q, s.n_heads, s.head_dim)
    q_positions = list(range(n_keys - n_q, n_keys))
    q_pos = bench.positions(q_positions)
    scale = 1 / math.sqrt(s.head_dim)
    out, lse = seq.attention(0, q, q_pos, scale, return_lse=True)
    group = s.n_heads // s.n_kv_heads
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    mask = torch.arange(n_keys, device=q.device)[None, :] > q_pos[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    ref_lse = torch.logsumexp(scores, -1).transpose(0, 1)
    ref_out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv)
    print(f"keys {n_keys} queries {n_q}: lse max err {(lse - ref_lse).abs().max().item():.3g}, "
          f"out max err {(out.float() - ref_out).abs().max().item():.3g} (out scale {ref_out.abs().max().item():.3g})")
    del arena, seq
