"""`mariner serve`'s supervisor (the control-plane process), one job per module:

- `main`: the order things start and stop in, the control plane's listeners (management,
  health, metrics), SIGTERM and the exit code (`run`);
- `registry`: the management API over the model versions (`ModelRegistry`); `model_loading`:
  an archive opened, checked and installed as a version, start-up's workers and shutdown's;
- `versions`: a version as the supervisor holds it, shown to management and to frontends;
- `worker_pool`: the model worker processes, started and restarted with backoff;
  `worker_stop`: a slot stopped with no process left behind; `worker_failures`: what a failed
  start answers; `worker_process`, `zygote_client`: one worker process, and the fork server;
- `management/`: TorchServe's management API over REST and gRPC, describe, workflows;
- `frontends`: the frontend processes and the model table broadcast to them;
- `children`: restart backoff and metrics clean-up shared by every child process;
- `ports`: the hold on the inference ports (SO_REUSEPORT, port 0 resolved before children start);
- `devices`: the GPUs the workers may use, counted without CUDA.

Nothing is imported here: `mariner serve` imports `private_dir` before it sets
PROMETHEUS_MULTIPROC_DIR, and a package that imported `main` (hence prometheus_client) at that
point would leave the supervisor's own metrics out of the merged /metrics.
"""
