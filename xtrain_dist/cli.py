"""What the command lines share: a parser whose errors are one line, and the argument types they check."""

import argparse
import re

from .errors import XtrainError


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument raises XtrainError (one line, exit 2 in main) instead of printing
    the usage and the message."""

    def error(self, message):
        # "argument STEPS: must be a positive integer ..." reads better as "STEPS must be ..."
        raise XtrainError(re.sub(r"^argument (\S+): must ", r"\1 must ", message))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got '{text}'")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got '{text}'")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got '{text}'")
    return value


def positive_float(text: str) -> float:
    """A finite number above zero: a NaN or infinite timeout would switch hang protection off."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got '{text}'")
    return value
