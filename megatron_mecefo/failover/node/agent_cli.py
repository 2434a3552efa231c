"""`mecefo-launch`: the per-node agent that replaces torchrun's elastic agent under failover.

    mecefo-launch --nproc-per-node 4 [--nnodes N --node-rank I --coordinator HOST:PORT] \\
        -- --config configs/run/demo_cpu.yaml [trainer args]

On the head node (node rank 0, no `--coordinator`) it first starts `mecefo-coordinator` in its own
session, on a free port. Then it runs this node's `Agent` (`agent.py`). Exit codes:
`launch/README.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from megatron_mecefo.control import keys
from megatron_mecefo.control.proc import die_with_parent, ignore_stop_signal, quiet_cpp_logs
from megatron_mecefo.errors import ExitCode, MecefoError
from megatron_mecefo.failover.node import store_wait
from megatron_mecefo.failover.node.agent import Agent
from megatron_mecefo.failover.node.candidate import CandidateId, CandidateKeeper

DIE_WITH_PARENT_ENV = "MECEFO_DIE_WITH_PARENT"
"""`1` (set by launch/local/run.sh for the agents it starts in the background): the agent stops
when its parent dies, so a SIGKILLed launcher leaves no node training on."""


AGENT_MODULE = "megatron_mecefo.failover.node.agent_cli"


def launch_command(
    trainer_args: list[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    flags: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """`mecefo-launch` for one node as a command line (`python -m` this module): the one way
    tests, benchmarks and the chaos tool start an agent. `flags`: its other options."""
    cmd = [sys.executable, "-m", AGENT_MODULE, "--nproc-per-node", str(nproc_per_node)]
    if nnodes != 1 or node_rank != 0:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    return [*cmd, *flags, "--", *trainer_args]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="mecefo-launch",
        description="Start this node's trainer ranks under failover (and the coordinator on the "
        "head node); restart dead ranks so they rejoin.",
    )
    p.add_argument("--nproc-per-node", type=int, default=int(env("NPROC", 1)))
    p.add_argument("--nnodes", type=int, default=int(env("MECEFO_NNODES", 1)))
    p.add_argument("--node-rank", type=int, default=int(env("MECEFO_NODE_RANK", 0)))
    p.add_argument(
        "--coordinator",
        default=env("MECEFO_COORDINATOR_ADDR"),
        help="HOST:PORT of a running coordinator; default on node 0: start one",
    )
    p.add_argument(
        "--coordinator-port",
        type=int,
        default=int(env("MECEFO_COORDINATOR_PORT", 0)),
        help="port for the coordinator this agent starts (0: a free one)",
    )
    p.add_argument(
        "--store",
        choices=("tcp", "etcd"),
        default=env("MECEFO_STORE", "tcp"),
        help="the job's store: tcp (a TCPStore on the head node, for one machine and small jobs) "
        "or etcd (an etcd cluster; no special node) ($MECEFO_STORE)",
    )
    p.add_argument(
        "--etcd-endpoints",
        default=env("MECEFO_ETCD_ENDPOINTS", ""),
        help="HOST:PORT[,HOST:PORT...] of the etcd cluster; empty on one node: start 3 members "
        "on this machine ($MECEFO_ETCD_ENDPOINTS)",
    )
    p.add_argument(
        "--job-id",
        default=env("MECEFO_JOB_ID") or env("SLURM_JOB_ID", ""),
        help="etcd store: the job's name in etcd, the same on every node ($MECEFO_JOB_ID, else "
        "$SLURM_JOB_ID; on one node without either, a new one)",
    )
    p.add_argument(
        "--restart-delay-s",
        type=float,
        default=float(env("MECEFO_RESTART_DELAY_S", 1.0)),
        help="seconds before a dead rank is restarted",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=int(env("MECEFO_MAX_RESTARTS", 20)),
        help="restarts per rank before the agent gives up on it",
    )
    p.add_argument(
        "--start-method",
        choices=("fork", "exec"),
        default=env("MECEFO_START_METHOD", "fork"),
        help="fork: ranks (and restarted ranks) are forked from one process per node that "
        "imported torch and megatron once (falls back to exec if that fails); exec: each rank "
        "is a new interpreter, restarted ranks use warm spares ($MECEFO_START_METHOD)",
    )
    p.add_argument(
        "--warm-spares",
        type=int,
        default=int(env("MECEFO_WARM_SPARES")) if env("MECEFO_WARM_SPARES") else None,
        help="with --start-method exec: pre-imported spare processes kept per node to replace "
        "dead ranks quickly (0: off; default: as many as one replica (TP x PP) has ranks on "
        "the node, so a whole replica restarts warm) ($MECEFO_WARM_SPARES)",
    )
    p.add_argument(
        "--coordinator-arg",
        action="append",
        default=[],
        help="extra flag for mecefo-coordinator (repeatable), e.g. --coordinator-arg=--grace-s=0.5",
    )
    p.add_argument(
        "--standby",
        action="store_true",
        default=env("MECEFO_STANDBY", "") == "1",
        help="a spare node: run no rank, keep warm processes, and take over the ranks of a lost "
        "node when the coordinator assigns one ($MECEFO_STANDBY=1)",
    )
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then mecefo-train arguments")
    args = p.parse_args(argv)
    if args.trainer_args and args.trainer_args[0] == "--":
        args.trainer_args = args.trainer_args[1:]
    if args.nproc_per_node < 1 or args.nnodes < 1 or args.node_rank < 0:
        p.error("need --nproc-per-node >= 1, --nnodes >= 1 and --node-rank >= 0")
    if args.node_rank >= args.nnodes and not args.standby:
        p.error(
            f"--node-rank {args.node_rank} is not one of the {args.nnodes} nodes; "
            "pass --standby for a spare node"
        )
    if args.store not in ("tcp", "etcd"):  # argparse does not check a default against choices
        p.error(f"--store (MECEFO_STORE) must be tcp or etcd, got {args.store!r}")
    if args.store == "etcd":
        from megatron_mecefo.control import etcd_store  # imports torch: not before main()

        if args.coordinator:
            p.error("--coordinator is for --store tcp; --store etcd takes --etcd-endpoints")
        multi = args.nnodes > 1 or args.standby
        if multi and not (args.etcd_endpoints and args.job_id):
            p.error(
                "--store etcd on several nodes needs the cluster's endpoints and one job id on "
                "every node: --etcd-endpoints (MECEFO_ETCD_ENDPOINTS) and --job-id (MECEFO_JOB_ID "
                "or SLURM_JOB_ID); launch/README.md shows both"
            )
        try:
            etcd_store.parse(etcd_store.address(_endpoints(args), args.job_id or "x"))
        except ValueError as exc:
            p.error(f"--etcd-endpoints: {exc}")
    elif (args.node_rank > 0 or args.standby) and not args.coordinator:
        p.error(
            "nodes other than 0 and standbys need --coordinator HOST:PORT "
            "(or MECEFO_COORDINATOR_ADDR)"
        )
    return args


def _endpoints(args: argparse.Namespace) -> list[str]:
    return [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()] or ["127.0.0.1:2379"]


@contextlib.contextmanager
def etcd_control_plane(args: argparse.Namespace):
    """`--store etcd`: the job's etcd address (starting 3 local members when no endpoints are
    given) and this node's coordinator candidate; both stopped on exit. Given endpoints must
    answer within a few seconds (`store_wait.probe_etcd`)."""
    from megatron_mecefo.control import etcd_cluster, etcd_store

    local = None
    tmp = None
    if args.etcd_endpoints:
        store_wait.probe_etcd(_endpoints(args))
    else:
        tmp = Path(tempfile.mkdtemp(prefix="mecefo-etcd-"))
        local = etcd_cluster.LocalEtcd(tmp, log=lambda m: print(m, flush=True))
        args.etcd_endpoints = ",".join(local.start())
    job = args.job_id = args.job_id or f"job-{uuid.uuid4().hex[:12]}"
    address = etcd_store.address(_endpoints(args), job)
    who = CandidateId(args.node_rank, bool(args.standby), socket.gethostname(), os.getpid())
    keeper = CandidateKeeper(
        address,
        args.nnodes * args.nproc_per_node,
        str(who),
        args.coordinator_arg,
        log=lambda m: print(f"[agent {args.node_rank}] {m}", flush=True),
    )
    try:
        keeper.start()
        yield address
    finally:
        keeper.stop()
        if local is not None:
            local.stop()
            shutil.rmtree(tmp, ignore_errors=True)


def start_coordinator(world: int, port: int, extra: list[str]) -> tuple[subprocess.Popen, int]:
    """The job's store and coordinator (`store_host.py`) in their own session (a signal to the
    agent's group does not reach them)."""
    tmp = Path(tempfile.mkdtemp(prefix="mecefo-coord-"))
    try:
        return _start_coordinator(world, port, extra, tmp / "port")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _start_coordinator(
    world: int, port: int, extra: list[str], port_file: Path
) -> tuple[subprocess.Popen, int]:
    cmd = [
        sys.executable,
        "-m",
        "megatron_mecefo.failover.authority.store_host",
        "--world-size",
        str(world),
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        *extra,
    ]
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=ignore_stop_signal)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"error: mecefo-coordinator did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def stop_coordinator(proc: subprocess.Popen) -> None:
    """It exits by itself once every agent has left; an agent that was SIGKILLed never says so,
    so after a short wait it is told to stop (it drains its events first), then killed."""
    for wait_s, then in ((3.0, proc.terminate), (20.0, proc.kill), (None, None)):
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            then()


