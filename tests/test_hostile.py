"""The hostile suite, round 2: what a hostile pass over the mesh, PowerSGD, configuration files, TensorBoard,
the planner and the console scripts broke, replayed. Each case asserts the exit status and the exact line,
and that no traceback is printed. Most run the command in this process and are refused before any corpus
is read (a few milliseconds each); a few run it to the end, and one runs four MPI processes.

  1. outputs against outputs and inputs: every pair that can collide (save folder, report, the configuration
     written beside it, metrics, TensorBoard folder; the corpus, the tokenizer, --config, --resume,
     --init-from), and a second run on an output a running one holds
  2. a full disk under the TensorBoard writer: one line naming the cause, no hang (a 64 KiB tmpfs where the
     tests run as root and may mount one, else a writer whose flush raises ENOSPC)
  3. a stuck rank under --tp 2 --pp 2 over MPI: the failure lines name job-wide ranks
  4. the configuration a resumed run wrote replays the run from step 1, to the same parameters
  5. the planner's results files with 0, infinite, negative, NaN, true and subnormal figures, and its flags
  6. --pp 2 --grad-accum 1000000000: the memory check answers without listing the schedule
  7. options without effect; 8. a huge bad value, --report /dev/full
"""

import contextlib
import errno
import fcntl
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain_dist.data.corpus import DEFAULT_TOKENIZER
from xtrain_dist.errors import XtrainError
from xtrain_dist.planner.cli import main as plan_main
from xtrain_dist.train.cli import main as train_main
from xtrain_dist.train.cli import parse_config

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--eval-batches", "0", "--log-every", "1000"]


