#!/bin/sh
# Trim a virtualenv for the runtime image: remove what serving never reads.
#
# Run in the images' build stage (Dockerfile, Dockerfile.gpu) on /opt/venv after `pip install .`,
# before the runtime stage copies it. POSIX sh: the build stage may have no bash.
#   - pip and setuptools: the runtime stage installs nothing (pip cache is off during the build).
#   - torch/include and other C/C++ headers: they serve compiling extensions and torch.compile's C++,
#     which needs a compiler the images deliberately lack.
#   - packages' own test suites (`tests` directories): never imported by the serving path.
#   - TorchServe's Java frontend (ts/frontend/model-server.jar, ~46 MB) and the `torchserve` script
#     that starts it: Mariner imports only ts's Python handler library, and the image has no Java.
#     `torchserve` then names Mariner's own launcher (`mariner-torchserve`: TorchServe's command line).
#     `wheel` (which the torchserve wheel declares) is a packaging tool, like pip.
# Bytecode (__pycache__) stays: the pod's root filesystem is read-only, so anything not compiled here
# would be compiled again from source on every start (seconds of torch/transformers imports).
set -eu
venv=${1:?usage: image_trim.sh VENV}
site=$(echo "$venv"/lib/python3*/site-packages)
[ -d "$site" ] || { echo "image_trim: no site-packages under $venv" >&2; exit 1; }
before=$(du -sm "$venv" | cut -f1)

"$venv/bin/python" -m pip uninstall -q -y pip setuptools wheel 2> /dev/null || true
rm -rf "$site/ts/frontend" "$venv/bin/torchserve"
# `torchserve` is Mariner's launcher instead (TorchServe's command line; server/compat/torchserve/command.py).
ln -s mariner-torchserve "$venv/bin/torchserve"
rm -rf "$site/torch/include"
find "$site" -depth -type d -name tests -prune -exec rm -rf {} +
find "$site" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' \) -delete

after=$(du -sm "$venv" | cut -f1)
echo "image_trim: $venv ${before} MB -> ${after} MB"
