"""A new run never replaces an earlier one: versioned folders, the refusal, and the
keys that say otherwise (resume, overwrite)."""

from __future__ import annotations

import json
import shutil

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedspc_app import client_app, server_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.experiments import centralized
from fedspc_app.runs.runfolder import claim_run_folder, earlier_run
from tests.inprocess import InProcessGrid


def config(tmp_path, **keys):
    return parse_run_config({"output-dir": str(tmp_path), **keys})


def finished(folder, rounds=3):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "summary.json").write_text(json.dumps({"complete": True, "rounds": rounds}))


def test_a_folder_without_run_files_holds_no_run(tmp_path):
    assert earlier_run(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert earlier_run(tmp_path / "empty") is None
    (tmp_path / "empty" / "partition.json").write_text("{}")
    assert earlier_run(tmp_path / "empty") is None


def test_what_a_folder_holds_is_said(tmp_path):
    finished(tmp_path / "done", rounds=20)
    assert earlier_run(tmp_path / "done") == "a finished run of 20 rounds"
    (tmp_path / "paused").mkdir()
    (tmp_path / "paused" / "checkpoint.json").write_text(json.dumps({"round": 7}))
    assert earlier_run(tmp_path / "paused") == "an unfinished run (checkpoint after round 7)"
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("not json")
    assert earlier_run(tmp_path / "broken") == "an earlier run"


def test_a_free_folder_is_used_as_named(tmp_path):
    for keys in ({}, {"run-name": "mine"}):
        plain = config(tmp_path, **keys)
        assert claim_run_folder(plain) == (plain, None)


def test_the_default_name_moves_on_to_the_next_free_version(tmp_path):
    plain = config(tmp_path)
    finished(plain.run_dir)
    claimed, note = claim_run_folder(plain)
    assert claimed.run_dir == tmp_path / f"{plain.resolved_run_name}-2"
    assert str(plain.run_dir) in note and "finished run of 3 rounds" in note
    assert f"run-name = '{plain.resolved_run_name}-2'" in note
    finished(claimed.run_dir)
    assert claim_run_folder(plain)[0].run_name == f"{plain.resolved_run_name}-3"
    # Only the named folder is looked at: -2 removed, it is free again.
    shutil.rmtree(claimed.run_dir)
    assert claim_run_folder(plain)[0].run_name == f"{plain.resolved_run_name}-2"


def test_an_explicit_name_is_refused_naming_the_ways_forward(tmp_path):
    named = config(tmp_path, **{"run-name": "mine"})
    finished(named.run_dir)
    with pytest.raises(ConfigError) as error:
        claim_run_folder(named)
    message = str(error.value)
    assert str(named.run_dir) in message and "finished run of 3 rounds" in message
    for way in ("resume = true", "run-name", "overwrite = true"):
        assert way in message


@pytest.mark.parametrize("key", ["resume", "overwrite"])
def test_resume_and_overwrite_keep_the_named_folder(tmp_path, key):
    for keys in ({}, {"run-name": "mine"}):
        chosen = config(tmp_path, **keys, **{key: True})
        finished(chosen.run_dir)
        (chosen.run_dir / "checkpoint.json").write_text(json.dumps({"round": 3}))
        assert claim_run_folder(chosen) == (chosen, None)


def test_resuming_recorded_rounds_without_a_checkpoint_is_refused_and_keeps_them(tmp_path):
    # A run with checkpoint = false (or whose checkpoint was removed): resume = true
    # would start it over from round 1, replacing its metrics and summary.
    for keys in ({}, {"run-name": "mine"}):
        chosen = config(tmp_path, **keys, resume=True)
        finished(chosen.run_dir, rounds=50)
        (chosen.run_dir / "metrics.json").write_text(json.dumps({"rounds": [{"round": 1}]}))
        before = {p.name: p.read_bytes() for p in chosen.run_dir.iterdir()}
        with pytest.raises(ConfigError) as error:
            claim_run_folder(chosen)
        message = str(error.value)
        assert str(chosen.run_dir) in message and "finished run of 50 rounds" in message
        assert "no checkpoint" in message and "overwrite = true" in message
        assert {p.name: p.read_bytes() for p in chosen.run_dir.iterdir()} == before
    # Nothing recorded yet (a run stopped before its first round): it starts over.
    started = config(tmp_path, **{"run-name": "started"}, resume=True)
    started.run_dir.mkdir()
    (started.run_dir / "config.json").write_text("{}")
    assert claim_run_folder(started) == (started, None)
    fresh = config(tmp_path, **{"run-name": "fresh"}, resume=True)
    assert claim_run_folder(fresh) == (fresh, None)


def test_resume_and_overwrite_together_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match="set one of them"):
        config(tmp_path, resume=True, overwrite=True)


