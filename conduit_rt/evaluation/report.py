"""The quality report: markdown tables, the plot and the docs page, all from the results dict.

``write_report(results, out)`` writes ``out/table.md`` (tables and headline), ``out/plot.png``,
``out/plot-recall.png`` (when the run measured recall: ``recall.plot_recall``) and ``out/quality.md``
(the docs page: how the numbers were made, then the tables and the plots, whose files it names
``quality.png`` and ``quality-recall.png``). ``python -m conduit_rt.evaluation.report results.json
--docs docs`` regenerates ``docs/quality.md`` and its plots from a finished run's JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .. import compress, refresh
from ..extras import pyplot
from . import recall

PLOTTING = {"extra": "eval", "command": "conduit eval", "purpose": "for its plot"}  # what a missing matplotlib says
# the order of the tables: the policy registries' (the bounds, the baselines, the method, then beyond the papers)
REFRESH_ORDER = tuple(refresh.POLICIES)
COMPRESS_ORDER = tuple(compress.POLICIES)
HEADLINE_RATIO = 0.1
COMPARISONS_NOTE = ("At every budget CONDUIT is set against `attention` and against the most accurate other refresh "
                    "baseline there, at every keep ratio VL-Cache against the most accurate other compression policy; "
                    "the interval is a percentile bootstrap over requests, so an interval that excludes 0 means the "
                    "two settings differ at 95% confidence.")

KV_NOTE = ("The same cold full prefill on a second Runtime over the same weights whose KV cache is stored in the "
           "other format (fp8: e4m3 with a power-of-two scale per token and KV head). The difference is paired over "
           "the same requests (percentile bootstrap, 95%); the KL is KL(dense || other) of the first answer token's "
           "next-token distribution, in nats, over the requests.")


def rows_by_key(results: dict) -> dict[str, dict]:
    return {row["key"]: row for row in results["rows"]}


def refresh_row(results: dict, policy: str, budget: float) -> dict | None:
    """The row of a refresh policy at a budget; ``full``/``none`` at any budget, budget 0 = ``none``."""
    rows = rows_by_key(results)
    if policy == "full":
        return rows.get("refresh:full@1")
    if policy == "none" or budget == 0:
        return rows.get("refresh:none@0")
    return rows.get(f"refresh:{policy}@{budget:g}")


def compress_row(results: dict, policy: str, keep: float) -> dict | None:
    rows = rows_by_key(results)
    return rows.get("compress:none@1") if policy == "none" else rows.get(f"compress:{policy}@{keep:g}")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def _interval(bounds: list[float] | None, scale: float = 1.0) -> str:
    """" [low, high]" of a confidence interval times ``scale``, or nothing when there is none."""
    return "" if not bounds else f" [{scale * bounds[0]:.1f}, {scale * bounds[1]:.1f}]"


def _accuracy(cells: dict) -> str:
    """Exact match in percent with its 95% interval: "61.0 [55.2, 66.8]"."""
    return f"{100 * cells['accuracy']:.1f}{_interval(cells.get('accuracy_ci'), 100)}"


def _pct_of_full(cells: dict) -> str:
    """% of full with its 95% interval: "95.3% [90.1, 99.0]"."""
    value = cells["accuracy_pct_of_full"]
    return _pct(value) + (_interval(cells.get("accuracy_pct_of_full_ci")) if value is not None else "")


def _cell(row: dict | None) -> str:
    """accuracy [CI] (% of full [CI]) of a row or of one family of a row, or a dash."""
    if row is None:
        return "-"
    return f"{_accuracy(row)} ({_pct_of_full(row)})"


def _policies(results: dict, kind: str, order: tuple[str, ...]) -> list[str]:
    present = {row[kind] for row in results["rows"] if row["kind"] == kind}
    return [p for p in order if p in present] + sorted(present - set(order))


def refresh_table(results: dict) -> str:
    budgets = results["config"]["budgets"]
    lines = ["| refresh policy | " + " | ".join(f"r = {100 * b:g}%" for b in budgets) + " |",
             "| --- |" + " --- |" * len(budgets)]
    for policy in _policies(results, "refresh", REFRESH_ORDER):
        cells = [_cell(refresh_row(results, policy, b)) for b in budgets]
        lines.append(f"| `{policy}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compress_table(results: dict) -> str:
    keeps = results["config"]["keeps"]
    lines = ["| compression policy | " + " | ".join(f"α = {100 * k:g}%" for k in keeps) + " |",
             "| --- |" + " --- |" * len(keeps)]
    for policy in _policies(results, "compress", COMPRESS_ORDER):
        cells = [_cell(compress_row(results, policy, k)) for k in keeps]
        lines.append(f"| `{policy}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(results: dict) -> str:
    header = ("| setting | accuracy | % of full | KL (first) | KL (aligned) | top-1 (first) | top-1 (aligned) | "
              "continuation match | hidden rel. err. | prefill FLOPs | KV kept | refreshed |")
    lines = [header, "| --- |" + " ---: |" * 11]
    for row in results["rows"]:
        lines.append(
            f"| `{row['key']}` | {_accuracy(row)} | {_pct_of_full(row)} | "
            f"{row['kl_first']:.2e} | {row['kl']:.2e} | {row['top1_first']:.3f} | {row['top1']:.3f} | "
            f"{row['continuation_match']:.3f} | {row['hidden_rel_error']:.2e} | {row['prefill_flops_ratio']:.3f} | "
            f"{row['kv_ratio']:.3f} | {row['refreshed_fraction']:.3f} |")
    return "\n".join(lines)


def families(results: dict) -> list[str]:
    """The task families the rows were measured on, sorted (none for results without families)."""
    return sorted({family for row in results["rows"] for family in row.get("families", {})})


def family_table(results: dict) -> str:
    """Every setting's exact match [95% CI] (% of full [95% CI]) in each task family's requests."""
    names = families(results)
    lines = ["| setting | " + " | ".join(f"{name} (n = {_family_n(results, name)})" for name in names) + " |",
             "| --- |" + " ---: |" * len(names)]
    for row in results["rows"]:
        lines.append(f"| `{row['key']}` | " + " | ".join(_cell(row["families"].get(name)) for name in names) + " |")
    return "\n".join(lines)


def _family_n(results: dict, name: str) -> int:
    return max(row["families"][name]["n"] for row in results["rows"] if name in row.get("families", {}))


def _level_name(kind: str, level: float) -> str:
    return f"{'r' if kind == 'refresh' else 'α'} = {100 * level:g}%"


def _difference(comparison: dict) -> str:
    """A - B in points with its 95% interval: "+4.2 [1.1, 7.3]"."""
    return f"{100 * comparison['difference']:+.1f}{_interval(comparison['ci'], 100)}"


def comparisons_table(results: dict) -> str:
    """The paired comparisons: A - B in exact-match points over the same requests, 95% bootstrap interval."""
    lines = ["| comparison | at | A | B | A exact match % | B exact match % | A - B (points) [95% CI] | CI excludes 0 |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for c in results["comparisons"]:
        lines.append(f"| {c['label']} | {_level_name(c['kind'], c['level'])} | `{c['a']}` | `{c['b']}` | "
                     f"{100 * c['accuracy_a']:.1f} | {100 * c['accuracy_b']:.1f} | {_difference(c)} | "
                     f"{'yes' if c['excludes_zero'] else 'no'} |")
    return "\n".join(lines)


def kv_table(results: dict) -> str:
    """The full prefill on the dense KV cache and on the ``--kv-dtype`` one: exact match, the paired
    difference over the same requests and the first answer token's KL(dense || kv dtype)."""
    kv = results["kv_cache"]
    kl = kv["kl_first"]
    dense = next(row for row in results["rows"] if row["kind"] == "reference")
    lines = ["| KV cache | exact match % [95% CI] | % of full [95% CI] | minus dense (points) [95% CI] | CI excludes 0 "
             "| first-token KL: mean | p99 | max |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
             f"| dense ({results['config']['dtype']}) | {_accuracy(dense)} | {_pct_of_full(dense)} | | | | | |",
             f"| `{kv['kv_dtype']}` | {_accuracy(kv)} | {_pct_of_full(kv)} | {_difference(kv)} | "
             f"{'yes' if kv['excludes_zero'] else 'no'} | {kl['mean']:.2e} | {kl['p99']:.2e} | {kl['max']:.2e} |"]
    return "\n".join(lines)


