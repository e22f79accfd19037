"""Checkpoint folders: one folder that Hugging Face loads as a GPT-2 and that resumes training to the bit.
This module owns the folder: the names of its files, writing it whole or not at all, and reading it back
verified. What the files hold is hf.py's (the Hugging Face layout) and resume.py's (the run's state: save,
check_resume, restore).

    DIR/model.safetensors      parameters under GPT2LMHeadModel's names, float32; no lm_head.weight
                               (tied to transformer.wte.weight, as save_pretrained writes it)
       config.json             a GPT2Config: GPT2LMHeadModel.from_pretrained(DIR) works as is
       tokenizer.json          the tokenizer the model was trained with, and a tokenizer_config.json
                               so that AutoTokenizer.from_pretrained(DIR) works too
       optimizer.safetensors   AdamW's m and v as flat float32 buffers in model.py's layout (wte's padded
                               rows included: version 2; version 1's layout had V rows), and the
                               step count; a sharded (ZeRO-1) optimizer writes one
                               optimizer.rank<R>.safetensors per rank, each holding its range
       trainer_state.json      the step, model shape, schedule, sampler (RNG) state, run config, world size,
                               precision (--dtype); the model and optimizer files are float32 in every
                               precision: a bf16 run saves its float32 master weights
       run_config.toml         the run's options as a --config file (xtrain-train --config DIR/run_config.toml
                               replays the run); a run configured in code rather than on a command line has none
       manifest.json           size and sha256 of every other file; written last

Atomic replacement. A save writes everything into the sibling `.DIR.new`, fsyncs every file and the
folder, writes manifest.json last (so a folder with a manifest is complete), then swaps:
DIR -> `.DIR.old`, `.DIR.new` -> DIR, fsync the parent, delete `.DIR.old`. POSIX has no atomic
exchange of two directories, but each rename is atomic, so a crash at any point leaves a complete
checkpoint at DIR, or (between the two renames) at `.DIR.new` and `.DIR.old`; never only a
half-written one. Readers change nothing: where DIR is missing they read the complete sibling
(`.DIR.new` first, the newer). The next run or save with --save-dir DIR finishes the job
(`recover`): it promotes the complete sibling to DIR and deletes leftovers. One writer per DIR at a
time: the run holding `.DIR.lock` (SaveDirLock, taken before the run touches DIR). Every rank must see
the same file system (rank 0 writes the model, and a sharded optimizer writes one file per rank into
the same folder).

Reading verifies every file against the manifest, and a file is parsed from the very bytes that
were hashed, so a checkpoint that is truncated, edited or half-copied is one clear error.
"""

import contextlib
import fnmatch
import hashlib
import json
import math
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tokenizers

from ..config import GPTConfig
from ..errors import XtrainError
from ..files import OutputLock, loads_json, probe_in, read_regular
from ..layout import ALIGN, param_layout
from .safetensors_io import parse_safetensors

FORMAT = "xtrain-dist checkpoint"
# 2: the flat layout pads wte to config.padded_vocab_size rows. A version 1 checkpoint (wte's V rows) still
# resumes: its layout is the same up to wte's last real row, then alignment zeros where version 2 has padded
# rows, zero too, so its optimizer state and param_sha256 are version 2's prefix (layout_size)
VERSION = 2
READS = (1, 2)
MANIFEST = "manifest.json"
MODEL = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
STATE = "trainer_state.json"
RUN_CONFIG = "run_config.toml"
OPTIMIZER = "optimizer.safetensors"


def optimizer_file(rank: int | None) -> str:
    return OPTIMIZER if rank is None else f"optimizer.rank{rank}.safetensors"


def powersgd_file(rank: int) -> str:
    """A rank's PowerSGD state (parallel/powersgd.py): every matrix's Q and the rank's own error buffers."""
    return f"powersgd.rank{rank}.safetensors"


