"""The protocol-neutral core: archives, the dataplane, batching, runners, errors, types."""
