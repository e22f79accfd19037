"""Reading the launcher from fake environments: torchrun, srun, mpirun (MPICH and Open MPI), none; the
SLURM node-list syntax; how --world-size, threads per process and GPUs follow from a launch."""

import pytest

from xtrain_dist.comm.launch_env import Launch, detect_launch, expand_nodelist, gpu_for, local_world_for
from xtrain_dist.comm.rendezvous import rdzv_addresses
from xtrain_dist.comm.world import choose_engine
from xtrain_dist.errors import XtrainError

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node7",
            "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "GROUP_RANK": "1"}
SRUN = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu[07-09],login2",
        "SLURM_JOB_NODELIST": "gpu[01-09],login2"}


def test_no_launcher_is_one_process():
    assert detect_launch({"PATH": "/bin"}) == Launch("single")
    assert detect_launch({"RANK": "0", "WORLD_SIZE": "1"}) == Launch("single")  # a world of one needs no address


def test_torchrun():
    launch = detect_launch(TORCHRUN)
    assert (launch.kind, launch.process_rank, launch.num_processes, launch.local_rank) == ("torchrun", 3, 4, 1)
    assert (launch.master_addr, launch.master_port, launch.job_id) == ("node7", 29511, "job42")
    # torchrun's agent listens on MASTER_PORT itself: the rendezvous must use another port
    assert launch.rdzv_port == 29512
    plain = detect_launch({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_USE_AGENT_STORE"})
    assert plain.rdzv_port == 29511


def test_srun_uses_the_step_and_the_first_host_of_the_step():
    launch = detect_launch(SRUN)
    assert (launch.kind, launch.process_rank, launch.num_processes, launch.local_rank) == ("srun", 5, 6, 1)
    assert launch.master_addr == "gpu07"
    assert 20000 <= launch.master_port < 40000  # derived from the job id: every task computes the same one
    assert detect_launch(dict(SRUN)).master_port == launch.master_port
    explicit = detect_launch({**SRUN, "MASTER_PORT": "31000", "MASTER_ADDR": "10.0.0.2"})
    assert (explicit.master_addr, explicit.master_port) == ("10.0.0.2", 31000)


@pytest.mark.parametrize("per_node, node, tasks", [
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x4)"}, "gpu08", 2),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}, "gpu08", 2),  # the step's nodes: gpu07, gpu08, gpu09, login2
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}, "login2", 1),
    ({"SLURM_STEP_TASKS_PER_NODE": "1,3,2(x2)"}, "gpu08", 3),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}, "elsewhere", 1),  # this node is not in the list: no guess
    ({"SLURM_TASKS_PER_NODE": "4(x2)"}, "gpu08", 4),  # the job's counts, where the step's are missing
    ({"SLURM_NTASKS_PER_NODE": "3"}, "gpu08", 3),
    ({}, "gpu08", 1),
])
def test_srun_counts_the_tasks_sharing_this_node(per_node, node, tasks):
    """They share its cores: each rank thread gets cores / (threads x tasks on the node) BLAS threads."""
    assert detect_launch({**SRUN, **per_node, "SLURMD_NODENAME": node}).local_processes == tasks


def test_a_batch_script_is_not_an_srun_step():
    """sbatch's script sees SLURM_PROCID=0 and the job's task count, but it is one process."""
    env = {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")}
    assert detect_launch(env).kind == "single"


def test_mpirun_mpich_and_open_mpi():
    hydra = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "9"})
    assert (hydra.kind, hydra.process_rank, hydra.num_processes, hydra.local_rank) == ("mpirun", 1, 2, 1)
    ompi = detect_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (ompi.kind, ompi.process_rank, ompi.num_processes, ompi.local_rank) == ("mpirun", 2, 4, 0)


def test_torchrun_wins_over_the_slurm_step_it_runs_in():
    assert detect_launch({**SRUN, **TORCHRUN}).kind == "torchrun"