def kv_headline(kv: dict) -> str:
    """The headline's sentence on the ``--kv-dtype`` cache (``results["kv_cache"]``)."""
    kl = kv["kl_first"]
    within = "within" if kv["within_tolerance"] else "NOT within"
    return (f"Full prefill on the {kv['kv_dtype']} KV cache: exact match {100 * kv['accuracy']:.1f}%"
            f"{_interval(kv['accuracy_ci'], 100)}, {_difference(kv)} points "
            f"against the dense cache over the same {kv['n']} requests ({within} {kv['tolerance_points']:g} points; "
            f"CI {'excludes' if kv['excludes_zero'] else 'includes'} 0); "
            f"KL(dense || {kv['kv_dtype']}) of the first answer token: mean {kl['mean']:.2e}, p99 {kl['p99']:.2e}, "
            f"max {kl['max']:.2e} nats.")


def _compared(comparison: dict, method: str) -> str:
    """How a comparison is named in a sentence about ``method``: "attention" for the method's own
    (method vs B), "`conduit_focus` over `conduit`" for a policy beyond the papers against it (or
    over the best baseline)."""
    a, b = comparison["label"].split(" vs ", 1)
    if a == method:
        return b
    best = b.removeprefix("best baseline (").removesuffix(")")
    return f"`{a}` over `{b}`" if best == b else f"`{a}` over the best baseline (`{best}`)"


