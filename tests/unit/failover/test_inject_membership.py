"""Injection specs (command line and scenario files) and the membership object."""

from __future__ import annotations

import pytest

from megatron_mecefo.errors import ConfigError
from megatron_mecefo.testing import inject
from megatron_mecefo.training.membership import Membership

pytestmark = pytest.mark.timeout(30)


def test_parse_inject():
    assert inject.parse_inject("kill:2:10:5") == inject.InjectionSpec("kill", 2, 10, 5)
    assert inject.parse_inject("hang:0:3") == inject.InjectionSpec("hang", 0, 3, None)
    assert inject.parse_inject("kill:1:rejoin").step == inject.AT_REJOIN
    assert inject.parse_inject("nan:1:3") == inject.InjectionSpec("nan", 1, 3)
    assert inject.parse_inject("nan:1:3:data").mode == "data"
    assert inject.parse_inject("nan:0:3:persistent").mode == "persistent"
    assert inject.parse_inject("spike:1:3:data") == inject.InjectionSpec(
        "spike", 1, 3, None, "data"
    )
    assert inject.parse_inject("slow:2:1.5:6") == inject.InjectionSpec("slow", 2, 6, factor=1.5)
    assert inject.parse_inject("bitflip:1:5") == inject.InjectionSpec("bitflip", 1, 5)
    assert inject.parse_inject("bitflip:1:5:update") == inject.InjectionSpec(
        "bitflip", 1, 5, None, "update"
    )


@pytest.mark.parametrize(
    "text",
    [
        "kill:2",
        "explode:1:2",
        "kill:a:3",
        "kill:1:2:0",
        "kill:-1:2",
        "kill:1:2:3:4",
        "nan:1:2:sometimes",
        "nan:1:2:update",
        "bitflip:1:2:persistent",
        "kill:1:2:data",
        "nan:1:rejoin",
        "spike:1:rejoin",
        "slow:1:2",
        "slow:1:x:3",
        "slow:1:1.0:3",
        "slow:1:2:rejoin",
    ],
)
def test_parse_inject_rejects(text):
    with pytest.raises(ConfigError, match="KIND:RANK:STEP"):
        inject.parse_inject(text)


@pytest.mark.parametrize(
    "text", ["kill: 1:3", "kill:1 :3", "kill:+1:3", "kill:1:3 ", "kill:1:3:_2"]
)
def test_parse_inject_rejects_anything_but_plain_numbers(text):
    with pytest.raises(ConfigError, match="plain numbers"):
        inject.parse_inject(text)


def test_injection_beyond_the_last_step_is_refused():
    """An injection at a step the run never reaches would silently never fire."""
    inject.check_steps([inject.parse_inject("kill:0:9"), inject.parse_inject("kill:0:rejoin")], 10)
    with pytest.raises(ConfigError, match=r"at step 10, but the job runs steps 0..9"):
        inject.check_steps([inject.parse_inject("kill:0:10")], max_steps=10)


def test_scenario_injections_cover_every_tp_rank(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text(
        "injections:\n  - {step: 4, dp_rank: 1, kind: kill, downtime_steps: 3}\n"
        "  - {step: 6, dp_rank: 0, kind: crash}\n"
    )
    specs = inject.from_scenario(str(f), tp_size=2)
    assert specs == [
        inject.InjectionSpec("kill", 2, 4, 3),
        inject.InjectionSpec("kill", 3, 4, 3),
        inject.InjectionSpec("exception", 0, 6, None),
        inject.InjectionSpec("exception", 1, 6, None),
    ]


def test_scenario_kinds_that_cannot_be_injected(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("injections:\n  - {step: 4, dp_rank: 1, kind: slow}\n")
    with pytest.raises(ConfigError, match="cannot be injected"):
        inject.from_scenario(str(f), tp_size=1)


def test_injection_rank_out_of_range():
    with pytest.raises(ConfigError, match="the job has 4"):
        inject.check_ranks([inject.InjectionSpec("kill", 4, 1)], world_size=4)


def test_membership_maps_logical_replicas_to_group_ranks():
    m = Membership(num_replicas=4, replica=3, members=(3, 0, 1), group=None, generation=2)
    assert m.members == (0, 1, 3) and m.size == 3 and m.position == 2
    assert m.dead == (2,) and m.group_rank_of(1) == 1
    with pytest.raises(ValueError, match="not a member"):
        Membership(num_replicas=4, replica=2, members=(0, 1), group=None)
