"""PNG plots of `moe-serve bench serve` results (matplotlib, the `bench` extra)."""
from __future__ import annotations

import argparse
import math

INSTALL_HINT = "pip install 'moe-serve[bench]'"

LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png_path(value: str) -> str:
    """argparse type of --plot: a path, accepted only where matplotlib can draw it."""
    if not have_matplotlib():
        raise argparse.ArgumentTypeError(f"PNG plots need matplotlib, which is not installed: {INSTALL_HINT}")
    return value


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _log_ticks(ax, xs: list[int]) -> None:
    """The sweep's levels as the only x labels of a log axis."""
    import matplotlib.ticker

    ax.set_xticks(xs, [str(x) for x in xs])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def plot_sweep(levels: list[dict], title: str, path: str) -> str:
    """Latency percentiles (left, log-log) and throughput (right) against the concurrency level."""
    plt = _pyplot()
    import matplotlib.ticker

    xs = [lv["max_concurrency"] for lv in levels]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    # one colour per metric, one line style per statistic (the median solid, higher percentiles lighter)
    colors = {"ttft": "tab:blue", "tpot": "tab:orange", "itl": "tab:green", "e2el": "tab:red"}
    styles = ["-", "--", ":", "-."]
    stats = [k.split("_")[0] for k in levels[0] if k.endswith("_ttft_ms") or k.endswith("_e2el_ms")
             or k.endswith("_tpot_ms") or k.endswith("_itl_ms")]
    stats = list(dict.fromkeys(x for x in stats if x == "median" or (x.startswith("p") and x != "p50")))
    for metric, color in colors.items():
        for i, stat in enumerate(stats):
            key = f"{stat}_{metric}_ms"
            pts = [(x, lv[key]) for x, lv in zip(xs, levels) if _finite(lv.get(key))]
            if pts:
                a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, color=color,
                        linestyle=styles[i % len(styles)], alpha=1.0 if i == 0 else 0.75,
                        label=f"{LABELS[metric]} {'p50' if stat == 'median' else stat}")
    a1.set(xscale="log", yscale="log", xlabel="max concurrency (requests in flight)", ylabel="latency (ms)",
           title="latency against load")
    _log_ticks(a1, xs)
    a1.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    a1.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7, ncol=2, framealpha=0.6)
    a2.plot(xs, [lv["output_throughput"] for lv in levels], marker="o", color="tab:green", label="output tokens/s")
    a2.plot(xs, [lv["total_token_throughput"] for lv in levels], marker="s", color="tab:olive",
            label="total tokens/s")
    a2.set(xscale="log", xlabel="max concurrency (requests in flight)", ylabel="tokens/s",
           title="throughput against load")
    _log_ticks(a2, xs)
    a2.grid(True, which="both", alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path


def plot_level(level: dict, results: list, title: str, path: str) -> str:
    """One level: the distribution (CDF) of per-request TTFT, TPOT and E2E latency (left), and the
    requests in flight over the run (right)."""
    plt = _pyplot()
    ok = [r for r in results if r.ok]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {"ttft": [1e3 * r.ttft for r in ok],
              "tpot": [1e3 * (r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
              "e2el": [1e3 * r.latency for r in ok]}
    for name, xs in series.items():
        xs = sorted(x for x in xs if x > 0)
        if xs:
            a1.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=LABELS[name])
    a1.set(xscale="log", xlabel="ms (log)", ylabel="share of requests", title="per-request latency (CDF)")
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results])
    t, n, ts, ns = 0.0, 0, [0.0], [0]
    for t, d in events:
        n += d
        ts.append(t)
        ns.append(n)
    a2.step(ts, ns, where="post", color="tab:purple")
    a2.set(xlabel="seconds since the level started", ylabel="requests in flight", title="load over the run")
    a2.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path
