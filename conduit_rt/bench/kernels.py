"""Attention kernels over the native arena against torch SDPA on the same data, laid out contiguously.

Each benchmark fills a one-layer arena with random K, V (positions = slots = 0..n-1), times
``Sequence.attention`` with ``Timer.device_time`` and checks its output against a float32
reference (a wrong kernel fails its rows however fast it is):

- ``decode``: one query per sequence over its n keys, through a ``DecodeStep`` (the kernel the
  runtime's decode runs, one launch for the whole batch; the step's capacity is n); effective
  bandwidth = K+V bytes / time. SDPA gets the whole batch in one call. With ``kv_format="fp8"``
  the arena stores K and V as e4m3 with a float32 scale per (token, KV head) row; SDPA still runs
  on the arena dtype's K and V (what a dense cache would hand it), and our output is checked
  against the reference over the K and V the arena holds (read back, rounded), the rounding's own
  error against the unrounded K and V reported beside it.
- ``compressed``: the same decode over one sequence, then over a random ``keep`` of its slots after
  compaction (VL-Cache's per-layer compaction), with the same step.
- ``recompute``: CONDUIT's recompute queries, ``refresh`` of the visual tokens plus the last text
  tokens, causal by position; ``prefill``: a chunk of queries at positions 0..n-1. Useful FLOPs
  count only visible (query, key) pairs, 4 H d per pair. The reference is SDPA (flash, cuDNN: the
  faster) on a dense causal problem of the same size: as many queries, the last ones of as many
  keys. SDPA's rate on a square causal problem over those keys (more queries, more parallel work)
  is reported beside it.
"""
from __future__ import annotations

import math

import torch

from conduit_rt.arena import KVArena

from . import sdpa
from .config import KernelSizes
from .stages import run_stages
from .targets import Target, at_least, at_most
from .timing import Timer

BLOCK = 16
FP8_SCALE_BYTES = 4  # an fp8 arena's float32 scale per (token, KV head) row, after the row's e4m3 bytes