def precheck_job(args: argparse.Namespace) -> tuple[int, str | None] | None:
    """`precheck.check` for this node's part of the job: (exit code, one line) for a mistake
    (None as the line: argparse printed it, or a finished run's line was printed: exit 0), None
    when fine. The run directory is checked only by the head node at the start of a job (a node
    or standby joining a running job finds it used)."""
    from megatron_mecefo import precheck
    from megatron_mecefo.config.batch import resolve_global_batch
    from megatron_mecefo.config.cli import load_run_config
    from megatron_mecefo.config.cli import parse_args as trainer_parse_args

    head = args.node_rank == 0 and not args.standby and args.coordinator is None
    world = args.nnodes * args.nproc_per_node
    try:
        targs = trainer_parse_args(list(args.trainer_args))
        cfg = load_run_config(targs)
        done = head and precheck.already_complete(resolve_global_batch(cfg, world), world)
        if done:  # a rerun of a finished run: one line, nothing started
            print(done, flush=True)
            return int(ExitCode.OK), None
        precheck.check(cfg, targs, world_size=world, nodes=args.nnodes, run_dir=head)
    except MecefoError as exc:
        return int(exc.exit_code), str(exc)
    except SystemExit as exc:  # the trainer's command line: argparse said why
        return int(exc.code or ExitCode.CONFIG_ERROR), None
    return None


