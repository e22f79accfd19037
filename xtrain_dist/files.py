"""Output files appear whole or not at all: the one way every command here writes a file it produces; the
JSON parse every reader of a project file uses (loads_json); the one line an input file that cannot be
read gives (reading); and the refusal of an input that is not a regular file (check_regular, read_regular)."""

import contextlib
import errno
import fcntl
import itertools
import json
import os
import socket
import stat
from pathlib import Path

from .errors import XtrainError, first_line


def loads_json(text):
    """json.loads, except that a document nested deeper than Python's recursion limit (a file of 100k "[")
    raises the json.JSONDecodeError every other malformed document raises, not a RecursionError that no
    reader expects."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None


# what a path is where it is not a regular file, by the type bits of its mode
_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class NotRegularFile(OSError):
    """An input that exists but is not a regular file: a named pipe, a device or a socket."""


def check_regular(path) -> None:
    """Raise NotRegularFile where `path` (symlinks followed) is a named pipe, a device or a socket, before
    anything opens it: open() of a FIFO blocks until a writer comes, forever where none does, and a device
    such as /dev/zero never ends, so a read of it grows until memory runs out. A folder raises what open()
    would (IsADirectoryError); a path that cannot be stat'ed is left to open() to say why."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise NotRegularFile(errno.EINVAL, f"{kind}, not a regular file", str(path))


def read_regular(path) -> bytes:
    """The bytes of the regular file `path`: Path.read_bytes, refusing first what check_regular refuses.
    Raises OSError, as read_bytes does, so a reader's own message for an unreadable file names these too."""
    check_regular(path)
    return Path(path).read_bytes()


@contextlib.contextmanager
def reading(what: str, path: Path):
    """Turn an OSError raised while reading `path` into one XtrainError that names it as `what`; `path` is
    refused before the block runs where it is not a regular file (check_regular), so the block's open()
    never blocks on a named pipe nor reads a device without end."""
    try:
        check_regular(path)
        yield
    except NotRegularFile as err:
        raise XtrainError(f"{what} '{path}' is {err.strerror}") from None
    except FileNotFoundError:
        raise XtrainError(f"{what} '{path}' not found") from None
    except IsADirectoryError:
        raise XtrainError(f"{what} '{path}' is a directory, not a file") from None
    except PermissionError:
        raise XtrainError(f"{what} '{path}' cannot be read (permission denied)") from None
    except OSError as err:
        raise XtrainError(f"{what} '{path}' cannot be read ({err.strerror or first_line(err)})") from None


def check_input(what: str, path) -> None:
    """One XtrainError naming `path` as `what` where it exists and is not a regular file (check_regular), for
    a reader whose own open() lies elsewhere (and says itself what else is wrong, a missing file say)."""
    with reading(what, Path(path)):
        pass


def written_in_place(path: Path) -> bool:
    """A path that is a device or a pipe (/dev/stdout, /dev/null) is written as it is: there is no file to
    replace, and renaming over it would put a regular file where the device was."""
    return path.exists() and not path.is_file() and not path.is_dir()


def same_file(a, b) -> bool:
    """Whether paths `a` and `b` name one file: two names of an existing file (a symlink, a hard link) by
    its device and inode, paths not yet made by where their symlinks lead. A device or a pipe is written
    in place, not replaced, so two outputs may share one (--report and --metrics both to /dev/stdout)."""
    a, b = Path(a), Path(b)
    if written_in_place(a) or written_in_place(b):
        return False
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def refuse_output_on_inputs(out, flag: str, inputs, consequence: str) -> None:
    """One XtrainError where the output `out` (given as `flag`) is one of `inputs`, (what, path) pairs compared
    as files (same_file; an empty path is skipped): "{flag} '{out}' is {what} '{path}': {consequence}"."""
    for what, given in inputs:
        if given and same_file(out, given):
            raise XtrainError(f"{flag} '{out}' is {what} '{given}': {consequence}")


def inside(path, folder) -> bool:
    """Whether `path` is `folder` or lies under it, symlinks followed."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def write_atomic(path, data: bytes | str | list, name: str) -> None:
    """Write `data` (str: UTF-8; a list: its buffers one after another, which a large file need not join
    first) to `path` so that a reader finds the old file or the new one, never a part:
    a temporary file beside the file PATH names, flushed to disk, then renamed over it. A symlink is
    followed (the link stays, and the file it names is replaced); a device or a pipe is written directly;
    missing folders are made. Any failure is one XtrainError, "{name} '{path}' cannot be written (why)",
    and leaves no temporary file behind."""
    chunks = data if isinstance(data, list) else [data.encode("utf-8") if isinstance(data, str) else data]
    given = Path(path)
    direct = written_in_place(given)
    target = given if direct else Path(os.path.realpath(given))
    tmp = None if direct else target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        if direct:
            with open(target, "wb") as f:
                f.writelines(chunks)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.writelines(chunks)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as err:
        if tmp is not None:  # there may be none to remove, or no folder to remove it from
            with contextlib.suppress(OSError):
                tmp.unlink()
        why = "a part of its folder is a file" if _through_a_file(target) else (err.strerror or err)
        raise XtrainError(f"{name} '{path}' cannot be written ({why})") from None


def _through_a_file(target: Path) -> bool:
    """Whether a folder on the way to `target` is a file: mkdir's own words for it (File exists, Not a
    directory) depend on which part it is, and name neither."""
    return any(parent.exists() and not parent.is_dir() for parent in target.parents)


def probe_in(folder: Path, name: str) -> None:
    """Make and remove the file `name` in `folder`, or where `folder` does not exist yet, in the nearest
    folder on its way that does: what making the missing folders and then a file needs, tried without
    leaving a folder behind for a run that is refused later. (access() says yes to root on read-only
    filesystems, so the probe is a real file.) Raises OSError."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    probe = existing / name
    probe.touch()
    probe.unlink()


