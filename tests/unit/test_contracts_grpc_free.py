"""The contracts every process shares name gRPC statuses without importing grpc: a worker speaks
no gRPC, and the value types must not pull grpc core into it."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import grpc

import mariner.server.contracts as contracts
from mariner.server.common.grpc_status import grpc_code
from mariner.server.contracts.errors import STATUS, Code


def test_importing_every_contract_module_imports_no_grpc() -> None:
    names = [f"mariner.server.contracts.{m.name}" for m in pkgutil.iter_modules(contracts.__path__)]
    assert "mariner.server.contracts.errors" in names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_code_has_the_grpc_status_its_table_names() -> None:
    for code in Code:
        assert grpc_code(code) is grpc.StatusCode[STATUS[code].grpc]
    assert grpc_code(Code.RESOURCE_EXHAUSTED) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_code(Code.CANCELLED) is grpc.StatusCode.CANCELLED
