"""Install the project's top-level folders under one import name, `mariner`, with its gRPC stubs.

The folders stay where a newcomer expects them (server/, client/, ...), but installed they are
`mariner.server`, `mariner.client`, ..., so they never collide with another distribution's
`server` or `client` package in site-packages. Everything else is in pyproject.toml.

The gRPC stubs (`mariner.server._proto`) are build products, never committed: every build
generates them from proto/ first (grpcio-tools is a build requirement in pyproject.toml), so
`pip install .`, `pip install git+...`, `python -m build` and an editable install all give a
`mariner serve` that starts. Generation is skipped when the stubs are fresh, and when there is no
proto/ (a build from an sdist made without it: its stubs came with it).
"""

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
FOLDERS = ("server", "client", "training", "loadtest", "handlers")


def generate_stubs() -> None:
    """Run server/protogen.py from the source tree (the package is not importable yet)."""
    if not (ROOT / "proto").is_dir():
        return
    spec = importlib.util.spec_from_file_location("_mariner_protogen", ROOT / "server" / "protogen.py")
    if spec is None or spec.loader is None:
        raise SystemExit("server/protogen.py is missing: the sources are incomplete")
    protogen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(protogen)
    try:
        protogen.generate()  # a no-op when the stubs are fresh
    except ImportError as exc:  # grpc_tools: a build without build isolation and without it
        raise SystemExit(
            f"building mariner generates its gRPC stubs and needs grpcio-tools ({exc}): build with "
            "pip's build isolation (the default), or `pip install grpcio-tools` first"
        ) from None


generate_stubs()  # before the packages are listed: mariner.server._proto is one of them
package_dir = {f"mariner.{folder}": folder for folder in FOLDERS}
packages = [
    name
    for folder in FOLDERS
    for name in [f"mariner.{folder}", *(f"mariner.{folder}.{sub}" for sub in find_packages(folder))]
]

setup(packages=packages, package_dir=package_dir)
