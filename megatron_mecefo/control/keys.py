"""The coordinator store's key schema and client connection (one place, so writers and readers
agree). The store is torch's C++ `TCPStore`, served by `mecefo-coordinator`
(`failover/authority/store_host.py`), or an etcd cluster (`etcd_store.py`, `--store etcd`).
The JSON records under some keys are `records.py`'s.

Ranks are global ranks; replicas are logical DP indices (global rank // TP), stable for the whole
job. A rank's *incarnation* counts its restarts (0 for the first process).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

COORDINATOR_ENV = "MECEFO_COORDINATOR"
"""host:port of the coordinator store; its presence switches failover on in a trainer."""
INCARNATION_ENV = "MECEFO_INCARNATION"
"""Restart count of this rank, set by the per-node agent."""

GEN = "gen"
"""Latest published membership generation (int as text)."""
ABORT = "abort"
"""Set by the coordinator when the job cannot continue; value = reason."""
DONE = "done"
"""Set by the leader when the last step committed; agents stop restarting ranks."""
STOP = "job/stop"
"""Set (value = reason) when a stop was requested (SIGUSR1): members stop at an agreed step after a
final checkpoint and exit PREEMPTED."""
RECOVERY = "recovery"
"""JSON {"mode": failover|restart, "recoverable": bool, "wait_all_s": float}, set by trainers:
whether losing every replica can be survived (snapshots or checkpoints exist) and how."""
RECOVERING = "job/recovering"
"""Set to "1" by the coordinator while every replica is lost and it waits for the restarted ranks
(the job cannot advance), "0" once the recovery generation is published: an agent then restarts a
rank held back until a later job step at once (that step would never come)."""
RUN_DIR = "run_dir"
"""Absolute run directory, published by the first leader; the coordinator writes events there."""
JOB_STEP = "job/step"
"""Highest step a member has reached (published by the coordinator from progress markers)."""
REG_SEQ = "reg/seq"
"""Bumped after every registration (the coordinator re-reads registrations when it moves)."""
DEAD_SEQ = "dead/seq"
"""Bumped after every death report."""
AGENTS_ACTIVE = "agents/active"
"""Per-node agents running; the coordinator exits when it falls back to 0."""
EVENT_SEQ = "ev/seq"
"""Counter of posted events; event i is under `ev/<i>` (1-based)."""
EVENTS_WRITTEN = "ev/written"
"""The last event index the coordinator wrote to events.jsonl (or skipped as never posted)."""
COORD_EPOCH = "coord/epoch"
"""Bumped by each coordinator instance at start; an instance that sees a newer one stops."""
COORD_LEADER = "coord/leader"
"""etcd store only: the elected coordinator's candidate id, on its lease (`election.py`)."""
COORD_STARTED = "coord/started"
"""Epoch time the first coordinator started (start timeout across coordinator restarts)."""
COMMITTED = "job/committed"
"""The last step the job committed (set by the leader after each committed step): where the job is
even while no coordinator runs (a restarted one, or none, has not moved JOB_STEP)."""
JOB_START_STEP = "job/start_step"
"""The step this launch of the job started from (set with the run directory)."""
JOB_EVENTS_START = "job/events_start"
"""Bytes events.jsonl held when this launch began: its events start there (a resumed run appends
to the file). Set by the first leader before RUN_DIR."""
IDENTITY = "mecefo/identity"
"""The state identity the first trainer of a launch proposed (`checkpoint/resume.py`)."""
DATA_READY = "data/ready"
"""Set by the first data builder once the data and its index cache are on disk."""
NODE_RANK_ENV = "MECEFO_NODE_RANK"
"""The node (agent) a trainer runs on, set by the agent; in the registration as `node`."""


FLAGS = "job/flags"
"""Names of the job-wide flags set so far (ABORT, STOP, DONE), each followed by ";": an agent
learns all three, with GEN and its node's owner, in one multi_get (`raise_flag`, `control_keys`)."""
REG_LOG = "reg/log"
"""Ranks that registered, appended as "<rank>," before REG_SEQ moves: the coordinator reads only
the entries it has not seen (no request per rank)."""
DEAD_LOG = "dead/log"
"""Ranks reported dead, appended as "<rank>," before DEAD_SEQ moves."""
EVICT_SEQ = "evict/seq"
"""Bumped after every eviction key the coordinator sets: an agent reads its ranks' eviction keys
only when it moved (it reads this with GEN and FLAGS in its one multi_get)."""
STANDBY_LOG = "standby/log"
"""Ids of the agents that stood by at some time, appended as "<id>,"; their beats are under
`standby(id)`."""

AGENT_ALIVE = "agents/alive/"
"""etcd store only: prefix of the agents' lease-held keys (`failover/node/node_lease.py`)."""
AGENT_IDS = "agents/ids"
"""Counter handing each node agent a job-unique id (1-based) when it starts."""


def agent_alive(agent_id: int) -> str:
    return f"{AGENT_ALIVE}{agent_id}"