# Linux's /dev/full (character device 1, 7): every write to it fails with ENOSPC. A device is written in place,
# and writing a probe byte into a terminal or a pipe would show; this one device is known to refuse them all.
_DEV_FULL = os.makedev(1, 7)


def check_writable(path, name: str) -> None:
    """Fail before the work, not after it, where write_atomic(path, ..., name) could not write: a folder,
    a folder path through a file, a folder without write permission. Leaves nothing behind: missing
    folders are made by the write, not by the check."""
    given = Path(path)
    if given.is_dir():
        raise XtrainError(f"{name} '{path}' is a folder, not a file")
    if written_in_place(given):
        if not os.access(given, os.W_OK):
            raise XtrainError(f"{name} '{path}' cannot be written (Permission denied)")
        if os.stat(given).st_rdev == _DEV_FULL:
            raise XtrainError(f"{name} '{path}' cannot be written ({os.strerror(errno.ENOSPC)})")
        return
    target = Path(os.path.realpath(given))  # through symlinks: the file a link names is the one replaced
    if _through_a_file(target):
        raise XtrainError(f"{name} '{path}' cannot be written (a part of its folder is a file)")
    try:
        probe_in(target.parent, f".{target.name}.probe{os.getpid()}")
    except OSError as err:
        raise XtrainError(f"{name} '{path}' cannot be written ({err.strerror})") from None


def check_out_dir(path, name: str) -> None:
    """check_writable for a folder that results files go into (a benchmark's --out): fail before the work,
    not after it, where the folder is a file, goes through one, or cannot be made or written. Leaves
    nothing behind: a missing folder is made by the results' write (write_atomic), so a benchmark refused
    after this check leaves no empty folder."""
    target = Path(os.path.realpath(path))  # through symlinks, as write_atomic follows them
    if target.exists() and not target.is_dir():
        raise XtrainError(f"{name} '{path}' is a file, not a folder")
    if _through_a_file(target):
        raise XtrainError(f"{name} '{path}' cannot be written (a part of its path is a file)")
    try:
        probe_in(target, f".probe{os.getpid()}")
    except OSError as err:
        raise XtrainError(f"{name} '{path}' cannot be written ({err.strerror})") from None


class OutputLock:
    """The run that owns an output (--save-dir, --report, --metrics, --tensorboard): an exclusive flock on
    `.NAME.lock` beside it (not inside a folder that a save replaces whole), the file holding the owner's
    host and pid for the run refused. Taken before the output is read or touched, and held for the whole
    run; the kernel lets go of it when the process ends, however it ends, so a run killed with -9 leaves
    only an unlocked file, which the next run takes over. release() deletes the file while still holding
    it, so a run that locked the file just deleted finds it gone from the path and locks the file there
    now instead. A second run is refused in one line: "{flag} '{path}' is in use by another run (host H,
    pid P): {consequence}; wait for it to end or give another {flag}"."""

    def __init__(self, path, flag: str, consequence: str):
        path = Path(path)
        real = Path(os.path.realpath(path))  # one output reached by two paths has one lock
        self.path = real.with_name(f".{real.name}.lock")
        # the folders on the way that the lock file needs and that do not exist yet: release() removes those
        # still empty, so that a run refused later leaves nothing behind (one that wrote leaves them holding it)
        self._made = list(itertools.takewhile(lambda f: not f.exists(), self.path.parents))
        self._fd = None
        tries = 0
        while True:
            tries += 1
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                if tries < 5:  # another run's release removed the folder it had made: make it again
                    continue
                raise XtrainError(f"{flag} '{path}': cannot make '{self.path}' (No such file or directory)") from None
            except OSError as err:
                why = "a part of its folder is a file" if _through_a_file(self.path) else err.strerror
                raise XtrainError(f"{flag} '{path}': cannot write into '{path.parent}' ({why})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a run starting"
                os.close(fd)
                raise XtrainError(f"{flag} '{path}' is in use by another run ({holder}): {consequence}; wait for "
                                  f"it to end or give another {flag}") from None
            if self._at_path(fd):
                break
            os.close(fd)  # its owner deleted it on release before we locked it
        self._fd = fd
        with contextlib.suppress(OSError):  # on a full disk the lock holds without its note of who holds it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}".encode(), 0)

    def _at_path(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self._fd)  # lets go of the lock
            self._fd = None
            for made in self._made:
                try:
                    made.rmdir()
                except OSError:  # not empty: it holds the output, or another run's files
                    break
