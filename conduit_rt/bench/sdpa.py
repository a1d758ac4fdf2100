"""torch's scaled_dot_product_attention as the kernels' reference: each backend timed on the same
data laid out contiguously, and a float32 reference output to check ours against.

Layout: q [B, H, n_q, d], k and v [B, H_kv, n_k, d], contiguous, the arena's dtype. GQA goes in as
``enable_gqa=True`` where the backend takes it, else with K and V expanded to H heads (the row's
detail says which layout each backend ran).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .timing import Timer

DECODE_BACKENDS = ("flash", "cudnn", "efficient", "math")
PREFILL_BACKENDS = ("flash", "cudnn", "efficient")  # the reference is the faster of cuDNN and flash
CORRECT_REL_ERR = 2e-2  # bf16 attention lands near 5e-3; past this the kernel computes something else


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def time_backends(timer: Timer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  backends: tuple[str, ...]) -> dict[str, dict]:
    """Per backend: {"seconds", "layout", "time"} or {"error"} when it cannot run this problem.

    causal with fewer queries than keys aligns the queries with the last keys (a chunk at the end of
    its context: query i sees keys up to n_k - n_q + i), through torch's ``causal_lower_right``,
    which flash and the memory-efficient kernel take natively; another backend then runs on the
    materialised mask."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // k.shape[1]
    layouts = ("gqa", "expanded") if group > 1 else ("dense",)
    expanded: tuple[torch.Tensor, torch.Tensor] | None = None
    results: dict[str, dict] = {}
    for name in backends:
        error = "not tried"
        for layout in layouts:
            if layout == "expanded" and expanded is None:
                expanded = (k.repeat_interleave(group, 1).contiguous(), v.repeat_interleave(group, 1).contiguous())
            kk, vv = expanded if layout == "expanded" else (k, v)
            extra = {"enable_gqa": True} if layout == "gqa" else {}

            n_q, n_k = q.shape[2], kk.shape[2]
            mask = {"attn_mask": causal_lower_right(n_q, n_k)} if causal and n_q != n_k else {"is_causal": causal}

            def run(kk=kk, vv=vv, extra=extra, mask=mask):
                return F.scaled_dot_product_attention(q, kk, vv, **mask, **extra)

            try:
                with warnings.catch_warnings(), sdpa_kernel([_backend(name)]):
                    warnings.simplefilter("ignore")
                    run()
                    timing = timer.device_time(run)
            except (RuntimeError, TypeError, ValueError) as exc:
                error = str(exc).splitlines()[0][:160]
                continue
            results[name] = {"seconds": timing.median_s, "layout": layout, "time": timing.as_dict()}
            break
        else:
            results[name] = {"error": error}
    return results


def fastest(results: dict[str, dict], among: tuple[str, ...] | None = None) -> tuple[str, float]:
    """(backend, seconds) of the fastest backend that ran (among ``among`` when given and any ran)."""
    ran = {name: r["seconds"] for name, r in results.items() if "seconds" in r}
    if among is not None and any(name in ran for name in among):
        ran = {name: s for name, s in ran.items() if name in among}
    if not ran:
        return "none", float("nan")
    name = min(ran, key=ran.get)
    return name, ran[name]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal-by-position attention in float32: q [n_q, H, d], k, v [n_k, H_kv, d], positions int
    [n_q] / [n_k] -> [n_q, H, d] float32 (every query here sees at least one key)."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)[None]                                    # [1, H, n_q, d]
    kf = k.float().repeat_interleave(group, 1).transpose(0, 1)[None]        # [1, H, n_k, d]
    vf = v.float().repeat_interleave(group, 1).transpose(0, 1)[None]
    visible = k_pos.to(q.device)[None, :] <= q_pos.to(q.device)[:, None]    # [n_q, n_k]
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """||ours - reference|| / ||reference|| in float32 (NaN anywhere gives NaN)."""
    ours, reference = ours.float(), reference.float()
    return float((ours - reference).norm() / reference.norm())


def is_correct(rel_err: float) -> bool:
    return rel_err == rel_err and rel_err <= CORRECT_REL_ERR
