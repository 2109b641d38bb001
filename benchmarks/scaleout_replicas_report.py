"""``scaleout.py --replicas``: the plot (results/scaleout-replicas.png) and the lines printed (scaleout_replicas.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

CPU_GOAL, FLOOR_GOAL = 1.15, 2.5


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one, many, direct, hinted, n = result["one"], result["many"], result["direct"], result["hinted"], result["replicas"]
    sides = ((one, "1 replica", "#2f6db5"), (many, f"{n}, round_robin", "#3a923a"), (direct, f"{n}, direct to owner", "#9bc89b"),
             (hinted, f"{n}, owner hints", "#d9a441"))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), dpi=90)
    ax = axes[0]
    labels = ["scheduler(s)", "Postgres", "client", "fake workers"]
    keys = ["scheduler", "database", "client", "workers"]
    for j, (side, name, color) in enumerate(sides):
        values = [(side["cores"].get(k) or 0) / side["verbs_per_s"] * 1000 if side["verbs_per_s"] else 0 for k in keys]
        bars = ax.bar(np.arange(4) + (j - 1.5) * 0.2, values, width=0.19, color=color, label=name)
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(4), labels, fontsize=8)
    ax.set_ylabel("CPU ms per verb")
    r = result["ratios"]["scheduler_cpu_per_verb"] or 0
    h = result["ratios"]["hinted_scheduler_cpu_per_verb"] or 0
    ax.set_title(f"CPU per verb: schedulers {n} / 1 = {r:.2f}, with hints {h:.2f} (goal <= {CPU_GOAL})", fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[1]
    for x, (side, _, color) in enumerate(sides):
        ax.bar([x], [side["verbs_per_s"]], color=color, width=0.6)
        ax.plot([x] * len(side["samples_verbs_per_s"]), side["samples_verbs_per_s"], "k.", markersize=6)
        ax.text(x, side["verbs_per_s"], f"{side['verbs_per_s']:.0f}", ha="center", va="bottom", fontsize=9, fontweight="bold")
    ax.set_xticks([0, 1, 2, 3], ["1 replica", f"{n}, round_robin\n(forwarded {many['forwarded_fraction'] or 0:.2f})",
                                 f"{n}, direct\n(forwarded {direct['forwarded_fraction'] or 0:.2f})",
                                 f"{n}, hints\n(forwarded {hinted['forwarded_fraction'] or 0:.2f})"], fontsize=7)
    ax.set_ylabel("verbs/s answered")
    ax.set_title(f"verbs/s {n} / 1 = {result['ratios']['verbs_per_s'] or 0:.2f} (machine busy "
                 f"{one['machine_busy_fraction'] or 0:.2f} / {many['machine_busy_fraction'] or 0:.2f})", fontsize=9)

    f = result["failover"]
    ax = axes[2]
    gaps = sorted(g for g in f["next_answer_s"]["per_run"].values() if g is not None)
    ax.plot(range(1, len(gaps) + 1), gaps, "o-", color="#c8423a", markersize=3, label="runs of the killed replica")
    ax.axhline(f["goal_s"], linestyle=":", color="black", label=f"goal 2 x lease ({f['goal_s']:.1f} s)")
    ax.axhline(f["lease_seconds"], linestyle="--", color="grey", label=f"lease {f['lease_seconds']:.1f} s")
    if f["lanes_taken_s"] is not None:
        ax.axhline(f["lanes_taken_s"], linestyle="-.", color="#2f6db5", label=f"lanes taken {f['lanes_taken_s']:.2f} s")
    ax.set_xlabel("runs, sorted")
    ax.set_ylabel("s from SIGKILL to next answer")
    ax.set_title(f"failover: {len(f['lanes'])} lanes, {f['runs']} runs, max {f['next_answer_s']['max'] or 0:.2f} s", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"Temper scheduler replicas (instant fake trainers, reps {result['config']['reps']}, "
                 f"{result['config']['cpu_count']} CPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(result: dict) -> None:
    one, many, r, f, n = result["one"], result["many"], result["ratios"], result["failover"], result["replicas"]
    for name, side in (("1 replica", one), (f"{n} replicas", many), (f"{n} direct", result["direct"]), (f"{n} hinted", result["hinted"])):
        c = side["cores"]
        print(f"{name:11s} {side['verbs_per_s']:7.0f} verbs/s  scheduler {side['scheduler_cpu_ms_per_verb'] or 0:.3f} ms/verb  "
              f"Postgres {side['database_cpu_ms_per_verb'] or 0:.3f} ms/verb  cores: scheduler {c['scheduler'] or 0:.2f}, "
              f"Postgres {c['database'] or 0:.2f}, client {c['client'] or 0:.2f}, workers {c['workers'] or 0:.2f}; "
              f"machine busy {side['machine_busy_fraction'] or 0:.2f}", file=sys.stderr)
    print(f"scheduler CPU per verb {n} / 1: {r['scheduler_cpu_per_verb'] or 0:.2f} (goal <= {CPU_GOAL}: "
          f"{'met' if result['goals']['scheduler_cpu_per_verb']['met'] else 'MISSED'}; sent straight to the owner: "
          f"{r['direct_scheduler_cpu_per_verb'] or 0:.2f}; round_robin with owner hints: {r['hinted_scheduler_cpu_per_verb'] or 0:.2f}, "
          f"forwarded {result['hinted']['forwarded_fraction'] or 0:.3f}); verbs/s {n} / 1: {r['verbs_per_s'] or 0:.2f}; "
          f"forwarded {many['forwarded_fraction'] or 0:.2f} of verbs (round_robin expects {many['expected_forwarded_fraction']:.2f})",
          file=sys.stderr)
    print(f"one scheduler / durable floor CPU per verb: {r['one_scheduler_cpu_per_verb_over_durable_floor'] or 0:.2f} "
          f"(goal <= {FLOOR_GOAL}); extra scheduler CPU per forwarded verb {r['extra_scheduler_cpu_ms_per_forwarded_verb'] or 0:.3f} ms "
          f"(the bare gRPC server: {result['grpc_floor_cpu_ms_per_verb'] or 0:.3f} ms per verb)", file=sys.stderr)
    print(f"failover: SIGKILL of {f['killed']} ({len(f['lanes'])} lanes, {f['runs']} runs): lanes taken after "
          f"{f['lanes_taken_s'] or 0:.2f} s, next answer median {f['next_answer_s']['median'] or 0:.2f} s, max "
          f"{f['next_answer_s']['max'] or 0:.2f} s (lease {f['lease_seconds']} s, goal <= {f['goal_s']:.1f}: "
          f"{'met' if f['goal_met'] else 'MISSED'}; {f['unanswered_runs']} runs unanswered)", file=sys.stderr)
    if result["errors"]["count"]:
        print(f"{result['errors']['count']} verbs failed, e.g. {result['errors']['first'][:3]}", file=sys.stderr)
