"""A model worker, the process that runs a handler (`main`): the link to each frontend, the
runner (load, batch, out-of-memory split, encode), TorchServe's handler Context and entry point,
and the zygote process workers are forked from. Handler code runs nowhere else."""
