"""A store client made as the agent, the coordinator and the snapshot process make theirs: in a
fresh interpreter that never imported torch (`control/tcp_client.py`, `control/etcd_store.py`)."""

from __future__ import annotations

import subprocess
import sys


def client_without_torch(address: str, ops: str, imports=(), timeout_s: float = 60) -> str:
    """In a fresh interpreter: import `imports`, `s = keys.connect(address)`, run `ops` (Python
    on `s`), and fail unless torch is still not imported. Returns the client's type name."""
    code = "\n".join(
        [
            "import sys",
            "from megatron_mecefo.control import keys",
            *(f"import {module}" for module in imports),
            f"s = keys.connect({address!r}, 5.0)",
            ops,
            "assert 'torch' not in sys.modules, 'torch was imported'",
            "print(type(s).__name__)",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    return out.stdout.strip()