def comparison_notes(results: dict, kind: str, level: float) -> str:
    """The comparisons at one budget or keep ratio as a clause: "paired: vs `attention` +4.2 [1.1, 7.3] points (CI excludes 0)"."""
    found = [c for c in results.get("comparisons", []) if c["kind"] == kind and abs(c["level"] - level) < 1e-9]
    method = "conduit" if kind == "refresh" else "vlcache"
    parts = [f"{_compared(c, method)} {_difference(c)} points "
             f"({'CI excludes 0' if c['excludes_zero'] else 'CI includes 0'})" for c in found]
    return ("; paired differences over the same requests: " + ", ".join(parts)) if parts else ""


def headline(results: dict) -> list[str]:
    """The closing note's sentences: the `none` gap, CONDUIT at 10% and VL-Cache at 10% against every
    baseline, and both together."""
    notes = []
    check = results["checks"]
    if check["none_gap_points"] is not None:
        notes.append(f"`none` (stale KV, no refresh) scores {check['none_gap_points']:.1f}"
                     f"{_interval(check.get('none_gap_points_ci'))} points below full prefill "
                     f"({100 * check['full_accuracy']:.1f}% exact match): the benchmark "
                     f"{'tells' if check['tells_policies_apart'] else 'does NOT tell'} policies apart (needs >= 5 points).")
    conduit = refresh_row(results, "conduit", HEADLINE_RATIO)
    if conduit is not None:
        others = [f"`{p}` {_pct(row['accuracy_pct_of_full'])}" for p in REFRESH_ORDER if p != "conduit"
                  and (row := refresh_row(results, p, HEADLINE_RATIO)) is not None]
        notes.append(f"CONDUIT at r = 10%: {_pct(conduit['accuracy_pct_of_full'])} of full-prefill accuracy at "
                     f"{conduit['prefill_flops_ratio']:.3f}x its prefill FLOPs (KL {conduit['kl_first']:.2e}, top-1 "
                     f"{conduit['top1_first']:.3f})" + _alongside("at the same budget", others)
                     + comparison_notes(results, "refresh", HEADLINE_RATIO) + ".")
    vlcache = compress_row(results, "vlcache", HEADLINE_RATIO)
    if vlcache is not None:
        others = [f"`{p}` {_pct(row['accuracy_pct_of_full'])}" for p in COMPRESS_ORDER if p != "vlcache"
                  and (row := compress_row(results, p, HEADLINE_RATIO)) is not None]
        notes.append(f"VL-Cache at α = 10%: {_pct(vlcache['accuracy_pct_of_full'])} of full-cache accuracy with "
                     f"{vlcache['kv_ratio']:.3f}x the KV bytes (continuation match {vlcache['continuation_match']:.3f})"
                     + _alongside("at the same keep ratio", others)
                     + comparison_notes(results, "compress", HEADLINE_RATIO) + ".")
    together = [row for row in results["rows"] if row["kind"] == "together"]
    for row in together:
        pair = f"`{row['refresh']}` r = {100 * row['budget']:g}% + `{row['compress']}` α = {100 * row['keep']:g}%"
        notes.append(f"{pair} together: {_pct(row['accuracy_pct_of_full'])} of full-prefill accuracy at "
                     f"{row['prefill_flops_ratio']:.3f}x the prefill FLOPs and {row['kv_ratio']:.3f}x the KV bytes.")
    if results.get("kv_cache"):  # results of runs without --kv-dtype have none
        notes.append(kv_headline(results["kv_cache"]))
    return notes


def _alongside(where: str, others: list[str]) -> str:
    """"; <where> a, b" naming the other policies' figures, or nothing when none was measured."""
    return f"; {where} " + ", ".join(others) if others else ""


