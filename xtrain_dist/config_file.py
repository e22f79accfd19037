"""Configuration files in TOML: read with the standard library's tomllib (tomli, its original, on Python 3.10),
written by the small writer below.

The writer knows what a run's configuration holds and no more: one flat table of keys whose values are
strings, integers, floats, booleans or lists of them. A float is written as repr() writes it, the shortest
text that reads back as the same double, so a file written here and read again holds the very values it was
written from: a run replayed from its configuration trains to the same bits.
"""

import math
import re
import sys
from pathlib import Path

from . import files
from .errors import XtrainError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - tomllib is Python 3.11's; tomli is the same parser, installed on 3.10 (pyproject.toml)
    import tomli as tomllib

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# what a TOML basic string must escape: the quote, the backslash and the control characters
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def read(path, what: str) -> dict:
    """The table in the TOML file at `path`, or one XtrainError naming the file (as `what`) and its fault."""
    path = Path(path)
    with files.reading(what, path):
        raw = files.read_regular(path)
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise XtrainError(f"{what} '{path}' is not TOML (not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as err:
        raise XtrainError(f"{what} '{path}' is not TOML ({err})") from None


def dumps(table: dict, comment: str = "") -> str:
    """`table` as TOML text, one `key = value` line per item in its order, after `comment` as # lines."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    lines += [f"{_key(key)} = {_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    return '"' + "".join(_ESCAPES.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in text) + '"'


def _value(value) -> str:
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # the shortest text that reads back as this double: 0.001, 1e-05, 3.0
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    raise TypeError(f"a configuration value must be a string, number, boolean or list, not {type(value).__name__}")