@pytest.mark.parametrize("env, message", [
    ({**TORCHRUN, "RANK": "x"}, "environment variable RANK='x' is not an integer"),
    ({**TORCHRUN, "RANK": "4"}, "torchrun says this is process 4 of 4"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "environment variable MASTER_PORT=70000 is not a TCP port (1-65535)"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK=1 and WORLD_SIZE=2 are set but MASTER_ADDR is not: set MASTER_ADDR (and "
     "MASTER_PORT) to where process 0 can be reached, or unset RANK and WORLD_SIZE to run as one process"),
    ({k: v for k, v in SRUN.items() if "NODELIST" not in k},
     "srun set SLURM_PROCID but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: cannot tell which host is rank 0's"),
])
def test_bad_environments_get_one_line(env, message):
    with pytest.raises(XtrainError) as info:
        detect_launch(env)
    assert str(info.value) == message


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a[1-2],b,c[009-011]", ["a1", "a2", "b", "c009", "c010", "c011"]),
    ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
    ("gpu-a100-[10-11].cluster", ["gpu-a100-10.cluster", "gpu-a100-11.cluster"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-3", "node[3-1]", "node[a-b]", ""])
def test_unreadable_nodelists(nodelist):
    with pytest.raises(XtrainError, match="cannot read the SLURM node list"):
        expand_nodelist(nodelist)


def test_world_size_must_agree_with_the_launch():
    launch = detect_launch(TORCHRUN)
    assert local_world_for(launch, None) == 1
    assert local_world_for(launch, 8) == 2  # 4 processes x 2 rank threads
    with pytest.raises(XtrainError) as info:
        local_world_for(launch, 6)
    assert str(info.value) == ("--world-size 6 does not match the launch: torchrun started 4 processes, and every "
                               "process hosts the same number of rank threads, so the world size must be a "
                               "multiple of 4 (or omit it)")


def test_gpus_follow_the_local_rank():
    launch = detect_launch(TORCHRUN)  # local rank 1
    assert [gpu_for(launch, 1, 0, visible=8)] == [1]
    assert [gpu_for(launch, 2, t, visible=8) for t in range(2)] == [2, 3]
    # the launcher gave this process only its own GPUs (CUDA_VISIBLE_DEVICES per task)
    assert [gpu_for(launch, 2, t, visible=2) for t in range(2)] == [0, 1]
    with pytest.raises(XtrainError, match=r"needs GPU 3 for its rank thread 1, but only 3 GPU\(s\) are visible"):
        gpu_for(launch, 2, 1, visible=3)


def test_engine_choice():
    single, mpirun, torchrun = Launch("single"), Launch("mpirun", 0, 2), detect_launch(TORCHRUN)
    assert choose_engine("auto", "numpy", single) == "local"
    assert choose_engine("auto", "numpy", mpirun) == "mpi"
    assert choose_engine("auto", "numpy", torchrun) == "tcp"
    assert choose_engine("auto", "cuda", single) == "local"  # world 1: nothing to reduce
    assert choose_engine("auto", "cuda", single, local_world=4, gpus=4) == "nccl"  # a GPU per rank thread
    assert choose_engine("auto", "cuda", single, local_world=2, gpus=8) == "nccl"
    assert choose_engine("auto", "cuda", single, local_world=2, gpus=1) == "local"  # virtual ranks on one GPU
    with pytest.raises(XtrainError, match=r"^4 GPU ranks on 2 GPUs: the thread communicator adds buffers on one GPU"):
        choose_engine("auto", "cuda", single, local_world=4, gpus=2)
    assert choose_engine("auto", "cuda", torchrun) == "nccl"
    for name, backend, launch, message in [
        ("local", "numpy", torchrun, "--comm local joins the rank threads of one process, but torchrun started 4 "
                                     "processes: use --comm mpi, tcp or nccl (or omit --comm)"),
        ("nccl", "numpy", single, "--comm nccl reduces GPU buffers: it needs --backend cuda"),
        ("tcp", "numpy", single, "--comm tcp joins processes over sockets, but this process runs alone (no "
                                 "torchrun, srun or mpirun started it): use --comm local for the rank threads of one "
                                 "process (or omit --comm)"),
        ("mpi", "cuda", mpirun, "--comm mpi reduces host (numpy) buffers: with --backend cuda use --comm nccl"),
        ("mpi", "numpy", torchrun, "--comm mpi needs processes started by mpirun/mpiexec, not torchrun: use "
                                   "--comm tcp (or omit --comm)"),
        ("gloo", "numpy", single, "--comm must be one of auto, local, mpi, tcp, nccl, got 'gloo'"),
    ]:
        with pytest.raises(XtrainError) as info:
            choose_engine(name, backend, launch)
        assert str(info.value) == message


def test_mpi_without_mpi4py_is_refused_before_the_run_starts(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else
                        real_find_spec(name, *a))
    with pytest.raises(XtrainError) as info:
        choose_engine("auto", "numpy", Launch("mpirun", 0, 2))
    assert str(info.value) == ("the MPI communicator needs mpi4py and an MPI library: No module named 'mpi4py' "
                               "(from a clone of the repository: pip install -e '.[mpi]')")
    assert choose_engine("auto", "numpy", Launch("single")) == "local"  # no MPI asked for, none needed


def test_rendezvous_addresses_bind_and_advertise_separately():
    launch = detect_launch(TORCHRUN)
    assert rdzv_addresses(launch, None, None) == (("node7", 29512), ("node7", 29512))
    # docker/NAT: rank 0 listens on the container's port, the others reach the host's published port
    assert rdzv_addresses(launch, "0.0.0.0:29500", "host.example:31000") == (("0.0.0.0", 29500),
                                                                              ("host.example", 31000))
    assert rdzv_addresses(launch, "172.17.0.2", "host.example:31000") == (("172.17.0.2", 31000),
                                                                          ("host.example", 31000))
    assert rdzv_addresses(launch, None, "[::1]:4000") == (("::1", 4000), ("::1", 4000))
    with pytest.raises(XtrainError, match=r"--rdzv-advertise 'host' needs a port \(HOST:PORT\)"):
        rdzv_addresses(launch, None, "host")


# ------------------------------------------------------------------ what mutation testing found untested
@pytest.mark.parametrize("port, ok", [("0", False), ("65536", False), ("65535", True), ("1", True)])
def test_master_port_must_be_a_tcp_port(port, ok):
    env = {**TORCHRUN, "MASTER_PORT": port}
    if ok:
        assert detect_launch(env).master_port == int(port)
    else:
        with pytest.raises(XtrainError) as info:
            detect_launch(env)
        assert str(info.value) == f"environment variable MASTER_PORT={port} is not a TCP port (1-65535)"


def test_a_negative_rank_is_refused():
    with pytest.raises(XtrainError) as info:
        detect_launch({**TORCHRUN, "RANK": "-1"})
    assert str(info.value) == "torchrun says this is process -1 of 4"


def test_each_launcher_s_local_rank_and_count_come_from_its_own_variables():
    """Values that differ from every other variable of the launch, so that reading the wrong one shows."""
    torchrun = detect_launch({**TORCHRUN, "RANK": "2", "LOCAL_RANK": "0"})  # GROUP_RANK (the node) stays 1
    assert (torchrun.local_rank, torchrun.local_processes) == (0, 2)
    hydra = detect_launch({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (hydra.process_rank, hydra.num_processes, hydra.local_rank, hydra.local_processes) == (3, 4, 1, 2)
    ompi = detect_launch({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "6",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"})
    assert (ompi.process_rank, ompi.num_processes, ompi.local_rank, ompi.local_processes) == (3, 6, 0, 3)


def test_an_srun_job_id_names_the_step():
    """The derived rendezvous token holds it: two steps of one job (two sruns in one batch script) on one
    port must not take each other's processes."""
    assert detect_launch(SRUN).job_id == "123456.0"
    assert detect_launch({**SRUN, "SLURM_STEP_ID": "1"}).job_id == "123456.1"


@pytest.mark.parametrize("nodelist, hosts", [
    ("n[8-10]", ["n8", "n9", "n10"]),  # the padding is the low end's: no n08
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
])
def test_ranges_keep_the_padding_of_their_low_end(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("node[3-1]", "cannot read the SLURM node list 'node[3-1]' (range '3-1' runs backwards)"),
    ("node[a-b]", "cannot read the SLURM node list 'node[a-b]' (range 'a-b')"),
    ("node[1-3", "cannot read the SLURM node list 'node[1-3' (unbalanced brackets)"),
])
def test_unreadable_nodelists_say_why(nodelist, message):
    with pytest.raises(XtrainError) as info:
        expand_nodelist(nodelist)
    assert str(info.value) == message


def test_tcp_with_cuda_is_refused_like_mpi():
    with pytest.raises(XtrainError) as info:
        choose_engine("tcp", "cuda", detect_launch(TORCHRUN))
    assert str(info.value) == "--comm tcp reduces host (numpy) buffers: with --backend cuda use --comm nccl"


@pytest.mark.parametrize("text", ["host:-1", "host:65536", "host:x", ":4000", "host:", "[::1]junk", "[::1", "[::1]:",
                                  "[::1]x4000", "[]:4000"])
def test_rendezvous_addresses_outside_the_port_range_are_refused(text):
    with pytest.raises(XtrainError) as info:
        rdzv_addresses(detect_launch(TORCHRUN), None, text)
    assert str(info.value) == f"--rdzv-advertise '{text}' is not HOST[:PORT]"


@pytest.mark.parametrize("text, address", [("[::1]:4000", ("::1", 4000)), ("[fe80::1%eth0]", ("fe80::1%eth0", 29512)),
                                           ("10.0.0.7:4000", ("10.0.0.7", 4000)), ("0.0.0.0", ("0.0.0.0", 29512))])
def test_rendezvous_bind_addresses_in_every_accepted_form(text, address):
    """A bind address without a port takes the advertised one (MASTER_PORT + 1 under torchrun)."""
    bind, advertise = rdzv_addresses(detect_launch(TORCHRUN), text, None)
    assert bind == address and advertise == ("node7", 29512)