def tables_markdown(results: dict, plot_name: str = "plot.png") -> str:
    c = results["config"]
    setup = (f"{results['n_requests']} test requests ({c['min_pages']}-{c['max_pages']} pages, seed {c['seed']}, pages seen "
             f"before as `{c['seen']}`), model `{c['model_name']}` on {c['device']} ({c['dtype']}), greedy answers of "
             f"at most {c['max_tokens']} tokens, {results['seconds']:.0f} s.")
    parts = [
        "### Setup", setup,
        "### Refresh policies: exact match % [95% CI] (and % of full prefill [95% CI]) by refresh budget",
        refresh_table(results),
        ("`full` and `none` do not depend on the budget; at r = 0 every policy refreshes nothing, so that column "
         "is `none`."),
        "### Compression policies: exact match % [95% CI] (and % of full cache [95% CI]) by keep ratio",
        compress_table(results),
        "`none` keeps the whole cache (a full prefill with compression on and nothing dropped).",
    ]
    if families(results):
        parts += ["### By task family: exact match % [95% CI] (and % of full prefill [95% CI])", family_table(results)]
    if results.get("comparisons"):
        parts += ["### Paired comparisons: A - B in exact-match points over the same requests",
                  comparisons_table(results), COMPARISONS_NOTE]
    if results.get("kv_cache"):
        parts += [f"### KV cache: full prefill on the dense and the {results['kv_cache']['kv_dtype']} cache",
                  kv_table(results), KV_NOTE]
    parts += [
        "### Every setting",
        detail_table(results),
        f"![accuracy by budget]({plot_name})",
    ]
    if recall.has_recall(results):
        parts += ["### Recall of the tokens the answer needs", recall.recall_table(results),
                  f"![recall of the needed tokens]({recall_plot_name(plot_name)})"]
    parts += ["### Headline", "\n".join(f"- {note}" for note in headline(results))]
    return "\n\n".join(parts) + "\n"


def recall_plot_name(plot_name: str) -> str:
    """The recall plot's file beside the accuracy plot: plot.png -> plot-recall.png."""
    return plot_name.replace(".png", "-recall.png")


def _draw(axis, points: list[tuple[float, dict]], fmt: str, **style) -> None:
    """One policy's accuracy (%) at each x as a line with its 95% interval as error bars (when the rows have one)."""
    xs = [x for x, _ in points]
    ys = [100 * row["accuracy"] for _, row in points]
    bounds = [row.get("accuracy_ci") for _, row in points]
    errors = None
    if all(bounds):
        errors = [[y - 100 * b[0] for y, b in zip(ys, bounds)], [100 * b[1] - y for y, b in zip(ys, bounds)]]
    axis.errorbar(xs, ys, yerr=errors, fmt=fmt, capsize=2, elinewidth=1, **style)


