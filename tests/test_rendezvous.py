"""The TCP rendezvous between real processes on loopback: the id reaches every process, a wrong token
or another command line is refused with a line on both sides, and a missing peer, a missing rank 0 or
a port in use end in one line naming the address; a process that fails before it joins ends the others
within seconds, with a line naming it and its reason. No test depends on timing to pass: deadlines are
generous and every wait has its own."""

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from xtrain_dist.comm import rendezvous as rdzv
from xtrain_dist.comm import world as world_mod
from xtrain_dist.comm.launch_env import Launch
from xtrain_dist.comm.rendezvous import RendezvousServer, join, report_failure
from xtrain_dist.errors import XtrainError
from xtrain_dist.train.launch import RankFailed, run_thread_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# this checkout first, then whatever the caller had (the GPU scripts add the wheels of .whl/)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

# One participant. Rank 0 prints the port it listens on, then every rank prints what it received.
PARTICIPANT = r"""
import sys
from xtrain_dist.comm.rendezvous import RendezvousServer, join, token_from_env
from xtrain_dist.errors import XtrainError
rank, world, port = (int(a) for a in sys.argv[1:4])
timeout, fingerprint = float(sys.argv[4]), sys.argv[5].encode()
token = token_from_env(b"default token")
log = lambda line: print("LOG", line, file=sys.stderr, flush=True)
try:
    if rank == 0:
        server = RendezvousServer(("127.0.0.1", port), world, token, fingerprint, timeout, log=log)
        print("PORT", server.port, flush=True)
        payload = bytes(range(128))
        peers = server.serve(payload)
        print("SERVED", sum(p is not None for p in peers), flush=True)
    else:
        payload, conn = join(("127.0.0.1", port), rank, world, token, fingerprint, timeout)
        print("GOT", payload.hex(), flush=True)
except XtrainError as e:
    print("ERROR", e, file=sys.stderr, flush=True)
    sys.exit(2)
"""


def start(rank, world, port, timeout=60, fingerprint="cfg", token=None):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    env.pop("XTRAIN_RDZV_TOKEN", None)
    if token is not None:
        env["XTRAIN_RDZV_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-c", PARTICIPANT, str(rank), str(world), str(port), str(timeout),
                             fingerprint], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def start_server(world, timeout=60, **kw):
    server = start(0, world, 0, timeout, **kw)
    line = server.stdout.readline()
    assert line.startswith("PORT "), (line, server.stderr.read())
    return server, int(line.split()[1])


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def error_of(err):
    lines = [line for line in err.splitlines() if line.startswith("ERROR ")]
    assert len(lines) == 1, err
    return lines[0][len("ERROR "):]


def test_the_id_reaches_every_process():
    server, port = start_server(3, token="s3cret")
    peers = [start(r, 3, port, token="s3cret") for r in (1, 2)]
    for peer in peers:
        code, out, err = finish(peer)
        assert code == 0, err
        assert out.strip() == "GOT " + bytes(range(128)).hex()
    code, out, err = finish(server)
    assert code == 0 and "SERVED 2" in out, err


def test_a_wrong_token_is_refused_on_both_sides():
    server, port = start_server(2, timeout=60, token="right")
    intruder = start(1, 2, port, token="wrong")
    code, out, err = finish(intruder)
    assert code == 2 and "GOT" not in out
    assert error_of(err) == (f"rendezvous: rank 0 at 127.0.0.1:{port} refused rank 1: wrong token "
                             "(set the same XTRAIN_RDZV_TOKEN for every process)")
    # rank 0 said so too, and still serves the rank that holds the token
    legit = start(1, 2, port, token="right")
    assert finish(legit)[0] == 0
    code, out, err = finish(server)
    assert code == 0 and "SERVED 1" in out
    assert "LOG rendezvous: refused a connection from 127.0.0.1:" in err
    assert "wrong token (set the same XTRAIN_RDZV_TOKEN for every process)" in err


