"""State identity and the resume policy (issue 15, "never resume the wrong state"): which config
defines a run, how a run directory's identity is resolved, and which checkpoints `resume=auto`
and an explicit `checkpoint.resume` may load (pure: no megatron, no processes)."""

from __future__ import annotations

import json

import pytest

from megatron_mecefo.checkpoint import layout
from megatron_mecefo.checkpoint.manager import find_resume
from megatron_mecefo.checkpoint.resume import resolve
from megatron_mecefo.config.checkpoint import CheckpointConfig
from megatron_mecefo.config.loader import load_config
from megatron_mecefo.config.run import RunConfig
from megatron_mecefo.errors import CheckpointError
from megatron_mecefo.training import identity as ident
from megatron_mecefo.training.identity import StateIdentity

pytestmark = pytest.mark.timeout(60)
RUN = StateIdentity("run-a", "cfg-a", ("line1@0",), {"training": {"lr": 0.003}})


def _cfg(tmp_path, *overrides):
    return load_config(
        RunConfig, "configs/run/demo_cpu.yaml", [f"run_dir={tmp_path / 'run'}", *overrides]
    )


def _ckpt(root, step, identity=RUN):
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "common.pt").write_bytes(b"common")
    layout.write_marker(
        folder, step, {"config": identity.config}, identity=identity and identity.to_dict()
    )
    return folder


def _find(root, identity, resume="auto"):
    said = []
    cfg = CheckpointConfig(dir=str(root), resume=resume)
    found = find_resume(cfg, "unused", identity, log=said.append)
    return [(f.name, m and m["next_step"]) for f, m in found], said


def test_config_hash_covers_the_trajectory_only(tmp_path):
    base = ident.config_hash(_cfg(tmp_path), 2)
    same = (
        "training.max_steps=7",
        "checkpoint.keep_latest=5",
        "snapshot.interval=1",
        "parallel.tensor_model_parallel_size=2",
        "logging.print_interval=3",
        "run_dir=elsewhere",
    )
    assert ident.config_hash(_cfg(tmp_path, *same), 2) == base
    # the same global batch under another DP size (a supported resume) is the same trajectory
    assert ident.config_hash(_cfg(tmp_path, "training.num_microbatches=4"), 1) == base
    for other in ("training.seed=7", "training.lr=0.002", "model.ffn_hidden_size=96"):
        assert ident.config_hash(_cfg(tmp_path, other), 2) != base, other
    assert ident.config_hash(_cfg(tmp_path), 1) != base  # a smaller global batch


def test_relation_of_each_kind_of_checkpoint():
    rolled = RUN.branch(RUN.lineage, 10)
    assert rolled.lineage[0] == "line1@0" and rolled.lineage[1].endswith("@10")
    assert rolled.relation(rolled.to_dict(), 15) == "current"
    assert rolled.relation(RUN.to_dict(), 10) == "ancestor"  # the branch point and before
    assert rolled.relation(RUN.to_dict(), 8) == "ancestor"
    assert rolled.relation(RUN.to_dict(), 15) == "abandoned"  # rolled back: never resumed
    changed = StateIdentity(RUN.run_id, "cfg-b", RUN.lineage)
    assert RUN.relation(changed.to_dict(), 5) == "changed"
    assert RUN.relation(StateIdentity("run-b", "cfg-a", ("x@0",)).to_dict(), 5) == "foreign"
    assert RUN.relation(None, 5) == "unidentified"
    assert RUN.relation({"run_id": "run-a"}, 5) == "unidentified"


def test_auto_takes_the_current_line_newest_first_and_never_an_abandoned_one(tmp_path):
    for step in (10, 15, 20):
        _ckpt(tmp_path, step)
    rolled = RUN.branch(RUN.lineage, 10)
    _ckpt(tmp_path, 18, identity=rolled)
    layout.step_dir(tmp_path, 25).mkdir()  # a save that never completed
    found, said = _find(tmp_path, rolled)
    assert found == [("step_00000018", 18), ("step_00000010", 10)]
    assert "step_00000025: no commit.json" in said[0]
    assert "step_00000015, step_00000020 belong to an abandoned lineage" in said[-1]
    # before the rollback, line 1 was current: its newest first
    assert [f for f, _ in _find(tmp_path, RUN)[0]] == ["step_00000020", "step_00000015"] + [
        "step_00000010"
    ]


def test_a_committed_but_corrupt_marker_is_still_tried_and_refused_in_order(tmp_path):
    _ckpt(tmp_path, 4)
    bad = _ckpt(tmp_path, 8)
    marker = json.loads((bad / layout.MARKER).read_text())
    marker["next_step"] = 12
    (bad / layout.MARKER).write_text(json.dumps(marker))
    found, said = _find(tmp_path, RUN)
    assert found == [("step_00000008", None), ("step_00000004", 4)]
    assert "fails its own checksum" in said[0]


