"""Model workers: each model instance is a process of its own (handler code never runs in a
frontend or the supervisor). `api` holds the values that cross process boundaries."""