def test_another_command_line_ends_the_job_at_once():
    """A process with the token but another configuration is of this job and can never join it: rank 0
    refuses it and ends the rendezvous now, telling the rank that joined, instead of waiting out its timeout."""
    t0 = time.monotonic()
    server, port = start_server(3, timeout=60, fingerprint="steps=10")
    joined = start(1, 3, port, fingerprint="steps=10")
    time.sleep(0.5)  # most likely waiting at rank 0 by now; either way it must hear the same
    code, _, err = finish(start(2, 3, port, fingerprint="steps=20"))
    why = ("rank 2 was started with a different configuration than rank 0 (another command line, other corpus "
           "or tokenizer files, or --resume auto finding a checkpoint in --save-dir on some machines only?)")
    assert code == 2 and error_of(err) == f"rendezvous: rank 0 at 127.0.0.1:{port} refused rank 2: {why}"
    code, _, err = finish(joined)
    assert code == 2 and error_of(err) == f"rendezvous: rank 0 at 127.0.0.1:{port} refused rank 1: {why}"
    code, _, err = finish(server)
    assert code == 2 and re.fullmatch(rf"rendezvous at 127\.0\.0\.1:{port}: refused 127\.0\.0\.1:\d+: {re.escape(why)}",
                                      error_of(err))
    assert time.monotonic() - t0 < SOON


def test_rank0_times_out_naming_the_missing_ranks():
    """...and the rank that joined, waiting for the others, hears the same line instead of starting alone."""
    server, port = start_server(3, timeout=3)
    code, _, err = finish(start(2, 3, port))
    assert code == 2
    assert error_of(err) == (f"rendezvous: rank 0 at 127.0.0.1:{port} refused rank 2: only 2 of 3 processes joined "
                             "within 3 s (missing rank 1)")
    code, _, err = finish(server)
    assert code == 2
    assert error_of(err) == f"rendezvous at 127.0.0.1:{port}: only 2 of 3 processes joined within 3 s (missing rank 1)"


def test_a_peer_times_out_naming_the_address():
    with socket.socket() as probe:  # a port nobody listens on (bound, not listening: connections are refused)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        code, _, err = finish(start(1, 2, port, timeout=2))
    assert code == 2
    assert error_of(err) == (f"rendezvous: no answer from rank 0 at 127.0.0.1:{port} within 2 s (connection refused); "
                             "is rank 0 running, and is this the address the other processes reach "
                             "(MASTER_ADDR/MASTER_PORT or --rdzv-advertise)?")


def test_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = finish(start(0, 2, port))
    assert code == 2
    assert error_of(err) == (f"rendezvous cannot listen on 127.0.0.1:{port}: address already in use (another job or "
                             "process uses that port; choose another with --rdzv-bind HOST:PORT (and "
                             "--rdzv-advertise for the other processes))")


def test_binding_an_address_of_another_machine_says_what_to_do():
    with pytest.raises(XtrainError) as info:
        RendezvousServer(("192.0.2.1", 0), 2, b"t")  # TEST-NET-1: never assigned to this machine
    assert str(info.value).startswith("rendezvous cannot listen on 192.0.2.1:0: cannot assign requested address "
                                      "(the address is not one of this machine's; behind docker or NAT bind")


def test_it_binds_only_the_address_it_is_told():
    server = RendezvousServer(("127.0.0.1", 0), 2, b"t", timeout_s=1)
    try:
        assert server.sock.getsockname()[0] == "127.0.0.1"
    finally:
        server.sock.close()


def test_something_that_is_not_a_rendezvous_is_named():
    """As torchrun's own store on MASTER_PORT would be: it does not greet with our magic."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        def answer():
            conn, _ = other.accept()
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"\x00" * 64)
                conn.recv(1024)

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(XtrainError) as info:
            join(("127.0.0.1", port), 1, 2, b"t", timeout_s=20)
    assert str(info.value).startswith(f"rendezvous: 127.0.0.1:{port} is not an xtrain-dist rendezvous")


def test_a_server_without_the_token_is_not_believed():
    """The peer checks rank 0's proof too: a listener that accepts everyone cannot hand out an id."""
    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen()
        port = fake.getsockname()[1]

        def accept_anyone():
            conn, _ = fake.accept()
            with conn, contextlib.suppress(OSError):
                conn.sendall(rdzv._GREETING.pack(rdzv.MAGIC, rdzv.VERSION, bytes(32)))
                rdzv._recv_exact(conn, rdzv._JOIN.size)
                conn.sendall(rdzv._REPLY.pack(rdzv.MAGIC, rdzv.ACCEPT, bytes(32), 7) + b"fake id")
                conn.recv(1)

        threading.Thread(target=accept_anyone, daemon=True).start()
        with pytest.raises(XtrainError) as info:
            join(("127.0.0.1", port), 1, 2, b"the job's token", timeout_s=20)
    assert str(info.value) == (f"rendezvous: 127.0.0.1:{port} answered without proof of the token: not our rank 0, "
                               "or a different XTRAIN_RDZV_TOKEN")


