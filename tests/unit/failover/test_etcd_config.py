"""The etcd store's address and `mecefo-launch --store etcd` flags: mistakes are one line."""

from __future__ import annotations

import pytest

from megatron_mecefo.control import etcd_store
from megatron_mecefo.failover.node import agent_cli
from megatron_mecefo.failover.node.candidate import CandidateId


def test_address_round_trip_and_bad_addresses():
    addr = etcd_store.address(["h1:2379", ("h2", 2380)], "job-7")
    assert addr == "etcd://h1:2379,h2:2380/job-7"
    assert etcd_store.parse(addr) == ([("h1", 2379), ("h2", 2380)], "job-7")
    for bad in (
        "h1:2379/job",
        "etcd://h1/job",
        "etcd://h1:x/job",
        "etcd://h1:1",
        "etcd://h1:1/a/b",
    ):
        with pytest.raises(ValueError):
            etcd_store.parse(bad)


def test_candidate_id_round_trip():
    for who, text in (
        (CandidateId(3, False, "gpu-a17", 4242), "node3@gpu-a17:4242"),
        (CandidateId(12, True, "h.example:x", 7), "node12-standby@h.example:x:7"),
    ):
        assert str(who) == text
        assert CandidateId.parse(text) == who
    for bad in ("node@h:1", "node1-spare@h:1", "node1@h", "node1@:1", "x node1@h:1"):
        with pytest.raises(ValueError):
            CandidateId.parse(bad)


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        agent_cli.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_launch_flags(capsys, monkeypatch):
    for var in ("MECEFO_STORE", "MECEFO_ETCD_ENDPOINTS", "MECEFO_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    err = _usage_error(capsys, ["--store", "etcd", "--nnodes", "2", "--", "x"])
    assert "needs the cluster's endpoints and one job id" in err
    err = _usage_error(capsys, ["--store", "etcd", "--coordinator", "h:1", "--", "x"])
    assert "--coordinator is for --store tcp" in err
    err = _usage_error(capsys, ["--store", "etcd", "--etcd-endpoints", "h1", "--", "x"])
    assert "etcd endpoint must be HOST:PORT" in err
    args = agent_cli.parse_args(["--store", "etcd", "--", "x"])  # one node: a local cluster
    assert args.store == "etcd" and args.etcd_endpoints == ""
    monkeypatch.setenv("MECEFO_STORE", "etcd")
    monkeypatch.setenv("MECEFO_ETCD_ENDPOINTS", "e1:2379,e2:2379")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    args = agent_cli.parse_args(["--nnodes", "2", "--node-rank", "1", "--", "x"])
    assert (args.store, args.etcd_endpoints, args.job_id) == ("etcd", "e1:2379,e2:2379", "42")
