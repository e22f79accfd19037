"""The fault suite: what a hostile user, a scheduler or a flaky machine does to a run, replayed, each case
bounded in time (a few seconds; the tiny model, few steps, short sequences) and on loopback only.

It tries 22 hostile cases, listed in CASES with what each must end with:

  rendezvous (rank 0 serving a world of 3 while strangers connect; the ranks must join within seconds):
   1. a client that connects every 0.2 s and says nothing, and a flood of 200 held connections
   2. a client that sends one byte every 0.3 s and never finishes its message
   3. a client that sends 200 bytes of garbage, again and again
   4. a client that sends a well-formed JOIN without the token (a wrong HMAC), again and again
      -> the ranks join; the log names the strangers by address, at most a few lines
   5. a job over several hosts without XTRAIN_RDZV_TOKEN -> rank 0 warns, one line
   6. a bad argument in one torchrun-launched process while the other is not started yet -> its own line
      at once, and the other, once started, ends with "process 1 failed before joining: ..." (exit 2)
  the save folder:
   7. a second run, fresh and --resume auto, on a running job's --save-dir -> refused, one line naming
      the job's host and pid (exit 2); the job trains on
  stop signals (exit 143, the checkpoint saved every time):
   8. SIGTERM to coreutils timeout, which passes it to the run and then to its process group, 3 times
   9. SIGTERM to the run, then to its process group
  timeouts past what a socket takes:
  10. --comm-timeout 1e10, 11. --rdzv-timeout 1e10 -> one line naming the bound (exit 2)
  the metrics file:
  12. a torn last line (a full disk) and then --resume -> the line dropped with a note, the file whole (exit 0)
  a checkpoint edited with its manifest re-hashed (a resume refuses it, one line naming field and file, exit 2):
  13. sampler.pcg64.state "-5", 14. schedule.lr NaN, 15. sampler.batches_drawn -3, 16. config.json not JSON
  inputs that are not what they claim (one line, exit 2, never a hang):
  17. a named pipe as the corpus, 18. /dev/zero as the corpus, 19. a .bin token file with another magic
  20. --comm tcp in a process that runs alone
  21. an option's bad choice -> the one form "--dtype must be one of fp32, bf16, got 'fp16'"
  22. a bad number -> the same form
"""

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_cli import stop_with_a_signal_burst
from test_multiprocess import first_line_within, free_port, reaped, torchrun_style
from test_rendezvous import Background, Strangers, serving

from xtrain_dist.comm import rendezvous as rdzv
from xtrain_dist.comm.launch_env import Launch
from xtrain_dist.data.corpus import DEFAULT_TOKENIZER
from xtrain_dist.errors import XtrainError
from xtrain_dist.train import metrics
from xtrain_dist.train.cli import main as train_main

ROOT = Path(__file__).resolve().parent.parent
TINY = ["4", "16", "--eval-batches", "0", "--log-every", "1000"]  # BATCH SEQ and quiet options after STEPS
TIME_LIMIT_S = 20  # each case (a stop-signal burst: each repetition); most take 1-4 s, a burst 3-6 s each


