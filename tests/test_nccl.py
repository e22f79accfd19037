"""NCCL through nccl4py, on a GPU (skipped without one, or without CuPy/nccl4py).

World 1 in this process; rank threads on several GPUs (when there are several); and two processes on
one GPU. NCCL refuses two ranks on one device within one host, but processes with different
NCCL_HOSTID values take each other for separate hosts and talk through NCCL's socket transport: the
`hostid_probe` fixture first checks that this works, and the multi-process tests fail with its
ranks' last words when it does not (with a GPU and nccl4py here, the only place they run).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytest.importorskip("nccl.core", reason="nccl4py is not installed (pip install -e '.[cuda]')")


def _gpu_count():
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPUS = _gpu_count()
if GPUS == 0:
    pytest.skip("no CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu

from xtrain_dist.comm.world import open_world  # noqa: E402
from xtrain_dist.train.launch import run_thread_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "nccl_worker.py"
# this checkout first, then whatever the caller had (the GPU scripts add the wheels of .whl/)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def has_cuda_backend():
    try:
        from xtrain_dist.backend.cuda import ops as cuda_ops  # noqa: F401
        return True
    except ImportError:
        return False


def training_corpus():
    """What the training tests here train on: each compares runs with each other, at 512 ids for the
    simulator's time (tests/small_vocab.py)."""
    from small_vocab import corpus

    return corpus()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(args, port, **extra):
    """Two processes on GPU 0, told apart as two hosts by NCCL_HOSTID."""
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONUNBUFFERED": "1", "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "NCCL_HOSTID": f"xtrain-test-host-{rank}", "CUDA_VISIBLE_DEVICES": os.environ.get(
                   "CUDA_VISIBLE_DEVICES", "0").split(",")[0], **extra}
        procs.append(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=ROOT, env=env, start_new_session=True))
    return procs


def finish(procs, timeout=240):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outs.append(p.communicate())
    return outs


@pytest.fixture(scope="module")
def hostid_probe():
    """[(exit status, stdout, stderr)] of the two ranks of an all-reduce between two processes on one GPU
    with different NCCL_HOSTID; each rank checks the sum (1 + 2 on every element) and prints 'OK probe RANK'."""
    procs = two_processes([str(WORKER), "probe"], free_port(), NCCL_DEBUG="WARN")
    outs = finish(procs, timeout=180)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def needs_hostid(probe):
    """The two-process tests stand on the probe: with a GPU and nccl4py here (the module skips otherwise),
    a probe that fails is a failure of the NCCL path, never a skip that reads as 'not applicable'."""
    failed = [f"rank {rank}: exit {code}, {err.strip().splitlines()[-1] if err.strip() else 'no error output'}"
              for rank, (code, out, err) in enumerate(probe) if code != 0 or f"OK probe {rank}" not in out]
    assert not failed, f"two processes on one GPU with different NCCL_HOSTID could not all-reduce: {'; '.join(failed)}"


# ---------------------------------------------------------------------------------------------- one process
def test_world1_collectives_keep_the_bits():
    world = open_world("nccl", local_world=1)
    try:
        comm = world.communicator(0)
        x = cupy.asarray(np.random.default_rng(0).standard_normal(4099).astype(np.float32))
        before = x.get().tobytes()
        comm.all_reduce(x)
        assert x.get().tobytes() == before  # a sum over one rank is the rank's own bits
        bf = cupy.arange(100, dtype=cupy.uint16)
        comm.all_reduce(bf, dtype="bf16")
        assert bf.get().tolist() == list(range(100))
        stream = cupy.cuda.Stream(non_blocking=True)
        comm.all_reduce(x, stream=stream)
        stream.synchronize()
        assert x.get().tobytes() == before
        out = cupy.empty(4099, cupy.float32)
        comm.all_gather(x, out)
        comm.reduce_scatter(x, out)
        comm.broadcast(x, root=0)
        comm.synchronize()
        assert out.get().tobytes() == before
    finally:
        world.close()


def test_unsupported_dtype_is_a_clear_error():
    world = open_world("nccl", local_world=1)
    try:
        with pytest.raises(ValueError, match="NCCL collectives here take float32, bfloat16, bf16"):
            world.communicator(0).all_reduce(cupy.zeros(3, cupy.complex64))
    finally:
        world.close()


