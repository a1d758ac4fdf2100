"""Recall of the tokens an answer needs in what a policy selected: does the selection find them?

The task generator knows which image cells each answer reads: ``needed_cells``, (image index, cell
index) pairs, the cell index counting the image's visual tokens in their own order (row * grid +
column). A request answered with ``GenerationOptions.trace_selection`` says where each image's
tokens sit (``GenerationStats.image_spans``), so the cells become prompt positions, and per decoder
layer:

- refresh recall: of the needed tokens that were restored (stale), the fraction the layer recomputed
  (a needed token of an image computed in the request itself is not stale, and not counted);
- kept recall: of the needed tokens, the fraction whose KV the layer kept for decoding.

The overall recall is the mean over layers: the needed token-layers covered over all needed
token-layers. A one-pass refresh policy recomputes the same tokens on every layer, so there it is
simply the fraction of needed tokens it chose.

Measures (``selection_measures``, one value per request): ``needed_recall`` and
``needed_recall_l{layer}`` of the setting's selection: the refreshed set when it refreshes, else the
kept set; a setting that does both also gives ``kept_recall`` and ``kept_recall_l{layer}``. A
setting that selects nothing (the cold full prefill) gives none. ``plot_recall`` draws them against
the budget and, at r = α = 10%, per layer.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import RequestError
from ..extras import pyplot

PLOTTING = {"extra": "eval", "command": "conduit eval", "purpose": "for its recall plot"}
PER_LAYER_RATIO = 0.1
MEASURE = "needed_recall"
KEPT_MEASURE = "kept_recall"


@dataclass(frozen=True, slots=True)
class Recall:
    """Recall of the needed tokens: ``per_layer`` (one value per decoder layer) and their mean."""

    per_layer: list[float]

    @property
    def overall(self) -> float:
        return sum(self.per_layer) / len(self.per_layer)

    def measures(self, name: str) -> dict[str, float]:
        """``{name: overall, f"{name}_l{layer}": per layer}``."""
        return {name: self.overall, **{f"{name}_l{layer}": value for layer, value in enumerate(self.per_layer)}}


def needed_positions(needed_cells: Sequence[tuple[int, int]], image_spans: Sequence[tuple[int, int]]) -> list[int]:
    """The prompt positions of (image index, cell index) pairs, sorted and distinct. RequestError
    when an image or a cell is not in the prompt (the task's grid and the model's tokens per image
    disagree)."""
    positions = set()
    for image, cell in needed_cells:
        if not 0 <= image < len(image_spans):
            raise RequestError(f"needed cell ({image}, {cell}) names image {image}, but the request shows "
                               f"{len(image_spans)}; give cells of the request's own images")
        start, stop = image_spans[image]
        if not 0 <= cell < stop - start:
            raise RequestError(f"needed cell {cell} of image {image} is outside its {stop - start} visual tokens; "
                               "the task's grid must give one token per cell for this model")
        positions.add(start + cell)
    return sorted(positions)


def layer_recall(needed: Sequence[int], selected_per_layer: Sequence[Sequence[int]]) -> Recall | None:
    """Per layer, the fraction of ``needed`` positions in that layer's selected positions; None when
    nothing is needed."""
    if not needed:
        return None
    wanted = set(needed)
    return Recall([len(wanted.intersection(selected)) / len(wanted) for selected in selected_per_layer])


def refresh_recall(needed_cells: Sequence[tuple[int, int]], stats) -> Recall | None:
    """Recall of the needed restored tokens in the refreshed set (``stats``: a traced
    ``GenerationStats``); None without a refresh or when no needed token was restored."""
    if stats.refreshed_positions is None:
        return None
    restored = set(stats.restored_positions)
    needed = [p for p in needed_positions(needed_cells, stats.image_spans) if p in restored]
    return layer_recall(needed, stats.refreshed_positions)


def kept_recall(needed_cells: Sequence[tuple[int, int]], stats) -> Recall | None:
    """Recall of the needed tokens in the kept set; None without compression."""
    if stats.kept_positions is None:
        return None
    return layer_recall(needed_positions(needed_cells, stats.image_spans), stats.kept_positions)


def selection_measures(needed_cells: Sequence[tuple[int, int]], stats) -> dict[str, float]:
    """The recall measures of one traced answer (see the module docstring); {} without needed cells."""
    if not needed_cells:
        return {}
    refreshed, kept = refresh_recall(needed_cells, stats), kept_recall(needed_cells, stats)
    primary = refreshed if refreshed is not None else kept
    out = primary.measures(MEASURE) if primary is not None else {}
    if refreshed is not None and kept is not None:
        out.update(kept.measures(KEPT_MEASURE))
    return out


def together_label(row: dict) -> str:
    """A combined row's two policies, as the plots name it: "conduit + vlcache"."""
    return f"{row['refresh']} + {row['compress']}"