def node_owner(node: int) -> str:
    """Id of the agent that runs `node` now (a standby's once it replaced the node)."""
    return f"node_owner/{node}"


def standby(agent_id: int) -> str:
    """JSON {"seq": ..} bumped by a standby agent (no ranks) every tick: it is alive and free."""
    return f"standby/{agent_id}"


def assign(agent_id: int) -> str:
    """The node (int as text) the coordinator gives to standby agent `agent_id`, or RETIRED for
    an agent whose node was given away for computing too slowly (it takes no node again)."""
    return f"assign/{agent_id}"


RETIRED = "retired"

RETIRE = "straggler/retire"
"""JSON {"replicas": {replica: times slower per sample}, "step"}: the leader asks the coordinator
to give these replicas' nodes to free standbys (`failover/trainer/straggler.py`)."""


def replacement(node: int) -> str:
    """JSON {"standby", "failure_epoch_s"}: a lost node being replaced (coordinator restarts)."""
    return f"replace/{node}"


def node_key(node: int) -> str:
    """`records.NodeReport` of one node, written by its agent every tick."""
    return f"node/{node}"


def redone(gen: int, step: int, attempt: int) -> str:
    """Counter: the first member to bump it posts the attempt's one `step_redone` event."""
    return f"redone/{gen}/{step}/{attempt}"


def rollback(gen: int) -> str:
    """Counter: the first rank of generation `gen` to find optimizer shards lost posts the event."""
    return f"rollback/{gen}"


def inject_claim(rank: int, step: int) -> str:
    """The incarnation of `rank` that fired its injection of `step` (each fires once per job)."""
    return f"inject_claim/{rank}/{step}"


def gen_record(gen: int) -> str:
    """`records.GenerationRecord`: replicas of generation `gen`."""
    return f"gen/{gen}"


def registration(rank: int) -> str:
    """`records.Registration`: written by a trainer at start."""
    return f"reg/{rank}"


def heartbeat(rank: int) -> str:
    """Counter bumped by the rank's heartbeat thread."""
    return f"hb/{rank}"


def progress(rank: int) -> str:
    """`<incarnation>:<step>:<phase>` (phase: compute | reduce | idle)."""
    return f"progress/{rank}"


def dead(rank: int) -> str:
    """Incarnation of `rank` reported dead (by its agent or itself), as `<inc>:<epoch time>`."""
    return f"dead/{rank}"


def evict(rank: int) -> str:
    """Incarnation the coordinator wants killed (hung or fenced); the agent SIGKILLs it."""
    return f"evict/{rank}"


def downtime(rank: int, incarnation: int) -> str:
    """Step at which an injected failure of this incarnation may come back (agent waits)."""
    return f"downtime/{rank}/{incarnation}"


def injected(rank: int, incarnation: int) -> str:
    """`<kind>:<epoch>` written by an injection just before it fires (true failure time)."""
    return f"injected/{rank}/{incarnation}"


def vote(gen: int, step: int, attempt: int) -> str:
    """Counter of members whose reduction of (gen, step, attempt) succeeded."""
    return f"vote/{gen}/{step}/{attempt}"


def decision(gen: int, step: int, attempt: int) -> str:
    """`commit:<next gen>` or `abort:<next gen>`, set once with compare_set."""
    return f"decision/{gen}/{step}/{attempt}"


def anomaly(gen: int, step: int, attempt: int, replica: int) -> str:
    """Set by replica `replica`'s ranks before they vote (gen, step, attempt) down for NaN/Inf;
    the value says what was not finite."""
    return f"anomaly/{gen}/{step}/{attempt}/{replica}"


def anomalies(gen: int, step: int, attempt: int) -> str:
    """Counter of votes of (gen, step, attempt) cast with an anomaly (TP x PP > 1)."""
    return f"anomalies/{gen}/{step}/{attempt}"


def pace(gen: int, step: int, attempt: int, rank: int) -> str:
    """Rank `rank`'s compute seconds per sample (its median over the straggler window; 0:
    not known yet), set before it votes (gen, step, attempt) (`failover/trainer/straggler.py`)."""
    return f"pace/{gen}/{step}/{attempt}/{rank}"


def fingerprint(gen: int, step: int, attempt: int, rank: int) -> str:
    """Rank `rank`'s state fingerprint at (gen, step, attempt) (TP x PP > 1: compared by the
    last voter, position by position)."""
    return f"fingerprint/{gen}/{step}/{attempt}/{rank}"


ROLLBACK_BOUND = "rollback_bound"
"""The newest step a rollback may load (a restarted rank's recovery ignores newer state), set
while replicas redo an update they computed differently; deleted once it is resolved."""


def diverged_at(step: int) -> str:
    """Set when the replicas' states differed at the start of `step` with no vote naming the
    wrong one: the commit of a redone step reads this one key before `divergence`'s."""
    return f"divergence/{step}"


def divergence(step: int, replica: int, position: int) -> str:
    """The state fingerprint `replica` (its rank at `position`) held at the start of `step` when
    the replicas' states differed there and no vote could name the wrong one."""
    return f"divergence/{step}/{replica}/{position}"


