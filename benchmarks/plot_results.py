"""PNG plots of benchmark results (issue #7 item 5): reads the JSON files a benchmark wrote into a results
directory and draws every plot whose inputs are there.

One function per plot, each `plot_<name>(results_dir, out_dir) -> Path` reading its own JSON files; `PLOTS`
maps the files a plot needs to its function, and `main` runs those whose files exist. To add a plot: write
the function, add a `Plot` entry.

  python benchmarks/plot_results.py RESULTS_DIR [--out-dir DIR]

matplotlib is imported only when a plot is drawn (it is not a Baton dependency: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Serving benchmark (benchmarks/serving_bench.py): one file per configuration, in this order on the plots.
SERVING_CONFIGS = ("agg", "disagg")
SERVING_LABELS = {"agg": "2 aggregated replicas", "disagg": "1P1D disaggregated"}
SERVING_COLORS = {"agg": "tab:blue", "disagg": "tab:orange"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _serving_runs(results_dir: Path) -> dict[str, dict[str, Any]]:
    """serving_<config>.json documents found in `results_dir`, by configuration."""
    out = {}
    for name in SERVING_CONFIGS:
        f = results_dir / f"serving_{name}.json"
        if f.exists():
            out[name] = json.loads(f.read_text())
    return out


def _stat(point: dict[str, Any], metric: str, q: str) -> float:
    """A latency percentile of one rate point in ms (NaN where nothing completed)."""
    s = point[metric]
    return float("nan") if s is None else 1e3 * s[q]


def _serving_title(runs: dict[str, dict[str, Any]]) -> str:
    doc = next(iter(runs.values()))
    m = doc["model"]
    cards = doc.get("cards") or ["CPU"]
    load = doc["load"]
    return (f"{m['preset']} ({m['parameters'] / 1e6:,.0f}M parameters) on {len(cards)} × {cards[0]}; prompts "
            f"{load['prompt_min']}–{load['prompt_max']}, outputs {load['output_min']}–{load['output_max']} tokens")


def _save(plt: Any, fig: Any, title: str, path: Path, fontsize: int) -> Path:
    """The figure's title over its plots, written as a PNG and closed."""
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_serving_latency(results_dir: Path, out_dir: Path) -> Path:
    """TTFT and ITL p50 / p99 against offered load, both configurations, with the SLO drawn."""
    plt = _pyplot()
    runs = _serving_runs(results_dir)
    slo = next(iter(runs.values()))["slo"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, name, bound in ((axes[0], "ttft_s", "TTFT", slo["ttft_s"]),
                                    (axes[1], "itl_s", "ITL", slo["tpot_s"])):
        for cfg, doc in runs.items():
            rates = [p["offered_rps"] for p in doc["points"]]
            for q, style in (("p50", "-o"), ("p99", "--s")):
                ax.plot(rates, [_stat(p, metric, q) for p in doc["points"]], style, color=SERVING_COLORS[cfg],
                        label=f"{SERVING_LABELS[cfg]} {q}")
        label = "SLO (TTFT)" if metric == "ttft_s" else "SLO (mean ITL per request)"
        ax.axhline(1e3 * bound, color="gray", linestyle=":", label=label)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{name} against load")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, _serving_title(runs), out_dir / "serving_latency.png", 9)


def plot_serving_goodput(results_dir: Path, out_dir: Path) -> Path:
    """Goodput (SLO met) and throughput against offered load, both configurations."""
    plt = _pyplot()
    runs = _serving_runs(results_dir)
    slo = next(iter(runs.values()))["slo"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    top = 0.0
    for cfg, doc in runs.items():
        rates = [p["offered_rps"] for p in doc["points"]]
        top = max(top, *rates)
        ax.plot(rates, [p["goodput_rps"] for p in doc["points"]], "-o", color=SERVING_COLORS[cfg],
                label=f"{SERVING_LABELS[cfg]} goodput")
        ax.plot(rates, [p["throughput_rps"] for p in doc["points"]], ":", color=SERVING_COLORS[cfg],
                label=f"{SERVING_LABELS[cfg]} throughput")
    ax.plot([0, top], [0, top], color="gray", linewidth=0.8, label="offered")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("requests/s")
    ax.set_title(f"goodput: TTFT ≤ {slo['ttft_s']:g} s and mean ITL ≤ {1e3 * slo['tpot_s']:g} ms", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, _serving_title(runs), out_dir / "serving_goodput.png", 8)


def _max_goodput(doc: dict[str, Any], ttft_s: float, tpot_s: float) -> float:
    """A configuration's max goodput over its rate points under (ttft_s, tpot_s), from the per-request records."""
    best = 0.0
    for p in doc["points"]:
        good = sum(1 for t, o in p["per_request"] if t is not None and o is not None and t <= ttft_s and o <= tpot_s)
        best = max(best, good / p["window_s"])
    return best


def plot_serving_slo_sweep(results_dir: Path, out_dir: Path) -> Path:
    """Max goodput of each configuration against the TPOT bound (the run's TTFT bound kept), and their ratio
    with the 2x goal drawn: where the comparison depends on the SLO, the whole curve."""
    plt = _pyplot()
    runs = _serving_runs(results_dir)
    if any(len(p.get("per_request", ())) != p["requests"] for doc in runs.values() for p in doc["points"]):
        raise ValueError(f"{results_dir}: expected per-request records in every rate point (older files lack them)")
    ttft_s = next(iter(runs.values()))["slo"]["ttft_s"]
    bounds_ms = [4.0 + 0.5 * i for i in range(93)]  # 4 .. 50 ms
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    goodput = {cfg: [_max_goodput(doc, ttft_s, b / 1e3) for b in bounds_ms] for cfg, doc in runs.items()}
    for cfg, ys in goodput.items():
        ax.plot(bounds_ms, ys, color=SERVING_COLORS[cfg], label=f"{SERVING_LABELS[cfg]} max goodput")
    ax.set_xlabel("TPOT SLO: mean ITL per request (ms)")
    ax.set_ylabel("max goodput over the sweep (requests/s)")
    ax.grid(True, alpha=0.3)
    lines, labels = ax.get_legend_handles_labels()
    if len(goodput) == 2:
        ratio = [d / a if a > 0 else float("nan") for a, d in zip(goodput["agg"], goodput["disagg"], strict=True)]
        ax2 = ax.twinx()
        ax2.plot(bounds_ms, ratio, color="black", linestyle="--", label="disagg / agg")
        ax2.axhline(2.0, color="gray", linestyle=":", label="goal 2x")
        ax2.set_ylabel("disagg / agg")
        ax2.set_yscale("log")
        from matplotlib.ticker import FuncFormatter
        for fmt in (ax2.yaxis.set_major_formatter, ax2.yaxis.set_minor_formatter):
            fmt(FuncFormatter(lambda v, _: f"{v:g}x"))
        more = ax2.get_legend_handles_labels()
        lines, labels = lines + more[0], labels + more[1]
    ax.legend(lines, labels, fontsize=8)
    ax.set_title(f"max goodput against the TPOT bound (TTFT ≤ {ttft_s:g} s)", fontsize=10)
    return _save(plt, fig, _serving_title(runs), out_dir / "serving_slo_sweep.png", 8)


@dataclass(frozen=True)
class Plot:
    # Any one of these files in the results directory is enough to draw the plot.
    needs_any: tuple[str, ...]
    draw: Callable[[Path, Path], Path]


PLOTS: tuple[Plot, ...] = (
    Plot(tuple(f"serving_{c}.json" for c in SERVING_CONFIGS), plot_serving_latency),
    Plot(tuple(f"serving_{c}.json" for c in SERVING_CONFIGS), plot_serving_goodput),
    Plot(tuple(f"serving_{c}.json" for c in SERVING_CONFIGS), plot_serving_slo_sweep),
)


def plot_all(results_dir: Path, out_dir: Path) -> list[Path]:
    """Draws every plot whose input files exist; returns the PNG paths."""
    if not results_dir.is_dir():
        raise ValueError(f"results_dir: expected a directory, got {results_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [p.draw(results_dir, out_dir) for p in PLOTS if any((results_dir / f).exists() for f in p.needs_any)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="PNG plots of the benchmark JSON files in a results directory")
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--out-dir", type=Path, default=None, help="where the PNGs go (default: results_dir)")
    a = ap.parse_args(argv)
    written = plot_all(a.results_dir, a.out_dir or a.results_dir)
    if not written:
        print(f"plot_results: no known result files in {a.results_dir}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
