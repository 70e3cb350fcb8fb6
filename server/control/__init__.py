"""The control plane: management APIs, metrics, health."""