class KernelBench:
    """Shared state of the kernel benchmarks: sizes, dtype, timer and a seeded generator."""

    def __init__(self, timer: Timer, sizes: KernelSizes, dtype: torch.dtype, seed: int = 0) -> None:
        self.timer, self.s, self.dtype = timer, sizes, dtype
        self.device = timer.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.scale = sizes.head_dim**-0.5
        self.elem = torch.tensor([], dtype=dtype).element_size()

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=self.device, generator=self.generator)

    def token_bytes(self, n_layers: int = 1, kv_format: str = "dense") -> int:
        """K + V bytes of one token over ``n_layers`` layers as ``kv_format`` stores them (fp8: one byte
        an element and a float32 scale per KV head)."""
        row = self.s.head_dim * self.elem if kv_format == "dense" else self.s.head_dim + FP8_SCALE_BYTES
        return 2 * self.s.n_kv_heads * row * n_layers

    def arena(self, n_tokens: int, n_seqs: int = 1, n_layers: int = 1, kv_format: str = "dense") -> KVArena:
        blocks = n_seqs * (math.ceil(n_tokens / BLOCK) + 1) + 8
        return KVArena(n_layers=n_layers, n_kv_heads=self.s.n_kv_heads, head_dim=self.s.head_dim, dtype=self.dtype,
                       device=self.device, block_size=BLOCK, kv_format=kv_format,
                       kv_bytes=blocks * BLOCK * self.token_bytes(n_layers, kv_format))

    def filled(self, arena: KVArena, n: int, n_layers: int = 1):
        """A sequence of n tokens with random K, V in every layer; returns (seq, [k], [v]) per layer."""
        seq = arena.new_sequence()
        seq.append(torch.arange(n, dtype=torch.int32))
        ks, vs = [], []
        for layer in range(n_layers):
            k, v = self.randn(n, self.s.n_kv_heads, self.s.head_dim), self.randn(n, self.s.n_kv_heads, self.s.head_dim)
            seq.write_kv(layer, k, v)
            ks.append(k)
            vs.append(v)
        return seq, ks, vs

    def positions(self, values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(self.device)

    def rel_err(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                k_pos: torch.Tensor | None = None) -> float:
        """Our output against the float32 reference (keys at positions 0..n-1 unless ``k_pos``)."""
        k_pos = self.positions(range(k.shape[0])) if k_pos is None else k_pos
        return sdpa.relative_error(out, sdpa.reference_attention(q, k, v, q_pos, k_pos, self.scale))

    # -- decode ---------------------------------------------------------------------------------
    def stepped(self, arena: KVArena, n: int, batch: int):
        """``batch`` sequences of n tokens, the last appended by a ``DecodeStep`` (as a decode step does;
        capacity n + 1: room for one more). Returns (step, seqs, k, v), k, v [batch, n, n_kv_heads, head_dim]."""
        s = self.s
        filled = [self.filled(arena, n - 1) for _ in range(batch)]
        seqs = [f[0] for f in filled]
        step = arena.new_step(batch, n + 1, s.n_heads)
        step.prepare(seqs, [n - 1] * batch)
        k_new, v_new = (self.randn(batch, s.n_kv_heads, s.head_dim) for _ in range(2))
        step.write_kv(0, k_new, v_new)
        k = torch.stack([torch.cat([f[1][0], k_new[b:b + 1]]) for b, f in enumerate(filled)])
        v = torch.stack([torch.cat([f[2][0], v_new[b:b + 1]]) for b, f in enumerate(filled)])
        return step, seqs, k, v

    def decode(self, n: int, batch: int = 1, compare: bool = True, kv_format: str = "dense") -> dict:
        """One query per sequence at position n-1 over its n keys, ``batch`` sequences in one launch,
        from an arena storing K and V as ``kv_format``; with ``compare``, torch SDPA's backends on the
        same data laid out contiguously in the arena dtype."""
        s = self.s
        arena = self.arena(n, batch, kv_format=kv_format)
        try:
            step, seqs, k, v = self.stepped(arena, n, batch)
            q = self.randn(batch, s.n_heads, s.head_dim)
            out: list = [None]

            def ours() -> None:
                out[0] = step.attention(0, q, None, self.scale)

            timing = self.timer.device_time(ours)
            host_s = self.timer.host_time(ours)
            q_pos = self.positions([n - 1])

            def worst_rel_err(keys: torch.Tensor, values: torch.Tensor) -> float:
                return max(self.rel_err(out[0][b:b + 1], q[b:b + 1], keys[b], values[b], q_pos) for b in range(batch))

            rounding: dict = {}
            if kv_format != "dense":  # the kernel against what it reads; the format's rounding on its own
                rounding["rel_err_vs_unrounded"] = worst_rel_err(k, v)
                stored = [seq.read_kv(0) for seq in seqs]
                k, v = torch.stack([kv[0] for kv in stored]), torch.stack([kv[1] for kv in stored])
                del stored
            rel_err = worst_rel_err(k, v)
            k_dense = k.transpose(1, 2).contiguous()  # [B, H_kv, n, d]
            v_dense = v.transpose(1, 2).contiguous()
            del k, v
            q_dense = q[:, :, None].contiguous()  # [B, H, 1, d]
            reference = (sdpa.time_backends(self.timer, q_dense, k_dense, v_dense, False, sdpa.DECODE_BACKENDS)
                         if compare else {})
        finally:
            arena.close()
        kv_bytes = batch * n * self.token_bytes(kv_format=kv_format)
        return {"length": n, "batch": batch, "kv_format": kv_format, "dtype": str(self.dtype).replace("torch.", ""),
                "seconds": timing.median_s, "time": timing.as_dict(), "host_s": host_s, "kv_bytes": kv_bytes,
                "bytes_per_s": kv_bytes / timing.median_s, "rel_err": rel_err, **rounding, "sdpa": reference}

    def compressed(self, n: int, keep: float) -> dict:
        """Decode over n tokens, then over a random ``keep`` of them after compaction."""
        s = self.s
        arena = self.arena(n)
        try:
            step, (seq,), (k,), (v,) = self.stepped(arena, n, 1)
            q = self.randn(1, s.n_heads, s.head_dim)
            q_pos = self.positions([n - 1])
            full = self.timer.device_time(lambda: step.attention(0, q, None, self.scale))
            kept = torch.randperm(n - 1, generator=torch.Generator().manual_seed(1))[: max(1, round(keep * n))]
            kept = torch.cat([torch.sort(kept).values, torch.tensor([n - 1])])  # the newest token stays
            seq.compact(0, kept)
            step.prepare([seq], [n])  # the next token: the step sees the compacted layer
            k_new, v_new = (self.randn(1, s.n_kv_heads, s.head_dim) for _ in range(2))
            step.write_kv(0, k_new, v_new)
            out: list = [None]
            compact = self.timer.device_time(lambda: out.__setitem__(0, step.attention(0, q, None, self.scale)))
            idx = kept.to(self.device, torch.int32)
            rel_err = self.rel_err(out[0], q, torch.cat([k[idx], k_new]), torch.cat([v[idx], v_new]),
                                   self.positions([n]), torch.cat([idx, self.positions([n])]))
        finally:
            arena.close()
        return {"length": n, "kept": int(kept.numel()), "full_seconds": full.median_s, "seconds": compact.median_s,
                "time": compact.as_dict(), "full_time": full.as_dict(), "rel_err": rel_err}

    # -- many queries ---------------------------------------------------------------------------
    def many_queries(self, n_keys: int, q_positions: list[int]) -> dict:
        """Queries at ``q_positions`` over n_keys keys; SDPA on the dense causal problem of the same
        size (len(q_positions) queries at the end of n_keys keys) and on the square one of n_keys."""
        s = self.s
        arena = self.arena(n_keys)
        try:
            seq, (k,), (v,) = self.filled(arena, n_keys)
            q = self.randn(len(q_positions), s.n_heads, s.head_dim)
            q_pos = self.positions(q_positions)
            out: list = [None]
            timing = self.timer.device_time(lambda: out.__setitem__(0, seq.attention(0, q, q_pos, self.scale)))
            rel_err = self.rel_err(out[0], q, k, v, q_pos)
            backends = sdpa.PREFILL_BACKENDS + (("math",) if not self.timer.is_cuda else ())
            dense_k, dense_v = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()
            n_q = len(q_positions)
            same = sdpa.time_backends(self.timer, self.randn(1, s.n_heads, n_q, s.head_dim), dense_k, dense_v,
                                      True, backends)
            square = same if n_q == n_keys else sdpa.time_backends(
                self.timer, self.randn(1, s.n_heads, n_keys, s.head_dim), dense_k, dense_v, True, backends)
        finally:
            arena.close()
        per_pair = 4.0 * s.n_heads * s.head_dim
        flops = per_pair * sum(p + 1 for p in q_positions)
        same_flops = per_pair * (n_q * (n_keys - n_q) + n_q * (n_q + 1) / 2)  # query i sees n_keys - n_q + i + 1
        square_flops = per_pair * n_keys * (n_keys + 1) / 2
        best, best_s = sdpa.fastest(same, among=("flash", "cudnn"))
        square_best, square_s = sdpa.fastest(square, among=("flash", "cudnn"))
        return {"n_keys": n_keys, "n_queries": n_q, "seconds": timing.median_s, "time": timing.as_dict(),
                "useful_flops": flops, "flop_per_s": flops / timing.median_s, "rel_err": rel_err,
                "dense_flops": same_flops, "sdpa": same, "sdpa_best": best, "sdpa_flop_per_s": same_flops / best_s,
                "square_flops": square_flops, "sdpa_square": square, "sdpa_square_best": square_best,
                "sdpa_square_flop_per_s": square_flops / square_s}

    def recompute_positions(self) -> tuple[int, list[int]]:
        """(n_keys, sorted query positions): ``refresh`` of the visual tokens + the last text tokens."""
        s = self.s
        n_keys = s.n_text_before + s.n_visual + s.n_text_after
        n_chosen = math.ceil(s.refresh * s.n_visual)
        chosen = torch.randperm(s.n_visual, generator=torch.Generator().manual_seed(2))[:n_chosen] + s.n_text_before
        text = range(n_keys - s.n_text_queries, n_keys)
        return n_keys, sorted(chosen.tolist()) + list(text)


FP8 = "_fp8"  # the suffix of a decode run's twin over an fp8 arena, and of its row's key


def decode_problems(sizes: KernelSizes) -> dict[str, tuple[int, int]]:
    """The decode runs: key -> (keys per sequence, sequences in the launch)."""
    return {"decode": (sizes.decode_length, 1), "decode_long": (sizes.long_decode_length, 1),
            "decode_batch": (sizes.batch_length, sizes.batch)}


def _fmt(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def run(timer: Timer, sizes: KernelSizes, dtype: torch.dtype,
        copy_bytes_per_s: float) -> tuple[dict, list[Target], dict[str, str]]:
    """Every kernel benchmark; returns the raw numbers, the target rows and the stages' errors."""
    bench = KernelBench(timer, sizes, dtype)
    decodes = decode_problems(sizes)
    raw, errors = run_stages("kernels", [
        *((key, lambda n=n, b=b: bench.decode(n, b)) for key, (n, b) in decodes.items()),
        *((f"{key}{FP8}", lambda n=n, b=b: bench.decode(n, b, kv_format="fp8")) for key, (n, b) in decodes.items()),
        ("compressed", lambda: bench.compressed(sizes.compressed_length, sizes.compressed_keep)),
        ("recompute", lambda: bench.many_queries(*bench.recompute_positions())),
        ("prefill", lambda: bench.many_queries(sizes.prefill_chunk, list(range(sizes.prefill_chunk)))),
    ])
    rows: list[Target] = []
    for key in decodes:
        if key in raw:
            rows += decode_rows(key, raw[key], copy_bytes_per_s)
    for key in (f"{key}{FP8}" for key in decodes):
        if key in raw:
            rows.append(fp8_decode_row(key, raw[key]))
    if "compressed" in raw:
        c = raw["compressed"]
        rows.append(at_most(
            "compressed.vs_full", f"decode over VL-Cache-compressed KV ({c['kept']} of {_fmt(c['length'])} kept)",
            c["seconds"] * 1e3, c["full_seconds"] * 1e3, "ms", 0.15, "compressed time / full-cache time",
            f"rel err {c['rel_err']:.1e}", valid=sdpa.is_correct(c["rel_err"])))
    for key, label in (("recompute", "scattered recompute queries"), ("prefill", "prefill chunk")):
        if key in raw:
            rows.append(many_queries_row(key, label, raw[key]))
    return raw, rows, errors


def many_queries_row(key: str, label: str, r: dict) -> Target:
    return at_least(
        f"{key}.vs_sdpa", f"{label} ({r['n_queries']} queries over {_fmt(r['n_keys'])} keys): useful TFLOP/s",
        r["flop_per_s"] / 1e12, r["sdpa_flop_per_s"] / 1e12, "TFLOP/s", 0.6,
        "our useful rate / SDPA's on a dense causal problem of the same size",
        f"SDPA {r['sdpa_best']}; on a square causal problem of the keys SDPA reaches "
        f"{r['sdpa_square_flop_per_s'] / 1e12:.0f} ({r['sdpa_square_best']}); rel err {r['rel_err']:.1e}",
        valid=sdpa.is_correct(r["rel_err"]))


def decode_rows(key: str, r: dict, copy_bytes_per_s: float) -> list[Target]:
    """Bandwidth against the copy ceiling, and time against the fastest SDPA backend."""
    what = _decode_what(r)
    valid = sdpa.is_correct(r["rel_err"])
    return [
        at_least(f"{key}.bandwidth", f"{what}: effective bandwidth", r["bytes_per_s"] / 1e9, copy_bytes_per_s / 1e9,
                 "GB/s", 0.85, "K+V bytes / time, over the copy bandwidth",
                 f"rel err {r['rel_err']:.1e}{_per_call(r)}", valid=valid),
        _vs_sdpa_row(f"{key}.vs_sdpa", f"{what}: time vs torch SDPA", r, 1.5, "fastest SDPA time / our time"),
    ]


def fp8_decode_row(key: str, r: dict) -> Target:
    """The decode over an fp8 arena against cuDNN SDPA on the arena dtype's K and V (another backend,
    named in the detail, only where cuDNN cannot run: the CPU)."""
    return _vs_sdpa_row(f"{key}.vs_cudnn", f"fp8 KV {_decode_what(r)}: time vs cuDNN SDPA on {r['dtype']} K/V", r,
                        1.8, "cuDNN SDPA time / our time", among=("cudnn",),
                        note=f"; rel err {r['rel_err']:.1e} over the stored K/V, "
                             f"{r['rel_err_vs_unrounded']:.1e} vs unrounded K/V")


def _decode_what(r: dict) -> str:
    return f"decode attention, batch {r['batch']} x {_fmt(r['length'])}"


def _per_call(r: dict) -> str:
    return " (one batched call, as SDPA)" if r["batch"] > 1 else ""


def _vs_sdpa_row(key: str, name: str, r: dict, threshold: float, ratio_is: str,
                 among: tuple[str, ...] | None = None, note: str = "") -> Target:
    """Our decode time (``KernelBench.decode``'s ``r``) against the fastest SDPA backend that ran,
    among ``among`` where one of them ran (``sdpa.fastest``); fails when our output is wrong."""
    best, best_s = sdpa.fastest(r["sdpa"], among=among)
    layout = r["sdpa"].get(best, {}).get("layout", "")
    return at_least(key, name, r["seconds"] * 1e3, best_s * 1e3, "ms", threshold, ratio_is,
                    f"SDPA {best} ({layout}){_per_call(r)}{note}", invert=True, valid=sdpa.is_correct(r["rel_err"]))
