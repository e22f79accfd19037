"""The command line as a user meets it: a real run in a subprocess, and one exact line for each bad input."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import forked
import pytest

from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER


def cli(*args, timeout=120, env=None):
    """`python -m xtrain_dist.train_ddp args`, forked from a process that has imported the package (forked.py)
    unless env adds variables to this process's."""
    return forked.run(["-m", "xtrain_dist.train_ddp", *map(str, args)], timeout=timeout,
                      env={**os.environ, **env} if env else None)


def test_a_run_prints_progress_and_writes_the_report(tmp_path):
    report = tmp_path / "sub" / "report.json"
    out = cli(6, 4, 16, "--world-size", 2, "--seed", 3, "--report", report)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 6
    for key in ("loss", "lr", "norm", "ms", "tok/s"):
        assert key in progress[0]
    assert all(re.search(r" \| \d+:\d\d:\d\d elapsed, \d+:\d\d:\d\d left( \||$)", line) for line in progress)
    assert " elapsed, 0:00:00 left" in progress[-1]  # the last step: nothing left
    data = json.loads(report.read_text())
    assert len(data["losses"]) == 6 and len(data["param_sha256"]) == 2
    assert data["param_sha256"][0] == data["param_sha256"][1]
    assert data["config"]["world_size"] == 2 and data["config"]["seed"] == 3
    assert data["config"]["sample_prompt"] == "" and data["samples"] == []  # a str default, not argparse's bytes
    # numpy queues nothing to capture: said in the report, not in a line
    assert data["cuda_graph"] == {"mode": "auto", "replayed_steps": 0,
                                  "without": "the numpy backend queues nothing to capture"}
    assert not [line for line in lines if "graph" in line]
    assert not list(report.parent.glob(".*tmp*"))  # no temporary left behind


def test_profile_step_prints_where_the_step_went_and_changes_no_bits(tmp_path):
    """--profile-step times every op of one step on rank 0 and prints the table; the run's parameters are
    those of the same run without it. Under bucketed sync with bf16 compression the communication thread
    rounds the buckets: its calls are not the rank's ops and stay out of the table; the rank's thread rounds
    the tail it reduces itself after backward (parallel/ddp.py), before and after the sum: two calls."""
    args = (4, 8, 16, "--world-size", 2, "--eval-batches", 0, "--grad-compress", "bf16")
    plain, profiled = tmp_path / "plain.json", tmp_path / "profiled.json"
    assert cli(*args, "--report", plain).returncode == 0
    out = cli(*args, "--report", profiled, "--profile-step", 3)
    assert out.returncode == 0, out.stderr
    assert "profile of step 3 (rank 0, " in out.stdout and "| matmul_backward | 9 |" in out.stdout
    a, b = json.loads(plain.read_text()), json.loads(profiled.read_text())
    assert a["param_sha256"] == b["param_sha256"] and "profile" not in a
    ops = {row["op"]: row for row in b["profile"]["ops"]}
    # 2 layers: 4 products each (c_fc's with GELU beside it) and the tied classifier; one AdamW over the flat buffer
    assert ops["matmul_forward"]["calls"] == 7 and ops["matmul_gelu_forward"]["calls"] == 2
    assert ops["adamw_update"]["calls"] == 1
    assert ops["bf16_round"]["calls"] == 2
    assert b["profile"]["step"] == 3 and b["profile"]["step_ms"] == b["step_ms"][2]
    assert sum(row["share"] for row in b["profile"]["ops"]) == pytest.approx(1.0)
    assert error_line(cli(*args, "--profile-step", 5)) == \
        "train_ddp: error: --profile-step 5 is not a step of this run (it runs steps 1 to 4)"


def test_profile_step_under_zero_2_counts_the_classifiers_late_weight_gradient():
    """ZeRO-2/3 take the tied classifier's weight gradient at the embedding's backward, a matmul_backward with no
    weight (the input gradient's product left out): the profiler counts it as one product. It failed on the None
    weight before ('NoneType' object has no attribute 'shape')."""
    out = cli(3, 8, 32, "--world-size", 2, "--zero", 2, "--profile-step", 2, "--eval-batches", 0)
    assert out.returncode == 0, out.stderr
    assert "profile of step 2 (rank 0, " in out.stdout and "| matmul_backward | 10 |" in out.stdout


def test_explicit_tokenizer_and_corpus(tmp_path):
    out = cli(2, 2, 16, DEFAULT_TOKENIZER, DEFAULT_CORPUS)
    assert out.returncode == 0, out.stderr
    # after options too, as users type them: the same run
    after = cli(2, 2, 16, "--log-every", 1, DEFAULT_TOKENIZER, DEFAULT_CORPUS)
    assert after.returncode == 0, after.stderr
    assert after.stdout.splitlines()[-1].split(",")[0] == out.stdout.splitlines()[-1].split(",")[0]


def test_every_option_is_in_the_docs_option_tables():
    """The option tables of the README and the docs pages (first cells of rows starting `| `--`) name every
    option --help has: three had gone missing from them before this test."""
    from xtrain_dist.train.cli import build_parser

    repo = Path(__file__).parents[1]
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    first_cells = " ".join(line.split(" | ")[0] for page in pages for line in page.read_text().splitlines()
                           if line.startswith("| `--"))
    options = {flag for action in build_parser()._actions for flag in action.option_strings
               if flag.startswith("--") and flag != "--help"}
    assert len(options) > 40
    assert sorted(flag for flag in options if not re.search(re.escape(flag) + r"(?![\w-])", first_cells)) == []