# ------------------------------------------------------------------ a process that fails before it joins
class Background:
    """fn(*args) in a daemon thread; result() waits a bounded time, then returns its value or raises its error."""

    def __init__(self, fn, *args):
        self.value = self.error = None
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self.thread.start()

    def _run(self, fn, args):
        try:
            self.value = fn(*args)
        except BaseException as e:  # handed to result()
            self.error = e

    def result(self, timeout=30):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


SOON = 20  # seconds: "at once" next to the 60 s rendezvous timeout, yet generous on a loaded machine


def serving(world, token=b"tok", timeout=60, log=None):
    server = RendezvousServer(("127.0.0.1", 0), world, token, b"cfg", timeout, log=log or (lambda line: None))
    return server, ("127.0.0.1", server.port), Background(server.serve, b"the id")


def test_a_peer_that_fails_ends_rank0s_wait_at_once(monkeypatch):
    monkeypatch.setattr(rdzv, "LINGER_S", 100)  # rank 0 lingers only for ranks not yet told: here none
    t0 = time.monotonic()
    _, addr, served = serving(2)
    report_failure(addr, 1, 2, b"tok", "corpus 'data/x.txt' not found\n(on node7)", timeout_s=20)
    with pytest.raises(XtrainError) as info:
        served.result()
    assert str(info.value) == "process 1 failed before joining: corpus 'data/x.txt' not found (on node7)"
    assert time.monotonic() - t0 < SOON


@pytest.mark.parametrize("rank1", ["joined first", "joins later"])
def test_the_other_ranks_hear_which_process_failed_and_why(rank1):
    t0 = time.monotonic()
    _, addr, served = serving(3)
    if rank1 == "joined first":
        joining = Background(join, addr, 1, 3, b"tok", b"cfg", 60)
        time.sleep(0.5)  # most likely waiting at rank 0 by now; either way it must hear the same
        report_failure(addr, 2, 3, b"tok", "out of memory", timeout_s=20)
    else:
        report_failure(addr, 2, 3, b"tok", "out of memory", timeout_s=20)
        joining = Background(join, addr, 1, 3, b"tok", b"cfg", 60)
    with pytest.raises(XtrainError) as info:
        joining.result()
    assert str(info.value) == (f"rendezvous: rank 0 at 127.0.0.1:{addr[1]} refused rank 1: "
                               "process 2 failed: out of memory")
    with pytest.raises(XtrainError, match=r"^process 2 failed before joining: out of memory$"):
        served.result()  # every other rank was told: rank 0 need not linger
    assert time.monotonic() - t0 < SOON


def test_a_rank0_that_fails_tells_every_joiner():
    t0 = time.monotonic()
    server = RendezvousServer(("127.0.0.1", 0), 3, b"tok", timeout_s=60)
    refusing = Background(server.refuse_all, "tokenizer 'tok.json' not found", 60)
    for rank in (1, 2):
        with pytest.raises(XtrainError) as info:
            join(("127.0.0.1", server.port), rank, 3, b"tok", b"any config", timeout_s=60)
        assert str(info.value) == (f"rendezvous: rank 0 at 127.0.0.1:{server.port} refused rank {rank}: "
                                   "process 0 failed: tokenizer 'tok.json' not found")
    refusing.result()  # both ranks know: it stops long before its 60 s
    assert time.monotonic() - t0 < SOON


def test_a_rank0_that_fails_while_serving_tells_every_joiner():
    """Any failure of rank 0 in the rendezvous, not only its own checks: here a timeout past what a socket
    takes (OverflowError at the first wait), which once left the other processes retrying until theirs."""
    t0 = time.monotonic()
    server = RendezvousServer(("127.0.0.1", 0), 3, b"tok", b"cfg", timeout_s=1e10)
    joining = [Background(join, ("127.0.0.1", server.port), rank, 3, b"tok", b"cfg", 60) for rank in (1, 2)]
    time.sleep(0.5)  # most likely both wait in rank 0's backlog by now; either way they must hear it
    with pytest.raises(OverflowError):
        server.serve(b"the id")
    for rank, joiner in zip((1, 2), joining, strict=True):
        with pytest.raises(XtrainError) as info:
            joiner.result()
        assert str(info.value).startswith(f"rendezvous: rank 0 at 127.0.0.1:{server.port} refused rank {rank}: "
                                          "process 0 failed: OverflowError: ")
    assert time.monotonic() - t0 < SOON


