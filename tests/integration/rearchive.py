"""Re-archive a built .mar's files with the real `torch-model-archiver`, in another layout.

`--archive-format no-archive` writes a directory and `tgz` a `.tar.gz`; both are what TorchServe
users have in their stores, so the tests serve exactly what the archiver writes, not an
imitation of it. The archiver is the one installed beside this interpreter (the torchserve
wheels' `torch-model-archiver`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

ARCHIVER = Path(sys.executable).with_name("torch-model-archiver")


def unpack_mar(mar: Path, dest: Path) -> dict[str, object]:
    """Unzip `mar` into `dest`; its manifest's `model` entry."""
    with zipfile.ZipFile(mar) as zf:
        zf.extractall(dest)
    return json.loads((dest / "MAR-INF" / "MANIFEST.json").read_text())["model"]


def rearchive(
    mar: Path,
    export_dir: Path,
    model_name: str,
    archive_format: str,
    *,
    handler: Path | None = None,
    extra_files: Sequence[Path] = (),
    requirements_file: Path | None = None,
) -> Path:
    """The files of `mar` archived again as `model_name` in `archive_format` ("default", "tgz",
    "no-archive") into `export_dir`; the path the archiver wrote. `handler` replaces the
    archive's handler (the original then ships as an extra file)."""
    src = export_dir / f".src-{model_name}"
    shutil.rmtree(src, ignore_errors=True)
    model = unpack_mar(mar, src)
    named = {str(model[k]) for k in ("serializedFile", "handler", "configFile", "modelFile") if model.get(k)}
    extras = [p for p in sorted(src.iterdir()) if p.is_file() and p.name not in named]
    if handler is not None:
        extras.append(src / str(model["handler"]))
    cmd = [
        str(ARCHIVER),
        "--model-name",
        model_name,
        "--version",
        str(model.get("modelVersion", "1.0")),
        "--serialized-file",
        str(src / str(model["serializedFile"])),
        "--handler",
        str(handler or src / str(model["handler"])),
        "--extra-files",
        ",".join(str(p) for p in [*extras, *extra_files]),
        "--archive-format",
        archive_format,
        "--export-path",
        str(export_dir),
        "--force",
    ]
    if model.get("configFile"):
        cmd += ["--config-file", str(src / str(model["configFile"]))]
    if requirements_file is not None:
        cmd += ["--requirements-file", str(requirements_file)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    shutil.rmtree(src)
    suffix = {"default": ".mar", "tgz": ".tar.gz", "no-archive": ""}[archive_format]
    out = export_dir / f"{model_name}{suffix}"
    assert out.exists(), f"torch-model-archiver wrote no {out}"
    return out
