"""Printing and plotting of benchmark / demo JSON results (rich tables, matplotlib PNGs)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from rich.console import Console, JustifyMethod
from rich.table import Table


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)[:100]
    return str(v)


def print_kv_table(result: dict, title: str | None = None, console: Console | None = None) -> None:
    """Print a flat dict as a two-column table; a dict of dicts as one row per key."""
    console = console or Console()
    rows = list(result.items())
    if rows and all(isinstance(v, dict) for _, v in rows):
        cols = sorted({c for _, v in rows for c in v})
        t = Table(title=title)
        t.add_column("name")
        for c in cols:
            t.add_column(c, justify="right")
        for k, v in rows:
            t.add_row(str(k), *(_fmt(v.get(c, "")) for c in cols))
    else:
        t = Table(title=title, show_header=False)
        t.add_column("key")
        t.add_column("value", justify="right")
        for k, v in rows:
            t.add_row(str(k), _fmt(v))
    console.print(t)


def _iec(v: int) -> str:
    """Bytes in binary units, about 3 significant digits (``1.97 GiB``, ``1010 MiB``)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if v >= scale:
            x = v / scale
            return f"{x:.0f} {unit}" if x >= 100 else f"{x:.1f} {unit}" if x >= 10 else f"{x:.2f} {unit}"
    return f"{v} B"


def print_layouts(rows: dict, *, page_size: int, tp: int, default: str, console: Console | None = None) -> None:
    """``kvbm-backend layouts`` as text that fits 80 columns: full preset names, whole numbers with
    thousands separators, two-line headers, no side borders; the hybrid models' per-group figures in a
    second table; a preset that does not split over ``tp`` as one line under the first table.

    ``rows``: preset name -> the ``layouts --json`` row (``bytes_per_token_tp1``, ``bytes_per_block``,
    ``num_layers``, ``outer_dim``, ``inner_dim``, ``dtype``, hybrid keys, or ``error``)."""
    from rich import box
    console = console or Console()

    def n(v) -> str:
        return f"{v:,}"

    console.print(f"KV bytes per preset: blocks of {page_size} tokens, per rank at tp={tp}", highlight=False)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    cols: tuple[tuple[str, JustifyMethod], ...] = (
        ("preset", "left"), ("bytes/token\n(tp=1)", "right"), ("bytes/block\n(per rank)", "right"),
        ("layers", "right"), ("KV x dim", "right"), ("dtype", "left"))
    for c, j in cols:
        t.add_column(c, justify=j, no_wrap=True)
    errors = []
    for name, r in rows.items():
        label = f"{name} *" if name == default else name
        if "error" in r:
            errors.append(r["error"] if name in r["error"] else f"{name}: {r['error']}")
            bpt = r.get("bytes_per_token_tp1")  # None: the preset file itself did not load
            t.add_row(label, "-" if bpt is None else n(bpt), "-", "-", "-", "-")
            continue
        t.add_row(label, n(r["bytes_per_token_tp1"]), n(r["bytes_per_block"]), str(r["num_layers"]),
                  f"{r['outer_dim']}x{r['inner_dim']}", r["dtype"])
    console.print(t)
    console.print("* the default --layout of bench, replay and plan", highlight=False)
    for e in errors:
        console.print(e, highlight=False)
    hybrid = {k: r for k, r in rows.items() if "full_layers" in r}
    if not hybrid:
        return
    console.print(f"\nHybrid models, bytes per rank at tp={tp}: full-attention layers keep every token,\n"
                  "sliding-window layers at most 'window' tokens per sequence (--json: exact bytes)",
                  highlight=False)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for c in ("preset", "full\nlayers", "sliding\nlayers", "window\ntokens", "full\nB/token",
              "sliding\nB/token", "KV of 8K\ntokens"):
        t.add_column(c, justify="left" if c == "preset" else "right", no_wrap=True)
    for name, r in hybrid.items():
        t.add_row(name, str(r["full_layers"]), str(r["sliding_layers"]), n(r["sliding_window"]),
                  n(r["full_bytes_per_token"]), n(r["sliding_bytes_per_token"]), _iec(r["kv_bytes_8k_tokens"]))
    console.print(t)


# (label, ours key, baseline key) pairs recognised in bench JSON
_PAIRS = [
    ("write GB/s", "write_gbps", "baseline_write_gbps"),
    ("read GB/s", "read_gbps", "baseline_read_gbps"),
    ("write GB/s", "ours_write_gbps", "vllm_fs_write_gbps"),
    ("read GB/s", "ours_read_gbps", "vllm_fs_read_gbps"),
]