def test_a_fail_without_the_token_does_not_abort_the_job():
    logs = []
    _, addr, served = serving(2, token=b"right", log=logs.append)
    report_failure(addr, 1, 2, b"wrong", "a stranger says stop", timeout_s=20)
    payload, conn = join(addr, 1, 2, b"right", b"cfg", timeout_s=20)
    with conn:
        assert payload == b"the id"
        peers = served.result()
        assert peers[1] is not None
        peers[1].close()
    assert len(logs) == 1 and logs[0].endswith("wrong token (set the same XTRAIN_RDZV_TOKEN for every process)")


def test_reporting_a_failure_never_waits_past_its_timeout():
    with socket.socket() as closed, socket.socket() as mute:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        mute.bind(("127.0.0.1", 0))
        mute.listen()  # connections are queued, never greeted
        for sock in (closed, mute):
            t0 = time.monotonic()
            assert report_failure(sock.getsockname(), 1, 2, b"tok", "reason", timeout_s=1.5) is None
            assert time.monotonic() - t0 < 5


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(rank, world, port):
    return Launch("torchrun", process_rank=rank, num_processes=world, master_addr="127.0.0.1", master_port=port,
                  job_id="job42")


def test_the_trainers_entry_point_tells_the_others(monkeypatch):
    monkeypatch.delenv("XTRAIN_RDZV_TOKEN", raising=False)
    t0 = time.monotonic()
    # rank 1 fails before the world: rank 0, already in the rendezvous, ends at once
    port = free_port()
    server = RendezvousServer(("127.0.0.1", port), 2, rdzv.derived_token("job42", "127.0.0.1", port), timeout_s=60)
    served = Background(server.serve, b"id")
    rdzv.report_failure_before_world(torchrun(1, 2, port), "corpus missing", timeout_s=20)
    with pytest.raises(XtrainError, match=r"^process 1 failed before joining: corpus missing$"):
        served.result()
    # rank 0 fails before the world: rank 1 hears it at the rendezvous
    port = free_port()
    refusing = Background(rdzv.report_failure_before_world, torchrun(0, 2, port), "no GPU")
    with pytest.raises(XtrainError, match=r"refused rank 1: process 0 failed: no GPU$"):
        join(("127.0.0.1", port), 1, 2, rdzv.derived_token("job42", "127.0.0.1", port), timeout_s=20)
    refusing.result()
    assert time.monotonic() - t0 < 2 * SOON


@pytest.mark.parametrize("launch", [Launch("single"), Launch("mpirun", process_rank=1, num_processes=2)])
def test_the_entry_point_does_nothing_alone_or_under_mpirun(launch, monkeypatch):
    t0 = time.monotonic()
    rdzv.report_failure_before_world(launch, "reason", timeout_s=30)
    assert time.monotonic() - t0 < 1


# ------------------------------------------------------------------ the derived token on several hosts
@pytest.mark.parametrize("rank, local, advertise, token, warned", [
    (0, 1, "node7", None, True),                # 1 of 2 processes on rank 0's host: the others connect from afar
    (0, 1, "10.0.0.5", None, True),
    (0, 1, "10.0.0.5", "s3cret", False),         # a secret token: nothing to say
    (0, 2, "10.0.0.5", None, False),             # both processes on this host
    (0, 1, "127.0.0.1", None, False),            # a launch by hand on loopback: one host whatever it counts
    (0, 1, "localhost", None, False),
    (1, 1, "10.0.0.5", None, False),             # one line per job: rank 0's
])
def test_a_derived_token_on_several_hosts_is_said_once_by_rank0(rank, local, advertise, token, warned, monkeypatch):
    """Without XTRAIN_RDZV_TOKEN the token is the launcher's job id and rank 0's address, which a process on
    another host can work out as well as the job's own: rank 0 says so, once, where the job spans hosts."""
    if token is None:
        monkeypatch.delenv("XTRAIN_RDZV_TOKEN", raising=False)
    else:
        monkeypatch.setenv("XTRAIN_RDZV_TOKEN", token)
    port = free_port()
    launch = Launch("torchrun", process_rank=rank, num_processes=2, local_processes=local, master_addr=advertise,
                    master_port=port, job_id="job42")
    logs = []
    monkeypatch.setattr(rdzv, "join", lambda *args: (_ for _ in ()).throw(XtrainError("nobody there")))
    with pytest.raises(XtrainError, match="only 1 of 2 processes joined" if rank == 0 else "nobody there"):
        rdzv.rendezvous(launch, bind=f"127.0.0.1:{port}", timeout_s=0.2, log=logs.append)
    expected = [f"rendezvous: XTRAIN_RDZV_TOKEN is not set, and the launcher puts 1 of this job's 2 processes on "
                f"this host: the token is derived from the job id and rank 0's address, which anyone who can reach "
                f"{advertise}:{port} can work out; set the same secret XTRAIN_RDZV_TOKEN for every process"]
    assert logs == (expected if warned else [])


