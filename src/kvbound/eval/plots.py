"""Plots of evaluation and benchmark results (matplotlib, no display needed)."""
from __future__ import annotations


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ppl_bars(res: dict, path, title: str):
    """Perplexity change of each strategy against the first, as bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(res), [r["delta_pct"] for r in res.values()], color="tab:blue")
    ax.set_ylabel("PPL Δ% vs baseline")
    ax.set_title(title)
    plt.xticks(rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_lines(rows: dict, names, over: str, path, title: str):
    """Perplexity change against the full cache over the swept values, one line per strategy."""
    plt = _pyplot()
    values = list(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in names[1:]:
        ax.plot(values, [rows[v][s]["delta_pct"] for v in values], marker="o", label=s)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel(over)
    ax.set_ylabel("PPL Δ% vs full cache")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heatmap(rows, cols, grid, path, label):
    """Fractions in [0, 1] per (row, column), printed in the cells."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(cols), 1 + 0.45 * len(rows)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    long_labels = max(map(len, cols), default=0) > 10
    ax.set_xticks(range(len(cols)), cols, rotation=30 if long_labels else 0, ha="right" if long_labels else "center")
    ax.set_yticks(range(len(rows)), rows)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def needle_heatmap(strategies, cols, grid, path):
    heatmap(strategies, [f"{c} tok\nbudget {f:g}" for c, f in cols], grid, path, "retrieved")


def serve_timeline(res, steps, path):
    """Running sequences and step times over a serving run, spikes marked, phases ruled."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    t = [s["t"] for s in steps]
    name = res.get("step_name", "step")
    ax1.plot(t, [s["running"] for s in steps], lw=1)
    ax1.set_ylabel("running sequences" if name == "step" else "requests in flight")
    ax2.plot(t, [s["ms"] for s in steps], lw=0.8, label=f"{name} time" if name == "step" else
             "gap between streamed pieces")
    spikes = [s for s in steps if s["ms"] > res["spike_ms"]]
    ax2.scatter([s["t"] for s in spikes], [s["ms"] for s in spikes], color="red", s=8, label="spike", zorder=3)
    ax2.axhline(res["spike_ms"], color="red", lw=0.6, ls="--")
    ax2.set_ylabel(f"{name} ms")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper right", fontsize=8)
    cfg = res["config"]
    if cfg.get("rate"):
        for ax in (ax1, ax2):
            for x in (0.2 * cfg["duration"], cfg["duration"]):
                ax.axvline(x, color="gray", lw=0.6, ls=":")
    ax1.set_title(f"{res['requests']} requests at {cfg['rate']}/s (ramp | steady | tail)" if cfg.get("rate") else
                  f"{res['requests']} requests, {cfg.get('concurrency')} at a time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