def sha256_of(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def params_sha256(tensors: dict[str, np.ndarray], config: GPTConfig, version: int = VERSION) -> str:
    """sha256_of the flat float32 buffer that `tensors` (Hugging Face shapes: wte's V rows) fill, with zeros
    between them and in wte's padded rows, up to layout_size(config, version), fed to the hash tensor by
    tensor: the digest a model holding them has, without building the buffer."""
    digest = hashlib.sha256()
    specs, _ = param_layout(config)
    end = 0
    for s in sorted(specs, key=lambda spec: spec.offset):
        digest.update(bytes(4 * (s.offset - end)))
        digest.update(np.ascontiguousarray(tensors[s.name], dtype="<f4"))
        end = s.offset + s.hf_size
    digest.update(bytes(4 * (layout_size(config, version) - end)))
    return digest.hexdigest()


def layout_size(config: GPTConfig, version: int = VERSION) -> int:
    """Elements of the flat buffer that hold parameters: the rest (ZeRO's padding) is always zero. A
    version 1 checkpoint's layout ends after wte's V rows (aligned); its flat buffers are this version's
    first layout_size(config, 1) elements, and the rest of this version's (wte's padded rows) is zero."""
    specs, used = param_layout(config)
    if version == 1:
        last = max(specs, key=lambda spec: spec.offset)
        return last.offset + -(-last.hf_size // ALIGN) * ALIGN
    return used


# ---------------------------------------------------------------------------------------------- files
def _followed(folder) -> Path:
    """The folder itself where --save-dir is a symbolic link to it: a save renames and deletes what is at
    the path, and the link must keep pointing at the checkpoint, not be swapped out for a folder."""
    folder = Path(folder)
    return Path(os.path.realpath(folder)) if folder.is_symlink() else folder


def _siblings(folder: Path) -> tuple[Path, Path]:
    """(.DIR.new, .DIR.old) beside DIR."""
    folder = Path(os.path.abspath(folder))  # "ck/", "." and "a/../ck" have a name too
    if not folder.name:
        raise XtrainError(f"a checkpoint folder cannot be the root '{folder}'")
    return folder.with_name(f".{folder.name}.new"), folder.with_name(f".{folder.name}.old")


def _is_complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def is_checkpoint(path) -> bool:
    """Whether `path` holds one of our checkpoints: DIR with its manifest, or (a save cut short between its
    two renames) no DIR but a complete .DIR.new beside it, which readers use."""
    path = Path(path)
    return (path / MANIFEST).exists() or (not path.exists() and any(_is_complete(s) for s in _siblings(path)))


def _discard(folder: Path) -> None:
    """Delete a folder, manifest first: a half-deleted folder must never look complete."""
    if folder.is_dir():
        (folder / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, write) -> None:
    """Create `path`, fill it with write(file), and make it durable before returning."""
    with open(path, "xb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def write_json(path: Path, data: dict) -> None:
    write_file(path, lambda f: f.write((json.dumps(data, indent=2, default=str) + "\n").encode()))


def recover(folder) -> str | None:
    """Finish or roll back a save that was cut short; delete its leftovers. Returns what it did, or None.

    Only a writer may call this (save does): it renames and deletes."""
    folder = _followed(folder)
    new, old = _siblings(folder)
    note = None
    if not folder.exists():
        for sibling in (new, old):  # .new is complete only once its manifest is written: it is the newer
            if _is_complete(sibling):
                os.rename(sibling, folder)
                _fsync_dir(folder.parent)
                note = f"checkpoint '{folder}' recovered from '{sibling}' after an interrupted save"
                break
    _discard(new)
    if folder.exists():
        _discard(old)
    return note


class SaveDirLock(OutputLock):
    """The run that owns a --save-dir: files.OutputLock on `.DIR.lock` beside DIR (not inside it, which a
    save replaces whole), taken before anything in the folder is read or touched, and held for the whole
    run."""

    def __init__(self, folder):
        folder = _followed(folder)
        _siblings(Path(os.path.realpath(folder)))  # the root is refused here too
        super().__init__(folder, "--save-dir", "two runs would replace each other's checkpoints")


def prepare_save_dir(folder) -> str | None:
    """Before a run, and before each save: finish an interrupted save (returns a line saying so), and
    fail before training, not after it, if DIR cannot take a checkpoint. Never replace a folder that
    is not one."""
    folder = _followed(folder)
    note = recover(folder)
    if folder.exists() and not folder.is_dir():
        raise XtrainError(f"--save-dir '{folder}' is a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not _is_complete(folder):
        raise XtrainError(f"--save-dir '{folder}' exists and is not an xtrain-dist checkpoint (no {MANIFEST}): "
                          "refusing to replace it; give a new or empty folder")
    # the first thing a save does is make .DIR.new beside DIR, and DIR's missing parents: try that, with a
    # probe that leaves no folder behind for a run refused later
    new, _ = _siblings(folder)
    try:
        probe_in(new.parent, f".{new.name}.probe{os.getpid()}")
    except OSError as err:
        raise XtrainError(f"--save-dir '{folder}': cannot write into '{folder.parent}' ({err.strerror})") from None
    return note


def refuse_another_runs_checkpoint(folder, resume) -> None:
    """A run's first save replaces what --save-dir holds. If that is a checkpoint the run did not start
    from, a forgotten --resume would lose it: refuse before training instead."""
    folder = _followed(folder)
    if not _is_complete(folder) or (resume and Path(resume).exists() and os.path.samefile(resume, folder)):
        return
    try:
        step = f" (step {loads_json(read_regular(folder / STATE))['step']})"
    except (OSError, ValueError, KeyError, TypeError):
        step = ""
    raise XtrainError(f"--save-dir '{folder}' holds the checkpoint of another run{step}: give --resume "
                      f"'{folder}' to continue it, or a new folder; it is not replaced")


# ---------------------------------------------------------------------------------------------- save
def write_folder(folder, *, rank: int, comm, write) -> None:
    """Replace the folder at `folder` atomically with one that write(new) fills: new is the fresh .DIR.new,
    and the manifest of what it holds is written last.

    Every rank calls it, and write(new) writes that rank's files (rank 0's, or each shard's); all ranks
    wait until the folder is in place."""
    folder = _followed(folder)
    new, _ = _siblings(folder)
    if rank == 0:
        prepare_save_dir(folder)
        try:
            new.parent.mkdir(parents=True, exist_ok=True)
            new.mkdir()
        except OSError as err:  # the disk filled up, or the folder's permissions changed, since the start
            raise XtrainError(f"cannot write checkpoint '{folder}' ({err.strerror or err})") from None
    comm.barrier()
    try:
        write(new)
        comm.barrier()  # every file is written and synced
        if rank == 0:
            files = sorted(p.name for p in new.iterdir())
            write_json(new / MANIFEST, {"format": FORMAT, "version": VERSION,
                                        "files": {name: _file_digest(new / name) for name in files}})
            _fsync_dir(new)
            _swap_into_place(new, folder)
    except BaseException as err:
        # An unfinished .new goes; a finished one stays, as DIR may already have stepped aside for it. Other
        # ranks may still be writing their shards into it, so deleting it can fail: what is left has no
        # manifest, is never read as a checkpoint, and the next prepare_save_dir() clears it.
        if rank == 0 and not _is_complete(new):
            with contextlib.suppress(OSError):
                _discard(new)
        if isinstance(err, OSError):
            raise XtrainError(f"cannot write checkpoint '{folder}' ({err.strerror or err})") from None
        raise
    comm.barrier()  # nobody goes on (or starts the next save) before the checkpoint is in place


def _swap_into_place(new: Path, folder: Path) -> None:
    _, old = _siblings(folder)
    if folder.exists():
        os.rename(folder, old)  # a crash from here ...
    os.rename(new, folder)      # ... to here leaves two complete siblings and no DIR: recover() handles it
    _fsync_dir(folder.parent)
    _discard(old)


def _file_digest(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


# ---------------------------------------------------------------------------------------------- load
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value) -> bool:
    return _is_int(value) and value >= 0


def _positive(value) -> bool:
    return _is_int(value) and value >= 1


def _count_or_none(value) -> bool:
    return value is None or _count(value)


def _finite(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and value >= 0


# the numbers of trainer_state.json that a reader takes (resume, evaluate), "section.field" -> (check, what it
# must be): a hand edit that re-hashed the manifest is one line naming the field, not a NaN learning rate taken
# or a traceback later. A field that a checkpoint from before its option lacks is not required here; the
# sampler's own state is BatchSampler.load_state's to check
_STATE_NUMBERS = {
    "optimizer.step_count": (_count, "an integer >= 0"),
    "sampler.batches_drawn": (_count, "an integer >= 0"),
    **{f"schedule.{name}": (_finite, "a finite number >= 0") for name in ("lr", "min_lr")},
    **{f"schedule.{name}": (_count_or_none, "an integer >= 0") for name in ("warmup_steps", "lr_decay_steps",
                                                                            "cooldown_steps")},
    **{f"config.{name}": (_positive, "an integer >= 1") for name in ("batch", "seq", "steps")},
    **{f"config.{name}": (_count, "an integer >= 0") for name in ("seed", "eval_batches")},
    **{f"config.{name}": (_finite, "a finite number >= 0") for name in ("lr", "min_lr", "weight_decay", "beta1",
                                                                        "beta2", "eps", "grad_clip")},
    **{f"config.{name}": (_count_or_none, "an integer >= 0") for name in ("warmup_steps", "lr_decay_steps",
                                                                          "cooldown_steps")},
    "config.overfit_batch": (lambda value: isinstance(value, bool), "true or false"),
    **{f"config.{name}": (lambda value: isinstance(value, str), "a string") for name in ("lr_schedule", "dtype")},
}


@dataclass
class Checkpoint:
    """A checkpoint folder whose manifest has been verified; `contents` holds the files that were read."""

    path: Path                      # what was asked for
    folder: Path                    # what was read: path, or its complete sibling after an interrupted save
    manifest: dict
    contents: dict[str, bytes] = field(repr=False)

    @property
    def note(self) -> str | None:
        if self.folder == self.path:
            return None
        return f"checkpoint '{self.path}' is missing after an interrupted save: reading '{self.folder}'"

    def corrupt(self, what: str) -> XtrainError:
        return XtrainError(f"checkpoint '{self.path}' is corrupt: {what}")

    @property
    def version(self) -> int:
        """The format version it was written in (READS); a Hugging Face folder's layout is this version's."""
        return self.manifest.get("version", VERSION)

    def json(self, name: str) -> dict:
        try:
            data = loads_json(self.contents[name])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self.corrupt(f"{name} is not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise self.corrupt(f"{name} is not a JSON object")
        return data

    def tensors(self, name: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        return parse_safetensors(self.contents[name], f"{self.folder / name}")

    @property
    def state(self) -> dict:
        """trainer_state.json, checked to hold what resuming needs."""
        if STATE not in self.manifest["files"]:
            raise XtrainError(f"checkpoint '{self.path}' has no {STATE}: it holds a model but cannot resume training")
        state = self.json(STATE)
        try:
            optimizer = state["optimizer"]
            ok = (isinstance(state["step"], int) and state["step"] >= 0
                  and isinstance(state["world_size"], int) and state["world_size"] >= 1
                  and isinstance(optimizer["files"], list) and isinstance(optimizer["step_count"], int)
                  and all(isinstance(state[k], dict) for k in ("model", "sampler", "data", "config", "schedule"))
                  and isinstance(state["param_sha256"], str) and isinstance(state["data"]["train_tokens_sha256"], str))
        except (KeyError, TypeError):
            ok = False
        if not ok or state.get("format") != FORMAT:
            raise self.corrupt(f"{STATE} lacks the step, model, optimizer, sampler, data or config of a run")
        for dotted, (fits, expected) in _STATE_NUMBERS.items():
            section, name = dotted.split(".")
            if name in state[section] and not fits(value := state[section][name]):
                raise self.corrupt(f"{STATE}: {dotted} is {value!r}, expected {expected}")
        return state

    def model_state(self, config: GPTConfig) -> dict[str, np.ndarray]:
        """model.safetensors as name -> array, checked against the layout of `config`."""
        return self.checked_model(self.tensors(MODEL)[0], config)

    def checked_model(self, tensors: dict[str, np.ndarray], config: GPTConfig) -> dict[str, np.ndarray]:
        specs, _ = param_layout(config)
        expected = {s.name: s.hf_shape for s in specs}
        for name, shape in expected.items():
            if name not in tensors:
                raise self.corrupt(f"{MODEL} has no tensor '{name}'")
            if tensors[name].shape != shape or tensors[name].dtype != np.float32:
                raise self.corrupt(f"{MODEL}: '{name}' is {tensors[name].dtype} {list(tensors[name].shape)}, "
                                   f"expected float32 {list(shape)}")
        extra = sorted(set(tensors) - set(expected))
        if extra:
            raise self.corrupt(f"{MODEL} has tensors this model does not: {', '.join(extra[:3])}")
        return tensors

    def tokenizer(self) -> tokenizers.Tokenizer:
        try:
            return tokenizers.Tokenizer.from_str(self.contents[TOKENIZER].decode("utf-8"))
        except Exception as err:  # the Rust side raises a bare Exception
            raise self.corrupt(f"{TOKENIZER} is not a tokenizers JSON file ({str(err).splitlines()[0]})") from None


class Shared:
    """One read of a checkpoint (its verified bytes, or pretrained weights) for all the rank threads of a
    process: read once, by `read` on first use unless `value` is given, held once, not once per rank
    (8 ranks of gpt2-774m would otherwise hold 8 x 9 GB), and let go when the last rank is done with it.
    `path` names it in errors."""

    def __init__(self, ranks: int, value=None, read=None, path=None):
        self.path, self._value, self._read, self._ranks_left = path, value, read, ranks
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self):
        """The value, for one rank; leaving the block (also by an exception) counts the rank as done."""
        try:
            with self._lock:
                if self._value is None:
                    self._value = self._read()
                value = self._value
            yield value
        finally:
            with self._lock:
                self._ranks_left -= 1
                if self._ranks_left <= 0:
                    self._value = None


def open_checkpoint(path, read=(MODEL, CONFIG, TOKENIZER, STATE)) -> Checkpoint:
    """Verify every file of the checkpoint at `path` against its manifest and keep the bytes of the
    files named in `read` (shell patterns; "*" for all). Changes nothing on disk."""
    path = Path(path)
    for _ in range(3):
        folder = _resolve(path)
        manifest = _read_manifest(path, folder)
        try:
            return _read_verified(path, folder, manifest, read)
        except XtrainError:
            # A save that swapped the folder while we read it is no corruption: read the new one.
            if _resolve(path) == folder and _read_manifest(path, folder) == manifest:
                raise
    raise XtrainError(f"checkpoint '{path}' kept changing while being read: is another run saving to it?")


def _resolve(path: Path) -> Path:
    if path.exists():
        if not path.is_dir():
            raise XtrainError(f"checkpoint '{path}' is not a folder")
        return path
    sibling = next((s for s in _siblings(path) if _is_complete(s)), None)
    if sibling is None:
        raise XtrainError(f"checkpoint '{path}' not found")
    return sibling


def _read_manifest(path: Path, folder: Path) -> dict:
    try:
        raw = read_regular(folder / MANIFEST)
    except FileNotFoundError:
        raise XtrainError(f"checkpoint '{path}' has no {MANIFEST}: it is not an xtrain-dist checkpoint, "
                          "or its save never finished") from None
    except OSError as err:
        raise XtrainError(f"checkpoint '{path}': cannot read {MANIFEST} ({err.strerror})") from None
    try:
        manifest = loads_json(raw)
        ok = manifest.get("format") == FORMAT and all(
            isinstance(e["bytes"], int) and isinstance(e["sha256"], str) for e in manifest["files"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise XtrainError(f"checkpoint '{path}' is corrupt: {MANIFEST} is not an xtrain-dist manifest")
    if manifest.get("version") not in READS:
        raise XtrainError(f"checkpoint '{path}' has format version {manifest.get('version')}; "
                          f"this xtrain-dist reads versions {', '.join(map(str, READS))}")
    for required in (MODEL, CONFIG, TOKENIZER):
        if required not in manifest["files"]:
            raise XtrainError(f"checkpoint '{path}' is corrupt: its manifest lists no {required}")
    return manifest


def _read_verified(path: Path, folder: Path, manifest: dict, read) -> Checkpoint:
    contents = {}
    for name, entry in manifest["files"].items():
        file = folder / name
        try:
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise XtrainError(f"checkpoint '{path}' is corrupt: {name} has {size} bytes, its manifest says "
                                  f"{entry['bytes']}")
            data = read_regular(file)
        except FileNotFoundError:
            raise XtrainError(f"checkpoint '{path}' is corrupt: {name} is missing") from None
        except OSError as err:
            raise XtrainError(f"checkpoint '{path}': cannot read {name} ({err.strerror})") from None
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise XtrainError(f"checkpoint '{path}' is corrupt: {name} does not match its sha256 in {MANIFEST}")
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in read):
            contents[name] = data
    return Checkpoint(path, folder, manifest, contents)
