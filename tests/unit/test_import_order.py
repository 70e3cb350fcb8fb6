"""`mariner serve` sets PROMETHEUS_MULTIPROC_DIR before prometheus_client is imported: the client
picks its value store (files in that dir, or this process's memory) at import time. A supervisor
that imported it earlier kept its own metrics in memory, and the merged /metrics lost them
(mariner_model_load_seconds). What cli imports before it sets the variable must not import it."""

from __future__ import annotations

import subprocess
import sys


def test_what_serve_imports_before_the_metrics_dir_is_set_imports_no_prometheus_client() -> None:
    code = (
        "import sys\n"
        "import mariner.server.cli\n"
        "from mariner.server.contracts.errors import ServingError\n"
        "from mariner.server.supervisor.private_dir import check_private, ensure_private_dir\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prometheus_client'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
