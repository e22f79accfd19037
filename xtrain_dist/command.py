"""What the command lines share: a parser whose errors are one line, and the argument types they check."""

import argparse
import errno
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import XtrainError, first_line, shown


def must_be(option: str, what: str, given) -> str:
    """The one form of every bad option's line, in every command: "--dtype must be one of fp32, bf16, got
    'fp16'" (the option, what it takes, what it was given)."""
    return f"{option} must be {what}, got '{shown(given)}'"


def one_of(choices) -> str:
    return f"one of {', '.join(map(str, choices))}"


# argparse's own lines about an option's value, and what they become in our form (see must_be)
_ARGPARSE_TYPES = {"int": "an integer", "float": "a number"}


def _our_form(message: str) -> str:
    """argparse's line about an option in our form: "argument --dtype: invalid choice: 'x' (choose from
    'fp32', 'bf16')" (quoted or not, by Python version) is "--dtype must be one of fp32, bf16, got 'x'";
    our argument types' "argument STEPS: must be ..." is "STEPS must be ..."."""
    if m := re.fullmatch(r"argument (\S+): must (.*)", message):
        return f"{m[1]} must {m[2]}"
    if m := re.fullmatch(r"argument (\S+): invalid choice: (.*) \(choose from (.*)\)", message):
        choices = [c.strip().strip("'\"") for c in m[3].split(",")]
        return must_be(m[1], one_of(choices), m[2].strip("'\""))
    if m := re.fullmatch(r"argument (\S+): invalid (\w+) value: (.*)", message):
        return must_be(m[1], _ARGPARSE_TYPES.get(m[2], f"a {m[2]}"), m[3].strip("'\""))
    if m := re.fullmatch(r"argument (\S+): expected one argument", message):
        return f"{m[1]} must be followed by a value"
    if m := re.fullmatch(r"unrecognized arguments: (.*)", message, re.DOTALL):
        return f"unrecognized arguments: {shown(m[1])}"
    return message


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help's layout: the description and the epilog (examples) with their lines as written, and every
    option's default after its description, unless the description says it already. A flag's default (off)
    goes without saying."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or "default" in text
                or isinstance(action, argparse._StoreTrueAction | argparse._HelpAction)):
            return text
        default = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {default})" if text else f"default: {default}"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument raises XtrainError (one line, exit 2 in main) instead of printing
    the usage and the message; argparse's lines about an option's value take our form (must_be), and its
    help shows each option's default (HelpFormatter)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise XtrainError(_our_form(message))


def command_name(default: str) -> str:
    """What a command's usage line calls it: the console script it was started as (xtrain-train, ...),
    else `default`, the form that started it otherwise (python -m xtrain_dist.train_ddp, bin/...)."""
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return invoked if invoked.startswith("xtrain-") else default


def _checked(parse, accept, what: str):
    """An argparse type: `parse` the text, keep the value if `accept`s it, else say `what` it must be."""

    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got '{shown(text)}'")
        return value

    check.__name__ = what  # argparse names the type in some messages
    return check


positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
non_negative_float = _checked(float, lambda v: 0 <= v < float("inf"), "a number >= 0")
positive_float = _checked(float, lambda v: 0 < v < float("inf"), "a finite number > 0")
probability = _checked(float, lambda v: 0 <= v < 1, "a number >= 0 and < 1")  # NaN fails both comparisons
# every timeout option's bound: a NaN or infinite timeout would switch the protection against hung peers off,
# and one past what a socket or a lock takes (1e10 s overflows the platform's time_t) would fail deep in a
# run, a traceback on one process while the others wait; a week is longer than any wait is meant to be
MAX_TIMEOUT_S = 7 * 24 * 3600
timeout_seconds = _checked(float, lambda v: 0 < v <= MAX_TIMEOUT_S,
                           f"a number of seconds > 0 and at most {MAX_TIMEOUT_S} (a week)")
# an empty path would read as "not given" and quietly switch the report, checkpoint or metrics off
non_empty_path = _checked(str, bool, "a path")
# the same as a Path, for the tools' --out and input options: Path("") would be ".", the folder they run in
path_arg = _checked(lambda text: Path(text) if text else None, bool, "a path")


def _comma_separated(item, what: str):
    """An argparse type: comma-separated values, each checked by `item` (one of the types above); where it
    refuses one, the message quotes the option's whole text."""

    def check(text: str) -> list:
        try:
            return [item(part) for part in text.split(",")]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"must be {what} separated by commas, got '{shown(text)}'") from None

    check.__name__ = f"{what} separated by commas"
    return check


# the benchmarks' sweeps (bench_collectives --worlds, bench_ddp --buckets)
positive_ints = _comma_separated(positive_int, "positive integers")
positive_floats = _comma_separated(positive_float, "numbers > 0")


def choice_list(flag: str, text: str, choices, allow_empty: bool = False) -> list[str]:
    """The items of a comma-separated option (the tools' --precisions, --matmuls, ...), in the order given,
    each one of `choices`; else one line naming the option, the choices and the item that is none of them
    (or the whole text, where it holds no item)."""
    items = [item for item in text.split(",") if item]
    what = f"{'zero' if allow_empty else 'one'} or more of {', '.join(choices)} (separated by commas)"
    for item in items:
        if item not in choices:
            raise XtrainError(must_be(flag, what, item))
    if not items and not allow_empty:
        raise XtrainError(must_be(flag, what, text))
    return items


def _utf8(text: str) -> str:
    """The text itself, once it is known to encode: bytes that are not UTF-8 reach Python as lone
    surrogates (UnicodeEncodeError is a ValueError), which the tokenizer would refuse with a TypeError."""
    text.encode("utf-8")
    return text


utf8_text = _checked(_utf8, lambda text: True, "UTF-8 text")


def say_line(line: str) -> None:
    """Write one line to stderr in one write: print() writes the text and its newline apart, and between
    the two another process of an MPI job could write its own line to the same pipe, joining the two."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_command(prog: str, main: Callable[[], int | None]) -> int:
    """Run a command line's `main` and turn how it ends into an exit status: an XtrainError (bad input, a
    missing engine, a path with a name too long for the file system, an allocation larger than memory) is
    the one line `prog: error: message` and status 2, Ctrl-C is `prog: interrupted` and 130. Anything else
    is a bug and keeps its traceback. Started as a console script, the lines name it (`xtrain-train: error:
    ...`), as its usage line does."""
    prog = command_name(prog)
    try:
        return main() or 0
    except XtrainError as e:
        say_line(f"{prog}: error: {e}")
        return 2
    except KeyboardInterrupt:
        say_line(f"{prog}: interrupted")
        return 130
    except BrokenPipeError:  # `| head` stopped reading: end quietly, as a SIGPIPE'd program does
        # Python flushes stdout once more at exit: point it at /dev/null so that cannot fail as well
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except MemoryError as e:  # sizes asked for that the machine cannot hold (numpy names the allocation)
        say_line(f"{prog}: error: not enough memory: {first_line(e)}")
        return 2
    except OSError as e:
        # a path with a name longer than the file system takes fails at the first stat() of it, wherever
        # that is: it is bad input like any other (the path is in the error), not a bug
        if e.errno != errno.ENAMETOOLONG:
            raise
        say_line(f"{prog}: error: '{e.filename}' cannot be used: a name in it is longer than the file system allows")
        return 2
