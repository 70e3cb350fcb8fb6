"""Install the project's top-level folders under one import name, `mariner`.

The folders stay where a newcomer expects them (server/, client/, ...), but installed they are
`mariner.server`, `mariner.client`, ..., so they never collide with another distribution's
`server` or `client` package in site-packages. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("server", "client", "training", "loadtest", "handlers")

package_dir = {f"mariner.{folder}": folder for folder in FOLDERS}
packages = [
    name
    for folder in FOLDERS
    for name in [f"mariner.{folder}", *(f"mariner.{folder}.{sub}" for sub in find_packages(folder))]
]

setup(packages=packages, package_dir=package_dir)
