#!/usr/bin/env python3
"""The stacked q/k/v product (one GEMM over the stack, q rotated from its columns) against the three
products one by one, on the H200, at two levels:
  gemm: device time of the projections alone at LLaVA-7B's shape (4096 -> 3 x 4096, bf16) for the
        row counts of a text pass, a recompute and a prefill chunk;
  ttft: conduit bench's end-to-end setup, untimed warm TTFTs (conduit at 10%, full prefill) with each
        form in turn, twice (prefill graphs captured anew for each form).
    python3 qkv_ab.py --out qkv_ab.json
"""
import argparse
import json

import torch
import torch.nn.functional as F

from conduit_rt.bench.config import E2ESizes
from conduit_rt.bench.e2e import EndToEnd
from conduit_rt.bench.timing import Timer
from conduit_rt.models import fused, llama
from conduit_rt.prefill_graph import PrefillGraphs


def device_us(fn, repeats=50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def gemm_rows() -> list[dict]:
    hidden, heads, d = 4096, 32, 128
    w = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    stacked = torch.cat(w)
    rows = []
    for n in (104, 565, 2048):
        h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
        separate = device_us(lambda: [F.linear(h, wi) for wi in w])
        one = device_us(lambda: [t.contiguous() for t in F.linear(h, stacked).split(hidden, dim=-1)[1:]])
        rows.append({"rows": n, "separate_us": separate, "stacked_us": one,
                     "stacked_tb_s": 3 * hidden * hidden * 2 / (one * 1e-6) / 1e12})
        print(rows[-1], flush=True)
    return rows


stacked_project = llama.LlamaAttention.project


def separate_project(self, h, tables):
    """The projections one by one (the form before this change); a decode row as shipped."""
    n = h.shape[0]
    if n == 1:
        return stacked_project(self, h, tables)
    q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
    q = fused.rotate(q.view(n, self.n_heads, self.head_dim), *tables).contiguous()
    return q, k.view(n, self.n_kv_heads, self.head_dim), v.view(n, self.n_kv_heads, self.head_dim)


def ttft_rows() -> list[dict]:
    e2e = EndToEnd(E2ESizes(), Timer(torch.device("cuda")), torch.bfloat16)
    e2e.request("first", e2e.first, refresh="conduit", max_tokens=1)
    rows = []
    for round_ in range(2):
        for name, project in (("separate", separate_project), ("stacked", stacked_project)):
            llama.LlamaAttention.project = project
            e2e.runtime.prefill_graphs.close()
            e2e.runtime.prefill_graphs = PrefillGraphs(e2e.model)
            for _ in range(2):
                e2e.request("second", e2e.second, refresh="conduit", refresh_budget=0.1, max_tokens=1)
                e2e.request("second", e2e.second, max_tokens=1)
            conduit = e2e.ttft("c", e2e.second, 9, refresh="conduit", refresh_budget=0.1)["ttft_s"] * 1e3
            full = e2e.ttft("f", e2e.second, 3)["ttft_s"] * 1e3
            rows.append({"round": round_, "form": name, "conduit_ms": conduit, "full_ms": full})
            print(rows[-1], flush=True)
    llama.LlamaAttention.project = stacked_project
    return rows


parser = argparse.ArgumentParser()
parser.add_argument("--out", default="qkv_ab.json")
args = parser.parse_args()
result = {"gemm": gemm_rows(), "ttft": ttft_rows()}
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