@pytest.mark.skipif(GPUS < 2, reason="one GPU: rank threads of one process need one GPU each")
def test_rank_threads_on_several_gpus():
    world = open_world("nccl", local_world=GPUS)

    def body(local, comm):
        with cupy.cuda.Device(comm.device):
            x = cupy.asarray(np.random.default_rng([local]).standard_normal(1 << 20).astype(np.float32))
            comm.all_reduce(x)
            comm.synchronize()
            return x.get()

    out = run_thread_ranks(GPUS, body, group=world)
    world.close()
    expected = sum(np.random.default_rng([r]).standard_normal(1 << 20).astype(np.float32) for r in range(GPUS))
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-5)
    assert all(o.tobytes() == out[0].tobytes() for o in out)


@pytest.mark.skipif(not has_cuda_backend(), reason="the CUDA backend (backend/cuda/ops.py) is not in this tree")
def test_world1_training_over_nccl_has_the_bits_of_the_in_process_communicator():
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.job import train

    def job(comm):  # 4 x 16 tokens and 4 steps, as the training tests of test_cuda_ops.py: the simulator's time
        cfg = TrainConfig(steps=4, batch=4, seq=16, seed=3, backend="cuda", comm=comm).resolved()
        return train(cfg, training_corpus(), log=lambda line: None)

    nccl, local = job("nccl"), job("local")
    assert nccl["param_sha256"] == local["param_sha256"]
    assert nccl["losses"] == local["losses"]


@pytest.mark.skipif(GPUS < 2 or not has_cuda_backend(), reason="needs two GPUs and the CUDA backend")
def test_two_gpu_training_over_nccl_follows_numpy():
    """Two rank threads, a GPU each, reducing through NCCL (bucketed on a side stream; ZeRO-1's unequal
    shards as grouped reduces and broadcasts; ZeRO-3's gathers and reduce-scatters on its communication thread's
    stream): the ranks keep the same bits and follow the numpy backend's run of the same options."""
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.job import train

    for options in ({"grad_sync": "bucketed", "bucket_mb": 0.05}, {"zero": 1}, {"zero": 3, "grad_sync": "bucketed"}):
        def job(backend, options=options):
            cfg = TrainConfig(steps=4, batch=4, seq=16, seed=3, backend=backend, world_size=2, **options).resolved()
            return train(cfg, training_corpus(), log=lambda line: None)

        nccl, reference = job("cuda"), job("numpy")
        assert nccl["launch"]["comm"] == "nccl"  # a GPU per rank: NCCL, not the in-process communicator
        assert len(nccl["param_sha256"]) == 2 and len(set(nccl["param_sha256"])) == 1
        np.testing.assert_allclose(nccl["losses"], reference["losses"], rtol=1e-3)


@pytest.mark.skipif(GPUS < 2 or not has_cuda_backend(), reason="needs two GPUs and the CUDA backend")
def test_two_gpu_steps_replayed_from_cuda_graphs_keep_the_bits():
    """NCCL calls are capturable: with --cuda-graph auto each rank captures its second step, the bucketed
    sync's communication stream joining the capture through its events, and replays it; the two ranks end
    with the bits of --cuda-graph off, for the bucketed sync, ZeRO-1 and bf16 with accumulation."""
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.job import train

    for options in ({"grad_sync": "bucketed", "bucket_mb": 0.05}, {"zero": 1},
                    {"dtype": "bf16", "grad_accum": 2, "grad_sync": "flat"}):
        def job(mode, options=options):
            cfg = TrainConfig(steps=4, batch=4, seq=16, seed=3, backend="cuda", world_size=2, eval_batches=0,
                              cuda_graph=mode, **options).resolved()
            return train(cfg, training_corpus(), log=lambda line: None)

        graph, off = job("auto"), job("off")
        assert graph["launch"]["comm"] == "nccl"
        assert graph["cuda_graph"] == {"mode": "auto", "replayed_steps": 3, "without": None}, options
        assert len(set(graph["param_sha256"])) == 1 and graph["param_sha256"] == off["param_sha256"], options
        assert graph["losses"] == off["losses"], options