def test_help_describes_every_option_with_its_default_and_ends_with_examples_that_parse():
    import argparse
    import shlex

    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.train.cli import EXAMPLES, build_parser, parse_config

    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, action.option_strings
        shown = formatter._expand_help(action)
        assert "default" in shown or isinstance(action, argparse._StoreTrueAction), shown
    text = parser.format_help()
    for option, default in (("--lr LR", "0.001"), ("--grad-clip GRAD_CLIP", "1.0"), ("--seed SEED", "1337"),
                            ("--backend {numpy,cuda}", "numpy"), ("--weight-decay WEIGHT_DECAY", "0.1"),
                            ("--log-every N", "1"), ("--model MODEL", "tiny"), ("--save-every N", "0"),
                            ("--comm-timeout COMM_TIMEOUT", "300.0")):
        described = " ".join(text.split(f"  {option}", 1)[1].split("\n  --", 1)[0].split())
        assert described.endswith(f"(default: {default})"), (option, described)
    assert text.rstrip().endswith(EXAMPLES.rstrip())
    commands = [" ".join(block.split()) for block in EXAMPLES.replace("\\\n", " ").split("\n")
                if block.startswith("  xtrain-train ")]
    assert len(commands) == 4
    for command in commands:
        args = shlex.split(command)[1:]
        if "--config" not in args:  # that one reads a file of a run that is not there
            parse_config(args, Launch("single"))


def error_line(out):
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize("args, message", [
    ((0, 8, 32), "STEPS must be a positive integer, got '0'"),
    (("x", 8, 32), "STEPS must be a positive integer, got 'x'"),
    ((5, -1, 32), "BATCH must be a positive integer, got '-1'"),
    ((5, 8, "1.5"), "SEQ must be a positive integer, got '1.5'"),
    ((5, 1, 32, "--world-size", 2), "BATCH (1) must be at least the world size (2): every rank needs a sequence"),
    ((5, 8, 32, "--world-size", 0), "--world-size must be a positive integer, got '0'"),
    ((5, 8, 32, "--world-size", 1.5), "--world-size must be a positive integer, got '1.5'"),
    ((5, 8, 32, "--log-every", 0), "--log-every must be a positive integer, got '0'"),
    ((5, 8, 32, "--report", ""), "--report must be a path, got ''"),
    ((5, 8, 32, "--save-dir", ""), "--save-dir must be a path, got ''"),
    ((5, 8, 32, "--min-lr", "0.01"), "--min-lr (0.01) must not exceed --lr (0.001): the schedule decays from the one "
                                     "to the other"),
    ((5, 8, 32, "--lr-schedule", "constant", "--min-lr", "0.0001"), "--min-lr has no effect with --lr-schedule "
                                                                    "constant"),
    ((5, 8, 32, "--lr-schedule", "constant", "--lr-decay-steps", 3), "--lr-decay-steps is for a schedule that "
     "decays, not --lr-schedule constant; the warmup is --warmup-steps (default STEPS/20)"),
    ((5, 8, 32, "--cooldown-steps", 2), "--cooldown-steps is for --lr-schedule wsd (this run's schedule is cosine)"),
    ((5, 8, 32, "--lr-schedule", "wsd", "--warmup-steps", 3, "--cooldown-steps", 3),
     "--warmup-steps (3) and --cooldown-steps (3) together exceed --lr-decay-steps (5): the cooldown would start in "
     "the warmup"),
    ((5, 8, 32, "--tf32"), "--tf32 is a choice of the cuda backend's matmuls; the numpy backend computes in float32 "
                           "only"),
    ((5, 8, 32, "--matmul", "cublaslt"), "--matmul cublaslt is a choice of the cuda backend's matmuls; the numpy "
                                         "backend's products are numpy's"),
    ((5, 8, 32, "--cuda-graph", "on"), "--cuda-graph must be one of auto, off, got 'on'"),
    ((5, 8, 32, "--comm-priority", "high"), "--comm-priority must be one of auto, realtime, normal, got 'high'"),
    ((5, 8, 32, "--grad-sync", "flat", "--comm-priority", "normal"), "--comm-priority has no effect without a "
     "communication thread (--grad-sync bucketed, or --zero 2 or 3)"),
    ((5, 8, 32, "--cpu-threads", "two"), "--cpu-threads must be a positive integer, got 'two'"),
    ((5, 8, 32, "--resume", "auto"), "--resume auto continues from the checkpoint in --save-dir: give --save-dir"),
    ((5, 8, 200), "SEQ (200) exceeds the context length of model 'tiny' (128)"),
    ((5, 8, 32, "--model", "huge"), "--model must be one of tiny, mini, small, gpt2-124m, gpt2-350m, gpt2-774m, "
                                    "got 'huge'"),
    ((5, 8, 32, DEFAULT_TOKENIZER), "give both TOKENIZER and CORPUS, or neither (for the shipped data)"),
    # an empty one is not "not given": it would have trained on the shipped data
    ((5, 8, 32, "", DEFAULT_CORPUS), "TOKENIZER must be a path, got ''"),
    ((5, 8, 32, DEFAULT_TOKENIZER, ""), "CORPUS must be a path, got ''"),
])
def test_bad_arguments_get_one_line(args, message):
    assert error_line(cli(*args)) == f"train_ddp: error: {message}"


def test_batch_equal_to_the_world_size_is_enough():
    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.train.cli import parse_config

    assert parse_config(["1", "2", "16", "--world-size", "2"], launch=Launch("single")).batch == 2


@pytest.mark.parametrize("flag, value, field, parsed", [
    ("--rdzv-bind", "0.0.0.0", "rdzv_bind", "0.0.0.0"),
    ("--rdzv-advertise", "node7:31000", "rdzv_advertise", "node7:31000"),
    ("--rdzv-timeout", "60", "rdzv_timeout_s", 60.0),
])
def test_rendezvous_options_are_for_jobs_of_several_processes(flag, value, field, parsed):
    """Alone, a process meets nobody: the option would be ignored, so it is refused; in a job of two it is taken."""
    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.errors import XtrainError
    from xtrain_dist.train.cli import parse_config

    with pytest.raises(XtrainError) as info:
        parse_config(["5", "8", "32", flag, value], launch=Launch("single"))
    assert str(info.value) == (f"{flag} is for a job of several processes (started by torchrun, srun or mpirun); "
                               "this one runs alone")
    cfg = parse_config(["5", "8", "32", flag, value], launch=Launch("torchrun", num_processes=2))
    assert getattr(cfg, field) == parsed
    assert parse_config(["5", "8", "32"], launch=Launch("torchrun", num_processes=2)).rdzv_timeout_s == 300.0


