# syntax=docker/dockerfile:1
#
# Mariner, CPU image: `mariner serve` as a non-root user, nothing to compile at run time.
#
#   docker build -t mariner:0.1.0 .                                   # the server (last stage)
#   docker build --target models -t mariner-models:0.1.0 .           # the model image (see below)
#   make image                                                        # both, with podman, no registry
#
# The server reads /etc/mariner/mariner.yaml (MARINER_CONFIG_FILE): the same file the Kubernetes
# ConfigMap carries (k8s/base/mariner.yaml), so `docker run` behaves like the pod: it listens on
# 0.0.0.0 and needs bearer tokens. Without them it refuses to start and says so. Mount token files
# (one token per line, readable by uid 10001) over /var/run/secrets/mariner:
#   docker run --rm -p 8080:8080 -p 7070:7070 -v "$PWD/model_store:/models:ro" \
#     -v "$PWD/tokens:/var/run/secrets/mariner:ro" mariner:0.1.0
# For a local experiment only, `-e MARINER_INSECURE=true` with `-p 127.0.0.1:8080:8080` serves without
# tokens. The GPU image is Dockerfile.gpu; docs/deploy.md has the whole story.
#
# Base images are build arguments. The defaults are public images for anyone with a registry;
# `make image` passes a Debian 12 base made locally (scripts/image_base.sh: python3 3.11 with venv,
# ca-certificates, useradd, as python:3.11-slim has them), so the Dockerfile uses only what both
# provide: `python3`, `python3 -m venv`, groupadd/useradd, cp.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG MODELS_BASE_IMAGE=busybox:1.37.0

# -- models: only the archives and index.json (their sha256, checked with pin_index). Kept out of the
# server image so a new model version is a new model image, rolled out without a new server build;
# the Deployment's initContainer copies /models into the pod (the base only needs `cp`).
FROM ${MODELS_BASE_IMAGE} AS models
COPY model_store/ /models/

# -- build: a virtualenv holding the pinned serving set (no extras) and the generated gRPC stubs.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Where pip finds packages, as the machine building the image has it configured (its PIP_* variables
# and pip.conf do not reach inside a build). Unset by default: pip's own defaults (PyPI). `make image`
# reads the host's settings and passes them, mounting any local wheel directory or index read-only for
# the build only; nothing of it is written into the image's filesystem.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first, from the CPU wheel index: for Linux x86_64 the default index serves a CUDA build of
# several GB. pyproject.toml pins the same version (a test keeps the two in step), so the install
# below finds it satisfied. An empty TORCH_INDEX_URL means "the indexes configured above" (`make
# image` passes it empty: the machine's own find-links hold the CPU wheel).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torchvision comes beside it from the same index (pyproject's `vision` extra, same pin: 0.28.0
# requires torch==2.13.0): there, a CPU build with its C ops. From the registry (`make image`)
# it is the CUDA build, whose C ops cannot load beside the CPU torch: the worker then runs nms on
# a pure-torch kernel (server/worker/torchvision_ops.py; docs/torchserve-torchvision.md).
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0 torchvision==0.28.0
# The whole build context (.dockerignore trims it to sources): every package pyproject.toml
# includes comes along without being listed here.
COPY . .
# The gRPC stubs are generated first, into server/_proto, by grpcio-tools (pyproject's `protogen`
# extra, same pin) in a throwaway virtualenv: the generator is a build tool, and /opt/venv, which the
# runtime stage copies, must not carry it. protogen.py needs only the standard library and
# grpc_tools, so it runs from the source tree. Then `pip install .` (the serving set, no extras)
# installs the package with its stubs.
ARG GRPCIO_TOOLS=grpcio-tools==1.85.1
RUN python3 -m venv /opt/protogen \
 && /opt/protogen/bin/pip install "${GRPCIO_TOOLS}" \
 && /opt/protogen/bin/python server/protogen.py \
 && pip install .
# The rest of pyproject's `vision` extra, same pins: TorchServe's vision handlers import captum
# (vision_handler.py), and captum imports matplotlib. Not `pip install .[vision]`: torchvision
# must stay the build taken from the torch index above.
ARG CAPTUM=captum==0.9.0
ARG MATPLOTLIB=matplotlib==3.11.2
RUN pip install "${CAPTUM}" "${MATPLOTLIB}"
# What serving never reads leaves the virtualenv before the runtime stage copies it (scripts/
# image_trim.sh says what and why, and keeps the bytecode: the root filesystem is read-only in the
# pod, so what is not compiled here is compiled again on every start).
RUN sh scripts/image_trim.sh /opt/venv

# -- runtime: the interpreter, the virtualenv and a user. No compiler, no pip install.
# The token files mariner.yaml names exist as placeholders holding no token (a comment line), so
# the baked-in config loads and a container started without the Secret stops with the server's
# "refusing to listen beyond loopback without authentication" message instead of a missing file;
# `-e MARINER_INSECURE=true` works too. Kubernetes mounts the Secret over the directory.
FROM ${PYTHON_IMAGE} AS runtime
# A numeric uid: the kubelet can only prove runAsNonRoot for a numeric USER (the pod also sets it).
RUN groupadd --system --gid 10001 mariner \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mariner \
 && mkdir -p /models /var/lib/mariner/work /var/run/secrets/mariner \
 && chown 10001:10001 /var/lib/mariner/work && chmod 700 /var/lib/mariner/work \
 && printf '%s\n' '# No token: mount the mariner-tokens Secret (one token per line) over this directory.' \
        | tee /var/run/secrets/mariner/inference /var/run/secrets/mariner/management > /dev/null
COPY --from=build /opt/venv /opt/venv
COPY k8s/base/mariner.yaml /etc/mariner/mariner.yaml
# HOME and TMPDIR point at /tmp: the pod runs with a read-only root filesystem and mounts an emptyDir
# there, which is where torch and friends put their caches.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    MARINER_CONFIG_FILE=/etc/mariner/mariner.yaml
USER 10001:10001
# TorchServe's defaults: HTTP inference, management, metrics; gRPC inference, management.
EXPOSE 8080 8081 8082 7070 7071
ENTRYPOINT ["mariner", "serve"]
