"""What every process shares and agrees on: value types, the one error type and its status table,
tensors and signatures, names, the worker wire (framed pickle-5 messages, peer checks) and the
zygote's. It imports nothing else of ours (`make lint` checks), so each process can rely on it
without pulling in another process's code."""