# ------------------------------------------------------------------ what mutation testing found untested
def test_a_peer_with_another_world_size_ends_the_job_at_once():
    _, addr, served = serving(2)
    with pytest.raises(XtrainError) as info:
        join(addr, 1, 3, b"tok", b"cfg", timeout_s=20)
    why = "rank 1 expects a world of 3 processes, rank 0 has 2"
    assert str(info.value) == f"rendezvous: rank 0 at 127.0.0.1:{addr[1]} refused rank 1: {why}"
    with pytest.raises(XtrainError, match=rf"^rendezvous at 127\.0\.0\.1:{addr[1]}: refused 127\.0\.0\.1:\d+: {why}$"):
        served.result()


@pytest.mark.parametrize("rank", [0, 2])
def test_a_peer_outside_the_ranks_is_refused(rank, monkeypatch):
    monkeypatch.setattr(rdzv, "LINGER_S", 0.5)  # rank 1 never comes to be told
    _, addr, served = serving(2)
    with pytest.raises(XtrainError) as info:
        join(addr, rank, 2, b"tok", b"cfg", timeout_s=20)
    assert str(info.value) == f"rendezvous: rank 0 at 127.0.0.1:{addr[1]} refused rank {rank}: rank {rank} is " \
                              "outside 1..1"
    with pytest.raises(XtrainError, match=rf"refused 127\.0\.0\.1:\d+: rank {rank} is outside 1\.\.1$"):
        served.result()


def test_every_rank_hears_of_a_process_with_another_world_size_whatever_rank_it_claims():
    """A process started for a world of 4 as its rank 3 meets a rank 0 of a world of 3: rank 3 is none of
    this job's ranks, so it must not count as told, or rank 0 stops telling the others one rank early and
    the last waits out its whole timeout (here: "no answer from rank 0" after 5 s)."""
    _, addr, served = serving(3)
    why = "rank 3 expects a world of 4 processes, rank 0 has 3"
    with pytest.raises(XtrainError, match=f"refused rank 3: {why}$"):
        join(addr, 3, 4, b"tok", b"cfg", timeout_s=20)
    for rank in (1, 2):
        with pytest.raises(XtrainError) as info:
            join(addr, rank, 3, b"tok", b"cfg", timeout_s=5)
        assert str(info.value) == f"rendezvous: rank 0 at 127.0.0.1:{addr[1]} refused rank {rank}: {why}"
    with pytest.raises(XtrainError, match=f"{why}$"):
        served.result()


def test_a_second_connection_for_a_rank_that_joined_is_refused_and_the_job_goes_on():
    """Whichever of the two arrives second is refused; the first keeps its place and starts with rank 2."""
    logs = []
    _, addr, served = serving(3, log=logs.append)
    twins = [Background(join, addr, 1, 3, b"tok", b"cfg", 60) for _ in range(2)]
    end = time.monotonic() + 20
    while all(t.thread.is_alive() for t in twins) and time.monotonic() < end:
        time.sleep(0.01)
    refused = [t for t in twins if not t.thread.is_alive()]
    assert len(refused) == 1, "neither connection for rank 1 was refused"
    with pytest.raises(XtrainError) as info:
        refused[0].result()
    assert str(info.value) == f"rendezvous: rank 0 at 127.0.0.1:{addr[1]} refused rank 1: rank 1 has already joined"
    payload, conn = join(addr, 2, 3, b"tok", b"cfg", timeout_s=20)
    conn.close()
    (first,) = [t for t in twins if t is not refused[0]]
    payload_1, conn_1 = first.result()
    conn_1.close()
    assert payload == payload_1 == b"the id"
    for peer in served.result()[1:]:
        peer.close()
    assert len(logs) == 1 and logs[0].endswith("rank 1 has already joined")


