"""The side-by-side table: every call, both answers, same or not (printed and build/dropin/report.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.integration.ts_examples.calls import Answer
from tests.integration.ts_examples.compare import Verdict


@dataclass(frozen=True)
class Row:
    call_id: str
    pair: str
    archive: str
    label: str
    torchserve: Answer
    mariner: Answer
    verdict: Verdict


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _deliberate(r: Row) -> bool:
    return r.verdict.same and r.verdict.why.startswith("deliberate: ")


def render(rows: list[Row], preamble: list[str]) -> str:
    deliberate = sum(_deliberate(r) for r in rows)
    same = sum(r.verdict.same for r in rows) - deliberate
    lines = [
        "# Stock TorchServe 0.12 vs Mariner: the same calls, side by side",
        "",
        *preamble,
        "",
        f"{same} of {len(rows)} calls answered the same; {deliberate} differ as docs/torchserve.md "
        f"documents; {len(rows) - same - deliberate} differ otherwise.",
        "",
        "| pair | archive | call | TorchServe | Mariner | same? |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = r.verdict.why if _deliberate(r) else "yes" if r.verdict.same else f"**no**: {r.verdict.why}"
        lines.append(
            f"| {r.pair} | {r.archive} | {_cell(r.label)} "
            f"| {_cell(r.torchserve.status)} {_cell(r.torchserve.text())} "
            f"| {_cell(r.mariner.status)} {_cell(r.mariner.text())} | {_cell(mark)} |"
        )
    return "\n".join(lines) + "\n"


def render_plain(rows: list[Row]) -> list[str]:
    """One short line per call for the terminal."""
    out = []
    for r in rows:
        mark = "DOC" if _deliberate(r) else "same" if r.verdict.same else "DIFF"
        out.append(f"{mark:4} {r.call_id}: TS {r.torchserve.status} {r.torchserve.text(70)}")
        if not r.verdict.same:
            out.append(f"{'':4} {'':{len(r.call_id)}}  MA {r.mariner.status} {r.mariner.text(70)}")
    return out


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
