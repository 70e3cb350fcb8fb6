"""Code that more than one of the three processes runs: reading and checking archives and their
settings, the server's config, listeners and their limits, TLS and tokens, metrics books, the
control channel, HTTP/gRPC plumbing, and the model descriptions the supervisor and frontends
must agree on. It imports no process package (`make lint` checks): what is here is a library,
not a process."""
