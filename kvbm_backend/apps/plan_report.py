"""Table and plot of ``kvbm-backend plan`` results (the dict :func:`kvbm_backend.apps.plan.run_plan` returns)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_plan(result: dict, console: Console | None = None) -> None:
    """One row per sweep point: capacities (GB per node / shared), hit rates (%), per-node G3 read and
    write GB/s (busiest node) and the share of the node's drive write bandwidth (``--g3-write-gbps``) the
    writes use, G3 drive writes per day, G4 GB/s (fleet), TTFT saved (s, mean per request)."""
    console = console or Console()
    f = result["fleet"]
    span = result["span_s"]
    console.print(
        f"[bold]plan[/bold] {result['requests']} requests, {result['input_tokens']:,} input tokens over "
        f"{_f(span, ',.0f')} s; {result['layout']} TP {result['tp']}, page {result['page_size']} tokens, "
        f"{result['bytes_per_token']:,} B/token, {result['worker_block_bytes']:,} B per stored block; "
        f"{f['nodes']} node(s) x {f['workers_per_node']} worker(s), routing {f['routing']}, admission "
        f"{result['admission']}; whole trace once: {result['unique_bytes'] / 1e9:,.1f} GB", highlight=False)
    hits = Table(title="hit rates and time to first token")
    io = Table(title="bandwidth (busiest node for G3) and SSD wear")
    for t, cols in ((hits, ("G3 GB\nper node", "G4 GB\nshared", "G3\nhit", "G4\nhit", "total\nhit",
                            "TTFT saved\ns/request", "TTFT\nsaved")),
                    (io, ("G3 GB\nper node", "G4 GB\nshared", "G3 read\nGB/s", "G3 write\nGB/s",
                          "of G3\ndrive", "G3\nDWPD", "G4 read\nGB/s", "G4 write\nGB/s"))):
        for c in cols:
            t.add_column(c, justify="right", no_wrap=True)
    for p in result["points"]:
        caps = (f"{p['g3_capacity_gb_per_node']:,.6g}", f"{p['g4_capacity_gb']:,.6g}")
        hits.add_row(*caps, f"{p['g3_hit_rate']:.1%}", f"{p['g4_hit_rate']:.1%}", f"{p['hit_rate']:.1%}",
                     f"{p['ttft_saved_s_mean']:.3g}", f"{p['ttft_saved_fraction']:.1%}")
        io.add_row(*caps, _f(p["g3_read_gbps_busiest_node"], ".3g"),
                   _f(p["g3_write_gbps_busiest_node"], ".3g"), _f(p["g3_write_bandwidth_used"], ".0%"),
                   _f(p["g3_dwpd"], ".3g"), _f(p["g4_read_gbps"], ".3g"), _f(p["g4_write_gbps"], ".3g"))
    console.print(hits)
    console.print(io)
    console.print(f"TTFT without cache (recompute): {result['points'][0]['ttft_recompute_s_mean']:.3g} s per "
                  f"request at {f['prefill_tokens_per_s']:,.0f} tokens/s; loads at {f['g3_read_gbps']:g} GB/s "
                  f"(G3, node) and {f['g4_read_gbps']:g} GB/s (G4, worker); G3 drives write {f['g3_write_gbps']:g} "
                  f"GB/s per node (\"of G3 drive\" over 100%: the offloads outrun them); loading beats recomputing above "
                  f"{result['breakeven_load_gbps']:.3g} GB/s (negative savings: slower than recompute)",
                  highlight=False)


def plot_plan_axes(ax_hit, ax_io, d: dict, name: str = "plan") -> None:
    """Hit rate vs G3 capacity per node on ``ax_hit`` (G3 alone; G3+G4 per G4 capacity); G3 drive
    writes per day and busiest-node G3 write GB/s (right axis) vs G3 capacity on ``ax_io`` (if given)."""
    pts = d["points"]
    g4s = sorted({p["g4_capacity_gb"] for p in pts})
    for g4 in g4s:
        ps = sorted((p for p in pts if p["g4_capacity_gb"] == g4), key=lambda p: p["g3_capacity_gb_per_node"])
        x = [p["g3_capacity_gb_per_node"] for p in ps]
        if g4 == g4s[0]:  # G3 hits do not depend on G4
            ax_hit.plot(x, [100 * p["g3_hit_rate"] for p in ps], "o-", label="G3")
            if ax_io is not None:
                ax_io.plot(x, [p["g3_dwpd"] or 0 for p in ps], "o-", label="G3 drive writes/day")
                ax_io.set_ylabel("drive writes per day")
                tw = ax_io.twinx()
                tw.plot(x, [p["g3_write_gbps_busiest_node"] or 0 for p in ps], "s--", color="tab:orange",
                        label="G3 write GB/s (busiest node)")
                tw.set_ylabel("GB/s")
                tw.legend(fontsize=8, loc="center right")
        if g4 > 0:
            ax_hit.plot(x, [100 * p["hit_rate"] for p in ps], "s--", label=f"G3+G4 (G4 {g4:,.6g} GB)")
    for ax in (ax_hit, ax_io):
        if ax is None:
            continue
        ax.set_xscale("log")
        ax.set_xlabel("G3 capacity per node, GB")
        ax.legend(fontsize=8)
    ax_hit.set_ylabel("hit rate, % of pages looked up")
    ax_hit.set_title(f"{name}: {d['layout']} TP {d['tp']}, {d['fleet']['workers']} worker(s)")
    if ax_io is not None:
        ax_io.set_title("SSD wear and write rate")


def plot_plan(d: dict, out: str) -> None:
    """Write ``out`` (PNG/PDF/SVG by suffix) with :func:`plot_plan_axes`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    plot_plan_axes(a, b, d)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
