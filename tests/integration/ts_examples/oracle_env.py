"""What stock TorchServe's Python processes get beyond the venv: Mariner's torchvision shim, only.

The registry's torchvision wheel is built for CUDA torch; beside the pinned CPU torch,
`import torchvision` dies ("operator torchvision::nms does not exist"), so on stock TorchServe
every vision handler (the MNIST example, the built-in `image_classifier`) would fail to load and
the oracle would say nothing about them. Mariner's workers make torchvision importable with
`mariner.server.worker.torchvision_ops` (pure-torch nms/qnms, nothing else). The same shim is
given to the oracle as a `sitecustomize` on PYTHONPATH that runs it right before torchvision is
first imported; TorchServe's own code and the handlers are untouched.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SITECUSTOMIZE = '''\
"""Written by the drop-in suite: Mariner's torchvision shim, run before torchvision is imported."""
import importlib.abc
import sys


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            from mariner.server.worker.torchvision_ops import ensure_torchvision_importable

            ensure_torchvision_importable()
        return None


sys.meta_path.insert(0, _BeforeTorchvision())
'''


@cache
def shim_dir() -> Path:
    """A private directory holding that sitecustomize.py, removed at interpreter exit."""
    path = Path(tempfile.mkdtemp(prefix="ts-oracle-site-"))
    (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    atexit.register(shutil.rmtree, path, True)
    return path


def pythonpath(existing: str | None) -> str:
    """PYTHONPATH for the oracle's processes: the shim first, then the repository (so the shim's
    `mariner` import resolves even outside an editable install), then what was there."""
    parts = [str(shim_dir()), str(REPO), *([existing] if existing else [])]
    return ":".join(parts)
