"""`mariner serve`'s supervisor (the control-plane process), one job per module:

- `main`: the order things start and stop in, the control plane's listeners (management,
  health, metrics), SIGTERM and the exit code (`run`);
- `registry`: the model versions and the management API over them (`ModelRegistry`);
- `versions`: a version as the supervisor holds it, shown to management and to frontends;
- `worker_pool`: the model worker processes, started and restarted with backoff;
- `frontends`: the frontend processes and the model table broadcast to them;
- `children`: restart backoff and metrics clean-up shared by every child process;
- `ports`: the hold on the inference ports (SO_REUSEPORT, port 0 resolved before children start);
- `devices`: the GPUs the workers may use, counted without CUDA.
"""

from mariner.server.supervisor.main import Supervisor, run

__all__ = ["Supervisor", "run"]
