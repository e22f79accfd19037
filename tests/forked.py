"""`python -m module args` and `python script args` for the tests that start hundreds of them, forked from a
process that has already imported numpy and the package instead of started afresh.

Most of what test_cli.py and test_bin_errors.py start fails on its arguments or its input within a
fraction of a second; the interpreter's start and the imports (numpy, tokenizers, the package) were the
rest, 0.3-0.4 CPU-seconds each on the 2-core machine, some 85 in a run of the suite. A server, one per
test process (started on first use, ended with it), imports those once; each run is a fork of it, which
takes the run's directory, environment, arguments and standard streams, runs the module or script as
`__main__`, and ends as an interpreter would (exit status, atexit functions, non-daemon threads joined).

Only where nothing else differs: run() gives a real process when given an environment of its own, since
what the server imported read its environment when it started (OPENBLAS_NUM_THREADS sizes OpenBLAS's pool
as it loads). What the package's entry points do in a process started from scratch is held by the tests
that start them so (test_install.py, test_multiprocess.py, and every other subprocess of the suite).

`python tests/forked.py SOCKET` is the server."""

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_server: dict = {}  # pid of this process -> (server process, socket path): a fork of it needs its own
_lock = threading.Lock()


def run(argv: list[str], cwd=None, env=None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...) with argv starting with
    "-m" or a script's path; forked (above), or a real process where env is given."""
    if env is not None:
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    request = {"argv": [str(a) for a in argv], "cwd": str(cwd or os.getcwd()), "env": dict(os.environ)}
    out_r, out_w = os.pipe()  # pipes, as subprocess's capture_output gives (a run may write to /dev/stdout)
    err_r, err_w = os.pipe()
    read = {}
    readers = [threading.Thread(target=_read_all, args=(fd, read)) for fd in (out_r, err_r)]
    with open(os.devnull, "rb") as stdin, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(_socket_path())
            socket.send_fds(conn, [json.dumps(request).encode()], [stdin.fileno(), out_w, err_w])
        finally:
            os.close(out_w)  # the fork holds its own copies: the pipes end when it does
            os.close(err_w)
        for reader in readers:
            reader.start()
        (pid,) = struct.unpack("q", _receive(conn, None))
        try:
            (returncode,) = struct.unpack("q", _receive(conn, timeout))
        except TimeoutError:
            os.kill(pid, 9)
            _receive(conn, None)
            returncode = None
        for reader in readers:
            reader.join()
    stdout, stderr = read[out_r], read[err_r]
    if returncode is None:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *argv], returncode, stdout, stderr)


def _read_all(fd: int, into: dict) -> None:
    with open(fd, "rb") as pipe:
        # text=True's decoding and universal newlines
        into[fd] = pipe.read().decode().replace("\r\n", "\n").replace("\r", "\n")


def _receive(conn, timeout) -> bytes:
    conn.settimeout(timeout)
    data = b""
    while len(data) < 8:
        chunk = conn.recv(8 - len(data))
        if not chunk:
            raise RuntimeError("the test's fork server ended without an answer")
        data += chunk
    return data


def _socket_path() -> str:
    with _lock:
        if os.getpid() not in _server:
            path = os.path.join(tempfile.mkdtemp(prefix="xtrain-forked-"), "socket")
            server = subprocess.Popen([sys.executable, __file__, path, str(os.getpid())], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the test's fork server did not start (exit {server.poll()})")
                time.sleep(0.01)
            _server[os.getpid()] = (server, path)
        return _server[os.getpid()][1]


# ---------------------------------------------------------------------------- the server

def _serve(path: str, client: int) -> None:
    import numpy  # noqa: F401  (imported once, for every fork)
    import tokenizers  # noqa: F401

    import xtrain_dist.train.cli  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".part")
    os.rename(path + ".part", path)  # the client waits for the name: it is there once the socket listens
    listener.listen(16)
    listener.settimeout(1.0)
    while True:
        with contextlib.suppress(ChildProcessError):  # reap every waiter that has ended
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if not _alive(client):
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
            return
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        if os.fork() == 0:  # the waiter: forks the run, tells the client its pid and then its exit status
            listener.close()
            _wait_for_run(conn, json.loads(message), fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait_for_run(conn, request: dict, fds: list[int]) -> None:
    try:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run(request, fds)
        for fd in fds:  # the run's now: the client's pipes end when the run does
            os.close(fd)
        conn.sendall(struct.pack("q", pid))
        _, status = os.waitpid(pid, 0)
        conn.sendall(struct.pack("q", os.waitstatus_to_exitcode(status)))
    finally:
        os._exit(0)


def _run(request: dict, fds: list[int]) -> None:
    """In the fork: become `python argv...` and end as the interpreter ends."""
    import atexit
    import runpy
    import signal
    import traceback

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        try:
            # sys.path[0] as the interpreter sets it (the server's is this file's folder): the working directory
            # for -m, the script's folder for a script
            if argv[0] == "-m":
                sys.path[0] = os.getcwd()
                sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path first
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = str(Path(argv[0]).resolve().parent)
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as the interpreter: wait for non-daemon threads, then the exit functions
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a stream the run closed
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
