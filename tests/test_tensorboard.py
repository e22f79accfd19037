"""--tensorboard DIR: the event file holds, for every step, the numbers of the metrics file's record, read back
here through TFRecord framing checked by a CRC-32C of our own (TensorBoard's reader checks the same), and
without tensorboardX the option is one line saying what to install."""

import importlib.util
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from xtrain_dist.config import TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.train.job import train

# looked for, not imported: tensorboardX imports PyTorch where it is installed (4 CPU-seconds), which every
# pytest-xdist worker would pay for at collection; the one test that reads events imports it
if importlib.util.find_spec("tensorboardX") is None:
    pytest.skip("tensorboardX is not installed (pip install -e '.[tensorboard]')", allow_module_level=True)


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked(crc: int) -> int:
    """TFRecord's masked CRC: rotated right by 15 and offset, so a CRC of data holding CRCs stays strong."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path) -> list[bytes]:
    """The records of a TFRecord file: u64 length, masked CRC-32C of the length, data, masked CRC-32C of the
    data, each CRC checked."""
    raw, records, at = path.read_bytes(), [], 0
    while at < len(raw):
        header = raw[at:at + 8]
        (length,), (length_crc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[at + 8:at + 12])
        assert length_crc == masked(crc32c(header)), f"record at byte {at}: length CRC"
        data = raw[at + 12:at + 12 + length]
        (data_crc,) = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
        assert data_crc == masked(crc32c(data)), f"record at byte {at}: data CRC"
        records.append(data)
        at += 16 + length
    return records


def test_crc32c_is_castagnoli_s():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    assert crc32c(b"") == 0


def test_the_event_file_holds_every_number_of_every_metrics_record(tmp_path):
    from tensorboardX.proto import event_pb2

    corpus = Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)
    cfg = TrainConfig(steps=4, batch=4, seq=16, world_size=2, eval_every=2, eval_batches=1,
                      metrics=str(tmp_path / "m.jsonl"), tensorboard=str(tmp_path / "tb")).resolved()
    train(cfg, corpus, log=lambda line: None)
    (event_file,) = (tmp_path / "tb").iterdir()
    assert event_file.name.startswith("events.out.tfevents.")
    events = [event_pb2.Event.FromString(record) for record in read_records(event_file)]
    assert events[0].file_version == "brain.Event:2"
    scalars = {(value.tag, event.step): value.simple_value for event in events[1:] for value in event.summary.value}
    want = {}
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    groups = {"loss": "train", "lr": "train", "grad_norm": "train", "tokens_per_s": "speed", "ms": "speed",
              "comm_ms": "comm", "exposed_comm_ms": "comm", "peer_wait_ms": "comm", "val_loss": "eval"}
    for record in records:
        assert set(record) - {"step"} <= set(groups), record  # every field this run reports has its tag
        for key, value in record.items():
            if key != "step":
                want[(f"{groups[key]}/{key}", record["step"])] = float(np.float32(value))
    assert scalars == want
    assert {step for (tag, step) in scalars if tag == "eval/val_loss"} == {2, 4}


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_without_tensorboardx_or_with_a_file_for_dir_the_run_is_one_line_before_it_starts(tmp_path):
    (tmp_path / "stub" / "tensorboardX").mkdir(parents=True)  # a stand-in that fails to import, ahead of the real
    (tmp_path / "stub" / "tensorboardX" / "__init__.py").write_text("raise ImportError('stand-in')\n")
    out = run_cli(2, 2, 16, "--tensorboard", tmp_path / "tb",
                  env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "stub"), *sys.path])})
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("train_ddp: error: --tensorboard needs tensorboardX (from a clone of the repository: "
                          "pip install -e '.[tensorboard]')\n")
    (tmp_path / "file").write_text("")
    out = run_cli(2, 2, 16, "--tensorboard", tmp_path / "file")
    assert (out.returncode, out.stderr) == (2, f"train_ddp: error: --tensorboard '{tmp_path / 'file'}' is a file, "
                                               "not a folder\n")
    assert not (tmp_path / "tb").exists()
