"""The variant table as markdown and as a PNG chart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mariner.training.verify import Verification


def markdown_table(rows: Sequence[Verification]) -> str:
    head = (
        "| variant | format | built for | max abs dlogit | top-1 agree | accuracy | size (KiB) "
        "| p50 b=1 (ms) | p50 b=32 (ms) | tolerance | ok |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|\n"
    )
    lines = [
        f"| {r.variant} | {r.format} | {r.target} "
        f"| {r.max_abs_logit_diff:.2e} | {r.top1_agreement * 100:.2f}% "
        f"| {r.accuracy * 100:.2f}% | {r.file_bytes / 1024:.0f} | {r.latency_b1_ms:.3f} "
        f"| {r.latency_b32_ms:.3f} | {r.tolerance} | {'yes' if r.passed else 'NO'} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def write_chart(rows: Sequence[Verification], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.variant for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    pos = range(len(rows))
    width = 0.4
    axes[0].bar([p - width / 2 for p in pos], [r.latency_b1_ms for r in rows], width, label="batch 1")
    axes[0].bar([p + width / 2 for p in pos], [r.latency_b32_ms for r in rows], width, label="batch 32")
    axes[0].set_ylabel("median latency (ms)")
    axes[0].legend()
    axes[1].bar(pos, [max(r.max_abs_logit_diff, 1e-9) for r in rows], color="tab:purple")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("max |logit - eager logit|")
    axes[2].bar(pos, [r.accuracy * 100 for r in rows], color="tab:green")
    axes[2].set_ylim(min(r.accuracy * 100 for r in rows) - 2, 100)
    axes[2].set_ylabel("test accuracy (%)")
    for ax in axes:
        ax.set_xticks(list(pos))
        ax.set_xticklabels(names, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Digits CNN variants vs eager (CPU, this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
