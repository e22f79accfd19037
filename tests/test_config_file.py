"""The TOML writer against the standard library's reader: what it writes reads back as the very values, every
float to the bit, every string whatever characters it holds."""

import math
import random
import struct

import pytest

from xtrain_dist import config_file
from xtrain_dist.config_file import tomllib
from xtrain_dist.errors import XtrainError


def test_floats_read_back_to_the_same_bits():
    rng = random.Random(0)
    values = [0.001, 1e-05, 0.1 + 0.2, 3.0, -0.0, 5e-324, 1.7976931348623157e308, 1e16, 123456789.125, 2.5e-8]
    values += [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(2000)]
    values = [v for v in values if math.isfinite(v)]
    table = {f"x{i}": v for i, v in enumerate(values)}
    back = tomllib.loads(config_file.dumps(table))
    assert [struct.pack("<d", back[k]) for k in table] == [struct.pack("<d", v) for v in values]
    specials = tomllib.loads(config_file.dumps({"a": math.inf, "b": -math.inf, "c": math.nan}))
    assert specials["a"] == math.inf and specials["b"] == -math.inf and math.isnan(specials["c"])


def test_strings_integers_booleans_lists_and_keys_read_back():
    table = {"plain": "text", "quoted": 'say "hi" \\ there', "controls": "a\tb\nc\rd\x00e\x1f\x7f",
             "unicode": "Shakespeare’s “plays” — ünïcode 🎭", "empty": "", "int": -(2 ** 63), "big": 2 ** 63 - 1,
             "yes": True, "no": False, "list": [1, 2.5, "three", False, []], "grad-sync": "flat",
             "a key with spaces": 1, "ключ": 2}
    text = config_file.dumps(table, comment="first line\nsecond line")
    assert text.startswith("# first line\n# second line\nplain = \"text\"\n")
    assert "\ngrad-sync = \"flat\"\n" in text and "\nyes = true\n" in text
    assert tomllib.loads(text) == table


def test_what_the_writer_cannot_write_is_a_type_error():
    with pytest.raises(TypeError, match=r"not dict$"):
        config_file.dumps({"table": {"a": 1}})
    with pytest.raises(TypeError, match=r"not NoneType$"):
        config_file.dumps({"nothing": None})


def test_read_names_the_file_and_its_fault(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"a = \"\xff\"\n")
    with pytest.raises(XtrainError, match=r"^--config '.*c\.toml' is not TOML \(not UTF-8 text\)$"):
        config_file.read(path, "--config")
    path.write_text("a = 1\na = 2\n")
    with pytest.raises(XtrainError, match=r"^--config '.*c\.toml' is not TOML \(Cannot overwrite a value"):
        config_file.read(path, "--config")
    with pytest.raises(XtrainError, match=r"^--config '.*' is a directory, not a file$"):
        config_file.read(tmp_path, "--config")