@pytest.mark.skipif(GPUS < 2 or not has_cuda_backend(), reason="needs two GPUs and the CUDA backend")
def test_a_step_over_nccl_copies_the_batch_in_and_one_array_out():
    """Over NCCL too (bucketed on a side stream, and ZeRO-1), each rank's step uploads its micro-batches,
    downloads one array and never waits for the device before that: the reductions are queued, not
    waited for. The simulator logs every copy and wait (CuPy has no hook for them): there only."""
    if not getattr(cupy, "cudasim", False):
        pytest.skip("the host traffic log is the CUDA simulator's (tests/cudasim)")
    import fake_cupy

    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.job import train

    for options in ({"grad_sync": "bucketed", "bucket_mb": 0.05}, {"zero": 1}):
        fake_cupy.host_traffic_by_thread.clear()
        cfg = TrainConfig(steps=3, batch=4, seq=16, seed=3, backend="cuda", world_size=2, grad_accum=2,
                          eval_batches=0, **options).resolved()
        assert train(cfg, training_corpus(), log=lambda line: None)["launch"]["comm"] == "nccl"
        for rank in ("rank0", "rank1"):
            log = " ".join(fake_cupy.host_traffic_by_thread[rank])
            assert re.fullmatch(fake_cupy.training_traffic(steps=3, uploads=6), log), (options, rank, log)


# ---------------------------------------------------------------------------------------------- two processes
@pytest.mark.real_gpu
def test_two_processes_on_one_gpu_with_distinct_nccl_hostid(hostid_probe):
    """The probe itself: both ranks exit 0 having each summed [1, 1, 1, 1] and [2, 2, 2, 2] to 3s over NCCL's
    socket transport; a failure names each rank's exit status and NCCL's last words."""
    needs_hostid(hostid_probe)
    # a line of its own (NCCL_DEBUG=WARN may print more to stdout)
    assert [(code, f"OK probe {rank}" in out.splitlines()) for rank, (code, out, _) in enumerate(hostid_probe)] == [
        (0, True), (0, True)]


@pytest.mark.real_gpu
def test_two_process_collectives_fp32_and_bf16(hostid_probe):
    needs_hostid(hostid_probe)
    procs = two_processes([str(WORKER), "collectives"], free_port())
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    received = [json.loads(out.split(" ", 3)[3]) for out, _ in outs]
    assert received[0] == received[1]  # identical bits on both ranks


@pytest.mark.skipif(not has_cuda_backend(), reason="the CUDA backend (backend/cuda/ops.py) is not in this tree")
@pytest.mark.real_gpu
def test_two_process_ddp_matches_world1_with_bitwise_ranks(hostid_probe, tmp_path):
    needs_hostid(hostid_probe)
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.train.job import train
    world1 = train(TrainConfig(steps=10, batch=8, seq=64, seed=3, backend="cuda").resolved(), log=lambda line: None)
    report = tmp_path / "nccl2.json"
    procs = two_processes(["-m", "xtrain_dist.train_ddp", "10", "8", "64", "--seed", "3", "--backend", "cuda",
                           "--report", str(report)], free_port())
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    data = json.loads(report.read_text())
    assert data["launch"]["comm"] == "nccl" and len(set(data["param_sha256"])) == 1
    a, b = np.array(data["losses"]), np.array(world1["losses"])
    assert np.max(np.abs(a - b) / np.abs(b)) <= 1e-3


@pytest.mark.real_gpu
def test_a_killed_nccl_peer_ends_the_other_process(hostid_probe):
    needs_hostid(hostid_probe)
    procs = two_processes([str(WORKER), "loop"], free_port())
    try:
        line = procs[0].stdout.readline()
        assert line.startswith("LOOPING"), (line, procs[0].stderr.read())
        time.sleep(1.0)
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        procs[0].wait(timeout=120)  # the watchdog's timeout (60 s in the worker) bounds it even if NCCL is silent
        assert procs[0].returncode != 0
        err = procs[0].stderr.read()
        assert "CommAborted" in err and ("NCCL" in err or "did not complete" in err), err
        print(f"survivor ended {time.monotonic() - t0:.1f} s after its peer was killed: {err.strip().splitlines()[-1]}")
    finally:
        finish(procs, timeout=5)
