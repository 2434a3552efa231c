"""An agent's first contact with the job's store (issue 32, items 13 and 14): a tcp store that is
not up yet is waited for quietly and for a bounded time, an etcd cluster that does not answer is
one line naming its endpoints (exit 6, within seconds), a bogus `MECEFO_STORE` is refused, and
`mecefo-launch` loads torch only after it has quietened torch's C++ logging."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from megatron_mecefo.errors import ConfigError, ExitCode
from megatron_mecefo.failover.node import agent_cli, store_wait

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tcp_store_that_comes_up_late_is_waited_for_with_one_line(monkeypatch):
    monkeypatch.setattr(store_wait, "QUIET_S", 0.2)
    port = _closed_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def serve_late() -> None:
        time.sleep(1.0)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    threading.Thread(target=serve_late, daemon=True).start()
    said: list[str] = []
    start = time.monotonic()
    store_wait.wait_for_tcp_store(f"127.0.0.1:{port}", 20.0, said.append)
    listener.close()
    assert time.monotonic() - start < 10
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0] and "waiting up to 20 s" in said[0]


def test_a_tcp_store_that_never_comes_is_one_error_after_the_bound(monkeypatch):
    monkeypatch.setattr(store_wait, "QUIET_S", 0.2)
    port = _closed_port()
    said: list[str] = []
    start = time.monotonic()
    with pytest.raises(store_wait.StoreUnreachableError) as exc:
        store_wait.wait_for_tcp_store(f"127.0.0.1:{port}", 1.0, said.append)
    assert 1.0 <= time.monotonic() - start < 5
    assert exc.value.exit_code == ExitCode.COORDINATOR_LOST == 6
    assert f"127.0.0.1:{port}" in str(exc.value) and "\n" not in str(exc.value)
    assert len(said) == 1


def test_wait_bound_from_the_environment():
    assert store_wait.wait_s({}) == store_wait.WAIT_DEFAULT_S
    assert store_wait.wait_s({store_wait.WAIT_ENV: "7.5"}) == 7.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ConfigError, match=store_wait.WAIT_ENV):
            store_wait.wait_s({store_wait.WAIT_ENV: bad})


def test_unreachable_etcd_endpoints_are_one_line_naming_them():
    endpoints = [f"127.0.0.1:{_closed_port()}", f"127.0.0.1:{_closed_port()}"]
    start = time.monotonic()
    with pytest.raises(store_wait.StoreUnreachableError) as exc:
        store_wait.probe_etcd(endpoints, timeout_s=1.0)
    assert time.monotonic() - start < 10
    text = str(exc.value)
    assert exc.value.exit_code == ExitCode.COORDINATOR_LOST
    assert ",".join(endpoints) in text and "did not answer within 1 s" in text, text
    assert "\n" not in text and "quorum" not in text  # at start-up, not a lost quorum


def test_a_bogus_store_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("MECEFO_STORE", "bogus")
    with pytest.raises(SystemExit) as exc:
        agent_cli.parse_args(["--", "--config", "x"])
    assert exc.value.code == 2
    assert "MECEFO_STORE) must be tcp or etcd, got 'bogus'" in capsys.readouterr().err


def test_the_launcher_loads_torch_after_quietening_its_cpp_logs():
    """`TORCH_CPP_LOG_LEVEL` is read when torch loads: importing `mecefo-launch`'s module must not
    load torch, or its own TCPStore client would print ~30 C++ frames per timed-out attempt."""
    code = "import sys, megatron_mecefo.failover.node.agent_cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
