"""A real 3-member etcd cluster for a test (Debian's `etcd`; `scripts/install_etcd.sh`)."""

from __future__ import annotations

import pytest

from tests.helpers.tools import needs_tool

needs_etcd = needs_tool("etcd", "bash scripts/install_etcd.sh (scripts/test.sh runs it)")
"""Skips without etcd on PATH; under CI=true fails (`tests/helpers/tools.py`)."""


@pytest.fixture
def cluster(tmp_path):
    """Three members on free loopback ports, stopped (SIGKILL) after the test."""
    from megatron_mecefo.control.etcd_cluster import LocalEtcd

    c = LocalEtcd(tmp_path / "etcd", log=lambda m: None)
    c.start()
    yield c
    c.stop()
