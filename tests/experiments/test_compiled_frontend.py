"""The compiled-frontend experiment (mariner.loadtest.experiments.compiled_frontend): mypyc really
compiles a module of a worktree of HEAD in place, the build imports the extension and it answers
as the source does, the classes the listener subclasses are marked, and nothing is left behind.

The whole list of hot modules takes about a minute of compiling; one small module proves the
path. Nothing here asserts a speed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mariner.loadtest.experiments import compiled_frontend as cf
from mariner.loadtest.experiments.ab_live import checkout, imported_from, path_first
from mariner.loadtest.servers.mariner import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None


@pytest.mark.skipif(NO_COMPILER, reason="mypyc needs a C compiler (cc or gcc) and none is installed")
def test_a_compiled_module_of_the_worktree_is_what_the_build_imports_and_answers_alike() -> None:
    module = "server/common/raw_headers.py"
    with checkout("HEAD") as path:
        tree = (path / "mariner").resolve()
        cf.compile_in_place(path, [module])
        origin = imported_from(path, "mariner.server.common.raw_headers")
        assert origin.endswith(".so")
        assert Path(origin).resolve().is_relative_to(tree)
        code = (
            "from mariner.server.common.raw_headers import first_header as f\n"
            "print(f([(b'a', b'1'), (b'b', b'2'), (b'b', b'3')], b'b'), f([], b'a'))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=path_first(path), capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == ["b'2'", "None"]
    assert not tree.exists()  # the worktree and its extensions are gone
    assert not list(Path(REPO, "server", "common").glob("raw_headers*.so"))  # nothing here


def test_the_classes_the_listener_subclasses_are_marked_for_interpreted_subclasses(tmp_path: Path) -> None:
    for rel, name in cf.SUBCLASSED.items():
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(REPO, rel), target)
        cf.open_to_subclasses(tmp_path, rel, name)
        text = target.read_text()
        assert f"@mypyc_attr(allow_interpreted_subclasses=True)\nclass {name}(" in text
        assert "from mypy_extensions import mypyc_attr" in text
        compile(text, str(target), "exec")  # still Python
    with pytest.raises(RuntimeError, match="no class Missing to mark"):
        cf.open_to_subclasses(tmp_path, "server/common/http_limits.py", "Missing")


def test_every_hot_module_exists() -> None:
    for rel in (*cf.HOT_MODULES, *cf.SUBCLASSED):
        assert Path(REPO, rel).is_file(), rel
