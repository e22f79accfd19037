"""The one exception type that the command line turns into a single line and a non-zero exit."""


class XtrainError(Exception):
    """A problem with the user's input or environment, stated in one line that names it.

    Anything else that escapes a rank is a bug and is reported as such."""


class MachineWide(XtrainError):
    """A problem every process on a machine finds alike (no CUDA driver, no CuPy): the command says it once a
    machine, from the machine's first process (local rank 0); the others end with the same exit status and
    no line, rather than eight copies of one line under a launcher of eight."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (a library's may run to many), or its type's name."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


SHOWN_CHARS = 80  # of a value an error line quotes: a 50 MB argument is named, not printed


def shown(text) -> str:
    """`text` as an error line quotes it: whole up to SHOWN_CHARS characters, else its start, a marker and
    its length, so the line stays one line a person reads."""
    text = str(text)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def install_hint(extra: str) -> str:
    """How to install an optional part of the project (an extra of pyproject.toml): the project is installed
    from its repository, not from a package index."""
    return f"from a clone of the repository: pip install -e '.[{extra}]'"
