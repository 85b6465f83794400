"""PNGs of `pdserve bench serve` results (matplotlib, Agg backend): one run's
latency percentiles and per-request latency, or a rate sweep's goodput and
latency percentiles against the offered rate."""
from __future__ import annotations

import math
from typing import Any

PCTS = (("p50", "o-"), ("p90", "s--"), ("p99", "^:"))


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a ValueError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'matplotlib>=3.8,<4' (or pip install .[plot])") \
            from exc
    return plt


def plot_run(result: dict, path: str) -> None:
    """Percentiles of TTFT/TPOT/E2E as bars, and each request's TTFT and E2E
    against its start time (queueing shows as a rising band)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names, pcts = ("ttft", "tpot", "e2e"), ("p50", "p90", "p99")
    for i, pct in enumerate(pcts):
        left.bar([j + 0.27 * (i - 1) for j in range(len(names))], [result[n][pct] * 1e3 for n in names], 0.27,
                 label=pct)
    left.set_xticks(range(len(names)), [n.upper() for n in names])
    left.set_yscale("log")
    left.set_ylabel("ms")
    left.set_title(f"{result['completed']} requests, {result['output_tokens_per_s']:.0f} output tok/s")
    left.legend()
    ok = [s for s in result["samples"] if s["ok"]]
    right.scatter([s["start"] for s in ok], [s["e2e"] * 1e3 for s in ok], s=6, label="end to end")
    right.scatter([s["start"] for s in ok], [s["ttft"] * 1e3 for s in ok], s=6, label="TTFT")
    right.set_xlabel("request start (s)")
    right.set_ylabel("ms")
    right.set_title("latency of each request")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _x_positions(rates: list[float]) -> tuple[list[float], list[str]]:
    """Where each offered rate goes on the x axis and its tick label (inf, a burst, to the right)."""
    finite = [r for r in rates if math.isfinite(r)]
    top = max(finite, default=1.0)
    xs = [r if math.isfinite(r) else top * 1.25 for r in rates]
    return xs, [f"{r:g}" if math.isfinite(r) else "inf\n(burst)" for r in rates]


def _latency_panel(ax: Any, xs: list[float], runs: list[dict], metric: str, title: str,
                   target: float | None) -> None:
    values = []
    for pct, style in PCTS:
        ys = [r[metric][pct] * 1e3 for r in runs]
        values += ys
        ax.plot(xs, ys, style, label=pct)
    if target is not None:
        ax.axhline(target * 1e3, color="tab:red", linestyle="-.", linewidth=1.2,
                   label=f"SLO {target * 1e3:g} ms")
        values.append(target * 1e3)
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 20:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(_plain_ms))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel(f"{metric.upper()} (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)


def _plain_ms(value: float, _pos: Any) -> str:
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def plot_sweep(result: dict, path: str) -> None:
    """Three panels against the offered rate: completed rate and goodput (with
    the share of requests within the SLOs), TTFT percentiles and TPOT
    percentiles, each with its SLO line; a rate's failed requests are counted
    under its tick, in red."""
    plt = pyplot()
    runs, targets = result["sweep"], result["goodput_targets_s"]
    xs, labels = _x_positions([r["request_rate"] for r in runs])
    fig, (tput, ttft, tpot) = plt.subplots(1, 3, figsize=(16, 5))

    finite = [r["request_rate"] for r in runs if math.isfinite(r["request_rate"])]
    if finite:
        tput.plot([0, max(finite)], [0, max(finite)], color="grey", linestyle=":", linewidth=1,
                  label="completed = offered")
    slos = ", ".join(f"{name.upper()} ≤ {limit * 1e3:g} ms" for name, limit in targets.items())
    tput.plot(xs, [r["request_throughput"] for r in runs], "o-", label="completed")
    goodput = [r["goodput_requests_per_s"] for r in runs]
    tput.plot(xs, goodput, "s-", color="tab:green", label=f"goodput: within {slos}\n(labels: % of the requests sent)")
    top = max([*goodput, *(r["request_throughput"] for r in runs), *finite, 1e-9])
    for x, r, g in zip(xs, runs, goodput):
        below = g > 0.12 * top  # near the axis the label goes above its point
        tput.annotate(f"{100 * r['goodput_fraction']:.0f}%", (x, g), textcoords="offset points",
                      xytext=(0, -14 if below else 7), ha="center", fontsize=8, color="tab:green")
    tput.set_ylim(bottom=0, top=top * 1.15)
    tput.set_title("completed rate and goodput")
    tput.set_xlabel("offered rate (req/s)")
    tput.set_ylabel("requests/s")
    tput.grid(True, alpha=0.3)
    tput.legend(fontsize=9, loc="best")

    _latency_panel(ttft, xs, runs, "ttft", "time to first token", targets.get("ttft"))
    _latency_panel(tpot, xs, runs, "tpot", "time per output token", targets.get("tpot"))
    labels = [label + (f"\n{r['failed']} failed" if r["failed"] else "") for label, r in zip(labels, runs)]
    for ax in (tput, ttft, tpot):
        ax.set_xticks(xs, labels)
        ax.set_xlim(0, max(xs) * 1.08)
        for tick, r in zip(ax.get_xticklabels(), runs):
            if r["failed"]:
                tick.set_color("tab:red")

    a = result.get("args", {})
    what = f"{a.get('dataset', '?')} prompts, {a.get('input_len', '?')} tokens in, {a.get('output_len', '?')} out"
    per_rate = (f"{a['duration']:g} s of arrivals per rate" if a.get("duration") is not None
                else f"{a.get('num_prompts', '?')} prompts per rate")
    fig.suptitle(f"pdserve bench serve: {result.get('model', '')}, {what}, {per_rate}, "
                 f"max concurrency {a.get('max_concurrency', '?')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
