"""Routing under delay: the routing statistics of MoE runs, per setting, mean over seeds.

    python experiments/moe_routing.py RUN_FOLDER... --out docs/results/moe/routing

Reads every run under the folders (config.json + metrics.jsonl) with MoE blocks and writes
routing.md (a table per optimizer, balancer and schedule) and routing.png (MaxVio per step).
Per run, over its last ``--window`` logged steps:

- MaxVio: max over blocks of max(load)/mean(load) - 1 (0 is perfect balance);
- entropy: the router's entropy per token in nats (log 8 = 2.08 for 8 uniform experts);
- churn: how much the loads move from one step to the next, ½ Σₑ |shareₑ(t) - shareₑ(t-1)| (the
  share of assignments that changed expert), mean over blocks: an oscillating balancer churns;
- starved: experts below a quarter of their even share at the last step, over all blocks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from nobubble.config import names_in
from nobubble.runfolder.reading import saved_config


def load(run: Path) -> tuple[dict, list[dict]] | None:
    config = saved_config(run)  # any version's config.json, read as nobubble reads it
    if not config.get("moe_experts"):
        return None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return config, [r for r in rows if "moe_load" in r]


def label(config: dict) -> tuple[str, str, str]:
    balancer = "bias" if config.get("moe_bias_rate") else "aux loss"
    setup = config["schedule"] + ("+EF" if "ef" in names_in(config["correction"]) else "")
    return config["optim"], balancer, setup


def churn(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    moved = [sum(abs(x - y) for x, y in zip(a[k], b[k], strict=True)) / 2 for k in a]
    return statistics.mean(moved)


def summarize(rows: list[dict], window: int) -> dict[str, float]:
    tail = rows[-window:]
    last = rows[-1]["moe_load"]
    experts = len(next(iter(last.values())))
    return {
        "MaxVio": statistics.mean(r["moe_max_violation"] for r in tail),
        "entropy": statistics.mean(r["moe_entropy"] for r in tail),
        "churn": statistics.mean(
            churn(a["moe_load"], b["moe_load"]) for a, b in itertools.pairwise(tail)
        ),
        "starved": sum(share < 0.25 / experts for row in last.values() for share in row),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--window", type=int, default=50, help="last logged steps summarized")
    args = parser.parse_args()
    groups: dict[tuple[str, str, str], list[tuple[dict, list[dict]]]] = defaultdict(list)
    for folder in args.folders:
        for config_file in sorted(folder.rglob("config.json")):
            if (config_file.parent / "summary.json").exists():
                found = load(config_file.parent)
                if found:
                    groups[label(found[0])].append(found)
    if not groups:
        raise SystemExit("no finished MoE run under " + ", ".join(map(str, args.folders)))
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Routing under delay",
        "",
        f"Mean over seeds (± std) of each run's last {args.window} logged steps; starved: "
        "experts under a quarter of an even share at the last step, summed over blocks.",
        "",
        "| optimizer | balancer | schedule | seeds | MaxVio | entropy (nats) | churn | starved |",
        "|---|---|---|---:|---|---|---|---|",
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for key in sorted(groups):
        stats = [summarize(rows, args.window) for _, rows in groups[key]]

        def cell(name: str, digits: int, stats=stats) -> str:
            values = [s[name] for s in stats]
            spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
            return f"{statistics.mean(values):.{digits}f}{spread}"

        lines.append(
            f"| {' | '.join(key)} | {len(stats)} | {cell('MaxVio', 3)} | {cell('entropy', 3)} "
            f"| {cell('churn', 4)} | {cell('starved', 1)} |"
        )
        optim, balancer, setup = key
        steps = [r["step"] for r in groups[key][0][1]]
        per_step = [
            statistics.mean(rows[i]["moe_max_violation"] for _, rows in groups[key])
            for i in range(min(len(rows) for _, rows in groups[key]))
        ]
        ax = axes[0 if optim == sorted({k[0] for k in groups})[0] else 1]
        style = "-" if setup == "sync" else ("--" if setup == "2bw" else ":")
        ax.plot(steps[: len(per_step)], per_step, style, label=f"{balancer}, {setup}")
        ax.set_title(optim)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("MaxVio (mean over seeds)")
    fig.tight_layout()
    fig.savefig(args.out / "routing.png", dpi=110)
    (args.out / "routing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
