"""The four plots of the report; each takes matplotlib's pyplot, the result dict and the target rows
and returns a figure (``report.plots`` saves them)."""
from __future__ import annotations

import math

from .breakdown import PHASES
from .sdpa import fastest

PASS, FAIL, GREY = "#2e7d32", "#c62828", "#9e9e9e"


def targets(plt, result: dict, rows) -> object:
    """Each target's margin: ratio / threshold for '>=', threshold / ratio for '<='; 1 is the target."""
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    margins = []
    for r in rows:
        margins.append(margin(r))
    y = range(len(rows))
    ax.barh(list(y), margins, color=[PASS if r.passed else FAIL for r in rows])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(list(y), [r.key for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("margin over the target (log; >= 1 meets it)")
    ax.set_title("Targets")
    return fig


def margin(row) -> float:
    """ratio / threshold for '>=' rows, threshold / ratio for '<=' rows; 0 when not measured."""
    parts = row.target.split()
    if len(parts) != 2 or not math.isfinite(row.ratio):
        return 0.0
    threshold = float(parts[1])
    m = row.ratio / threshold if parts[0] == ">=" else (threshold / row.ratio if row.ratio else math.inf)
    return m if math.isfinite(m) else 0.0


def kernels(plt, result: dict, rows) -> object:
    """Decode attention: our effective bandwidth, the fastest SDPA backend's, the copy ceiling."""
    k = result["kernels"]
    copy = result["ceilings"]["copy"]["bytes_per_s"] / 1e9
    labels, ours, theirs = [], [], []
    for key in [key for key in ("decode", "decode_long", "decode_batch") if key in k]:
        r = k[key]
        labels.append(f"b{r['batch']} x {r['length']}")
        ours.append(r["bytes_per_s"] / 1e9)
        _, seconds = fastest(r["sdpa"])
        theirs.append(r["kv_bytes"] / seconds / 1e9 if math.isfinite(seconds) else 0.0)
    if "compressed" in k and "decode" in k:
        c = k["compressed"]
        labels.append(f"compressed {c['kept']} of {c['length']}")
        token_bytes = k["decode"]["kv_bytes"] / (k["decode"]["length"] * k["decode"]["batch"])
        ours.append(c["kept"] * token_bytes / c["seconds"] / 1e9 if c["seconds"] else 0.0)
        theirs.append(0.0)
    if not labels:
        raise KeyError("decode")
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], ours, width=0.4, label="conduit (arena)")
    ax.bar([i + 0.2 for i in x], theirs, width=0.4, label="torch SDPA, fastest backend", color=GREY)
    ax.axhline(copy, color="black", linestyle="--", linewidth=1, label="copy bandwidth")
    ax.axhline(0.85 * copy, color="black", linestyle=":", linewidth=1, label="85% of copy")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("K+V bytes read / time (GB/s)")
    ax.set_title("Decode attention, effective bandwidth")
    ax.legend(fontsize=8)
    return fig


def ttft_breakdown(plt, result: dict, rows) -> object:
    """Stacked phases of the warm conduit and full-prefill requests."""
    reuse = result["e2e"]["reuse"]
    runs = [("conduit (warm)", reuse["breakdown_conduit"]), ("full prefill (warm)", reuse["breakdown_full"])]
    fig, ax = plt.subplots(figsize=(8, 2.8))
    colors = ["#8d6e63", "#1565c0", "#ef6c00", "#fdd835", "#6a1b9a", GREY]
    for y, (label, phases) in enumerate(runs):
        left = 0.0
        for phase, color in zip(PHASES, colors):
            width = phases[phase] * 1e3
            ax.barh(y, width, left=left, color=color, label=phase if y == 0 else None)
            left += width
    ax.set_yticks(range(len(runs)), [label for label, _ in runs])
    ax.invert_yaxis()
    ax.set_xlabel("ms (instrumented request; device synchronized at each phase)")
    ax.set_title("Where the time to first token goes")
    ax.legend(fontsize=8, ncol=len(PHASES), loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    return fig


def decode(plt, result: dict, rows) -> object:
    """Tokens/s: ours, its bytes bound, transformers; long context with and without VL-Cache."""
    e2e = result["e2e"]
    bars, title = [], []
    if "decode" in e2e:
        d = e2e["decode"]
        bars += [("ours", d["ours"]["tokens_per_s"], "#1565c0"), ("bound", d["bound_tokens_per_s"], GREY),
                 ("transformers", d["transformers"]["tokens_per_s"], "#ef6c00")]
        title.append(f"{d['ours']['prompt_tokens']}-token context")
    if "long" in e2e:
        long = e2e["long"]
        bars += [("long, full KV", long["full"]["tokens_per_s"], "#90caf9"),
                 ("long, VL-Cache", long["vlcache"]["tokens_per_s"], "#1565c0")]
        title.append(f"long: {long['full']['prompt_tokens']}-token context")
    if not bars:
        raise KeyError("decode")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    ax.set_ylabel("tokens/s (batch 1)")
    ax.set_title("Decode at batch 1: " + "; ".join(title))
    return fig
