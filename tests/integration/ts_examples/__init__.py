"""TorchServe-style archives, both servers side by side, and the call-by-call comparison.

Used by tests/integration/test_torchserve_dropin.py: catalogue (what is built and sent), builders
(one per archive, the real torch-model-archiver), src/ (handlers written as TorchServe users write
them), servers (the pair), plan (every call), compare and report.
"""
