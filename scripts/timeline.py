"""The contract at a glance: a step/slot timeline of a ``StepStager`` with ``max_concurrency=2``.

    python scripts/timeline.py [OUT.png]      (default: docs/timeline.png; needs matplotlib)

Three lanes over steps N to N+3: the host (staging each step in its slot, the guard's wait before
a slot is reused), the two slots (what each holds, and how long a staged tensor keeps its values),
and the device (the kernels that read a step's inputs, after its publication).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "docs" / "timeline.png"

STAGE = 1.6  # host time to stage a step (its `with stager.step()` block)
HOST = 1.0  # the host's other work per step (enqueueing the step's kernels)
READ = 3.6  # device time of the kernels that read a step's inputs: the device is the slower side
STEPS = 4
LANES = {"host": 3.0, "slot 0": 2.0, "slot 1": 1.0, "device": 0.0}
COLORS = ["#2a7ab9", "#e08a2c"]  # slot 0, slot 1


def schedule(steps: int = STEPS, slots: int = 2) -> list[dict[str, float]]:
    """When each step waits, stages, is published and is read: a step begins in its slot once the host
    is free and the step ``slots`` earlier is done on the device (the guard); its kernels follow
    the previous step's on one stream."""
    out: list[dict[str, float]] = []
    host = dev = 0.0
    for i in range(steps):
        ready = host
        begin = max(ready, out[i - slots]["read_end"]) if i >= slots else ready
        published = begin + STAGE
        read = max(published, dev)
        dev = read + READ
        host = published + HOST
        out.append({"ready": ready, "begin": begin, "published": published, "read": read, "read_end": dev})
    return out


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.0), dpi=120)
    sched = schedule()
    horizon = sched[-1]["read_end"] + 0.3
    for i, st in enumerate(sched):
        slot, color, name = i % 2, COLORS[i % 2], "N" if i == 0 else f"N+{i}"
        host = LANES["host"]
        if st["begin"] > st["ready"]:  # the guard: the slot's previous step is still read on the device
            ax.add_patch(plt.Rectangle((st["ready"], host - 0.3), st["begin"] - st["ready"], 0.6,
                                       color="#bbbbbb"))  # fmt: skip
            ax.text((st["ready"] + st["begin"]) / 2, host + 0.42, "guard\nwaits", ha="center", va="bottom",
                    fontsize=7)  # fmt: skip
        ax.add_patch(plt.Rectangle((st["begin"], host - 0.3), STAGE, 0.6, color=color))
        ax.text(st["begin"] + STAGE / 2, host, f"stage {name}", ha="center", va="center", fontsize=7,
                color="white")  # fmt: skip
        # valid from its publication until the step two later begins in the same slot
        end = sched[i + 2]["begin"] if i + 2 < len(sched) else horizon
        lane = LANES[f"slot {slot}"]
        ax.add_patch(plt.Rectangle((st["published"], lane - 0.25), end - st["published"], 0.5, color=color,
                                   alpha=0.35))  # fmt: skip
        ax.text(st["published"] + 0.1, lane, f"{name}'s tensors valid", va="center", fontsize=7)
        ax.annotate("", (st["published"], lane + 0.3), (st["published"], host - 0.32),
                    arrowprops={"arrowstyle": "->", "lw": 0.8})  # fmt: skip
        ax.add_patch(plt.Rectangle((st["read"], LANES["device"] - 0.3), READ, 0.6, color=color))
        ax.text(st["read"] + READ / 2, LANES["device"], f"kernels read {name}", ha="center", va="center",
                fontsize=7, color="white")  # fmt: skip
    ax.text(STAGE + 0.05, LANES["host"] - 0.62, "published: leaving `with stager.step()`", fontsize=7)
    ax.set_yticks(list(LANES.values()), list(LANES))
    ax.set_xticks([])
    ax.set_xlim(-0.2, horizon)
    ax.set_ylim(-0.6, 3.9)
    ax.set_xlabel("time →  (max_concurrency=2: two slots, used in turn)", fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title("Visibility, lifetime and the guard: a StepStager with two slots", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    draw(out)
    print(out)