def test_a_silent_connection_does_not_hold_rank0_up(monkeypatch):
    """A connection that never speaks (a port scanner, a half-open socket) waits beside the ranks, not
    before them: the rank behind it joins at once, and the silent one is dropped and named after the
    greeting timeout."""
    monkeypatch.setattr(rdzv, "GREETING_TIMEOUT_S", 0.5)
    logs = []
    _, addr, served = serving(3, log=logs.append)
    with socket.create_connection(addr) as silent:  # queued first: rank 0 greets it first
        silent_port = silent.getsockname()[1]
        t0 = time.monotonic()
        joining = Background(join, addr, 1, 3, b"tok", b"cfg", 20)
        end = time.monotonic() + 20
        while not any(line.endswith("no valid greeting (timed out)") for line in logs) and time.monotonic() < end:
            time.sleep(0.05)
        payload, conn = join(addr, 2, 3, b"tok", b"cfg", timeout_s=20)
        conn.close()
        assert payload == b"the id" and joining.result()[0] == b"the id"
        for peer in served.result()[1:]:
            peer.close()
        assert time.monotonic() - t0 < SOON
    assert logs == [f"rendezvous: refused a connection from 127.0.0.1:{silent_port}: "
                    "no valid greeting (timed out)"]


class Strangers:
    """Connections that are not ranks, made in the background until stop(): `silent` opens one every 0.2 s
    and never speaks, `flood` opens 200 at once and holds them, `drip` sends one byte every 0.3 s,
    `garbage` sends 200 bytes that are not our message, `forger` sends a well-formed JOIN for rank 1
    without the token. Each records the local ports it used, so the log can be checked against them."""

    def __init__(self, addr, kinds):
        self.addr, self.done, self.ports = addr, threading.Event(), {kind: set() for kind in kinds}
        self.socks = []
        self.threads = [threading.Thread(target=getattr(self, kind), daemon=True) for kind in kinds]
        for t in self.threads:
            t.start()

    def _connect(self, kind):
        sock = socket.create_connection(self.addr, timeout=5)
        self.ports[kind].add(sock.getsockname()[1])
        self.socks.append(sock)
        return sock

    def silent(self):
        while not self.done.wait(0.2):
            with contextlib.suppress(OSError):
                self._connect("silent")

    def flood(self):
        for _ in range(200):
            with contextlib.suppress(OSError):
                self._connect("flood")

    def drip(self):
        with contextlib.suppress(OSError):
            sock = self._connect("drip")
            while not self.done.wait(0.3):
                sock.send(b"X")

    def garbage(self):
        while not self.done.wait(0.3):
            with contextlib.suppress(OSError), self._connect("garbage") as sock:
                sock.sendall(bytes(range(200)))
                sock.recv(1024)

    def forger(self):
        while not self.done.wait(0.3):
            with contextlib.suppress(OSError), self._connect("forger") as sock:
                sock.settimeout(5)
                rdzv._recv_exact(sock, rdzv._GREETING.size)
                sock.sendall(rdzv._JOIN.pack(rdzv.MAGIC, rdzv.VERSION, rdzv.JOIN, 1, 3, bytes(32), bytes(32),
                                             bytes(32), 0))
                sock.recv(1024)

    def stop(self):
        self.done.set()
        for t in self.threads:
            t.join(10)
        for sock in self.socks:
            sock.close()


