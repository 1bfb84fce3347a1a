"""What every benchmark writes: JSON results, a Markdown table, a plot, the machine."""

from __future__ import annotations

import json
import os
import platform
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlease.replay.report import percentile


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def stats(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": mean(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values, default=0.0),
    }


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """`names` starting at the `round_`-th, wrapping: over rounds, each goes first in turn."""
    i = round_ % len(names)
    return [*names[i:], *names[:i]]


def shuffled(names: Sequence[str], round_: int) -> list[str]:
    """`names` in a seeded order of their own each round. Rotating keeps every way's
    neighbours, and a way played right after a stock way runs kvlease's code cold, round
    after round: bench/policy.py's kvlease with telemetry on read 1.10x the wall of
    kvlease with it off when it came right after stock PRIORITY, 1.04x with the two
    swapped. Shuffled, each way meets a different predecessor each round."""
    return random.Random(round_).sample(list(names), len(names))


def write(out: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    (out / f"{name}.md").write_text(f"Machine: {result['machine']}\n\n{markdown}")


def hit_cell(hit: float | None, bound: float | None) -> str:
    """A leased next-turn hit, and in brackets its share of what the caps allow."""
    if hit is None:
        return "-"
    return f"{hit:.0%} ({hit / bound:.0%})" if bound else f"{hit:.0%}"


# The leased hit's bounds the tables can show it against (bench/policy.py's summarize)
BOUNDS = {
    "leased_prefix_cap_bound": "of what the caps allow",
    "leased_prefix_shared_bound": "of a clairvoyant reservation's",
}


def ablation_rows(
    ways: dict[str, dict[str, Any]],
    order: Sequence[str],
    seconds: str | None,
    title: str,
    tiers: Sequence[str],
    preemptions: bool = False,
    bound: str = "leased_prefix_cap_bound",
    paired: str | None = None,
) -> list[str]:
    """The ablation table (bench/policy.py on the real engine, bench/ablations.py at
    scale, bench/frontier.py per setting): per way, steps, `seconds` (headed `title`; None:
    no such column), wasted prefill, premium TTFT, the leased hit of the two leasing tiers
    (and its share of `bound`, one of BOUNDS) and the lowest tier's worst TTFT, each
    against stock PRIORITY (`ways["priority"]`); `preemptions` adds their count. `paired`:
    the key of each way's own ratio for the `seconds` column (bench/policy.py's median of
    the rounds' ratios), else the ratio of the two figures."""
    top, bottom = tiers[0], tiers[-1]
    base = ways["priority"]
    timed = [] if seconds is None else [seconds]
    lines = [
        "| way | engine steps | "
        + "".join(f"{title} | " for _ in timed)
        + "wasted prefill | premium TTFT steps mean / p99 | leased hit premium / standard "
        f"({BOUNDS[bound]}) | free worst TTFT steps |" + (" preemptions |" if preemptions else ""),
        "|---|---|" + "---|" * len(timed) + "---|---|---|---|" + ("---|" if preemptions else ""),
    ]
    for way in order:
        w = ways[way]
        t = w["tiers"]
        hits = [
            hit_cell(t.get(tier, {}).get("leased_prefix_hit"), t.get(tier, {}).get(bound))
            for tier in tiers[:2]
        ]
        ratio = {
            key: w[key] / max(1e-9, base[key])
            for key in ("engine_steps", *timed, "wasted_prefill_tokens")
        }
        if paired is not None and timed:
            ratio[timed[0]] = w[paired]
        prem, free = t[top]["ttft_steps"], t[bottom]["ttft_steps"]
        free_ratio = free["max"] / max(1e-9, base["tiers"][bottom]["ttft_steps"]["max"])
        line = (
            f"| {way} | {w['engine_steps']:,} ({ratio['engine_steps']:.2f}x) "
            + "".join(f"| {w[key]:,.2f} ({ratio[key]:.2f}x) " for key in timed)
            + f"| {w['wasted_prefill_tokens']:,} ({ratio['wasted_prefill_tokens']:.2f}x) "
            f"| {prem['mean']:.1f} / {prem['p99']:.0f} | {' / '.join(hits)} "
            f"| {free['max']:,.0f} ({free_ratio:.2f}x) |"
        )
        if preemptions:
            line += f" {sum(v['preemptions'] for v in t.values()):,} |"
        lines.append(line)
    return lines


def targets_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| target | wanted | measured | met |", "|---|---|---|---|"]
    for row in rows:
        value = row["measured"]
        shown = "-" if value is None else f"{value:.3g}" if isinstance(value, float) else value
        if "range" in row:  # the repeats' spread around a median
            shown += " ({:.3g}-{:.3g})".format(*row["range"])
        lines.append(
            f"| {row['target']} | {row['wanted']} | {shown} | {'yes' if row['met'] else 'no'} |"
        )
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_ttft(path: Path, ways: dict[str, dict], tiers: Sequence[str]) -> None:
    """Mean and worst TTFT in engine steps, per tier, one bar group per way."""
    plt = _pyplot()
    names = [w for w in ("alone", "fcfs", "priority", "kvlease") if w in ways]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    width = 0.8 / len(names)
    for ax, key in zip(axes, ("mean", "max"), strict=True):
        for i, way in enumerate(names):
            per_tier = ways[way]["tiers"]
            values = [per_tier[t]["ttft_steps"][key] if t in per_tier else 0 for t in tiers]
            ax.bar([x + i * width for x in range(len(tiers))], values, width, label=way)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(tiers))], tiers)
        ax.set_title(f"TTFT, {key} (engine steps)")
        ax.set_yscale("symlog", linthresh=1)  # linear below 1 step: 0 is a real value
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(path: Path, ways: dict[str, dict], names: Sequence[str], tier: str) -> None:
    """The reservation's trade: `tier`'s leased next-turn prefix hit against the engine
    steps (as a ratio to stock PRIORITY's), one point per way."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for way, x, y in _frontier_points(ways, names, tier):
        ax.plot([x], [y], marker="o")
        ax.annotate(way, (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set_title(f"Leased {tier} next-turn prefix hit against engine steps")
    ax.set_xlabel("engine steps / stock PRIORITY's")
    ax.set_ylabel("prefix hit, %")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier_pools(
    path: Path, pools: dict[str, dict[str, dict]], tiers: Sequence[str]
) -> None:
    """`plot_frontier` for every pool side by side, each of `tiers` a series: the leased
    next-turn prefix hit against the engine steps (to stock PRIORITY's), one point per way
    but PRIORITY, each labelled."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(pools), figsize=(6 * len(pools), 4), squeeze=False)
    for ax, (pool, ways) in zip(axes[0], pools.items(), strict=True):
        names = [way for way in ways if way != "priority"]
        for tier in tiers:
            points = _frontier_points(ways, names, tier)
            ax.plot([x for _, x, _ in points], [y for _, _, y in points], "o", label=tier)
            for way, x, y in points:
                ax.annotate(way, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_title(f"{pool} blocks")
        ax.set_xlabel("engine steps / stock PRIORITY's")
        ax.set_ylabel("leased next-turn prefix hit, %")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _frontier_points(
    ways: dict[str, dict], names: Sequence[str], tier: str
) -> list[tuple[str, float, float]]:
    """(way, engine steps / stock PRIORITY's, `tier`'s leased hit in %) for each of
    `names` where the tier had leased next turns."""
    base = ways["priority"]["engine_steps"]
    return [
        (way, ways[way]["engine_steps"] / base, hit * 100)
        for way in names
        if (hit := ways[way]["tiers"].get(tier, {}).get("leased_prefix_hit")) is not None
    ]


def plot_lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[list, list]],
    targets: dict[str, float] | None = None,
) -> None:
    """One line per series; `targets` (label -> value) as dashed horizontal lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    for label, value in (targets or {}).items():
        ax.axhline(value, linestyle="--", linewidth=1, color="grey")
        ax.annotate(label, (0, value), xycoords=("axes fraction", "data"), xytext=(4, 2),
                    textcoords="offset points", fontsize=8, color="grey")  # fmt: skip
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
