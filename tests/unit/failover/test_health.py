"""GPU health before a (re)start and the restart backoff (issue 18, item 5), and the preflight
that refuses a GPU config on a node without GPUs: nvidia-smi output parsed, a site command's exit
code honoured, an unhealthy GPU blocking the agent's restart of a rank, the delay doubling on quick
deaths only. nvidia-smi and the site command are stand-in scripts."""

from __future__ import annotations

import argparse
import stat
import types
from pathlib import Path

import pytest

from megatron_mecefo import preflight
from megatron_mecefo.errors import ExitCode
from megatron_mecefo.failover.liveness import gpu_health as health
from megatron_mecefo.failover.node import restart_policy
from megatron_mecefo.failover.node.agent import Agent

pytestmark = pytest.mark.timeout(60)

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "run" / "demo_cpu.yaml"
HEALTHY = "0, 0, No, No, No\n1, 0, [N/A], No, No\n"


def test_parse_smi():
    assert health.parse_smi(HEALTHY) is None
    assert "uncorrected ECC" in health.parse_smi("0, 3, No, No, No\n")
    assert "row remapping pending" in health.parse_smi("2, 0, [N/A], Yes, No\n")
    assert "row remapping failed" in health.parse_smi("2, 0, N/A, No, Yes\n")
    assert "unexpected" in health.parse_smi("garbage\n")


