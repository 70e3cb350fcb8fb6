"""Values that cross process boundaries between the supervisor, frontends and model workers.

The supervisor opens and checks each archive (workers unpack nothing), resolves the model's
settings and starts `WorkerSpec.min_workers` worker processes per model version; each worker
serves batches on a Unix socket (`WorkerSpec.socket_path`) to every frontend that connects.
Frontends learn where the workers are from `ModelEntry`s the supervisor sends them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mariner.server.contracts.types import instance_id


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs to load its model instance; nothing else is shared.

    `model_dir` is the archive's unpacked directory (the supervisor unpacked and checked it);
    the worker puts only that directory on its `sys.path`. `gpu_id` None means CPU.
    `require_gpu`: the worker refuses to load without a usable GPU instead of running on the CPU.
    """

    model: str
    version: str
    instance: int
    generation: int
    model_dir: str
    archive_file: str
    sha256: str
    manifest: dict[str, Any]
    model_config: dict[str, Any]
    batch_size: int
    gpu_id: int | None
    torch_threads: int | None
    socket_path: str
    require_gpu: bool = False
    # TorchServe's number for this worker slot (its backend port; ours listen on Unix sockets),
    # kept across restarts: its log lines name the worker `W-<ts_port>-<model>_<version>`.
    ts_port: int = 0

    @property
    def id(self) -> str:
        return instance_id(self.model, self.version, self.instance, self.generation)

    @property
    def device(self) -> str:
        return "cpu" if self.gpu_id is None else f"cuda:{self.gpu_id}"

    @property
    def ts_name(self) -> str:
        """The worker as TorchServe names it in its logs and WorkerLoadTime: `W-9000-mnist_1.0`."""
        return f"W-{self.ts_port}-{self.model}_{self.version}"


@dataclass(frozen=True)
class WorkerEndpoint:
    """How a frontend reaches one live worker: its socket, and its pid (to SIGKILL a hung batch)."""

    id: str
    instance: int
    generation: int
    socket_path: str
    pid: int
    device: str
    status: str  # LOADING | READY | FAILED | STOPPED
    start_time: float | None = None  # time.time() when it became ready
    load_seconds: float | None = None
    ts_name: str = ""  # as TorchServe names the worker in its logs (WorkerSpec.ts_name)


@dataclass(frozen=True)
class ModelEntry:
    """One model version as the supervisor serves it; frontends build their endpoints from it."""

    name: str
    version: str
    archive_file: str
    sha256: str
    model_dir: str
    manifest: dict[str, Any]
    model_config: dict[str, Any]
    settings: Any  # mariner.server.common.model_settings.ModelSettings (frozen)
    is_default: bool
    loaded_at_startup: bool
    workers: tuple[WorkerEndpoint, ...] = field(default_factory=tuple)
    error: str | None = None  # why the version is FAILED (a refused archive, workers that cannot start)


EXIT_LOAD_FAILED = 3


EXIT_INSTANCE_ENDED = 4  # the handler ended the instance (SystemExit & co)


def spec_to_json(spec: WorkerSpec) -> str:
    from dataclasses import asdict

    return json.dumps(asdict(spec))


def spec_from_json(text: str) -> WorkerSpec:
    return WorkerSpec(**json.loads(text))
