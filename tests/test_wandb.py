"""--wandb PROJECT (train/wandb_log.py): the same scalars as --tensorboard, at the same steps, through the wandb
package. The real package is not in the test extra (too large): the run is checked through a stand-in that records
its calls (tests/wandb_stand_in), held to the real package's names, and, where the real package is installed, an
offline run's own file is read back."""

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from xtrain_dist.config import TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError, shown
from xtrain_dist.train import wandb_log
from xtrain_dist.train.job import train
from xtrain_dist.train.tensorboard import scalars

STAND_IN = Path(__file__).parent / "wandb_stand_in"


@pytest.fixture
def stand_in(monkeypatch):
    spec = importlib.util.spec_from_file_location("wandb", STAND_IN / "wandb" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def expected_logs(metrics_file) -> list:
    """What --wandb logs for each record of the metrics file: --tensorboard's tags and values, at its step."""
    records = [json.loads(line) for line in Path(metrics_file).read_text().splitlines()]
    return [("log", scalars(record), record["step"]) for record in records]


def test_a_run_logs_every_record_s_scalars_at_its_step(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "w"))
    corpus = Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)
    cfg = TrainConfig(steps=4, batch=4, seq=16, world_size=2, eval_every=2, eval_batches=1, wandb="proj",
                      metrics=str(tmp_path / "m.jsonl"), options={"steps": 4, "wandb": "proj"}).resolved()
    train(cfg, corpus, log=lambda line: None)
    init, *logs, finish = stand_in.calls
    assert init == ("init", {"project": "proj", "dir": str(tmp_path / "w"), "config": {"steps": 4, "wandb": "proj"},
                             "console": "off"})
    assert finish == ("finish",)
    assert logs == expected_logs(tmp_path / "m.jsonl")
    assert [step for _, _, step in logs] == [1, 2, 3, 4]
    assert {"train/loss", "train/lr", "train/grad_norm", "speed/ms", "speed/tokens_per_s"} <= set(logs[0][1])
    assert "eval/val_loss" in logs[1][1] and "eval/val_loss" not in logs[0][1]


def test_without_the_package_or_with_a_project_wandb_refuses_it_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(XtrainError) as err:
        wandb_log.check("proj")
    assert str(err.value) == ("--wandb needs the wandb package (from a clone of the repository: "
                              "pip install -e '.[wandb]')")


@pytest.mark.parametrize("project", ["", "a/b", "x:y", "p" * 129])
def test_a_project_name_wandb_would_refuse_is_one_line(stand_in, project):
    with pytest.raises(XtrainError) as err:
        wandb_log.check(project)
    assert str(err.value) == ("--wandb must be a W&B project name of at most 128 characters, none of / \\ # ? % :, "
                              f"got '{shown(project)}'")


def test_the_command_line_without_the_package_is_one_line_before_training(tmp_path):
    (tmp_path / "stub" / "wandb").mkdir(parents=True)  # a package that fails to import, ahead of any real one
    (tmp_path / "stub" / "wandb" / "__init__.py").write_text("raise ImportError('stand-in')\n")
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "2", "16", "--wandb", "proj"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "stub"), *sys.path])})
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("train_ddp: error: --wandb needs the wandb package (from a clone of the repository: "
                          "pip install -e '.[wandb]')\n")
    assert not (tmp_path / "wandb").exists()


def test_the_wandb_folder_inside_save_dir_is_refused(stand_in, tmp_path, monkeypatch):
    from xtrain_dist.train.preflight import check_outputs
    monkeypatch.chdir(tmp_path)
    with pytest.raises(XtrainError) as err:
        check_outputs(TrainConfig(steps=1, batch=1, seq=8, wandb="proj", save_dir="."))
    assert str(err.value) == ("the --wandb folder 'wandb' is inside --save-dir '.': every checkpoint save replaces "
                              "that folder")


# ---------------------------------------------------------------------------------------------- the real package
def real_wandb():
    try:
        import wandb
    except ImportError:
        pytest.skip("wandb is not installed (pip install -e '.[wandb]')")
    if not hasattr(wandb, "init") or Path(wandb.__file__).parent.parent == STAND_IN:
        pytest.skip("wandb is the stand-in")
    return wandb


def test_the_stand_in_has_the_real_packages_names_and_parameters():
    wandb = real_wandb()
    spec = importlib.util.spec_from_file_location("stand_in_wandb", STAND_IN / "wandb" / "__init__.py")
    ours = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ours)
    for name, real, mine in [("init", wandb.init, ours.init), ("Run.log", wandb.Run.log, ours.Run.log),
                             ("Run.finish", wandb.Run.finish, ours.Run.finish)]:
        real_params = inspect.signature(real).parameters
        for param in inspect.signature(mine).parameters:
            assert param in real_params or param == "kw", f"{name}: wandb has no parameter {param}"
    assert wandb.Settings(console="off").console == "off"


def read_wandb_records(path):
    """The protobuf Records of a .wandb file: LevelDB's log format after a 7-byte header (":W&B", 0xBEE1, version
    0), 32 KiB blocks of chunks (CRC-32 of the type byte and data, length, type: 1 whole, 2 first, 3 middle,
    4 last), each CRC checked."""
    from wandb.proto import wandb_internal_pb2
    raw, at, pending, records = Path(path).read_bytes(), 7, b"", []
    assert raw[:7] == b":W&B\xe1\xbe\x00"
    while at + 7 <= len(raw):
        left = 32768 - at % 32768
        if left < 7:  # a block's tail too short for a header is padding
            at += left
            continue
        crc, length, kind = int.from_bytes(raw[at:at + 4], "little"), int.from_bytes(raw[at + 4:at + 6], "little"), \
            raw[at + 6]
        if (crc, length, kind) == (0, 0, 0):
            at += left
            continue
        data = raw[at + 7:at + 7 + length]
        assert zlib.crc32(bytes([kind]) + data) == crc, f"chunk at byte {at}"
        pending += data
        at += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def test_an_offline_run_s_file_holds_every_record_s_scalars(tmp_path):
    real_wandb()
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "4", "4", "16", "--world-size", "2",
                          "--eval-every", "2", "--eval-batches", "1", "--metrics", "m.jsonl", "--wandb", "proj"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": "",
                              "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = read_wandb_records(run_file)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    keys = [[item.key or "/".join(item.nested_key) for item in h.item] for h in history]  # wandb 0.31: nested_key
    got = [("log", {key: json.loads(item.value_json) for key, item in zip(names, h.item, strict=True)
                    if not key.startswith("_")}, h.step.num) for names, h in zip(keys, history, strict=True)]
    want = expected_logs(tmp_path / "m.jsonl")
    assert [step for _, _, step in got] == [step for _, _, step in want] == [1, 2, 3, 4]
    for (_, values, _), (_, expected, _) in zip(got, want, strict=True):
        assert values.keys() == expected.keys()
        for key, value in expected.items():  # JSON of the float64: the same number
            assert values[key] == value, key
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "proj"