def corruptions(replica: int, position: int) -> str:
    """Counter of the times replica `replica`'s state (its rank at `position`) was found to
    differ from the majority's, over every incarnation: the second time, it is evicted."""
    return f"corruptions/{replica}/{position}"


def rerun_verdict(step: int, replica: int, check: int) -> str:
    """The healthy peer's recomputation of replica `replica`'s micro-batches of `step` (its
    `check`-th): a JSON list of `finite` flags, one per micro-batch."""
    return f"rerun/{step}/{replica}/{check}"


def event(index: int) -> str:
    return f"ev/{index}"


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator address must be HOST:PORT, got {address!r}")
    return host, int(port)


def connect(address: str, timeout_s: float, *, torch_client: bool | None = None):
    """A new client of the job's store (one per thread: clients are not shared).

    `HOST:PORT`: torch's `TCPStore` client, or the same protocol in plain Python
    (`tcp_client.py`); `etcd://...`: an `EtcdStore` (`etcd_store.py`), wrapped as a c10d `Store`
    for torch. torch's kind where the store is handed to torch (`PrefixStore`,
    `init_process_group`: `torch_client=True`) or, by default, in a process that has imported
    torch already (a rank); the plain kind elsewhere, so the agent and the coordinator never pay
    a torch import for their store."""
    if torch_client is None:
        torch_client = "torch" in sys.modules
    if address.startswith("etcd://"):
        from megatron_mecefo.control import etcd_store

        store = etcd_store.EtcdStore(address, timeout_s)
        return etcd_store.torch_store(store) if torch_client else store
    host, port = parse_address(address)
    if not torch_client:
        from megatron_mecefo.control.tcp_client import TcpStoreClient

        return TcpStoreClient(host, port, timeout_s)
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port,
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        use_libuv=True,
    )


def is_store_error(exc: BaseException) -> bool:
    """Whether `exc` is a store client's error: torch's `DistError` or our `StoreError`
    (`tcp_client`, `etcd_store`), without importing torch to ask."""
    from megatron_mecefo.control.store_errors import StoreError

    if isinstance(exc, StoreError):
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(exc, dist.DistError)


def report_dead(store, rank: int, incarnation: int, epoch_s: float | None = None) -> None:
    """Tell the coordinator this incarnation of `rank` is gone (agent: child exited)."""
    store.set(dead(rank), f"{incarnation}:{time.time() if epoch_s is None else epoch_s}")
    store.append(DEAD_LOG, f"{rank},")  # before the counter: the coordinator reads seq, then log
    store.add(DEAD_SEQ, 1)


def register(store, rank: int, registration_json: str) -> None:
    """Publish one rank's registration (see REG_LOG for the order)."""
    store.set(registration(rank), registration_json)
    store.append(REG_LOG, f"{rank},")
    store.add(REG_SEQ, 1)


def set_eviction(store, rank: int, incarnation: int) -> None:
    """Tell `rank`'s agent to SIGKILL that incarnation (see EVICT_SEQ for the order)."""
    store.set(evict(rank), str(incarnation))
    store.add(EVICT_SEQ, 1)


def raise_flag(store, key: str, value: str) -> None:
    """Set one of the job-wide flags ABORT, STOP or DONE, and list it in FLAGS."""
    store.set(key, value)
    store.append(FLAGS, f"{key};")


def flag_raised(flags: bytes | str, key: str) -> bool:
    """Whether FLAGS' value lists `key`."""
    text = flags.decode() if isinstance(flags, bytes) else flags
    return f"{key};" in text


def control_keys(store) -> None:
    """Create GEN, FLAGS and EVICT_SEQ if absent, so that they can be read in one multi_get
    (which waits for keys that do not exist). Idempotent; any process may call it."""
    store.compare_set(GEN, "", "0")
    store.compare_set(FLAGS, "", "")
    store.compare_set(EVICT_SEQ, "", "0")


def new_log_entries(store, log_key: str, seen_chars: int) -> tuple[list[int], int]:
    """The ranks appended to `log_key` after its first `seen_chars` characters, and its length."""
    if not store.check([log_key]):
        return [], seen_chars
    text = store.get(log_key).decode()
    return sorted({int(x) for x in text[seen_chars:].split(",") if x}), len(text)


def has_leases(store) -> bool:
    """The store is an etcd store (`control/etcd_store.py`): it has leases, and node agents hold
    one each (`failover/node/node_lease.py`)."""
    return hasattr(store, "grant")


def leased_agents(store) -> set[int] | None:
    """The agent ids whose lease key (`agent_alive`) exists, or None on a store without leases."""
    if not has_leases(store):
        return None
    return {int(a) for a in store.keys_with_prefix(AGENT_ALIVE) if a.isdigit()}


def get_int(store, key: str, default: int = 0) -> int:
    if not store.check([key]):
        return default
    return int(store.get(key).decode())


def this_host() -> str:
    return os.uname().nodename
