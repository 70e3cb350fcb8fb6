"""The GPU checklist: one script a machine with an NVIDIA GPU runs before anyone quotes a GPU figure.

    python -m mariner.loadtest.gpu_check                  # on the GPU machine (make gpu-check)
    python -m mariner.loadtest.gpu_check --device cpu --quick   # CI's dry run, so it cannot rot
    python -m mariner.loadtest.gpu_check --only serve,bench     # some sections (keys: --help)
    python -m mariner.loadtest.gpu_check carry pack DIR   # the MiniLM weights for the trip there (`carry`)

Why one script: a GPU is lent for minutes, so the first run must measure, not debug. Each
section records what it found and never stops the others; the report says which passed:

1. environment: torch/CUDA/driver, the GPUs, onnxruntime's providers, the CPU's ISA flags;
2. every digits archive of the store loaded through the serving handler on the device (TF32
   off), logits compared with the eager model on the CPU over the 270 test digits; AOTInductor is
   exported again on this device (a package only runs where it was built);
3. the compiled variant at every batch size 1..128 (--quick: 1..8) after the handler's
   warm-up: graphs compiled after warm-up must be 0 (a recompile during live traffic is a
   latency spike);
4. out-of-memory: a batch too large for a capped memory fraction must raise an error the
   server's batch split recognises as out-of-memory (CUDA only; skipped on CPU, said so);
5. `mariner serve` on the device (`--require-gpu` on CUDA): every answer correct, describe's
   workers on the device, the GPU memory gauge on /metrics;
6. a short benchmark (raw handler vs Mariner; stock TorchServe when it is installed);
7. the MiniLM and ResNet-18 archives (`families`): each variant on the device vs
   the family's eager archive on the CPU, AOTInductor re-exported here, bf16 autocast and CUDA
   graphs as variants; no graph compiled or recorded after warm-up; both served by
   `mariner serve`; and (`bench`) Mariner vs stock TorchServe at 1/8/64 clients with
   and without bf16 and CUDA graphs.

Modules: `checklist` (section 1, running every section, the report), `digits` (2 to 5), `bench`
(6 and the benchmark of 7), `families` (the rest of 7), `workloads` (the MiniLM and ResNet
inputs, loading and comparisons), `carry` (the MiniLM weights' trip to the GPU machine).

Sections 7 run inside `--budget-s` (default 480 s on CUDA, so the whole check fits an 8-minute
slot on an H200): a step that no longer fits is skipped and named in the report. How to run
it on the lent GPU machine (no Java, no torchserve, no grpcio-tools; the MiniLM weights do not
fit one transfer): docs/benchmark.md, "GPU checklist".

`--only` runs the sections named and reports the others as skipped: a rerun of what failed on a
lent machine, and the dry run in two parts the tests run side by side.

The report (markdown) goes to --out (default bench/results-gpu.md; the dry run writes under
build/). A run on the CPU is labelled as such: no GPU figure comes from it.
"""

from mariner.loadtest.gpu_check.checklist import Section, main, report, run_section

__all__ = ["Section", "main", "report", "run_section"]