def test_missing_files(tmp_path):
    missing = tmp_path / "nope.json"
    assert error_line(cli(5, 8, 32, missing, DEFAULT_CORPUS)) == f"train_ddp: error: tokenizer '{missing}' not found"
    missing_corpus = tmp_path / "nope.txt"
    assert error_line(cli(5, 8, 32, DEFAULT_TOKENIZER, missing_corpus)) == \
        f"train_ddp: error: corpus '{missing_corpus}' not found"


def special_inputs(tmp_path) -> dict:
    """Inputs that are not regular files, each where a run reads one: a named pipe (open() blocks until a
    writer comes, so a run hung forever), a device (/dev/zero read until memory ran out; /dev/null here, which
    ends), a glob of token files that matches a pipe, and checkpoint folders holding one."""
    import numpy as np

    from xtrain_dist.data.token_files import token_file_chunks

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "a.bin").write_bytes(b"".join(bytes(c) for c in token_file_chunks(np.arange(500), 4096)))
    os.mkfifo(bins / "b.bin")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    os.mkfifo(hf / "model.safetensors")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / "manifest.json")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (ckpt / name).write_text("")
    pipe = "is a named pipe, not a regular file"
    return {
        "tokenizer": ([fifo, DEFAULT_CORPUS], f"tokenizer '{fifo}' {pipe}"),
        "corpus": ([DEFAULT_TOKENIZER, fifo], f"corpus '{fifo}' {pipe}"),
        "a device as the corpus": ([DEFAULT_TOKENIZER, "/dev/null"],
                                   "corpus '/dev/null' is a character device, not a regular file"),
        "a glob of token files": ([DEFAULT_TOKENIZER, bins / "*.bin"],
                                  f"corpus '{bins / '*.bin'}' matches '{bins / 'b.bin'}', which {pipe}"),
        "--val-corpus": (["--val-corpus", fifo, "--eval-batches", 1], f"validation corpus '{fifo}' {pipe}"),
        "--hellaswag": (["--hellaswag", fifo], f"--hellaswag '{fifo}' {pipe}"),
        "--init-from": (["--init-from", hf], f"--init-from '{hf}': cannot read model.safetensors (a named pipe, "
                                             "not a regular file)"),
        "--resume": (["--resume", ckpt], f"checkpoint '{ckpt}': cannot read manifest.json (a named pipe, not a "
                                         "regular file)"),
    }


@pytest.mark.parametrize("where", ["tokenizer", "corpus", "a device as the corpus", "a glob of token files",
                                   "--val-corpus", "--hellaswag", "--init-from", "--resume"])
def test_an_input_that_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path, where):
    args, message = special_inputs(tmp_path)[where]
    assert error_line(cli(2, 4, 16, *args, timeout=60)) == f"train_ddp: error: {message}"


def test_a_file_that_is_not_a_tokenizer(tmp_path):
    bogus = tmp_path / "tok.json"
    bogus.write_text("this is not json")
    line = error_line(cli(5, 8, 32, bogus, DEFAULT_CORPUS))
    assert line.startswith(f"train_ddp: error: tokenizer '{bogus}' is not a tokenizers JSON file")


def test_a_tokenizer_without_a_vocabulary(tmp_path):
    """It encoded every corpus to nothing, and the run blamed the corpus for being empty."""
    import tokenizers

    empty = tmp_path / "empty.json"
    tokenizers.Tokenizer(tokenizers.models.BPE()).save(str(empty))
    assert error_line(cli(5, 8, 32, empty, DEFAULT_CORPUS)) == (
        f"train_ddp: error: tokenizer '{empty}' has 0 tokens in its vocabulary: a language model needs at least 2 "
        "to choose between")