def baseline_label(d: dict) -> str:
    """The legend of a bench result's baseline bars: its JSON's ``baseline`` description when it has one, else
    what ``baseline_o_direct`` says (older results)."""
    if d.get("baseline"):
        return f"baseline: {d['baseline']}"
    return "buffered I/O baseline" if d.get("baseline_o_direct") is False else "O_DIRECT baseline"


def plot_results(files: Iterable[str], out: str) -> None:
    """Plot each JSON file: demo results (TTFT p50/p90 per config), bench results (ours vs the
    in-run baseline), ``bench --tier index`` results (prefix lookup times and bytes per block),
    ``plan`` results (hit rate per tier vs G3 capacity) or ``scaling`` results
    (``kind: "scaling"``: one line per ``series`` entry over the values of the key ``x`` names, e.g.
    G4 GB/s vs workers). Writes one PNG with one panel per file. Raises ValueError for an unknown shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [(Path(f).name, json.loads(Path(f).read_text())) for f in files]
    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4.2), squeeze=False)
    for ax, (name, d) in zip(axes[0], data):
        if d.get("kind") == "plan":
            from .plan_report import plot_plan_axes
            plot_plan_axes(ax, None, d, name)
            continue
        if d.get("tier") == "index":
            _plot_index(ax, d, name)
            continue
        if d.get("kind") == "scaling":  # {"x": "workers", "workers": [1, 2, 4], "series": {label: [y per x]}}
            xs = d[d.get("x", "workers")]
            for label, ys in d["series"].items():
                ax.plot(xs, ys, marker="o", label=label)
            ax.set_xticks(xs)
            ax.set_xlabel(d.get("x", "workers"))
            ax.set_ylabel("aggregate GB/s (1e9 B/s)")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{name}: {d.get('tier', '')} ({d.get('mode', '')})".strip())
        elif "configs" in d:
            names = list(d["configs"])
            p50 = [d["configs"][n].get("ttft_p50_s", 0) for n in names]
            p90 = [d["configs"][n].get("ttft_p90_s", 0) for n in names]
            x = range(len(names))
            ax.bar([i - 0.2 for i in x], p50, 0.4, label="TTFT p50")
            ax.bar([i + 0.2 for i in x], p90, 0.4, label="TTFT p90")
            ax.set_xticks(list(x), names)
            ax.set_ylabel("seconds")
            ax.set_title(f"{name}: TTFT per configuration")
        else:
            pairs = [(lbl, d[a], d[b], a.startswith("ours")) for lbl, a, b in _PAIRS if a in d and b in d]
            if not pairs:
                raise ValueError(f"{name}: neither demo ('configs') nor bench (*_gbps) results")
            import textwrap
            base_label = "vLLM fs tier" if pairs[0][3] else textwrap.fill(baseline_label(d), 48)
            x = range(len(pairs))
            ax.bar([i - 0.2 for i in x], [p[1] for p in pairs], 0.4, label="kvbm_backend")
            ax.bar([i + 0.2 for i in x], [p[2] for p in pairs], 0.4, label=base_label)
            ax.set_xticks(list(x), [p[0] for p in pairs])
            ax.set_ylabel("GB/s (1e9 B/s)")
            ax.set_title(f"{name}: {d.get('tier', '')} {d.get('engine', '')}".strip())
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _entries(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}K" if n >= 1000 else str(n)


def _plot_index(ax, d: dict, name: str) -> None:
    """``bench --tier index`` JSON: median time of a full and of a partial 8K-block prefix lookup (ms, the
    public path) per index (compact G3 index, scheduler's G3 mirror, OrderedDict index) and size, each bar
    pair labelled with the index's bytes per block, on a log scale; a dashed line at the 1 ms target."""
    rows = []
    for kind in ("compact", "mirror", "ordereddict"):
        for n, v in sorted(d.get(kind, {}).items(), key=lambda kv: int(kv[0])):
            rows.append((f"{kind}\n{_entries(int(n))}\n{v['bytes_per_block']:.0f} B/block",
                         v["prefix_lookup_ms"]["median"], v.get("partial_lookup_ms", {}).get("median", 0.0)))
    if not rows:
        raise ValueError(f"{name}: index bench results without any index")
    x = range(len(rows))
    blocks = d.get("prefix_blocks", 8192)
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label=f"full {blocks}-block hit, median")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="partial hit, median")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1 ms target")
    ax.set_xticks(list(x), [r[0] for r in rows], fontsize=7)
    ax.set_yscale("log")  # the OrderedDict index is ~30x the others
    ax.set_ylabel("prefix lookup, ms (log scale)")
    ax.set_title(f"{name}: G3 index and mirror")
    ax.legend(fontsize=7)
