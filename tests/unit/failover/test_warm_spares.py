"""How many warm spares a node agent keeps by default: as many as one replica (TP x PP ranks)
has on the node, so a replica that leaves whole restarts warm; read from the command line without
importing torch (the agent must stay light), else from the ranks' registrations."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from megatron_mecefo.failover.node.agent import Agent, replica_size_of, spares_for_replicas

DEMO = ["--config", "configs/run/demo_cpu.yaml"]


@pytest.mark.parametrize(
    ("ranks", "size", "want"),
    [
        ([0, 1, 2, 3], 1, 1),  # data parallel: one rank per replica
        ([0, 1, 2, 3], 2, 2),  # PP 2: each replica has both stages here
        ([4, 5, 6, 7], 4, 4),  # TP 2 x PP 2 on one node
        ([0, 1], 4, 2),  # a replica spread over two nodes: its two ranks here
        ([0, 1, 2, 3], 3, 3),  # replica 0 = ranks 0-2
    ],
)
def test_spares_cover_the_ranks_a_replica_has_on_the_node(ranks, size, want):
    assert spares_for_replicas(ranks, size) == want


def test_replica_size_is_read_from_the_command_line():
    assert replica_size_of(DEMO) == 1
    pp_tp = ["parallel.pipeline_model_parallel_size=2", "parallel.tensor_model_parallel_size=2"]
    assert replica_size_of([*DEMO, *pp_tp]) == 4
    assert replica_size_of(["--config", "no/such.yaml"]) is None  # the trainers say why


def test_reading_the_config_does_not_import_torch():
    code = (
        "import sys; from megatron_mecefo.failover.node.agent import replica_size_of; "
        f"assert replica_size_of({DEMO!r} + ['parallel.pipeline_model_parallel_size=2']) == 2; "
        "print(json.dumps(sorted(m for m in ('torch', 'megatron') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def _agent(warm_spares, replica_size=None, ranks=(0, 1, 2, 3), registered=None):
    store = types.SimpleNamespace(
        check=lambda keys: registered is not None,
        get=lambda key: json.dumps(
            {"incarnation": 0, "pid": 1, "host": "h", "tp": 1, "world": 4, "pp": registered}
        ),
    )
    return types.SimpleNamespace(
        args=types.SimpleNamespace(warm_spares=warm_spares),
        replica_size=replica_size,
        ranks=list(ranks),
        store=store,
    )


def test_the_flag_wins_then_the_command_line_then_the_registration():
    assert Agent._warm_spares_wanted(_agent(0, replica_size=2)) == 0  # off on request
    assert Agent._warm_spares_wanted(_agent(None, replica_size=2)) == 2
    assert Agent._warm_spares_wanted(_agent(None)) == 1  # nothing known yet
    late = _agent(None, registered=2)
    assert Agent._warm_spares_wanted(late) == 2 and late.replica_size == 2