def plot(results: dict, path: Path) -> None:
    """Accuracy vs refresh budget per refresh policy (left) and vs keep ratio per compression policy (right),
    with 95% intervals as error bars."""
    plt = pyplot(**PLOTTING)

    full = 100 * results["checks"]["full_accuracy"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    budgets = results["config"]["budgets"]
    for policy in _policies(results, "refresh", REFRESH_ORDER):
        points = [(100 * b, row) for b in budgets if (row := refresh_row(results, policy, b))]
        style = "--o" if policy in ("full", "none") else "-o"
        _draw(left, points, style, label=policy, linewidth=2.5 if policy == "conduit" else 1.5)
    for row in (r for r in results["rows"] if r["kind"] == "together"):
        _draw(left, [(100 * row["budget"], row)], "*", markersize=14,
              label=f"{recall.together_label(row)} (α {100 * row['keep']:g}%)")
    keeps = results["config"]["keeps"]
    for policy in _policies(results, "compress", COMPRESS_ORDER):
        points = [(100 * k, row) for k in keeps if (row := compress_row(results, policy, k))]
        style = "--o" if policy == "none" else "-o"
        _draw(right, points, style, label=policy, linewidth=2.5 if policy == "vlcache" else 1.5)
    for axis, title, xlabel in ((left, "Refresh of restored image KV", "refresh budget r (% of visual tokens)"),
                                (right, "KV compression for decoding", "keep ratio α (% of the prompt's KV)")):
        axis.axhline(full, color="black", linewidth=1, linestyle=":", label="full prefill")
        axis.set(title=title, xlabel=xlabel, ylabel="exact match (%)")
        axis.set_ylim(bottom=0, top=max(5.0, axis.get_ylim()[1]))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"Tagged-pages QA, {results['n_requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


INTRO = """# Quality: refresh and compression policies side by side

Generated by `conduit eval` (`conduit_rt/evaluation/`) from `results.json`; docs/methods.md §4 defines
the measures. The task and its model are in `conduit_rt/evaluation/task/` (docs/quality/task.md): a
small model trained from scratch to answer questions about tagged pages (dense 64-token pages in
the `lookup` family, mostly white 256-token forms in `fields`), where the tag that names a page is
text *before* the page, so an image's KV computed under another prefix carries the wrong page
membership. **Recall** is the share of the image tokens the answer needs (the generator knows
them) that a policy recomputed (refresh) or kept (compression).

**Sessions.** For each test request the runtime first sees its pages elsewhere: spread over earlier
requests of 1-3 of them, in another order, among 0-2 other pages, each under another tag (`--seen
sessions`; `retagged` and `isolated` are the other choices). Each page's KV is stored then, in that
context. The test request then comes with its own tags, order and companions, and every setting
answers it on the same warmed image-KV store (restoring never writes the store; the prefix cache is
off; the store is emptied between sessions, so requests never warm each other). The reference is a
cold full prefill of the same request on the same runtime (`refresh=None`: nothing restored).

**Measures.** Accuracy: exact match of the greedy answer (at most 8 tokens) with the ground truth,
and as % of the full-prefill accuracy. Fidelity against the full-prefill run of the same request:
KL(full || policy) of the next-token distribution, top-1 agreement, greedy-continuation exact match
(the whole answer's tokens), and ||h - h_full|| / ||h_full|| of the final norm's output (the LM
head's input). "first" is the distribution right after the prompt (where refresh acts); "aligned"
averages over every decode step whose earlier tokens equal the reference's (where compression
acts). Prefill FLOPs: linear + attention FLOPs of the prefill over those of a full prefill (the
runtime's count, scoring included). KV kept: the sequence's KV bytes after compression over before.

**Statistics** (`conduit_rt/evaluation/statistics.py`). Every setting answers the same requests, so
its outcomes pair up request by request with every other setting's. Accuracy cells give a 95%
Wilson score interval in brackets; % of full gives a 95% percentile bootstrap interval over
requests (seeded: `results.json`'s `statistics` gives the resample count and the seed), each
resample taking the same requests for the setting and the full prefill. The paired comparisons
resample requests the same way and give the 95% interval of the difference in exact match between
two settings; an interval that excludes 0 means the two settings differ at that confidence. The
best baseline of a comparison is chosen on the same requests, which favours it.

The command that produced these numbers:

```
{command}
```
"""


def docs_page(results: dict, plot_name: str, note: str | None = None) -> str:
    """The docs page; ``note`` (optional) is shown as a quote under the title."""
    command = results["config"].get("command") or "conduit eval --model MODEL --out OUT"
    page = INTRO.replace("{command}", command)
    if note:
        title, rest = page.split("\n", 1)
        page = f"{title}\n\n> {note}\n{rest}"
    return page + "\n## Results\n\n" + tables_markdown(results, plot_name)


def write_report(results: dict, out: Path) -> None:
    """table.md, plot.png and quality.md (the docs page) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(tables_markdown(results, "plot.png"))
    plot(results, out / "plot.png")
    if recall.has_recall(results):
        recall.plot_recall(results, out / recall_plot_name("plot.png"))
    (out / "quality.md").write_text(docs_page(results, "quality.png"))


def write_docs(results: dict, plot_path: Path | None, docs: Path, note: str | None = None) -> None:
    """docs/quality.md and docs/quality.png (the plot copied from a run, or drawn again)."""
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "quality.md").write_text(docs_page(results, "quality.png", note))
    if plot_path is not None and plot_path.is_file():
        shutil.copyfile(plot_path, docs / "quality.png")
    else:
        plot(results, docs / "quality.png")
    if recall.has_recall(results):
        recall.plot_recall(results, docs / recall_plot_name("quality.png"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conduit_rt.evaluation.report",
                                     description="regenerate the quality docs page from a run's results.json")
    parser.add_argument("results", type=Path, help="results.json of a `conduit eval` run")
    parser.add_argument("--docs", type=Path, default=Path("docs"), help="folder for quality.md and quality.png")
    parser.add_argument("--note", default=None, help="a line shown under the page's title")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    write_docs(results, args.results.parent / "plot.png", args.docs, args.note)
    print(f"wrote {args.docs / 'quality.md'} and {args.docs / 'quality.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
