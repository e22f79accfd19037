"""Which launcher started this process, read from its environment: torchrun, SLURM srun, mpirun, or none.

Every launcher says the same four things in its own words: this process's rank among the processes
of the job, how many processes there are, this process's index among those on its node (which picks
its GPUs), and where rank 0 can be reached. `detect_launch` turns them into one `Launch`.

A process then hosts `local_world` rank threads (the same number in every process), and its thread
`l` is global rank `process_rank * local_world + l`.
"""

import os
import re
import zlib
from dataclasses import dataclass

from ..errors import XtrainError


@dataclass(frozen=True)
class Launch:
    kind: str                  # "single" | "torchrun" | "srun" | "mpirun"
    process_rank: int = 0
    num_processes: int = 1
    local_rank: int = 0        # this process's index among the processes on its node
    local_processes: int = 1   # processes of this job on this node (they share its cores)
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    job_id: str = ""           # the launcher's name for this job (a derived rendezvous token uses it)
    # torchrun's agent already listens on MASTER_PORT (its TCPStore): our rendezvous then takes the next port
    master_port_taken: bool = False

    @property
    def rdzv_port(self) -> int:
        return self.master_port + 1 if self.master_port_taken else self.master_port

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def _int(env, name: str) -> int:
    text = env.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise XtrainError(f"environment variable {name}='{text}' is not an integer") from None


def _int_or(env, name: str, default: int) -> int:
    return _int(env, name) if name in env else default


def _port(env, name: str, default: int) -> int:
    if not env.get(name):
        return default
    port = _int(env, name)
    if not 0 < port < 65536:
        raise XtrainError(f"environment variable {name}={port} is not a TCP port (1-65535)")
    return port


def _srun_tasks_on_this_node(env, nodelist: str) -> int:
    """The tasks of this srun step on this node (their rank threads share its cores). Slurm gives the step's
    count per node in node-list order, "2(x3),1" for 2 on each of the first three nodes and 1 on the fourth,
    in SLURM_STEP_TASKS_PER_NODE (SLURM_NTASKS_PER_NODE is set only under --ntasks-per-node); this node is
    SLURMD_NODENAME in the step's node list. 1 where that cannot be read: a guess that leaves cores idle
    is better than one that oversubscribes them."""
    counts = []
    spec = (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
            or env.get("SLURM_NTASKS_PER_NODE") or "")
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not match:
            return 1
        counts += [int(match[1])] * int(match[2] or 1)
    if counts and len(set(counts)) == 1:
        return counts[0]
    try:
        return counts[expand_nodelist(nodelist).index(env.get("SLURMD_NODENAME", ""))]
    except (ValueError, IndexError, XtrainError):
        return 1


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: "gpu[01-03,7],login1" -> gpu01 gpu02 gpu03 gpu7 login1.

    Ranges keep their zero padding (01-03 -> 01, 02, 03); several bracket groups in one name
    multiply out ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2), as scontrol does."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        names = [""]
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not literal and not bracket:
                continue
            names = [n + literal for n in names]
            if bracket:
                names = [n + value for n in names for value in _expand_ranges(bracket, nodelist)]
        hosts.extend(names)
    if not hosts or any(not h for h in hosts):
        raise XtrainError(f"cannot read the SLURM node list '{nodelist}'")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth != 0:
        raise XtrainError(f"cannot read the SLURM node list '{text}' (unbalanced brackets)")
    return [item for item in items if item]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    values = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise XtrainError(f"cannot read the SLURM node list '{whole}' (range '{part}')")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise XtrainError(f"cannot read the SLURM node list '{whole}' (range '{part}' runs backwards)")
        values += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
    return values


def detect_launch(env=None) -> Launch:
    """The launcher of this process. torchrun wins over srun (torchrun may itself run under srun), and
    srun over mpirun-style variables (srun's PMI plugins set those too)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env):
        launch = Launch(
            "torchrun", process_rank=_int(env, "RANK"), num_processes=_int(env, "WORLD_SIZE"),
            local_rank=_int_or(env, "LOCAL_RANK", 0), local_processes=_int_or(env, "LOCAL_WORLD_SIZE", 1),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_port(env, "MASTER_PORT", 29500),
            job_id=env.get("TORCHELASTIC_RUN_ID", ""),
            master_port_taken=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # a step started by srun, not the batch script
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        if not nodelist:
            raise XtrainError("srun set SLURM_PROCID but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: "
                              "cannot tell which host is rank 0's")
        job = env.get("SLURM_JOB_ID", "0")
        ntasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        # Every task must agree on the port without talking: MASTER_PORT if the user set one, else one
        # derived from the job id, so two jobs sharing a node rarely collide.
        launch = Launch(
            "srun", process_rank=_int(env, "SLURM_PROCID"), num_processes=_int(env, ntasks),
            local_rank=_int_or(env, "SLURM_LOCALID", 0),
            local_processes=_srun_tasks_on_this_node(env, nodelist),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
            master_port=_port(env, "MASTER_PORT", 20000 + zlib.crc32(job.encode()) % 20000),
            job_id=f"{job}.{env.get('SLURM_STEP_ID', '0')}")
    elif "OMPI_COMM_WORLD_RANK" in env:  # Open MPI's mpirun
        launch = Launch(
            "mpirun", process_rank=_int(env, "OMPI_COMM_WORLD_RANK"), num_processes=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_rank=_int_or(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            local_processes=_int_or(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    elif "PMI_RANK" in env:  # MPICH's Hydra (mpirun/mpiexec from the mpich wheel)
        launch = Launch(
            "mpirun", process_rank=_int(env, "PMI_RANK"), num_processes=_int(env, "PMI_SIZE"),
            local_rank=_int_or(env, "MPI_LOCALRANKID", 0), local_processes=_int_or(env, "MPI_LOCALNRANKS", 1))
    else:
        if "RANK" in env and "WORLD_SIZE" in env and env["WORLD_SIZE"].strip() != "1":
            # half a torchrun-style launch: running alone would train a whole job's batch in every process
            raise XtrainError(f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are set but MASTER_ADDR is not: "
                              "set MASTER_ADDR (and MASTER_PORT) to where process 0 can be reached, or unset RANK and "
                              "WORLD_SIZE to run as one process")
        return Launch("single")
    if not 0 <= launch.process_rank < launch.num_processes:
        raise XtrainError(f"{launch.kind} says this is process {launch.process_rank} of {launch.num_processes}")
    return launch


def local_world_for(launch: Launch, world_size: int | None) -> int:
    """Rank threads per process for a requested total world size (None: one per process)."""
    if world_size is None:
        return 1
    if world_size < 1:
        raise XtrainError(f"--world-size must be at least 1, got {world_size}")
    if world_size % launch.num_processes:
        raise XtrainError(f"--world-size {world_size} does not match the launch: {launch.kind} started "
                          f"{launch.num_processes} processes, and every process hosts the same number of rank "
                          f"threads, so the world size must be a multiple of {launch.num_processes} (or omit it)")
    return world_size // launch.num_processes


def gpu_for(launch: Launch, local_world: int, local: int, visible: int) -> int:
    """The CUDA device of rank thread `local`: the process's own slice of its node's GPUs, or, when the
    launcher already gave each process only its own GPUs (srun --gpus-per-task, CUDA_VISIBLE_DEVICES
    per process), those."""
    if visible == local_world:
        return local
    device = launch.local_rank * local_world + local
    if device >= visible:
        raise XtrainError(f"process {launch.process_rank} (local rank {launch.local_rank}) needs GPU {device} for "
                          f"its rank thread {local}, but only {visible} GPU(s) are visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return device