def test_a_corpus_shorter_than_seq(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question.\n" * 3)
    line = error_line(cli(5, 2, 100, DEFAULT_TOKENIZER, short))
    assert line.startswith(f"train_ddp: error: corpus '{short}' is too short for SEQ=100")


def test_cuda_where_there_is_none_is_an_error_not_a_cpu_run():
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU")
    line = error_line(cli(2, 2, 16, "--backend", "cuda"))
    assert line.startswith("train_ddp: error: --backend cuda")
    from xtrain_dist.backend.cuda.device import cupy, driver_present
    if cupy is not None and not driver_present():
        # CuPy without a driver: CUDA's own words would be "CUDA driver version is insufficient"
        assert line == ("train_ddp: error: --backend cuda: no CUDA device or driver is present on this machine "
                        "(libcuda.so.1 cannot be loaded)")


TIMEOUT = "a number of seconds > 0 and at most 604800 (a week)"


@pytest.mark.parametrize("flag, value, message", [
    ("--seed", "-1", "--seed must be an integer >= 0, got '-1'"),
    ("--lr", "nan", "--lr must be a number >= 0, got 'nan'"),
    ("--lr", "-1", "--lr must be a number >= 0, got '-1'"),
    ("--min-lr", "inf", "--min-lr must be a number >= 0, got 'inf'"),
    ("--weight-decay", "nan", "--weight-decay must be a number >= 0, got 'nan'"),
    ("--grad-clip", "-1", "--grad-clip must be a number >= 0, got '-1'"),
    ("--warmup-steps", "-5", "--warmup-steps must be an integer >= 0, got '-5'"),
    ("--lr-decay-steps", "0", "--lr-decay-steps must be a positive integer, got '0'"),
    # a NaN or infinite timeout would switch off the protection against a hung peer, and one past what a
    # socket takes (1e10 s overflows time_t) was a traceback on every process of a TCP job
    ("--comm-timeout", "nan", f"--comm-timeout must be {TIMEOUT}, got 'nan'"),
    ("--comm-timeout", "0", f"--comm-timeout must be {TIMEOUT}, got '0'"),
    ("--comm-timeout", "1e10", f"--comm-timeout must be {TIMEOUT}, got '1e10'"),
    ("--rdzv-timeout", "inf", f"--rdzv-timeout must be {TIMEOUT}, got 'inf'"),
    ("--rdzv-timeout", "604801", f"--rdzv-timeout must be {TIMEOUT}, got '604801'"),
    ("--profile-step", "0", "--profile-step must be a positive integer, got '0'"),
])
def test_numeric_options_are_checked_before_anything_runs(flag, value, message):
    from xtrain_dist.errors import XtrainError
    from xtrain_dist.train.cli import parse_config

    with pytest.raises(XtrainError) as info:
        parse_config(["5", "8", "32", flag, value])
    assert str(info.value) == message


def test_a_report_that_cannot_be_written_fails_before_training(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    assert error_line(cli(5, 4, 16, "--report", tmp_path)) == f"train_ddp: error: --report '{tmp_path}' is a folder, " \
                                                               "not a file"
    inside_a_file = blocker / "r.json"
    assert error_line(cli(5, 4, 16, "--report", inside_a_file)) == \
        f"train_ddp: error: --report '{inside_a_file}' cannot be written (a part of its folder is a file)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # no probe or temporary left behind


def test_outputs_on_the_runs_own_files_are_refused_before_anything_is_written(tmp_path):
    """--report and --metrics are compared with the tokenizer, the corpus and each other as files, not
    names (a symlink or a hard link is the same file), and refused inside --save-dir, which every save
    replaces, as is the corpus, and inside the folder of --resume or --init-from. Every file keeps its bytes
    and none appears."""
    tok, corpus, ckpt = tmp_path / "tok.json", tmp_path / "corpus.txt", tmp_path / "ckpt"
    tok.write_bytes(Path(DEFAULT_TOKENIZER).read_bytes())
    corpus.write_text(Path(DEFAULT_CORPUS).read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    (tmp_path / "hard.txt").hardlink_to(corpus)
    (tmp_path / "link.json").symlink_to(tok)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    own = "the run would write into its own input"
    for args, message in [
        (("--report", corpus), f"--report '{corpus}' is the corpus '{corpus}': {own}"),
        (("--metrics", tmp_path / "hard.txt"), f"--metrics '{tmp_path / 'hard.txt'}' is the corpus '{corpus}': {own}"),
        (("--report", tmp_path / "link.json"), f"--report '{tmp_path / 'link.json'}' is the tokenizer '{tok}': {own}"),
        (("--report", tmp_path / "x.json", "--metrics", tmp_path / "x.json"),
         f"--report '{tmp_path / 'x.json'}' and --metrics '{tmp_path / 'x.json'}' are the same file: the report "
         "would replace the metrics"),
        (("--metrics", ckpt / "m.jsonl", "--save-dir", ckpt),
         f"--metrics '{ckpt / 'm.jsonl'}' is inside --save-dir '{ckpt}': every checkpoint save replaces that folder"),
        (("--save-dir", tmp_path),
         f"corpus '{corpus}' is inside --save-dir '{tmp_path}': every checkpoint save replaces that folder"),
        # the folders a run reads its start from (an audit wrote a report over a checkpoint's weights)
        (("--resume", ckpt, "--report", ckpt / "model.safetensors"), f"--report '{ckpt / 'model.safetensors'}' is "
         f"inside --resume '{ckpt}': the run would write into the checkpoint it reads"),
        (("--init-from", ckpt, "--metrics", ckpt / "trainer_state.json"), f"--metrics '{ckpt / 'trainer_state.json'}' "
         f"is inside --init-from '{ckpt}': the run would write into the checkpoint it reads"),
    ]:
        assert error_line(cli(2, 4, 16, tok, corpus, *args)) == f"train_ddp: error: {message}"
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("flag", ["CORPUS", "--report", "--save-dir", "--resume"])
def test_a_name_longer_than_the_file_system_allows_is_bad_input(tmp_path, flag):
    """pathlib's stat() raises ENAMETOOLONG wherever such a path is first looked at: one line, status 2."""
    long = tmp_path / ("x" * 300)
    args = (DEFAULT_TOKENIZER, long) if flag == "CORPUS" else (flag, long)
    assert error_line(cli(2, 4, 16, *args)) == \
        f"train_ddp: error: '{long}' cannot be used: a name in it is longer than the file system allows"


def test_a_report_to_a_pipe(tmp_path):
    """A device or a pipe (here /dev/stdout, a pipe to this test) is written as it is, not replaced by a
    regular file (tests/test_files.py holds the rest of how outputs are written)."""
    out = cli(2, 2, 16, "--report", "/dev/stdout", "--log-every", 5)
    assert out.returncode == 0, out.stderr
    report = out.stdout[:out.stdout.index("done: ")]
    report = report[report.index("{"):]
    assert len(json.loads(report)["losses"]) == 2


def test_metrics_that_cannot_be_appended_name_the_file(tmp_path):
    from xtrain_dist.errors import XtrainError
    from xtrain_dist.train import metrics

    with pytest.raises(XtrainError) as info:
        metrics.append(tmp_path, {"step": 1})  # a folder: the open fails as a full disk's write would
    assert str(info.value).startswith(f"cannot append to --metrics '{tmp_path}' (")


def test_a_run_that_diverges_stops_with_one_line_and_keeps_the_checkpoint(tmp_path):
    """--lr 1e30: the first step is finite, the second overflows to nan on every rank. The run stops there,
    exit 1, with the progress line and one error line (no numpy warnings), and the checkpoint it resumed
    from, which the run would have saved over, keeps its bytes."""
    ckpt = tmp_path / "ckpt"
    assert cli(2, 4, 16, "--world-size", 2, "--save-dir", ckpt).returncode == 0
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    out = cli(5, 4, 16, "--world-size", 2, "--lr", "1e30", "--resume", ckpt, "--save-dir", ckpt)
    assert out.returncode == 1
    finite, diverged = out.stdout.splitlines()[-2:]
    assert finite.startswith("step     3/5 | loss 8.") and diverged.startswith("step     4/5 | loss nan |"), out.stdout
    assert out.stderr.splitlines() == [
        "train_ddp: error: rank 0 failed: step 4: training diverged (loss nan, gradient norm nan): the parameters "
        "are no longer finite, so the run stops here and saves nothing; lower --lr"]
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == before


def test_sigterm_ends_the_run_after_a_step_with_its_checkpoint_and_status_143(tmp_path):
    """What a scheduler's SIGTERM (or SLURM's --signal=USR1) gets: the run stops after the step it is in,
    saves it, says so and how to go on, and exits 143 (128 + SIGTERM) so that what follows it in a script
    knows the run did not finish; with --resume auto, the same command goes on. Without --save-dir it says
    nothing was saved."""
    for save in (["--save-dir", str(tmp_path / "ck"), "--resume", "auto"], []):
        proc = subprocess.Popen([sys.executable, "-m", "xtrain_dist.train_ddp", "5000", "8", "32", "--world-size", "2",
                                 "--log-every", "1000", *save], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            if save:
                assert proc.stdout.readline() == f"--resume auto: no checkpoint in '{tmp_path / 'ck'}' yet: starting " \
                                                 "at step 1\n"
            assert proc.stdout.readline().startswith("tiny: GPTConfig")
            assert proc.stdout.readline().startswith("step     1/5000 |")  # training is under way
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == 143, err
        lines = out.splitlines()  # after step 1: the step it stopped after, (the save,) the summary
        assert len(lines) == (3 if save else 2), out
        step = int(re.fullmatch(r"step +(\d+)/5000 \|.*", lines[0])[1])
        assert lines[-1].startswith(f"stopped after step {step} of 5000: loss 8.2995 -> ")
        folder = tmp_path / "ck"
        if save:
            assert lines[1] == f"saved checkpoint '{folder}' at step {step}"
            assert err.splitlines() == [
                f"train_ddp: SIGTERM: stopping after the step the ranks are in (saving a checkpoint in '{folder}'); "
                "send it again to end now",
                f"train_ddp: stopped by SIGTERM: checkpoint '{folder}' holds step {step}: the same command goes on "
                "from there"]
            assert json.loads((folder / "trainer_state.json").read_text())["step"] == step
            # requeued after its last step was saved, the job's command finds nothing to train: success
            done = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", str(step), "8", "32",
                                   "--world-size", "2", *save], capture_output=True, text=True, timeout=120)
            assert (done.returncode, done.stderr) == (0, ""), done.stderr
            assert done.stdout == f"--resume auto: checkpoint '{folder}' is at step {step} and STEPS is {step}: " \
                                  "nothing left to train\n"
        else:
            assert err.splitlines() == [
                "train_ddp: SIGTERM: stopping after the step the ranks are in (no --save-dir: nothing is saved); "
                "send it again to end now",
                "train_ddp: stopped by SIGTERM: nothing was saved (no --save-dir)"]


def test_a_save_dir_belongs_to_the_run_that_holds_it_until_that_run_ends_even_killed(tmp_path):
    """A second run on the --save-dir of a running job (a fresh start, or a requeued `--resume auto` racing
    it) is refused at once with one line naming the job's host and pid; once the job is killed with -9, the
    kernel has let go of its lock and the same command runs."""
    import socket

    folder = tmp_path / "ck"
    job = subprocess.Popen([sys.executable, "-m", "xtrain_dist.train_ddp", "5000", "8", "32", "--world-size", "2",
                            "--eval-batches", "0", "--log-every", "1000", "--save-dir", str(folder)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().startswith("tiny: GPTConfig")
        for resume in ([], ["--resume", "auto"]):
            assert error_line(cli(3, 8, 32, "--eval-batches", 0, "--save-dir", folder, *resume)) == (
                f"train_ddp: error: --save-dir '{folder}' is in use by another run (host {socket.gethostname()}, "
                f"pid {job.pid}): two runs would replace each other's checkpoints; wait for it to end or give "
                "another --save-dir")
        assert job.poll() is None  # the job trains on
    finally:
        job.kill()
        job.communicate()
    out = cli(3, 8, 32, "--eval-batches", 0, "--save-dir", folder, "--resume", "auto")
    assert out.returncode == 0, out.stderr
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == 3


def stop_with_a_signal_burst(proc: subprocess.Popen, sender: str) -> tuple[str, str]:
    """SIGTERM to a training process (in a process group of its own) once its first step is logged; with
    sender "process group", the group's copy once the first is caught, as a launcher forwarding a signal the
    group also got sends it (under `timeout`, timeout itself passes one on to the group). -> (stdout, stderr)
    once it has ended; the group is killed whatever happens."""
    try:
        assert proc.stdout.readline().startswith("tiny: GPTConfig")
        assert proc.stdout.readline().startswith("step     1/5000 |")  # training is under way
        proc.send_signal(signal.SIGTERM)
        if sender == "process group":  # the first one caught, the group's copy follows
            assert proc.stderr.readline().startswith("train_ddp: SIGTERM: stopping after the step")
            os.killpg(proc.pid, signal.SIGTERM)
        return proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.parametrize("sender", ["timeout", "process group"])
def test_a_burst_of_stop_signals_still_ends_with_the_checkpoint_saved(tmp_path, sender):
    """coreutils timeout passes a signal (its own timer's SIGTERM, or one sent to it) to the child and then to
    its whole process group, so the run gets two at once; a launcher forwarding a signal the group also got
    does the same. The second is the same request: the run still stops after a step, saved, with 143."""
    folder = tmp_path / "ck"
    command = [sys.executable, "-m", "xtrain_dist.train_ddp", "5000", "8", "32", "--world-size", "2",
               "--eval-batches", "0", "--log-every", "1000", "--save-dir", str(folder)]
    if sender == "timeout":
        command = ["timeout", "300", *command]  # a signal to timeout is passed on as its timer's would be
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a process group of its own
    out, err = stop_with_a_signal_burst(proc, sender)
    assert proc.returncode == 143, err
    step = json.loads((folder / "trainer_state.json").read_text())["step"]
    assert out.splitlines()[-2] == f"saved checkpoint '{folder}' at step {step}", out
    assert err.splitlines()[-1] == f"train_ddp: stopped by SIGTERM: checkpoint '{folder}' holds step {step}: the " \
                                   f"same command with --resume {folder} goes on from there", err


def test_the_first_stop_signal_asks_a_burst_is_one_request_and_a_later_one_ends_the_process(capsys):
    from xtrain_dist.train.job import StopRequest

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    stop = StopRequest("ck")
    with stop.on_signals():
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs on this (the main) thread, within the wait
        assert stop.wait(10) and stop.signal_name == "SIGUSR1"
        # a second one at once (timeout's SIGTERM to the process group after the one to the child) is the same
        # request: still caught, and the process goes on to save
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == stop._caught
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal_name == "SIGUSR1"
    assert {s: signal.getsignal(s) for s in before} == before
    first, again = capsys.readouterr().err.splitlines()
    assert first == ("train_ddp: SIGUSR1: stopping after the step the ranks are in (saving a checkpoint in 'ck'); "
                     "send it again to end now")
    assert re.fullmatch(r"train_ddp: SIGTERM 0\.\d s after the SIGUSR1: the same request \(a stop signal 2 s or more "
                        r"after the first ends the process now\)", again), again
    # a later one is deliberate: the process ends at once, killed by that signal as without a handler
    script = ("import os, signal, time\n"
              "from xtrain_dist.train.job import StopRequest\n"
              "StopRequest.GRACE_S = 0.3\n"
              "stop = StopRequest(None)\n"
              "with stop.on_signals():\n"
              "    os.kill(os.getpid(), signal.SIGTERM); assert stop.wait(10)\n"
              "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGUSR1); time.sleep(10)\n"
              "print('not ended')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (-signal.SIGUSR1, ""), out.stderr
    # off the main thread (train() called from code), Python lets nobody catch signals: nothing is touched
    import threading
    seen = []
    thread = threading.Thread(target=lambda: seen.append(StopRequest(None).on_signals().__enter__()))
    thread.start()
    thread.join()
    assert len(seen) == 1 and {s: signal.getsignal(s) for s in before} == before


def test_a_run_refused_after_its_outputs_were_checked_leaves_no_folders(tmp_path):
    """--report, --metrics and --save-dir in folders that do not exist yet are checked before anything else
    can refuse the run (here --profile-step, checked after them): the checks probe without making the
    folders, so the refused run leaves tmp_path as it was; a run that goes ahead makes them."""
    outputs = ["--report", tmp_path / "a" / "b" / "r.json", "--metrics", tmp_path / "c" / "m.jsonl",
               "--save-dir", tmp_path / "d" / "e" / "ck"]
    assert error_line(cli(2, 2, 16, *outputs, "--profile-step", 9)) == \
        "train_ddp: error: --profile-step 9 is not a step of this run (it runs steps 1 to 2)"
    assert list(tmp_path.iterdir()) == []
    assert cli(2, 2, 16, *outputs).returncode == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "a/b/r.config.toml", "a/b/r.json", "c/m.jsonl", *(f"d/e/ck/{name}" for name in sorted(
            p.name for p in (tmp_path / "d" / "e" / "ck").iterdir()))]


# ------------------------------------------------------------------ what mutation testing found untested
def test_ctrl_c_is_one_line_and_status_130(capsys):
    from xtrain_dist.command import run_command

    def interrupted():
        raise KeyboardInterrupt

    assert run_command("prog", interrupted) == 130
    assert capsys.readouterr().err == "prog: interrupted\n"


@pytest.fixture(scope="module")
def shipped_corpus():
    from xtrain_dist.data.corpus import Corpus
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def prepare(loaded, launch=None, **fields):
    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.preflight import prepare
    cfg = TrainConfig(**{"steps": 2, "batch": 2, "seq": 16, "eval_batches": 0, **fields}).resolved()
    return prepare(cfg, loaded, launch or Launch("single"), 1, lambda line: None)


def test_the_configuration_fingerprint_ignores_what_may_differ_between_nodes(shipped_corpus, tmp_path):
    """The same tokens from files at other paths, and other outputs, are the same run; another seed is not."""
    fingerprint = prepare(shipped_corpus).fingerprint
    elsewhere = prepare(shipped_corpus, tokenizer="/node7/tok.json", corpus="/node7/corpus.txt",
                        report=str(tmp_path / "r.json"), metrics=str(tmp_path / "m.jsonl"), log_every=5).fingerprint
    assert elsewhere == fingerprint
    # what changes no bits, or only what rank 0's process prints, may differ between processes too
    assert prepare(shipped_corpus, recompute=2, sample_every=3, sample_prompt="KING:").fingerprint == fingerprint
    assert prepare(shipped_corpus, seed=8).fingerprint != fingerprint


def test_the_fingerprint_holds_the_hellaswag_examples_not_their_path(shipped_corpus, tmp_path):
    """Processes that score different examples would all-reduce counts of different things."""
    import shutil

    import numpy as np

    from xtrain_dist.eval.hellaswag import Example, eval_file_chunks
    from xtrain_dist.files import write_atomic

    def eval_file(name, label):
        ids = np.arange(1, 4, dtype=np.int32)
        write_atomic(tmp_path / name, eval_file_chunks([Example(0, label, ids, (ids, ids))]), "test")
        return str(tmp_path / name)

    here = prepare(shipped_corpus, hellaswag=eval_file("a.bin", 0)).fingerprint
    shutil.copy(tmp_path / "a.bin", tmp_path / "copy.bin")
    assert prepare(shipped_corpus, hellaswag=str(tmp_path / "copy.bin")).fingerprint == here
    assert prepare(shipped_corpus, hellaswag=eval_file("b.bin", 1)).fingerprint != here
    assert prepare(shipped_corpus).fingerprint != here


def test_only_process_0_needs_a_writable_report(shipped_corpus, tmp_path):
    """Process 0 writes the report; another node need not have its folder."""
    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.errors import XtrainError
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    report = str(blocker / "r.json")  # a part of its folder is a file: nobody can write it
    rank1 = Launch("torchrun", process_rank=1, num_processes=2, master_addr="127.0.0.1", master_port=29500)
    assert prepare(shipped_corpus, rank1, report=report, world_size=2).engine == "tcp"
    with pytest.raises(XtrainError, match="cannot be written"):
        prepare(shipped_corpus, Launch("single"), report=report)


def test_each_rank_runs_one_blas_thread_unless_told_whatever_the_cores(shipped_corpus, monkeypatch):
    """2 rank threads in each of 2 processes on a node of 8 cores: 1 BLAS thread per rank (not the 2 that
    sharing the cores would give: numpy_ops.CPU_THREADS_PER_RANK says why), and --cpu-threads 3 gives 3, for
    BLAS and for the numpy ops' own threads (numpy_ops.op_threads) alike."""
    from xtrain_dist.backend import numpy_ops
    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train import job

    class Stop(Exception):
        pass

    asked = []

    def limits(n, user_api):
        asked.append((n, user_api))
        return contextlib.nullcontext()

    def op_threads(n):
        asked.append((n, "ops"))
        raise Stop  # the numbers are all this test needs: no training

    monkeypatch.setattr(numpy_ops, "available_cores", lambda: 8)
    monkeypatch.setattr(job, "threadpool_limits", limits)
    monkeypatch.setattr(numpy_ops, "op_threads", op_threads)
    for threads in (None, 3):
        cfg = TrainConfig(steps=1, batch=2, seq=16, world_size=2, eval_batches=0, cpu_threads=threads).resolved()
        with pytest.raises(Stop):
            job.train(cfg, shipped_corpus, log=lambda line: None, launch=Launch("single", local_processes=2))
    assert asked == [(1, "blas"), (1, "ops"), (3, "blas"), (3, "ops")]


def test_a_process_that_cannot_start_tells_the_others_within_its_rdzv_timeout(tmp_path):
    """Rank 0 of 2 misses its corpus: it says so at once, and answers the others from a thread for
    --rdzv-timeout (here 1 s), not 30 s; the process exits once that thread has."""
    import socket
    import threading
    import time

    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.errors import XtrainError
    from xtrain_dist.train.job import train
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = Launch("torchrun", process_rank=0, num_processes=2, master_addr="127.0.0.1", master_port=port)
    missing = tmp_path / "nope.txt"
    cfg = TrainConfig(steps=1, batch=2, seq=16, world_size=2, tokenizer=DEFAULT_TOKENIZER, corpus=str(missing),
                      rdzv_timeout_s=1).resolved()
    t0 = time.monotonic()
    with pytest.raises(XtrainError) as info:
        train(cfg, launch=launch, log=lambda line: None)
    assert str(info.value) == f"corpus '{missing}' not found"
    assert time.monotonic() - t0 < 5
    (reporting,) = [t for t in threading.enumerate() if t.name == "report-failure"]
    assert not reporting.daemon  # Python waits for it before the process exits
    reporting.join(20)
    assert not reporting.is_alive() and 0.9 < time.monotonic() - t0 < 10


def test_a_choice_list_keeps_the_order_given_and_names_a_bad_item_and_the_choices():
    from xtrain_dist.command import choice_list
    from xtrain_dist.errors import XtrainError
    choices = ("fp32", "tf32", "bf16")
    assert choice_list("--precisions", "bf16,,fp32", choices) == ["bf16", "fp32"]
    assert choice_list("--torch-modes", "", ("eager",), allow_empty=True) == []
    what = "--precisions must be one or more of fp32, tf32, bf16 (separated by commas)"
    for text, message in (("bf16,FP32", f"{what}, got 'FP32'"), (",", f"{what}, got ','")):
        with pytest.raises(XtrainError) as info:
            choice_list("--precisions", text, choices)
        assert str(info.value) == message


@pytest.mark.parametrize("argparse_line, ours", [
    # argparse quotes the value and the choices or not, by Python version: both read the same
    ("argument --dtype: invalid choice: 'fp16' (choose from 'fp32', 'bf16')",
     "--dtype must be one of fp32, bf16, got 'fp16'"),
    ("argument --dtype: invalid choice: fp16 (choose from fp32, bf16)",
     "--dtype must be one of fp32, bf16, got 'fp16'"),
    ("argument --zero: invalid choice: 2 (choose from 0, 1)", "--zero must be one of 0, 1, got '2'"),
    ("argument --vocab-size: invalid int value: 'x'", "--vocab-size must be an integer, got 'x'"),
    ("argument --lr: expected one argument", "--lr must be followed by a value"),
    ("argument STEPS: must be a positive integer, got '0'", "STEPS must be a positive integer, got '0'"),
    ("unrecognized arguments: --bogus", "unrecognized arguments: --bogus"),  # about the command line, not a value
])
def test_argparse_lines_about_a_value_take_our_form(argparse_line, ours):
    from xtrain_dist.command import OneLineParser
    from xtrain_dist.errors import XtrainError
    with pytest.raises(XtrainError) as info:
        OneLineParser().error(argparse_line)
    assert str(info.value) == ours


# every entry point, a bad choice and a bad number: the same form, one line, exit 2
ENTRY_POINTS = [["xtrain_dist.train_ddp", "2", "2", "16"], ["xtrain_dist.sample", "ckpt"],
                ["xtrain_dist.evaluate", "ckpt"], ["xtrain_dist.hellaswag", "ckpt", "hs.bin"]]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e[0].split(".")[1])
def test_every_entry_point_says_a_bad_option_in_one_form(entry):
    out = subprocess.run([sys.executable, "-m", *entry, "--backend", "gpu"], capture_output=True, text=True,
                         timeout=120)
    prog = entry[0].split(".")[1]
    assert (out.returncode, out.stderr) == (2, f"{prog}: error: --backend must be one of numpy, cuda, got 'gpu'\n")


# ------------------------------------------------------------------------------------------- --config
def test_a_run_replays_from_the_configuration_it_wrote(tmp_path):
    """A run writes its options beside its report and into its checkpoint; --config of either file trains
    the same run to the same bits, and an option on the command line overrides the file."""
    first = tmp_path / "first.json"
    out = cli(3, 4, 16, "--world-size", 2, "--lr", 0.002, "--grad-sync", "flat", "--min-lr", 1e-05,
              "--report", first, "--save-dir", tmp_path / "ck")
    assert out.returncode == 0, out.stderr
    written = (tmp_path / "first.config.toml").read_text()
    assert "\nlr = 0.002\n" in written and "\nmin-lr = 1e-05\n" in written and '\ngrad-sync = "flat"\n' in written
    assert "\nwarmup-steps" not in written  # left to its derived default: not written as a value
    assert (tmp_path / "ck" / "run_config.toml").read_text() == written
    from xtrain_dist.checkpoint import store
    assert "run_config.toml" in store.open_checkpoint(tmp_path / "ck", read="*").manifest["files"]
    sha = json.loads(first.read_text())["param_sha256"]
    for n, source in enumerate((tmp_path / "first.config.toml", tmp_path / "ck" / "run_config.toml")):
        again = tmp_path / "again.json"
        out = cli("--config", source, "--report", again, "--save-dir", tmp_path / f"again{n}")
        assert out.returncode == 0, out.stderr
        assert json.loads(again.read_text())["param_sha256"] == sha
    changed = tmp_path / "changed.json"
    out = cli("--config", tmp_path / "first.config.toml", "--seed", 4, "--report", changed, "--save-dir",
              tmp_path / "ck3")
    assert out.returncode == 0, out.stderr
    assert json.loads(changed.read_text())["param_sha256"] != sha
    assert "\nseed = 4\n" in (tmp_path / "changed.config.toml").read_text()
    # positionals on the command line fill STEPS BATCH SEQ in order, over the file's
    assert cli("--config", tmp_path / "first.config.toml", 1, 4, 16, "--save-dir", tmp_path / "ck4",
               "--report", tmp_path / "one.json").returncode == 0
    assert len(json.loads((tmp_path / "one.json").read_text())["losses"]) == 1


@pytest.mark.parametrize("text, message", [
    ("lrr = 0.1", "unknown key 'lrr': keys are the options without their dashes, and steps, batch, seq, tokenizer, "
                  "corpus"),
    ("grad_sync = 'flat'", "unknown key 'grad_sync' (the option is spelled 'grad-sync'): keys are the options "
                           "without their dashes, and steps, batch, seq, tokenizer, corpus"),
    ("lr = '0.1'", 'lr must be a number, got "0.1"'),
    ("steps = 2.5", "steps must be an integer, got 2.5"),
    ("seed = true", "seed must be an integer, got true"),
    ("tf32 = 1", "tf32 must be true or false, got 1"),
    ("model = 3", "model must be a string, got 3"),
    ("lr = [1, 2]", "lr must be a number, got [1, 2]"),
    ("cuda = { graph = 'off' }", "unknown key 'cuda': keys are the options without their dashes, and steps, batch, "
                                 "seq, tokenizer, corpus"),
    ("steps = 0", "steps must be a positive integer, got '0'"),
    ("dtype = 'fp16'", "dtype must be one of fp32, bf16, got 'fp16'"),
    ("zero = 4", "zero must be one of 0, 1, 2, 3, got 4"),
])
def test_a_config_file_s_bad_key_or_value_is_one_line_naming_it_and_the_file(tmp_path, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text + "\n")
    assert error_line(cli(2, 2, 16, "--config", config)) == f"train_ddp: error: --config '{config}': {message}"


def test_a_config_file_that_is_missing_or_not_toml_and_a_run_without_steps(tmp_path):
    config = tmp_path / "run.toml"
    assert error_line(cli(2, 2, 16, "--config", config)) == f"train_ddp: error: --config '{config}' not found"
    config.write_text("lr = \n")
    assert error_line(cli(2, 2, 16, "--config", config)).startswith(
        f"train_ddp: error: --config '{config}' is not TOML (Invalid value (at line 1, column 6))")
    config.write_text("batch = 2\nseq = 16\n")
    assert error_line(cli("--config", config)) == \
        "train_ddp: error: STEPS is missing: give it on the command line, or as steps in the --config file"
