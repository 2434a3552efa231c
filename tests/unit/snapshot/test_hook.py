"""The snapshot hook on a small torch model: the save point does not wait for the copy, the next
update does; a snapshot that cannot be written (no space, bad folder) is logged and training
goes on; the restored state equals the state at the save point even if training moved on."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_mecefo.config.snapshot import SnapshotConfig
from megatron_mecefo.snapshot.hook import SnapshotHook
from megatron_mecefo.snapshot.slots import SlotPair
from megatron_mecefo.training.identity import StateIdentity

pytestmark = pytest.mark.timeout(60)


def _engine():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    engine = types.SimpleNamespace(
        ddp=types.SimpleNamespace(module=model), optimizer=opt, before_update=[]
    )
    return engine


def _train_step(engine):
    for wait in engine.before_update:
        wait()
    model = engine.ddp.module
    loss = model(torch.ones(4, 64)).square().mean()
    loss.backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()


def test_snapshot_holds_the_state_of_its_save_point(tmp_path):
    engine = _engine()
    _train_step(engine)
    identity = StateIdentity("run", "cfg", ("line@0",))
    hook = SnapshotHook(
        SnapshotConfig(interval=1), tmp_path, 0, max_steps=100, log=print, identity=identity
    )
    hook.attach(engine)
    expected = {k: v.clone() for k, v in engine.ddp.module.state_dict().items()}
    hook.save(engine, 1)
    _train_step(engine)  # waits for the copy before it updates the weights
    hook.wait_done()
    assert not torch.equal(engine.ddp.module.weight, expected["weight"])
    step, state = SlotPair(tmp_path, 0).newest(check=identity.snapshot_mismatch)
    assert step == 1 and state["next_step"] == 1
    assert SlotPair(tmp_path, 0).clean()[0][0].meta == identity.slot_meta()
    for name, tensor in expected.items():
        assert torch.equal(state["model"][name], tensor)
    assert state["optimizer"]["state"][0]["exp_avg"].shape == (64, 64)


def test_an_unwritable_snapshot_is_logged_and_training_goes_on(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the snapshot folder should be")
    engine = _engine()
    logged = []
    hook = SnapshotHook(SnapshotConfig(interval=1), blocker, 0, max_steps=100, log=logged.append)
    hook.attach(engine)
    hook.save(engine, 1)
    _train_step(engine)
    hook.save(engine, 2)  # reports the first failure, tries again
    hook.wait_done()
    assert hook.stats["failed"] == 2 and hook.stats["saved"] == 0
    assert len(logged) == 2 and all("training goes on" in m for m in logged)