def test_strangers_cannot_keep_the_ranks_out():
    """While strangers connect again and again (silent, a flood of 200, a slow drip, garbage, a JOIN
    without the token), the two real ranks join within seconds of a 10 s rendezvous timeout: rank 0 hears
    every connection at once, drops one that has not spoken within the greeting timeout, and holds at most
    MAX_PENDING. The log names the strangers by address, one line per host every LOG_EVERY_S, and counts
    the rest. (Heard one at a time with a 10 s wait each, two silent connections kept rank 1 out until
    rank 0's timeout, and rank 1 blamed rank 0.)"""
    logs = []
    _, addr, served = serving(3, timeout=10, log=logs.append)
    strangers = Strangers(addr, ["silent", "flood", "drip", "garbage", "forger"])
    try:
        time.sleep(1.0)  # the strangers are at it before the ranks come
        t0 = time.monotonic()
        joining = [Background(join, addr, rank, 3, b"tok", b"cfg", 10) for rank in (1, 2)]
        for joiner in joining:
            payload, conn = joiner.result(timeout=15)
            conn.close()
            assert payload == b"the id"
        for peer in served.result(timeout=15)[1:]:
            peer.close()
        assert time.monotonic() - t0 < 8  # well within the 10 s timeout, on a loaded machine too
    finally:
        strangers.stop()
    assert logs and all(line.startswith("rendezvous: refused a connection from 127.0.0.1:")
                        or re.fullmatch(r"rendezvous: refused \d+ more connections? from 127\.0\.0\.1 \(the last: .*\)",
                                        line) for line in logs), logs
    assert len(logs) <= 3, logs  # one host: its first line, at most one more within 10 s, and the count
    first = re.fullmatch(r"rendezvous: refused a connection from 127\.0\.0\.1:(\d+): (.*)", logs[0])
    kind = [k for k, ports in strangers.ports.items() if int(first[1]) in ports]
    evicted = "no valid greeting (too many connections waiting to be heard)"
    why = {"silent": "no valid greeting (timed out)", "flood": evicted, "drip": "no valid greeting (timed out)",
           "garbage": "not an xtrain-dist process",
           "forger": "wrong token (set the same XTRAIN_RDZV_TOKEN for every process)"}
    # a silent or dripping connection still waiting when the flood fills the pending places is dropped as
    # the oldest of the busiest host (all are 127.0.0.1 here), so either line is its own
    assert kind and (first[2] == why[kind[0]] or (kind[0] in ("silent", "drip") and first[2] == evicted)), first


@pytest.mark.parametrize("kind, why", [
    ("garbage", "not an xtrain-dist process"),
    ("forger", "wrong token (set the same XTRAIN_RDZV_TOKEN for every process)"),
    ("drip", "no valid greeting (timed out)"),
])
def test_a_stranger_is_named_and_a_rank_gets_past_it(kind, why, monkeypatch):
    """One kind of stranger at a time, so its log line is known: the rank joins while it tries."""
    monkeypatch.setattr(rdzv, "GREETING_TIMEOUT_S", 0.5)
    logs = []
    _, addr, served = serving(2, timeout=10, log=logs.append)
    strangers = Strangers(addr, [kind])
    try:
        end = time.monotonic() + 10
        while not logs and time.monotonic() < end:
            time.sleep(0.05)
        _, conn = join(addr, 1, 2, b"tok", b"cfg", timeout_s=10)
        conn.close()
        served.result()[1].close()
    finally:
        strangers.stop()
    first = re.fullmatch(r"rendezvous: refused a connection from 127\.0\.0\.1:(\d+): (.*)", logs[0])
    assert first and int(first[1]) in strangers.ports[kind] and first[2] == why, logs


def test_a_timeout_names_the_refused_hosts_in_a_few_words():
    """A flood refused before the timeout is one entry with its count, not a line of every connection."""
    logs = []
    _, addr, served = serving(2, timeout=2, log=logs.append)
    strangers = Strangers(addr, ["garbage"])
    try:
        with pytest.raises(XtrainError) as info:
            served.result()
    finally:
        strangers.stop()
    assert re.fullmatch(rf"rendezvous at 127\.0\.0\.1:{addr[1]}: only 1 of 2 processes joined within 2 s \(missing "
                        r"rank 1\); refused: 127\.0\.0\.1 \(\d+ connections, the last: 127\.0\.0\.1:\d+ \(not an "
                        r"xtrain-dist process\)\)", str(info.value)), str(info.value)