def test_a_centralized_run_is_versioned_like_a_federated_one(tmp_path):
    echoed = []
    first = centralized.build_config({}, output_dir=str(tmp_path), echo=echoed.append)
    assert first.run_name == "centralized-digits-cnn-s0" and not echoed
    finished(first.run_dir)
    second = centralized.build_config({}, output_dir=str(tmp_path), echo=echoed.append)
    assert second.run_name == "centralized-digits-cnn-s0-2" and len(echoed) == 1
    with pytest.raises(ConfigError, match="overwrite = true"):
        centralized.build_config({}, run_name="centralized-digits-cnn-s0",
                                 output_dir=str(tmp_path))


def test_a_client_uses_the_run_name_the_server_settled_on(tmp_path):
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                      run_config={"output-dir": str(tmp_path)})
    InProcessGrid(client_app.app, 1, {})  # sets the task identity a Message needs
    message = Message(RecordDict({"config": ConfigRecord({"run-name": "x-2"})}),
                      dst_node_id=1, message_type=MessageType.TRAIN)
    assert client_app.node_run_config(context).run_name == ""
    assert client_app.node_run_config(context, message).run_dir == tmp_path / "x-2"


def test_a_second_flwr_run_goes_beside_the_first_and_leaves_it_whole(tmp_path):
    """The ServerApp's own path (plain ``flwr run``): FedRep + FedSPC twice with the
    default run name and other num-rounds; the first run's files stay byte for byte,
    the second writes <name>-2, its clients' state included."""
    run_config = {"method": "fedrep", "fedspc": True, "num-rounds": 1, "local-epochs": 1,
                  "batch-size": 64, "alpha": 0.5, "output-dir": str(tmp_path),
                  "keep-client-state": True}

    def run(**changes):
        keys = {**run_config, **changes}
        grid = InProcessGrid(client_app.app, 2, keys)
        server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                      run_config=keys))
        return grid

    run()
    first = parse_run_config(run_config).run_dir
    before = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()
              and p.name != ".lock"}
    assert any(p.parts[0] == "client-state" for p in before)
    grid = run(**{"num-rounds": 2})
    after = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()
             and p.name != ".lock"}
    assert after == before
    second = first.with_name(first.name + "-2")
    summary = json.loads((second / "summary.json").read_text())
    assert summary["complete"] and summary["rounds"] == 2
    assert sorted(p.name for p in (second / "client-state").iterdir()) == [
        ".partition-0.lock", ".partition-1.lock", "partition-0.npz", "partition-1.npz",
        "run.json"]
    assert {m.content.config_records["config"]["run-name"] for m in grid.sent} == {second.name}


def test_the_launchers_submit_the_versioned_name_and_read_that_folder(tmp_path, capsys):
    """python -m fedspc_app.simulate and the grid runner: the run-config they hand to
    ``flwr run`` names the free folder, and the summary is read from it."""
    from fedspc_app.launch.superlink import submit_and_check

    run_config = {"output-dir": str(tmp_path), "num-rounds": 1}
    first = parse_run_config(run_config).run_dir
    finished(first)
    submitted = {}

    def submit(merged):
        submitted.update(merged)
        folder = tmp_path / merged["run-name"]
        finished(folder, rounds=1)
        return 0

    summary = submit_and_check(run_config, submit)
    assert submitted["run-name"] == first.name + "-2" and summary["rounds"] == 1
    assert json.loads((first / "summary.json").read_text())["rounds"] == 3  # untouched
    assert f"this run writes {first.parent / (first.name + '-2')}" in capsys.readouterr().err
