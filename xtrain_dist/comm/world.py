"""open_world: the communicators of the rank threads this process hosts, for any engine and launcher.

    world = open_world("mpi", launch=detect_launch(), local_world=1)
    results = run_thread_ranks(world.local_world, fn, group=world)   # fn(local, world.communicator(local))
    world.close()

Engines: "local" (threads of one process), "mpi" (processes under mpirun; mpi4py), "tcp" (processes
under torchrun/srun without MPI; sockets from the rendezvous), "nccl" (GPU ranks; nccl4py). A process
hosts `local_world` rank threads, the same number in every process; thread l is global rank
process_rank * local_world + l. `choose_engine` picks the engine a run asked for, or the natural one.
"""

import hashlib

from ..command import must_be, one_of
from ..errors import XtrainError
from .launch_env import Launch, detect_launch
from .local import LocalGroup
from .rendezvous import CONFIGURATION_HINT, rendezvous

ENGINES = ("auto", "local", "mpi", "tcp", "nccl")


def choose_engine(name: str, backend: str, launch: Launch, local_world: int = 1, gpus: int = 0) -> str:
    """'auto' -> NCCL for GPU ranks that each have a GPU of their own (several GPUs in one process,
    or processes); the thread communicator for a single process otherwise (world 1, CPU ranks, or
    virtual ranks sharing a GPU, which NCCL refuses); across CPU processes MPI under mpirun and TCP
    otherwise. `gpus` is how many GPUs this process sees (0 when unknown or not CUDA)."""
    if name not in ENGINES:
        raise XtrainError(must_be("--comm", one_of(ENGINES), name))
    if name == "auto":
        if not launch.multi_process:
            name = "nccl" if backend == "cuda" and 1 < local_world <= gpus else "local"
        elif backend == "cuda":
            name = "nccl"
        else:
            name = "mpi" if launch.kind == "mpirun" else "tcp"
    if name == "local" and backend == "cuda" and local_world > 1 and gpus > 1:
        raise XtrainError(f"{local_world} GPU ranks on {gpus} GPUs: the thread communicator adds buffers on one GPU "
                          "only (virtual ranks: make one GPU visible, CUDA_VISIBLE_DEVICES=0); NCCL needs a GPU "
                          "per rank (--comm nccl with at most as many ranks as GPUs)")
    if name == "local" and launch.multi_process:
        raise XtrainError(f"--comm local joins the rank threads of one process, but {launch.kind} started "
                          f"{launch.num_processes} processes: use --comm mpi, tcp or nccl (or omit --comm)")
    if name == "tcp" and not launch.multi_process:  # it would meet nobody: a world of one process, said nowhere
        raise XtrainError("--comm tcp joins processes over sockets, but this process runs alone (no torchrun, srun or "
                          "mpirun started it): use --comm local for the rank threads of one process (or omit --comm)")
    if name == "nccl" and backend != "cuda":
        raise XtrainError("--comm nccl reduces GPU buffers: it needs --backend cuda")
    if name in ("mpi", "tcp") and backend == "cuda":
        raise XtrainError(f"--comm {name} reduces host (numpy) buffers: with --backend cuda use --comm nccl")
    if name == "mpi" and launch.multi_process and launch.kind != "mpirun":
        raise XtrainError(f"--comm mpi needs processes started by mpirun/mpiexec, not {launch.kind}: "
                          "use --comm tcp (or omit --comm)")
    if name == "mpi":  # said now, before the run's header, rather than at the join
        from .mpi import check_installed
        check_installed()
    return name


class World:
    """The rank threads of this process and their communicators (one per thread)."""

    def __init__(self, engine: str, launch: Launch, local_world: int, comms: list, parts: list):
        self.engine, self.launch, self.local_world = engine, launch, local_world
        self.world_size = launch.num_processes * local_world
        self._comms, self._parts = comms, parts

    def global_rank(self, local: int) -> int:
        return self.launch.process_rank * self.local_world + local

    def communicator(self, local: int):
        return self._comms[local]

    def abort(self, reason: str) -> None:
        for part in self._parts:
            part.abort(reason)

    def close(self) -> None:
        for part in self._parts:
            if hasattr(part, "close"):
                part.close()


def config_fingerprint(fields: dict) -> bytes:
    """What every process of a run must agree on, as bytes to compare at the rendezvous."""
    return hashlib.sha256(repr(sorted(fields.items())).encode()).digest()


def _check_same_config_over_mpi(comm, fingerprint: bytes) -> None:
    """What the rendezvous checks for TCP: every process was started with the same configuration."""
    import numpy as np
    mine = np.frombuffer(hashlib.sha256(fingerprint).digest(), np.uint8)
    everyone = np.empty(32 * comm.world_size, np.uint8)
    comm.all_gather(mine, everyone)
    differ = [r for r in range(comm.world_size) if everyone[32 * r:32 * (r + 1)].tobytes() != everyone[:32].tobytes()]
    if differ:
        raise XtrainError(f"MPI rank(s) {', '.join(map(str, differ))} were started with a different configuration "
                          f"than rank 0 {CONFIGURATION_HINT}")


def open_world(engine: str, *, launch: Launch | None = None, local_world: int = 1, timeout_s: float = 300.0,
               rdzv_bind: str | None = None, rdzv_advertise: str | None = None, rdzv_timeout_s: float = 300.0,
               fingerprint: bytes = b"", devices: list[int] | None = None, log=print) -> World:
    """Join this process's `local_world` rank threads to the job. `engine` is one of ENGINES minus 'auto'
    (see choose_engine); `devices` (nccl) are the CUDA devices of the threads."""
    launch = launch or detect_launch()
    if engine == "nccl":
        from .nccl import open_nccl_world
        return open_nccl_world(launch, local_world, devices, timeout_s=timeout_s, rdzv_bind=rdzv_bind,
                               rdzv_advertise=rdzv_advertise, rdzv_timeout_s=rdzv_timeout_s,
                               fingerprint=fingerprint, log=log)
    group = LocalGroup(local_world, timeout_s)
    if engine == "local":
        if launch.multi_process:
            raise XtrainError("the local communicator spans one process only")
        return World(engine, launch, local_world, [group.communicator(r) for r in range(local_world)], [group])
    if engine == "mpi":
        from .mpi import MpiCommunicator
        inter = MpiCommunicator(timeout_s=timeout_s)
        if (inter.rank, inter.world_size) != (launch.process_rank, launch.num_processes):
            raise XtrainError(f"{launch.kind} started this as process {launch.process_rank} of {launch.num_processes}, "
                              f"but MPI says {inter.rank} of {inter.world_size}: the mpirun/mpiexec is not from the "
                              "MPI library mpi4py uses (run the one installed beside this Python, e.g. "
                              "$(dirname $(which python))/mpirun)")
        _check_same_config_over_mpi(inter, fingerprint)
    elif engine == "tcp":
        from .tcp import TcpCommunicator
        _, peers = rendezvous(launch, bind=rdzv_bind, advertise=rdzv_advertise, timeout_s=rdzv_timeout_s,
                              fingerprint=fingerprint, log=log)
        inter = TcpCommunicator(launch.process_rank, launch.num_processes, peers, timeout_s)
        inter.connect_all()  # point-to-point between any two processes, not only through rank 0
    else:
        raise XtrainError(f"unknown communicator engine '{engine}'")
    if local_world == 1:
        return World(engine, launch, 1, [inter], [group, inter])
    from .hybrid import HybridCommunicator
    comms = [HybridCommunicator(group.communicator(r), inter, launch.process_rank, local_world)
             for r in range(local_world)]
    return World(engine, launch, local_world, comms, [group, inter])
