"""The live A/B tool (mariner.loadtest.experiments.ab_live): the base build really is served from
a worktree of the ref, both builds answer a short closed loop, the report has a row per build
with CPU by process role, and the worktree is gone afterwards.

Nothing here asserts a speed: the figures must exist, not favour either build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mariner.loadtest.experiments import ab_live

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def worktrees() -> str:
    listing = ["git", "-C", str(REPO), "worktree", "list"]
    return subprocess.run(listing, capture_output=True, text=True, check=True).stdout


def test_the_base_build_imports_mariner_from_its_worktree() -> None:
    with ab_live.checkout("HEAD") as path:
        tree = (path / "mariner").resolve()
        origin = subprocess.run(
            [sys.executable, "-c", "import mariner.server.frontend.batcher as m; print(m.__file__)"],
            env={**os.environ, "PYTHONPATH": str(path)}, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert Path(origin).resolve().is_relative_to(tree)
        assert (tree / "server" / "_proto").is_dir()  # the generated stubs came along
        assert str(tree) in worktrees()
    assert str(tree) not in worktrees()
    assert not tree.exists()


def test_two_builds_answer_and_the_report_has_both_with_cpu_by_role(
    model_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = worktrees()
    ab_live.main(["--base", "HEAD", "--rounds", "2", "--seconds", "1", "--clients", "4",
                  "--model-store", str(model_store)])  # fmt: skip
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    header = [h.strip() for h in rows["build"]]
    for name in ("base", "new"):
        cells = dict(zip(header, (c.strip() for c in rows[name]), strict=True))
        assert float(cells["req/s"].replace(",", "")) > 0
        assert float(cells["frontend µs/req"]) > 0
        assert float(cells["worker µs/req"]) > 0
    assert out.count(" round ") == 4  # each build once per round
    assert "new / base, median of the rounds: throughput" in out
    assert worktrees() == before