def train_here(*args) -> tuple[int, str, str]:
    """python -m xtrain_dist.train_ddp ARGS, in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main([str(a) for a in args])
    assert "Traceback" not in err.getvalue()
    return code, out.getvalue(), err.getvalue()


def refused(*args) -> str:
    """The one line a refused command prints (exit status 2, nothing else on either stream)."""
    code, out, err = train_here(*args)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1, err
    return err.removeprefix("train_ddp: error: ").rstrip("\n")


# ---------------------------------------------------------------------------------------------- 1. outputs
CONFIG = "steps = 2\nbatch = 4\nseq = 16\n"


def _collision(name, args, line, config=None):
    return pytest.param(args, line, config, id=name)


# each: the arguments after STEPS BATCH SEQ (D is tmp_path), the line, and the --config file to write first
COLLISIONS = [
    _collision("tensorboard-is-save-dir", ["--save-dir", "D/ck", "--tensorboard", "D/ck"],
               "--save-dir 'D/ck' and --tensorboard 'D/ck' are the same path: the checkpoint would replace the "
               "event files"),
    _collision("tensorboard-in-save-dir", ["--save-dir", "D/ck", "--tensorboard", "D/ck/tb"],
               "--tensorboard 'D/ck/tb' is inside --save-dir 'D/ck': every checkpoint save replaces that folder"),
    _collision("tensorboard-is-report", ["--report", "D/r.json", "--tensorboard", "D/r.json"],
               "--report 'D/r.json' and --tensorboard 'D/r.json' are the same path: the report would replace "
               "the event files"),
    _collision("tensorboard-is-metrics", ["--metrics", "D/m.jsonl", "--tensorboard", "D/m.jsonl"],
               "--metrics 'D/m.jsonl' and --tensorboard 'D/m.jsonl' are the same path: the metrics would "
               "replace the event files"),
    _collision("report-is-save-dir", ["--save-dir", "D/ck", "--report", "D/ck"],
               "--save-dir 'D/ck' and --report 'D/ck' are the same path: the checkpoint would replace the report"),
    _collision("written-config-is-metrics", ["--report", "D/r.json", "--metrics", "D/r.config.toml"],
               "--report's configuration 'D/r.config.toml' and --metrics 'D/r.config.toml' are the same file: the "
               "configuration would replace the metrics"),
    _collision("written-config-is-config", ["--config", "D/r.config.toml", "--report", "D/r.json"],
               "--report 'D/r.json' would write its configuration over the --config file 'D/r.config.toml': give "
               "another --report", config="r.config.toml"),
    _collision("written-config-is-corpus", [DEFAULT_TOKENIZER, "D/r.config.toml", "--report", "D/r.json"],
               "--report's configuration 'D/r.config.toml' is the corpus 'D/r.config.toml': the run would write "
               "into its own input", config="r.config.toml"),
    _collision("written-config-is-tokenizer", ["D/r.config.toml", "D/c.txt", "--report", "D/r.json"],
               "--report's configuration 'D/r.config.toml' is the tokenizer 'D/r.config.toml': the run would "
               "write into its own input", config="r.config.toml"),
    _collision("report-is-config", ["--config", "D/c.toml", "--report", "D/c.toml"],
               "--report 'D/c.toml' is the --config file 'D/c.toml': the run would write into its own input",
               config="c.toml"),
    _collision("metrics-is-config", ["--config", "D/c.toml", "--metrics", "D/c.toml"],
               "--metrics 'D/c.toml' is the --config file 'D/c.toml': the run would write into its own input",
               config="c.toml"),
    _collision("tensorboard-is-config", ["--config", "D/c.toml", "--tensorboard", "D/c.toml"],
               "--tensorboard 'D/c.toml' is the --config file 'D/c.toml': the run would write into its own input",
               config="c.toml"),
    _collision("tensorboard-is-corpus", [DEFAULT_TOKENIZER, "D/c.txt", "--tensorboard", "D/c.txt"],
               "--tensorboard 'D/c.txt' is the corpus 'D/c.txt': the run would write into its own input"),
    _collision("tensorboard-in-resume", ["--resume", "D/ck", "--tensorboard", "D/ck/tb"],
               "--tensorboard 'D/ck/tb' is inside --resume 'D/ck': the run would write into the checkpoint it reads"),
    _collision("tensorboard-in-init-from", ["--init-from", "D/gpt2", "--tensorboard", "D/gpt2/tb"],
               "--tensorboard 'D/gpt2/tb' is inside --init-from 'D/gpt2': the run would write into the checkpoint "
               "it reads"),
    _collision("save-dir-in-init-from", ["--init-from", "D/gpt2", "--save-dir", "D/gpt2/ck"],
               "--save-dir 'D/gpt2/ck' is inside --init-from 'D/gpt2': the run would write into the checkpoint it "
               "reads"),
    _collision("written-config-in-resume", ["--resume", "D/ck", "--report", "D/ck/r.json"],
               "--report 'D/ck/r.json' is inside --resume 'D/ck': the run would write into the checkpoint it reads"),
]


@pytest.mark.parametrize("args, line, config", COLLISIONS)
def test_outputs_colliding_with_outputs_or_inputs_are_one_line_before_anything_is_touched(tmp_path, args, line,
                                                                                         config):
    (tmp_path / "c.txt").write_text("to be or not to be\n" * 50)
    if config:
        (tmp_path / config).write_text(CONFIG)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    given = [str(a).replace("D/", f"{tmp_path}/") for a in args]
    positionals = [] if "--config" in given else [2, 4, 16]
    assert refused(*positionals, *given) == line.replace("D/", f"{tmp_path}/")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no lock, probe or folder left


@pytest.mark.parametrize("flag, name, consequence", [
    ("--report", "r.json", "two runs would replace each other's report"),
    ("--tensorboard", "tb", "two runs would mix their event files in one folder"),
    ("--metrics", "m.jsonl", "two runs would mix their records in one file"),
    ("--save-dir", "ck", "two runs would replace each other's checkpoints"),
])
def test_a_second_run_on_an_output_a_running_one_holds_is_refused(tmp_path, flag, name, consequence):
    """What a running run holds: the exclusive lock on .NAME.lock beside its output (files.OutputLock)."""
    with open(tmp_path / f".{name}.lock", "w") as owner:
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner.write("host node7, pid 4242")
        owner.flush()
        assert refused(2, 4, 16, flag, tmp_path / name) == (
            f"{flag} '{tmp_path / name}' is in use by another run (host node7, pid 4242): {consequence}; wait for it "
            f"to end or give another {flag}")
    assert not (tmp_path / name).exists()


def test_collisions_end_to_end_are_one_line_and_status_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "4", "16", "--save-dir", "ck",
                          "--tensorboard", "./ck/"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (
        2, "", "train_ddp: error: --save-dir 'ck' and --tensorboard './ck/' are the same path: the checkpoint would "
               "replace the event files\n")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------- 2. a full disk, TensorBoard
@contextlib.contextmanager
def full_disk(tmp_path, monkeypatch):
    """A folder on a full disk: a 64 KiB tmpfs filled up where this process may mount one, else a writer whose
    flush raises what a full disk raises."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True).returncode == 0
    try:
        if mounted:
            with contextlib.suppress(OSError), open(folder / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        else:
            from tensorboardX.event_file_writer import EventsWriter

            def flush(self):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            monkeypatch.setattr(EventsWriter, "flush", flush)
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.mark.parametrize("world", [1, 2])
def test_a_full_disk_under_tensorboard_ends_the_run_in_one_line(tmp_path, monkeypatch, world):
    """The writer thread of tensorboardX died on a full disk and the run hung on its queue (world 1 for good;
    world 2 until --comm-timeout, blaming a stuck rank). Written on rank 0's thread, the error is the run's."""
    pytest.importorskip("tensorboardX")
    from xtrain_dist.train import tensorboard
    monkeypatch.setattr(tensorboard, "FLUSH_S", 0)  # flush every record: the error comes at the first step
    with full_disk(tmp_path, monkeypatch) as disk:
        code, _, err = train_here(3, 4, 16, *QUIET, "--world-size", world, "--comm-timeout", 60,
                                  "--tensorboard", disk / "tb")
    assert code == 1
    assert err.splitlines()[-1] == (f"train_ddp: error: rank 0 failed: --tensorboard '{disk / 'tb'}' cannot be "
                                    "written (No space left on device)")


# ------------------------------------------------------------------------------- 3. a stuck rank over MPI
STUCK = """
import os, signal, sys
from xtrain_dist.train import loop
from xtrain_dist.train.cli import main
real = loop.lr_at
def lr_at(step, cfg):  # the process of job rank 1 stops itself (SIGSTOP) in its second step
    if step == 1 and os.environ.get("PMI_RANK") == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    return real(step, cfg)
loop.lr_at = lr_at
sys.exit(main())
"""


def test_a_stuck_rank_at_tp_2_by_pp_2_over_mpi_is_named_by_its_job_rank(tmp_path):
    """The lines of the ranks that waited name job-wide ranks, their own and their group's: a stopped rank 1
    was reported as "rank 0 is stuck" by its tp group's numbering."""
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("no mpirun")
    (tmp_path / "stuck.py").write_text(STUCK)
    out = subprocess.run([mpirun, "-n", "4", sys.executable, tmp_path / "stuck.py", "4", "4", "16", "--tp", "2",
                          "--pp", "2", "--grad-accum", "2", "--comm-timeout", "3", *QUIET],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("train_ddp: error: ")]
    assert lines, out.stderr
    form = re.compile(r"train_ddp: error: rank (\d) stopped: (\w+) aborted: rank (\d) waited more than 3 s in \2 "
                      r"among ranks (\d), (\d): (a peer process is stuck or dead|rank (\d) is stuck, dead or never "
                      r"sends)")
    for line in lines:
        m = form.fullmatch(line)
        assert m, line
        me, group = m[1], {m[4], m[5]}
        assert m[3] == me and me in group and (m[7] is None or m[7] in group - {me}), line
    # rank 3, the stopped rank's pipeline peer, blames it by its job rank
    assert "train_ddp: error: rank 3 stopped: recv aborted: rank 3 waited more than 3 s in recv among ranks 1, 3: " \
           "rank 1 is stuck, dead or never sends" in lines or all("rank 3 stopped" not in line for line in lines)


# ---------------------------------------------------------------------------- 4. replaying a resumed run
def test_the_configuration_a_resumed_run_wrote_replays_it_from_step_1(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths as the user gives them: relative ones stay relative in the file
    # one schedule over both parts (--lr-decay-steps 5), so that the resumed run is the 5-step run bitwise
    assert train_here(3, 4, 16, *QUIET, "--lr-decay-steps", 5, "--save-dir", "ck")[0] == 0
    assert train_here(5, 4, 16, *QUIET, "--lr-decay-steps", 5, "--save-dir", "ck", "--resume", "ck", "--report",
                      "r.json")[0] == 0
    written = (tmp_path / "r.config.toml").read_text()
    assert "\nresume" not in written and "# The run was started with --resume 'ck', left out here" in written
    assert '\nsave-dir = "ck"\n' in written
    assert "tokenizer" not in written and "corpus" not in written and str(tmp_path) not in written
    # the file as it stands names the first run's outputs: the replay gives its own, and starts at step 1
    code, _, err = train_here("--config", "r.config.toml", "--save-dir", "ck2", "--report", "again.json")
    assert code == 0, err
    resumed, again = (json.loads((tmp_path / name).read_text()) for name in ("r.json", "again.json"))
    assert again["start_step"] == 0 and len(again["losses"]) == 5
    assert again["param_sha256"] == resumed["param_sha256"]
    # --resume none: a hand-written file's resume unset from the command line
    (tmp_path / "hand.toml").write_text(CONFIG + 'resume = "ck"\n')
    assert parse_config(["--config", "hand.toml", "--resume", "none"]).resume is None


# ------------------------------------------------------------------------------------------ 5. the planner
def plan(argv, capsys) -> tuple[int, str]:
    code = plan_main([str(a) for a in argv])
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "Traceback" not in out.err
    return code, out.err.removeprefix("python -m xtrain_dist.plan: error: ").rstrip("\n")


@pytest.mark.parametrize("value, shown", [("0", "0"), ("1e400", "Infinity"), ("-1", "-1"), ("NaN", "NaN"),
                                           ("true", "true"), ("5e-324", "5e-324"), ("1.5", "1.5"), ('"0.4"', '"0.4"')])
def test_a_bench_gpu_file_with_a_bad_mfu_is_one_line(tmp_path, capsys, value, shown):
    bad = tmp_path / "gpu.json"
    row = '{"impl": "ours", "preset": "gpt2-124m", "precision": "bf16", "mfu": ' + value + "}"
    bad.write_text('{"rows": [' + row + "]}")
    assert plan(["--from-bench-gpu", bad, "--bus-gbps", 100, "--gpus", 8], capsys) == (
        2, f"--from-bench-gpu '{bad}': rows[0].mfu must be a number from 1e-06 to 1, got {shown}")


@pytest.mark.parametrize("field, value, what", [
    ("busbw_gbs", "0", "a number from 1e-06 to 1e+06, got 0"),
    ("busbw_gbs", "1e400", "a number from 1e-06 to 1e+06, got Infinity"),
    ("busbw_gbs", "1e300", "a number from 1e-06 to 1e+06, got 1e+300"),
    ("median_s", "-1", "a number from 1e-09 to 3600, got -1"),
    ("median_s", "NaN", "a number from 1e-09 to 3600, got NaN"),
    ("world", "true", "an integer >= 1, got true"),
    ("bytes", "2.5", "an integer >= 1, got 2.5"),
])
def test_a_bench_collectives_file_with_a_bad_figure_is_one_line(tmp_path, capsys, field, value, what):
    row = {"op": "all_reduce", "world": 8, "bytes": 1 << 20, "median_s": 0.001, "busbw_gbs": 100}
    text = json.dumps({"rows": [row, {**row, field: "X"}]}).replace('"X"', value)
    bad = tmp_path / "coll.json"
    bad.write_text(text)
    assert plan(["--from-bench-collectives", bad, "--gpus", 8], capsys) == (
        2, f"--from-bench-collectives '{bad}': rows[1].{field} must be {what}")


@pytest.mark.parametrize("flag, value, what", [
    ("--mfu", "5e-324", "a number from 1e-06 to 1"), ("--mfu", "0", "a number from 1e-06 to 1"),
    ("--peak-tflops", "5e-324", "a number from 1e-06 to 1e+06"),
    ("--bucket-mb", "1e-300", "a number from 1e-06 to 1e+06"),
    ("--bus-gbps", "inf", "a number from 1e-06 to 1e+06"), ("--latency-us", "nan", "a number from 0 to 1e+09"),
])
def test_the_planners_flags_are_checked_alike(capsys, flag, value, what):
    args = [flag, value] if flag == "--bus-gbps" else ["--bus-gbps", 100, flag, value]
    assert plan(args, capsys) == (2, f"{flag} must be {what}, got '{value}'")


# -------------------------------------------------------------------- 6. the memory check at grad-accum 1e9
def test_a_billion_micro_batches_at_pp_2_are_checked_without_listing_the_schedule():
    """The check used to list each stage's 2e9 actions (over a minute); its closed form is checked against the
    listing in tests/test_pipeline.py."""
    line = refused(2, 1_000_000_000, 16, "--pp", 2, "--world-size", 2, "--grad-accum", 1_000_000_000)
    assert re.fullmatch(r"not enough memory for this run: its 2 ranks need at least [\d.]+ GiB and this machine has "
                        r"[\d.]+ GiB available \(.*\); lower BATCH, SEQ, --world-size or --eval-batches, or raise "
                        r"--grad-accum, or use --zero 1, --attention flash or --recompute 2", line), line


# ------------------------------------------------------------------------------- 7. options without effect
@pytest.mark.parametrize("args, line", [
    (["--pp-schedule", "1f1b"], "--pp-schedule has no effect without --pp (2 or more stages)"),
    (["--powersgd-start-step", "-7"], "--powersgd-start-step has no effect without --grad-compress powersgd"),
    (["--powersgd-rank", "2"], "--powersgd-rank has no effect without --grad-compress powersgd"),
    (["--grad-sync", "flat", "--bucket-mb", "3"], "--bucket-mb has no effect without --grad-sync bucketed"),
    (["--zero", "3", "--bucket-mb", "3"], "--bucket-mb has no effect at --zero 2 and 3: each unit (a block's half, "
                                          "ln_f, wpe, wte) is reduce-scattered as backward finishes it"),
    (["--save-every", "0"], "--save-every needs --save-dir"),
])
def test_options_without_effect_are_one_line(args, line):
    with pytest.raises(XtrainError) as info:
        parse_config(["2", "4", "16", *args])
    assert str(info.value) == line


def test_a_written_configuration_holding_every_default_is_no_option_without_effect(tmp_path):
    """A file a run wrote holds the options left to their defaults too: those do not count as given."""
    (tmp_path / "c.toml").write_text(CONFIG + 'pp-schedule = "1f1b"\npowersgd-start-step = 100\nbucket-mb = 25.0\n')
    assert parse_config(["--config", str(tmp_path / "c.toml")]).pp == 1
    (tmp_path / "c.toml").write_text(CONFIG + 'pp-schedule = "gpipe"\n')
    with pytest.raises(XtrainError, match=r"^--pp-schedule has no effect without --pp \(2 or more stages\)$"):
        parse_config(["--config", str(tmp_path / "c.toml")])


# ------------------------------------------------------------------------------------------------ 8. minor
def test_a_huge_bad_value_is_quoted_in_part():
    assert refused(2, 4, 16, "--dtype", "x" * 50_000) == \
        f"--dtype must be one of fp32, bf16, got '{'x' * 80}... (50000 characters)'"
    assert refused(2, 4, 16, "--lr", "9" * 100_000) == \
        f"--lr must be a number >= 0, got '{'9' * 80}... (100000 characters)'"


def test_a_report_on_a_full_device_is_refused_before_training():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    assert refused(2, 4, 16, "--report", "/dev/full") == \
        "--report '/dev/full' cannot be written (No space left on device)"


def test_a_timeout_in_a_split_of_thread_ranks_names_world_ranks():
    """The same naming for thread ranks: groups {0, 2} and {1, 3} split from a world of 4; rank 3 never comes to
    its group's all-reduce, and the line names rank 1 (rank 0 of its group) and the group by world ranks."""
    import threading

    import numpy as np

    from xtrain_dist.comm import CommAborted
    from xtrain_dist.comm.local import LocalGroup

    world = LocalGroup(4, timeout_s=0.5)
    subs = [None] * 4

    def rank(r):
        subs[r] = world.communicator(r).split(r % 2)
        if r != 3:
            with contextlib.suppress(CommAborted):
                subs[r].all_reduce(np.ones(4, np.float32))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert world.abort_reason == "rank 1 waited more than 0.5 s in all_reduce among ranks 1, 3: a peer rank is stuck " \
                                "or dead"
