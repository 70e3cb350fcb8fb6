"""Load tools: three entry points, and the servers they (and the tests) start.

- `python -m mariner.loadtest.bench`: the side-by-side benchmark (`make bench`, `bench-scaling`);
  its other modes are its first word: `quick` (`make quickbench`), `ceiling`, `serve-torchserve`
  (`make serve-torchserve`);
- `python -m mariner.loadtest.gate`: locust with the p99 gate (`make loadtest`);
- `python -m mariner.loadtest.gpu_check`: the GPU checklist (`make gpu-check`); `carry` packs the
  MiniLM weights for the trip to the GPU machine;
- `mariner.loadtest.servers`: Mariner, stock TorchServe and the transport floor as subprocesses,
  one vocabulary for all three.
"""
