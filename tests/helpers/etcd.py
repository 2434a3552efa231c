"""A real 3-member etcd cluster for a test (Debian's `etcd`; `scripts/install_etcd.sh`)."""

from __future__ import annotations

import shutil

import pytest

needs_etcd = pytest.mark.skipif(
    shutil.which("etcd") is None,
    reason="no etcd on PATH: bash scripts/install_etcd.sh (scripts/test.sh runs it)",
)


@pytest.fixture
def cluster(tmp_path):
    """Three members on free loopback ports, stopped (SIGKILL) after the test."""
    from megatron_mecefo.control.etcd_cluster import LocalEtcd

    c = LocalEtcd(tmp_path / "etcd", log=lambda m: None)
    c.start()
    yield c
    c.stop()
