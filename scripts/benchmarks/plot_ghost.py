"""Per-user cost of the wide CNN's owner reply, before and after (pair 2 of update 2 in
docs/results/ghost/README.md): ``python scripts/benchmarks/plot_ghost.py`` writes
docs/results/ghost/channels_last/per_user_cost.png from that folder's bench4 files (packed in
docs/results/ghost/raw.jsonl: ``channels_last/bench4_*.jsonl``, read through
scripts/tools/results_archive.py)."""

import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import results_archive  # noqa: E402  (scripts/tools/: the folder's raw.jsonl)

GHOST = Path(__file__).resolve().parents[2] / "docs" / "results" / "ghost"
HERE = GHOST / "channels_last"
before = results_archive.load_member(GHOST, "channels_last/bench4_before_277621a.jsonl")
after = results_archive.load_member(GHOST, "channels_last/bench4_after_e150d50.jsonl")
sides = [
    ("old path, before (277621a)", before, "old", "#b2182b"),
    ("ghost, before (277621a)", before, "ghost", "#ef8a62"),
    ("ghost, after (e150d50)", after, "ghost", "#2166ac"),
    ("non-private pass, NCHW, chunks of 512", after, "plain", "#999999"),
    ("non-private pass, channels-last, chunks of 128", after, "floor", "#4d4d4d"),
]
labels = [f"{r['users']:,} users x {r['records_per_user']}" for r in before]
fig, ax = plt.subplots(figsize=(8, 4.2))
w = 0.16
for i, (name, recs, key, color) in enumerate(sides):
    ms = [1e3 * statistics.median(r["times"][key]) / r["users"] for r in recs]
    xs = [j + (i - 2) * w for j in range(len(recs))]
    ax.bar(xs, ms, w, label=name, color=color)
    for x, m in zip(xs, ms):
        ax.text(x, m, f"{m:.2f}", ha="center", va="bottom", fontsize=6.5)
ax.set_xticks(range(len(labels)), labels)
ax.set_ylabel("ms per user (median of 5; old path at 10,000 users: 2)")
ax.set_title("Wide CNN (857,738 parameters), clip + Gaussian owner reply, one thread")
ax.legend(fontsize=7, loc="upper left")
fig.tight_layout()
fig.savefig(HERE / "per_user_cost.png", dpi=120)
