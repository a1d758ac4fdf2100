"""Plain-torch references for the native kernels (float64 math, independent of the native code)."""
from __future__ import annotations

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal-by-position GQA attention through torch SDPA with an explicit mask.

    q: [n_q, H, d]; k, v: [n_k, H_kv, d]; q_pos: [n_q]; k_pos: [n_k]. Returns out [n_q, H, d] and the
    log-sum-exp [n_q, H] (natural log), both float64; a query that sees no key gets 0 and -inf.
    """
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.double().transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    visible = k_pos.cpu()[None, :].to(q.device) <= q_pos.to(q.device)[:, None]  # [n_q, n_k]
    scores = (qd @ kd.transpose(1, 2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n_q]
    attn = torch.where(visible.any(-1)[None, :, None], torch.softmax(scores, -1), torch.zeros_like(scores))
    out = torch.nan_to_num(attn) @ vd
    return out.transpose(0, 1), lse.transpose(0, 1)


def rope(x: torch.Tensor, rope_pos: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, int, int] | None = None,
         scaling: float = 1.0) -> torch.Tensor:
    """Rotate-half RoPE as transformers applies it (float32 angles), over the first 2 * n_freq dims.

    x: [n, H, d]; rope_pos: [n] or, with M-RoPE ``sections``, [3, n]. Returns float64 [n, H, d].
    """
    from transformers.models.llama.modeling_llama import rotate_half

    n_freq = inv_freq.numel()
    pos = rope_pos.cpu().float()
    if sections is None:
        freqs = pos[:, None] * inv_freq[None, :]  # [n, n_freq]
    else:  # frequency block i takes row i % 3, as transformers' Qwen2-VL rotary embedding does
        per_row = pos[:, :, None] * inv_freq[None, None, :]  # [3, n, n_freq]
        chunks = per_row.split(list(sections), dim=-1)
        freqs = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * scaling).double()[:, None, :], (emb.sin() * scaling).double()[:, None, :]
    xd = x.cpu().double()
    rotated = xd[..., : 2 * n_freq] * cos + rotate_half(xd[..., : 2 * n_freq]) * sin
    return torch.cat([rotated, xd[..., 2 * n_freq:]], dim=-1)


def attention_stats(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
                    threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The full probability matrix, then its reductions: (mass [n_k], n_below [H]) in float64."""
    group = q.shape[1] // k.shape[1]
    qd, kd = q.double().transpose(0, 1), k.repeat_interleave(group, 1).double().transpose(0, 1)
    visible = k_pos.cpu()[None, :] <= q_pos.cpu()[:, None]
    scores = ((qd @ kd.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf"))  # [H, n_q, n_k]
    probs = torch.nan_to_num(torch.softmax(scores, -1))
    row_max = probs.amax(-1, keepdim=True)
    below = (probs < threshold * row_max) & visible
    return probs.sum((0, 1)), below.sum((1, 2)).double()


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp8 KV as the arena stores it, dequantized: each row of the last dim scaled by the smallest power
    of two s with max |row| <= 448 s (1 for a zero row), rounded to e4m3 by torch, times s.

    x: [..., d] of any float dtype (float32 math). Returns float32 of x's shape.
    """
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    _, exponent = torch.frexp(amax / 448.0)
    scale = torch.ldexp(torch.ones_like(amax), exponent - 1)
    for _ in range(2):  # amax / 448 may round down: take the next power while amax > 448 s
        scale = torch.where(amax > 448.0 * scale, scale * 2, scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return (xf / scale).to(torch.float8_e4m3fn).float() * scale