def _script(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_check_gpu_with_nvidia_smi_and_a_site_command(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    _script(bin_dir, "nvidia-smi", f'echo "$*" >> {tmp_path}/args\nprintf "0, 5, No, No, No\\n"\n')
    monkeypatch.setattr(health, "gpus_present", lambda: True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    assert "uncorrected ECC" in health.check_gpu("GPU-abc", env)
    assert "-i GPU-abc" in (tmp_path / "args").read_text()  # the rank's own GPU
    _script(bin_dir, "nvidia-smi", f'printf "{HEALTHY}"\n')
    assert health.check_gpu("0", env) is None
    site = _script(tmp_path / "site", "dcgm-check", 'echo "GPU $1 failed diag"; exit 1\n')
    assert "failed diag" in health.check_gpu("0", {**env, health.HEALTH_CMD_ENV: str(site)})
    _script(bin_dir, "nvidia-smi", "sleep 5\n")
    slow = {**env, health.HEALTH_TIMEOUT_ENV: "0.5"}
    assert "no answer" in health.check_gpu("0", slow)


def test_without_gpus_or_tools_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(health, "gpus_present", lambda: False)
    assert health.check_gpu("0", {"PATH": "/nonexistent"}) is None


def test_device_id_follows_cuda_visible_devices():
    assert health.device_id(1, {"CUDA_VISIBLE_DEVICES": "4,5"}) == "5"
    assert health.device_id(1, {}) == "1"


def test_restart_backoff():
    policy = restart_policy
    env = {policy.BACKOFF_ENV: "2", policy.BACKOFF_MAX_ENV: "60"}
    assert [policy.restart_delay_s(5, n, env) for n in range(5)] == [5, 10, 20, 40, 60]
    assert policy.restart_delay_s(5, 3, {}) == 5  # default: no backoff
    assert policy.is_quick_death(10.0, {}) and not policy.is_quick_death(3600.0, {})


def test_agent_does_not_restart_a_rank_onto_an_unhealthy_gpu(tmp_path, monkeypatch):
    """`Agent._tick`'s restart branch on a stand-in agent: the site health command fails, so the
    rank is given up (finished) instead of spawned."""
    site = _script(tmp_path / "site", "check", "exit 1\n")
    monkeypatch.setenv(health.HEALTH_CMD_ENV, str(site))
    spawned, said = [], []
    store = types.SimpleNamespace(
        check=lambda keys: False,
        get=lambda key: b"7",
        set=lambda key, value: None,
        multi_get=lambda names: [b"3", b"", b"0", b"7"],  # GEN, FLAGS, EVICT_SEQ, node_owner
    )
    fake = types.SimpleNamespace(
        stop_reason=None,
        store=store,
        node=0,
        agent_id=7,
        smp=None,
        fork_server=None,
        procs={},
        restart_at={1: (0.0, -1)},
        ranks=[0, 1],
        finished=set(),
        incarnation={0: 0, 1: 0},
        log=said.append,
        spawn=spawned.append,
        _top_up_spares=lambda: None,
        _report_liveness=lambda gen, flags, stop_set: None,
        evict_seq_seen=b"0",
        _hand_over=lambda: None,
        gave_up={},
        replica_size=1,
        saw_done=False,
    )
    fake._restart_due = lambda rank, step: Agent._restart_due(fake, rank, step)
    monkeypatch.setattr("megatron_mecefo.control.keys.get_int", lambda store, key, d=0: 10)
    assert Agent._tick(fake) is None
    assert spawned == [] and fake.finished == {1}, said
    assert "GPU is unhealthy" in said[0] and fake.gave_up == {1: 1}  # the node will not exit 0
    monkeypatch.delenv(health.HEALTH_CMD_ENV)
    fake.restart_at, fake.finished = {1: (0.0, -1)}, set()
    Agent._tick(fake)
    assert spawned == [1] and fake.incarnation[1] == 1


def _preflight(run_dir: Path, *trainer: str) -> argparse.Namespace:
    """The preflight's arguments for the demo config; `run_dir` under the test's tmp_path (the
    config's own `runs/demo_cpu` is relative to the working directory: never the checkout's)."""
    return preflight.parse_args(
        [
            "--nproc-per-node",
            "2",
            "--world-size",
            "2",
            "--node",
            "0",
            "--",
            "--config",
            str(CONFIG),
            "--run-dir",
            str(run_dir),
            *trainer,
        ]
    )


def test_preflight_refuses_nccl_without_gpus_and_passes_gloo(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")  # check_config sets it; monkeypatch restores it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cfg, problem = preflight.check_config(_preflight(tmp_path / "run", "parallel.backend=nccl"))
    assert problem is None
    code, why = preflight.check_devices(cfg, 2)
    assert code == ExitCode.CONFIG_ERROR and "no GPU visible" in why and "backend=gloo" in why
    cfg, _ = preflight.check_config(_preflight(tmp_path / "run"))
    assert preflight.check_devices(cfg, 2) is None  # demo_cpu: gloo
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg, _ = preflight.check_config(_preflight(tmp_path / "run", "parallel.backend=auto"))
    code, why = preflight.check_devices(cfg, 2)
    assert code == ExitCode.CONFIG_ERROR and "1 GPU(s) visible" in why


def test_preflight_reports_an_unhealthy_gpu_and_config_errors(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv(health.HEALTH_CMD_ENV, str(_script(tmp_path, "bad", "exit 3\n")))
    cfg, _ = preflight.check_config(_preflight(tmp_path / "run", "parallel.backend=nccl"))
    code, why = preflight.check_devices(cfg, 2)
    assert code == ExitCode.DISTRIBUTED_ERROR and "local rank 0" in why
    _, (code, why) = preflight.check_config(_preflight(tmp_path / "run", "training.lrr=1"))
    assert code == ExitCode.CONFIG_ERROR and "training.lrr" in why


def test_preflight_needs_the_data_a_dry_run_may_skip_and_refuses_a_layout(tmp_path, monkeypatch):
    """Before preprocessing, `--dry-run` checks the layout and skips the data files; the preflight
    of a job does not: a missing file is exit 3. TP 3 on 4 ranks is exit 4 (launch/README.md)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    c4 = ["data.path=c4/c4_en", "data.tokenizer_model=c4/c4_en.model"]
    _, problem = preflight.check_config(_preflight(tmp_path / "run", *c4))
    assert problem is not None and problem[0] == ExitCode.DATA_ERROR, problem
    assert "c4/c4_en.bin" in problem[1]
    args = _preflight(tmp_path / "run", "parallel.tensor_model_parallel_size=3")
    args.world_size = 4
    _, problem = preflight.check_config(args)
    assert problem is not None and problem[0] == ExitCode.DISTRIBUTED_ERROR, problem


def test_preflight_ignores_a_run_in_the_working_directory(tmp_path, monkeypatch):
    """A finished demo run under the working directory's runs/demo_cpu (the config's default
    run_dir) does not change what the preflight says about another run directory."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    demo = tmp_path / "runs" / "demo_cpu"
    demo.mkdir(parents=True)
    (demo / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')  # occupied, nothing saved
    cfg, problem = preflight.check_config(_preflight(tmp_path / "run"))
    assert problem is None and preflight.check_devices(cfg, 2) is None