def fake_rank0(greeting, answer=None):
    """A listener that greets with `greeting`, reads the join and then answers `answer` (None: nothing,
    ever, while the test runs). Returns (port, stop)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.sendall(greeting)
            rdzv._recv_exact(conn, rdzv._JOIN.size)
            if answer is not None:
                conn.sendall(answer)
            stop.wait(30)
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], stop


def test_a_peer_that_rank0_never_answers_times_out_naming_its_wait():
    port, stop = fake_rank0(rdzv._GREETING.pack(rdzv.MAGIC, rdzv.VERSION, bytes(32)))
    try:
        joining = Background(join, ("127.0.0.1", port), 1, 2, b"tok", b"cfg", 1.5)
        with pytest.raises(XtrainError) as info:
            joining.result(timeout=15)
    finally:
        stop.set()
    assert str(info.value) == (f"rendezvous: rank 1 reached rank 0 at 127.0.0.1:{port}, but not every process "
                               "joined within 1.5 s (rank 0 names the missing ranks)")


def test_a_rank0_of_another_protocol_version_is_named():
    port, stop = fake_rank0(rdzv._GREETING.pack(rdzv.MAGIC, rdzv.VERSION - 1, bytes(32)))
    try:
        with pytest.raises(XtrainError) as info:
            join(("127.0.0.1", port), 1, 2, b"tok", timeout_s=20)
    finally:
        stop.set()
    assert str(info.value) == (f"rendezvous: rank 0 at 127.0.0.1:{port} speaks protocol version {rdzv.VERSION - 1}, "
                               f"this process {rdzv.VERSION}")


def test_an_address_that_does_not_resolve_is_one_line_at_once(monkeypatch):
    def unknown(*args, **kw):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(rdzv.socket, "create_connection", unknown)
    t0 = time.monotonic()
    with pytest.raises(XtrainError) as info:
        join(("node-that-is-not.invalid", 29500), 1, 2, b"tok", timeout_s=60)
    assert str(info.value) == ("rendezvous: cannot resolve rank 0's address node-that-is-not.invalid:29500 "
                               "(Name or service not known)")
    assert time.monotonic() - t0 < 5  # not retried until the timeout: a typo does not heal


def test_a_long_failure_reason_is_cut_to_fit_the_message_and_still_ends_the_job():
    """A FAIL may carry at most 1 KiB of reason: longer (a long path, a long error) is cut, on a character
    boundary, rather than refused as malformed, which would leave rank 0 waiting for its timeout."""
    _, addr, served = serving(2)
    report_failure(addr, 1, 2, b"tok", "\u00e9" * 700, timeout_s=20)  # 1400 bytes of UTF-8
    with pytest.raises(XtrainError) as info:
        served.result()
    assert str(info.value) == "process 1 failed before joining: " + "\u00e9" * 512


def test_open_world_over_tcp_two_processes_of_two_rank_threads_on_two_nodes():
    """Two processes (here threads of this one, each with its own Launch) of two rank threads each, as on
    two nodes (local rank 0 on both), rank 0 binding an address the others do not use: global ranks
    follow the process rank, the world is 4, every rank gets the process-order sum, and an abort of one
    process reaches the other at once."""
    port = free_port()
    sums = [rank_values(r) for r in range(4)]
    expected = (sums[0] + sums[1]) + (sums[2] + sums[3])
    go_on, done = threading.Event(), threading.Event()

    def process(p):
        launch = Launch("torchrun", process_rank=p, num_processes=2, local_rank=0, master_addr="127.0.0.1",
                        master_port=port, job_id="job42")
        # --rdzv-bind is rank 0's option: the others only know the advertised address
        world = world_mod.open_world("tcp", launch=launch, local_world=2, timeout_s=60, rdzv_timeout_s=20,
                                     rdzv_bind=f"127.0.0.1:{port}" if p == 0 else None,
                                     rdzv_advertise=f"localhost:{port}", log=lambda line: None)
        assert world.world_size == 4

        def body(local, comm):
            assert comm.rank == world.global_rank(local) == 2 * p + local
            buf = rank_values(comm.rank)
            comm.all_reduce(buf)
            return buf

        first = run_thread_ranks(2, body, group=world)
        if p == 0:
            go_on.wait(20)
            world.abort("process 0 stops")
            done.wait(30)  # the abort alone must reach process 1: its sockets stay open until then
            world.close()
            return first, None
        go_on.set()
        t0 = time.monotonic()
        with pytest.raises(RankFailed) as info:
            run_thread_ranks(2, lambda local, comm: comm.barrier(), group=world)
        done.set()
        world.close()
        return first, (time.monotonic() - t0, str(info.value))

    processes = [Background(process, p) for p in range(2)]
    (first_0, _), (first_1, (waited, error)) = (p.result(timeout=60) for p in processes)
    assert [b.tobytes() for b in first_0 + first_1] == [expected.tobytes()] * 4
    assert "the connection to rank 0 broke in barrier" in error, error
    assert waited < SOON


def rank_values(rank):
    return np.arange(5, dtype=np.float32) * np.float32(10.0 ** rank) + np.float32(rank / 3)