def test_auto_refuses_another_config_with_a_message_a_user_can_act_on(tmp_path):
    _ckpt(tmp_path, 5)
    now = StateIdentity(RUN.run_id, "cfg-b", RUN.lineage, {"training": {"lr": 0.001}})
    with pytest.raises(CheckpointError) as err:
        _find(tmp_path, now)
    text = str(err.value)
    assert "\n" not in text and "written with config cfg-a, this run's config is cfg-b" in text
    assert "(training.lr: 0.003 -> 0.001)" in text
    assert f"checkpoint.resume={layout.step_dir(tmp_path, 5)}" in text


def test_auto_never_starts_over_on_another_runs_checkpoints(tmp_path):
    _ckpt(tmp_path, 5)
    stranger = StateIdentity.fresh("cfg-z")
    with pytest.raises(CheckpointError, match="holds checkpoints of another run.*run run-a"):
        _find(tmp_path, stranger)
    _ckpt(tmp_path, 3, identity=stranger)  # but with state of its own, it takes that
    found, said = _find(tmp_path, stranger)
    assert found == [("step_00000003", 3)] and "step_00000005 belong to another run" in said[-1]
    assert _find(tmp_path, stranger, resume="never") == ([], [])


def test_an_explicit_resume_is_a_branch_from_that_folder(tmp_path):
    folder = _ckpt(tmp_path, 10)
    branch = StateIdentity(
        RUN.run_id, "cfg-b", (*RUN.lineage, "line2@10"), {"training": {"lr": 0.001}}
    )
    found, said = _find(tmp_path, branch, resume=str(folder))
    assert found == [("step_00000010", 10)]
    assert "a rollback/branch at step 10: new lineage line2@10 (parent line1@0)" in said[0]
    assert "written with config cfg-a (training.lr: 0.003 -> 0.001)" in said[0]
    with pytest.raises(CheckpointError, match="not the branch point"):
        _find(tmp_path, RUN, resume=str(folder))  # this run's own line: not a branch
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        _find(tmp_path, branch, resume=str(tmp_path / "step_00000099"))
    layout.step_dir(tmp_path, 12).mkdir()
    with pytest.raises(CheckpointError, match="never completed"):
        _find(tmp_path, branch, resume=str(layout.step_dir(tmp_path, 12)))


def test_resolve_continues_a_run_directory_and_branches_on_an_explicit_resume(tmp_path):
    cfg = _cfg(tmp_path)
    first = resolve(cfg, dp_size=1)
    assert first.lineage[-1].endswith("@0") and first.config is not None
    assert resolve(cfg, dp_size=1) != first  # no identity.json yet: each start is new
    (tmp_path / "run").mkdir()
    ident.write_file(tmp_path / "run", first)
    assert resolve(cfg, dp_size=1) == first  # resume=auto continues it
    assert resolve(cfg, dp_size=1, resume="never").run_id != first.run_id
    lr = resolve(_cfg(tmp_path, "training.lr=0.001"), dp_size=1)
    assert (lr.run_id, lr.lineage) == (first.run_id, first.lineage)
    assert lr.config_hash != first.config_hash  # (its checkpoints will be refused: "changed")
    folder = _ckpt(tmp_path / "ck", 10, identity=first)
    branch = resolve(cfg, dp_size=1, resume=str(folder))
    assert branch.run_id == first.run_id and branch.lineage[:-1] == first.lineage
    assert branch.lineage[-1].endswith("@10") and branch.relation(first.to_dict(), 10) == "ancestor"
    # every rank takes the agreed proposal, whatever it proposed itself
    agreed = resolve(cfg, dp_size=1, share=lambda _: json.dumps(branch.to_dict()))
    assert agreed == branch


def test_run_dir_records_the_identity_and_a_resume_trims_the_audit(tmp_path):
    from megatron_mecefo.training.run_dir import RunDir

    run = tmp_path / "run"
    audit = run / "audit"
    audit.mkdir(parents=True)
    rows = [{"step": s, "replica": 0, "tasks": [[0, 0, 0]]} for s in range(12)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 12, "repl'  # cut by a crash
    (audit / "tasks_rank0.jsonl").write_text(text)
    (audit / "state_rank0.json").write_text("{}")
    cfg = _cfg(tmp_path)
    RunDir(run, overwrite=False, resuming=True).create(cfg, {}, resume_step=8, identity=RUN)
    kept = [json.loads(x)["step"] for x in (audit / "tasks_rank0.jsonl").read_text().splitlines()]
    assert kept == list(range(8)) and not (audit / "state_rank0.json").exists()
    assert ident.read_file(run)["lineage"] == ["line1@0"]
    assert ident.read_file(run)["config"] == RUN.config
    RunDir(run, overwrite=True).create(cfg, {}, resume_step=0, identity=RUN)  # a fresh start
    assert (audit / "tasks_rank0.jsonl").read_text() == ""