def main(argv: list[str] | None = None) -> int:
    quiet_cpp_logs(os.environ)  # before torch loads, here and in every process started from here
    if os.environ.pop(DIE_WITH_PARENT_ENV, "") == "1":  # a launcher that may itself be SIGKILLed
        die_with_parent(signal.SIGTERM)  # a stop as on SIGTERM: this node's ranks go with it
    signal.signal(signal.SIGINT, _interrupted)  # also where a shell started us with it ignored
    try:
        args = parse_args(argv)
        bad = precheck_job(args)
        if bad is not None:
            if bad[1] is not None:
                print(f"error: {bad[1]}", file=sys.stderr, flush=True)
            return bad[0]
        with contextlib.ExitStack() as stack:
            return _run(args, stack)
    except KeyboardInterrupt:  # Ctrl-C: the node's ranks are stopped by now (agent.run's finally)
        print("interrupted (SIGINT): this node's ranks were stopped", file=sys.stderr, flush=True)
        return 128 + int(signal.SIGINT)


def _interrupted(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    coordinator = None
    address = args.coordinator
    if args.store == "etcd":
        try:
            address = stack.enter_context(etcd_control_plane(args))
        except (MecefoError, TimeoutError, RuntimeError) as exc:
            print(f"error: cannot start the etcd control plane: {exc}", file=sys.stderr, flush=True)
            return int(getattr(exc, "exit_code", ExitCode.COORDINATOR_LOST))
    elif address is None:
        world = args.nnodes * args.nproc_per_node
        coordinator, port = start_coordinator(world, args.coordinator_port, args.coordinator_arg)
        address = f"127.0.0.1:{port}"
    try:
        if coordinator is None and args.store == "tcp":  # node 0 may not be up yet
            who = f"[agent {args.node_rank}]"
            store_wait.wait_for_tcp_store(
                address, store_wait.wait_s(), lambda m: print(f"{who} {m}", flush=True)
            )
        agent = Agent(args, address)
    except MecefoError as exc:  # an etcd job id that names a stopped launch, no store
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)
    except Exception as exc:  # a store client's error (EtcdUnavailable too): no store to join
        if not keys.is_store_error(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__  # no C++ frames
        print(f"error: the job's store at {address}: {first}", file=sys.stderr, flush=True)
        return int(ExitCode.COORDINATOR_LOST)

    grace_s = float(os.environ.get("MECEFO_TERM_GRACE_S") or 0)

    def _terminate(signum, frame):
        if grace_s > 0:  # stop with a checkpoint; hard stop at the deadline. Slurm sends SIGTERM
            if agent.term_deadline is None:  # twice (the step, and srun forwarding): once counts
                agent.term_deadline = time.monotonic() + grace_s
                agent.request_stop("SIGTERM")
            return
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGUSR1, lambda signum, frame: agent.request_stop("SIGUSR1"))
    try:
        code = agent.run()
    finally:
        if coordinator is not None:
            stop_coordinator(coordinator)
    if code == ExitCode.OK and agent.snapshot_dir is not None:
        shutil.rmtree(agent.snapshot_dir, ignore_errors=True)  # the job is done: free the memory
        with contextlib.suppress(OSError):  # the run's folder, once the last node's is gone
            agent.snapshot_dir.parent.rmdir()
    agent.log(f"done (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