def has_recall(results: dict) -> bool:
    """Whether any row of a results dict carries the recall measures."""
    return any(MEASURE in row for row in results["rows"])


def layer_values(row: dict, name: str = MEASURE) -> list[float]:
    """A results row's per-layer means of measure ``name``, layer 0 first ([] when it has none)."""
    values, layer = [], 0
    while f"{name}_l{layer}" in row:
        values.append(row[f"{name}_l{layer}"])
        layer += 1
    return values


def _by_policy(results: dict, kind: str) -> dict[str, list[dict]]:
    """The rows of ``kind`` ("refresh" or "compress") that carry recall, by policy, in the run's order."""
    out: dict[str, list[dict]] = {}
    for row in results["rows"]:
        if row["kind"] == kind and MEASURE in row:
            out.setdefault(row[kind], []).append(row)
    return out


def recall_table(results: dict) -> str:
    """Markdown: every setting's recall of the needed tokens (overall, then first and last layer)."""
    lines = ["| setting | needed recall | layer 0 | last layer | kept recall (with both) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in results["rows"]:
        if MEASURE not in row:
            continue
        layers = layer_values(row)
        kept = f"{row[KEPT_MEASURE]:.3f}" if KEPT_MEASURE in row else "-"
        lines.append(f"| `{row['key']}` | {row[MEASURE]:.3f} | {layers[0]:.3f} | {layers[-1]:.3f} | {kept} |")
    return "\n".join(lines)


def plot_recall(results: dict, path: Path) -> None:
    """One figure: recall of the needed tokens against the refresh budget per refresh policy and
    against the keep ratio per compression policy (top), and per decoder layer at r = α = 10%
    (bottom)."""
    plt = pyplot(**PLOTTING)
    fig, ((budget_axis, keep_axis), (refresh_layers, keep_layers)) = plt.subplots(2, 2, figsize=(12, 8))
    for axis, kind, ratio_of in ((budget_axis, "refresh", "budget"), (keep_axis, "compress", "keep")):
        for policy, rows in _by_policy(results, kind).items():
            if len(rows) == 1 and policy in ("full", "none"):  # the same at every budget
                axis.axhline(100 * rows[0][MEASURE], linestyle="--", linewidth=1, label=policy,
                             color="black" if policy == "full" else "grey")
                continue
            points = sorted((100 * row[ratio_of], 100 * row[MEASURE]) for row in rows)
            axis.plot(*zip(*points), marker="o", label=policy,
                      linewidth=2.5 if policy in ("conduit", "vlcache") else 1.5)
    for row in (r for r in results["rows"] if r["kind"] == "together" and MEASURE in r):
        label = f"{together_label(row)} (r {100 * row['budget']:g}%, α {100 * row['keep']:g}%)"
        budget_axis.plot([100 * row["budget"]], [100 * row[MEASURE]], "*", markersize=14, label=label)
        keep_axis.plot([100 * row["keep"]], [100 * row[KEPT_MEASURE]], "*", markersize=14, label=label)
    for axis, kind, ratio_of in ((refresh_layers, "refresh", "budget"), (keep_layers, "compress", "keep")):
        for policy, rows in _by_policy(results, kind).items():
            row = next((r for r in rows if abs(r[ratio_of] - PER_LAYER_RATIO) < 1e-9), None)
            if row is not None and policy not in ("full", "none"):
                values = layer_values(row)
                axis.plot(range(len(values)), [100 * v for v in values], marker=".", label=policy)
    titles = (
        (budget_axis, "Refresh: needed tokens recomputed", "refresh budget r (% of visual tokens)"),
        (keep_axis, "Compression: needed tokens kept", "keep ratio α (% of the prompt's KV)"),
        (refresh_layers, f"Refresh at r = {100 * PER_LAYER_RATIO:g}%, per layer", "decoder layer"),
        (keep_layers, f"Compression at α = {100 * PER_LAYER_RATIO:g}%, per layer", "decoder layer"),
    )
    for axis, title, xlabel in titles:
        axis.set(title=title, xlabel=xlabel, ylabel="recall of the needed tokens (%)")
        axis.set_ylim(-2, 102)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.suptitle(f"Do the selections find what the answer reads? {results['n_requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