def train_in_process(*args) -> tuple[int, str, str]:
    """python -m xtrain_dist.train_ddp ARGS, in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def refused(*args) -> tuple[int, str]:
    code, _, err = train_in_process(*args)
    return code, last_line(err)


def train_process(*args, command_prefix=()) -> subprocess.Popen:
    """The training command in a process (and a process group) of its own."""
    return subprocess.Popen([*command_prefix, sys.executable, "-m", "xtrain_dist.train_ddp", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)


# ---------------------------------------------------------------------------------------------- rendezvous
def strangers_at_the_rendezvous(kinds):
    def case(tmp_path):
        logs = []
        _, addr, served = serving(3, timeout=10, log=logs.append)
        strangers = Strangers(addr, kinds)
        try:
            time.sleep(0.8)  # the strangers are at it before the ranks come
            t0 = time.monotonic()
            joining = [Background(rdzv.join, addr, rank, 3, b"tok", b"cfg", 10) for rank in (1, 2)]
            joined = [joiner.result(timeout=15) for joiner in joining]
            for peer in served.result(timeout=15)[1:]:
                peer.close()
            elapsed = time.monotonic() - t0
        finally:
            strangers.stop()
        for _, conn in joined:
            conn.close()
        assert elapsed < 8, f"the ranks took {elapsed:.1f} s"
        ports = set().union(*strangers.ports.values())
        first_lines = [re.match(r"rendezvous: refused a connection from 127\.0\.0\.1:(\d+): ", line) for line in logs]
        named = [int(m[1]) for m in first_lines if m]
        assert named and set(named) <= ports and len(logs) <= 3, logs
        return 0, "the ranks joined; the log names the strangers by address"
    return case


def derived_token_over_hosts(tmp_path):
    port = free_port()
    launch = Launch("torchrun", process_rank=0, num_processes=2, local_processes=1, master_addr="10.0.0.5",
                    master_port=port, job_id="job42")
    logs = []
    with pytest.raises(XtrainError):
        rdzv.rendezvous(launch, bind=f"127.0.0.1:{port}", timeout_s=0.2, log=logs.append)
    return 0, "; ".join(logs).replace(str(port), "PORT")


def bad_torchrun_argument(tmp_path):
    port = free_port()
    base = ["-m", "xtrain_dist.train_ddp", "5", *TINY, "--rdzv-timeout", "60"]
    with reaped([torchrun_style(1, 2, port, [*base, "--lr", "abc"])]) as procs:
        assert first_line_within(procs[0].stderr, 10) == "train_ddp: error: --lr must be a number >= 0, got 'abc'"
        procs.append(torchrun_style(0, 2, port, base))
        _, err = procs[1].communicate(timeout=30)
        assert procs[0].wait(timeout=30) == 2
    return procs[1].returncode, last_line(err)


# ---------------------------------------------------------------------------------------------- save folder
def second_run_on_a_running_jobs_save_dir(tmp_path):
    folder = tmp_path / "ck"
    job = train_process(5000, *TINY, "--save-dir", folder)
    try:
        assert job.stdout.readline().startswith("tiny: GPTConfig")
        outcomes = {refused(3, *TINY, "--save-dir", folder, *resume) for resume in ([], ["--resume", "auto"])}
        assert job.poll() is None  # the job trains on
    finally:
        job.kill()
        job.communicate()
    (code, line), = outcomes  # both the same
    return code, line.replace(socket.gethostname(), "HOST").replace(f"pid {job.pid}", "pid PID")


# ---------------------------------------------------------------------------------------------- stop signals
def stop_signal_burst(sender, repeats):
    def case(tmp_path):
        lines = set()
        for i in range(repeats):
            folder = tmp_path / f"ck{i}"
            proc = train_process(5000, *TINY, "--save-dir", folder,
                                 command_prefix=["timeout", "300"] if sender == "timeout" else [])
            out, err = stop_with_a_signal_burst(proc, sender)
            step = json.loads((folder / "trainer_state.json").read_text())["step"]
            assert f"saved checkpoint '{folder}' at step {step}" in out.splitlines()
            line = last_line(err).replace(str(folder), "{tmp}/ck").replace(f"step {step}", "step N")
            lines.add((proc.returncode, line))
        (outcome,) = lines
        return outcome
    case.time_limit_s = TIME_LIMIT_S * repeats
    return case


# ---------------------------------------------------------------------------------------------- metrics
def torn_metrics_then_resume(tmp_path):
    path, folder = tmp_path / "m.jsonl", tmp_path / "ck"
    assert train_in_process(2, *TINY, "--save-dir", folder, "--metrics", path)[0] == 0
    with open(path, "a") as f:
        f.write('{"step": 3, "loss": 3.1, "lr"')  # a full disk stopped the write mid-line
    code, out, err = train_in_process(4, *TINY, "--resume", folder, "--save-dir", folder, "--metrics", path)
    assert [r["step"] for r in metrics.read(path)] == [1, 2, 3, 4]
    note = [line for line in (out + err).splitlines() if "torn" in line]
    return code, "; ".join(note)


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "ck"
    assert train_in_process(2, *TINY, "--save-dir", folder)[0] == 0
    return folder


def rehash(folder: Path, name: str) -> None:
    """Vouch for the edited file in the manifest, as a consistent tamperer would."""
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def tampered(edit):
    def case(tmp_path, saved):
        folder = tmp_path / "ck"
        shutil.copytree(saved, folder)
        name = edit(folder)
        rehash(folder, name)
        code, line = refused(4, *TINY, "--resume", folder)
        return code, re.sub(r" \(.*\)$", " (...)", line) if name == "config.json" else line
    case.needs_checkpoint = True
    return case


def edit_state(change):
    def edit(folder):
        path = folder / "trainer_state.json"
        state = json.loads(path.read_text())
        change(state)
        path.write_text(json.dumps(state))
        return "trainer_state.json"
    return edit


def config_not_json(folder):
    (folder / "config.json").write_text("{not json")
    return "config.json"


# ---------------------------------------------------------------------------------------------- inputs
def corpus_fifo(tmp_path):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    return corpus_in_a_process(fifo)


def corpus_in_a_process(corpus):
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", *TINY, DEFAULT_TOKENIZER, str(corpus)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    return out.returncode, last_line(out.stderr)


def bin_with_another_magic(tmp_path):
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240999, 1, 64
    path = tmp_path / "tokens.bin"
    path.write_bytes(header.tobytes() + np.arange(64, dtype="<u2").tobytes())
    return refused(2, *TINY, DEFAULT_TOKENIZER, path)


def args_case(*args):
    return lambda tmp_path: refused(*args)


GOT = "the ranks joined; the log names the strangers by address"
CORRUPT = "train_ddp: error: checkpoint '{tmp}/ck' is corrupt: "
CASES = [
    pytest.param(strangers_at_the_rendezvous(["silent", "flood"]), (0, GOT), id="rdzv-silent-and-flood"),
    pytest.param(strangers_at_the_rendezvous(["drip"]), (0, GOT), id="rdzv-one-byte-at-a-time"),
    pytest.param(strangers_at_the_rendezvous(["garbage"]), (0, GOT), id="rdzv-garbage"),
    pytest.param(strangers_at_the_rendezvous(["forger"]), (0, GOT), id="rdzv-wrong-hmac"),
    pytest.param(derived_token_over_hosts, (0, "rendezvous: XTRAIN_RDZV_TOKEN is not set, and the launcher puts 1 of "
                 "this job's 2 processes on this host: the token is derived from the job id and rank 0's address, "
                 "which anyone who can reach 10.0.0.5:PORT can work out; set the same secret XTRAIN_RDZV_TOKEN for "
                 "every process"), id="rdzv-derived-token-over-hosts"),
    pytest.param(bad_torchrun_argument, (2, "train_ddp: error: process 1 failed before joining: --lr must be a "
                 "number >= 0, got 'abc'"), id="torchrun-bad-argument"),
    pytest.param(second_run_on_a_running_jobs_save_dir, (2, "train_ddp: error: --save-dir '{tmp}/ck' is in use by "
                 "another run (host HOST, pid PID): two runs would replace each other's checkpoints; wait for it to "
                 "end or give another --save-dir"), id="save-dir-in-use"),
    pytest.param(stop_signal_burst("timeout", 3), (143, "train_ddp: stopped by SIGTERM: checkpoint '{tmp}/ck' holds "
                 "step N: the same command with --resume {tmp}/ck goes on from there"), id="sigterm-under-timeout-x3"),
    pytest.param(stop_signal_burst("process group", 1), (143, "train_ddp: stopped by SIGTERM: checkpoint '{tmp}/ck' "
                 "holds step N: the same command with --resume {tmp}/ck goes on from there"),
                 id="sigterm-then-process-group"),
    pytest.param(args_case(2, *TINY, "--comm-timeout", "1e10"), (2, "train_ddp: error: --comm-timeout must be a "
                 "number of seconds > 0 and at most 604800 (a week), got '1e10'"), id="comm-timeout-1e10"),
    pytest.param(args_case(2, *TINY, "--rdzv-timeout", "1e10"), (2, "train_ddp: error: --rdzv-timeout must be a "
                 "number of seconds > 0 and at most 604800 (a week), got '1e10'"), id="rdzv-timeout-1e10"),
    pytest.param(torn_metrics_then_resume, (0, "--metrics '{tmp}/m.jsonl': dropped a torn last line "
                 "(29 bytes, a run stopped while writing it) before appending"), id="torn-metrics-line-then-resume"),
    pytest.param(tampered(edit_state(lambda s: s["sampler"]["pcg64"].update(state="-5"))),
                 (2, CORRUPT + "trainer_state.json: sampler.pcg64.state is '-5', expected an integer in [0, 2**128)"),
                 id="checkpoint-sampler-state"),
    pytest.param(tampered(edit_state(lambda s: s["schedule"].update(lr=float("nan")))),
                 (2, CORRUPT + "trainer_state.json: schedule.lr is nan, expected a finite number >= 0"),
                 id="checkpoint-nan-lr"),
    pytest.param(tampered(edit_state(lambda s: s["sampler"].update(batches_drawn=-3))),
                 (2, CORRUPT + "trainer_state.json: sampler.batches_drawn is -3, expected an integer >= 0"),
                 id="checkpoint-negative-batches-drawn"),
    pytest.param(tampered(config_not_json), (2, CORRUPT + "config.json is not valid JSON (...)"),
                 id="checkpoint-config-not-json"),
    pytest.param(corpus_fifo, (2, "train_ddp: error: corpus '{tmp}/corpus.txt' is a named pipe, not a regular file"),
                 id="corpus-fifo"),
    pytest.param(lambda tmp_path: corpus_in_a_process("/dev/zero"),
                 (2, "train_ddp: error: corpus '/dev/zero' is a character device, not a regular file"),
                 id="corpus-dev-zero"),
    pytest.param(bin_with_another_magic, (2, "train_ddp: error: corpus '{tmp}/tokens.bin' is not an llm.c token file "
                 "(magic 20240999, not 20240520 or 20240801)"), id="bin-bad-magic"),
    pytest.param(args_case(2, *TINY, "--comm", "tcp"), (2, "train_ddp: error: --comm tcp joins processes over "
                 "sockets, but this process runs alone (no torchrun, srun or mpirun started it): use --comm local for "
                 "the rank threads of one process (or omit --comm)"), id="comm-tcp-alone"),
    pytest.param(args_case(2, *TINY, "--dtype", "fp16"), (2, "train_ddp: error: --dtype must be one of fp32, bf16, "
                 "got 'fp16'"), id="bad-choice"),
    pytest.param(args_case(2, *TINY, "--seed", "-1"), (2, "train_ddp: error: --seed must be an integer >= 0, got "
                 "'-1'"), id="bad-number"),
]


def test_the_docstring_counts_every_case():
    assert f"It tries {len(CASES)} hostile cases" in __doc__


@pytest.mark.parametrize("case, outcome", CASES)
def test_a_hostile_case_ends_as_it_should(case, outcome, tmp_path, request, monkeypatch):
    monkeypatch.delenv(rdzv.TOKEN_ENV, raising=False)
    args = [tmp_path, request.getfixturevalue("saved")] if getattr(case, "needs_checkpoint", False) else [tmp_path]
    t0 = time.monotonic()
    code, line = case(*args)
    elapsed = time.monotonic() - t0
    assert (code, line.replace(str(tmp_path), "{tmp}")) == outcome
    assert elapsed < getattr(case, "time_limit_s", TIME_LIMIT_S), f"took {elapsed:.1f} s"
