"""Checkpoints: one folder that Hugging Face loads as a GPT-2 and that resumes training to the bit.

    DIR/model.safetensors      parameters under GPT2LMHeadModel's names, float32; no lm_head.weight
                               (tied to transformer.wte.weight, as save_pretrained writes it)
       config.json             a GPT2Config: GPT2LMHeadModel.from_pretrained(DIR) works as is
       tokenizer.json          the tokenizer the model was trained with, and a tokenizer_config.json
                               so that AutoTokenizer.from_pretrained(DIR) works too
       optimizer.safetensors   AdamW's m and v as flat float32 buffers in model.py's layout, and the
                               step count; a sharded (ZeRO-1) optimizer writes one
                               optimizer.rank<R>.safetensors per rank, each holding its range
       trainer_state.json      the step, model shape, schedule, sampler (RNG) state, run config, world size,
                               precision (--dtype); the model and optimizer files are float32 in every
                               precision: a bf16 run saves its float32 master weights
       manifest.json           size and sha256 of every other file; written last

Atomic replacement. A save writes everything into the sibling `.DIR.new`, fsyncs every file and the
folder, writes manifest.json last (so a folder with a manifest is complete), then swaps:
DIR -> `.DIR.old`, `.DIR.new` -> DIR, fsync the parent, delete `.DIR.old`. POSIX has no atomic
exchange of two directories, but each rename is atomic, so a crash at any point leaves a complete
checkpoint at DIR, or (between the two renames) at `.DIR.new` and `.DIR.old`; never only a
half-written one. Readers change nothing: where DIR is missing they read the complete sibling
(`.DIR.new` first, the newer). The next run or save with --save-dir DIR finishes the job
(`recover`): it promotes the complete sibling to DIR and deletes leftovers. One writer per DIR at a
time; every rank must see the same file system (rank 0 writes the model, and a sharded optimizer
writes one file per rank into the same folder).

Reading verifies every file against the manifest, and a file is parsed from the very bytes that
were hashed, so a checkpoint that is truncated, edited or half-copied is one clear error.
"""

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import tokenizers

from .. import __version__
from ..config import GPTConfig, TrainConfig, model_config
from ..data.sampler import BatchSampler
from ..errors import XtrainError
from ..files import loads_json, probe_in
from ..model import param_layout
from .safetensors_io import parse_safetensors, write_safetensors

FORMAT = "xtrain-dist checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
MODEL = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
EOS = "<|endoftext|>"
# each block's causal-mask buffers in Hugging Face's GPT-2 (older files save them): not parameters
GPT2_MASK_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias")
# the learning-rate schedule's settings (optim.lr_at), kept in trainer_state.json for the reader
SCHEDULE = ("lr", "min_lr", "warmup_steps", "lr_decay_steps", "lr_schedule", "cooldown_steps")
# settings a resumed run may change (they take effect from its first step); anything that would
# change the model, the data or the batches it draws must match the checkpoint
CHANGEABLE = (*SCHEDULE, "weight_decay", "beta1", "beta2", "eps", "grad_clip", "backend", "grad_sync", "attention",
              "recompute")


def optimizer_file(rank: int | None) -> str:
    return OPTIMIZER if rank is None else f"optimizer.rank{rank}.safetensors"


def sha256_of(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def params_sha256(tensors: dict[str, np.ndarray], config: GPTConfig) -> str:
    """sha256_of the flat float32 buffer that `tensors` fill (zeros between them, up to layout_size), fed
    to the hash tensor by tensor: the digest a model holding them has, without building the buffer."""
    digest = hashlib.sha256()
    specs, used = param_layout(config)
    end = 0
    for s in sorted(specs, key=lambda spec: spec.offset):
        digest.update(bytes(4 * (s.offset - end)))
        digest.update(np.ascontiguousarray(tensors[s.name], dtype="<f4"))
        end = s.offset + s.size
    digest.update(bytes(4 * (used - end)))
    return digest.hexdigest()


def layout_size(config: GPTConfig) -> int:
    """Elements of the flat buffer that hold parameters: the rest (ZeRO's padding) is always zero."""
    return param_layout(config)[1]


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


def _write_file(path: Path, write) -> None:
    """Create `path`, fill it with write(file), and make it durable before returning."""
    with open(path, "xb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def _write_json(path: Path, data: dict) -> None:
    _write_file(path, lambda f: f.write((json.dumps(data, indent=2, default=str) + "\n").encode()))


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
        step = f" (step {loads_json((folder / STATE).read_text())['step']})"
    except (OSError, ValueError, KeyError, TypeError):
        step = ""
    raise XtrainError(f"--save-dir '{folder}' holds the checkpoint of another run{step}: give --resume "
                      f"'{folder}' to continue it, or a new folder; it is not replaced")


def kept_folder(save_dir, step: int) -> Path:
    """Where --keep-every keeps the checkpoint of `step`: DIR.step000300 beside DIR, never replaced by the
    saves into DIR."""
    folder = Path(save_dir)
    if not folder.name:  # "." or "..": name it
        folder = Path(os.path.abspath(save_dir))
    return folder.with_name(f"{folder.name}.step{step:06d}")


def folders_to_save(cfg: TrainConfig, step: int, stopping: bool = False) -> list[Path]:
    """The checkpoints to write after `step`: DIR at every --save-every step, the last, and the one a stop
    request ends the run after (`stopping`); a kept one of its own at every --keep-every step."""
    folders = []
    if cfg.save_dir and (step == cfg.steps or stopping or (cfg.save_every and step % cfg.save_every == 0)):
        folders.append(Path(cfg.save_dir))
    if cfg.save_dir and cfg.keep_every and step % cfg.keep_every == 0:
        folders.append(kept_folder(cfg.save_dir, step))
    return folders


def refuse_existing_kept_folders(cfg: TrainConfig, start: int) -> None:
    """A kept checkpoint is written once and never replaced: a folder already where this run (continuing
    after step `start`) would keep one is refused before training, whatever it holds."""
    first = (start // cfg.keep_every + 1) * cfg.keep_every
    for step in range(first, cfg.steps + 1, cfg.keep_every):
        if os.path.lexists(folder := kept_folder(cfg.save_dir, step)):
            raise XtrainError(f"--keep-every {cfg.keep_every}: '{folder}' already exists, and this run would keep "
                              f"its step {step} there; move it away or give another --save-dir")


# ---------------------------------------------------------------------------------------------- save
def hf_config(config: GPTConfig, tokenizer: tokenizers.Tokenizer | None = None) -> dict:
    """config.json as transformers' GPT2Config reads it (without a tokenizer, no bos/eos ids).

    Dropout is 0: this trainer uses none, and the config describes the model as trained, so
    GPT2LMHeadModel in train() mode computes the same function as ours (GPT-2's own 0.1 is one
    assignment away for whoever fine-tunes with dropout)."""
    eos = tokenizer.token_to_id(EOS) if tokenizer is not None else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_ctx,
        "n_ctx": config.n_ctx,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def tokenizer_config(config: GPTConfig, tokenizer: tokenizers.Tokenizer) -> dict:
    special = {"bos_token": EOS, "eos_token": EOS} if tokenizer.token_to_id(EOS) is not None else {}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.n_ctx,
            "clean_up_tokenization_spaces": False, **special}


def trainer_state(step: int, cfg: TrainConfig, corpus, model, optimizer, sampler, world_size: int) -> dict:
    used = layout_size(model.config)
    return {
        "format": FORMAT, "version": VERSION, "xtrain_dist_version": __version__,
        "step": step,
        "world_size": world_size,
        "dtype": cfg.dtype,
        "model": {"preset": cfg.model, **asdict(model.config)},
        "param_sha256": sha256_of(model.ops.to_host(model.params)[:used]),
        "optimizer": {"sharded": bool(optimizer.sharded), "step_count": optimizer.step_count,
                      "files": [optimizer_file(r) for r in range(world_size)] if optimizer.sharded
                      else [optimizer_file(None)]},
        "schedule": {name: getattr(cfg, name) for name in SCHEDULE},
        "sampler": sampler.state(),
        "data": {"tokenizer": str(corpus.tokenizer_path), "corpus": str(corpus.corpus_path),
                 "val_corpus": str(corpus.val_path or ""),
                 "train_tokens": len(corpus.train), "train_tokens_sha256": corpus.train_sha256},
        "config": cfg.to_dict(),
    }


def _write_optimizer(path: Path, optimizer) -> None:
    state = optimizer.state_dict()
    meta = {"format": "xtrain-dist optimizer", "step_count": str(state["step_count"]), "start": str(state["start"])}
    _write_file(path, lambda f: write_safetensors(f, {"m": state["m"], "v": state["v"]}, meta))


def save(folder, *, rank: int, comm, step: int, cfg: TrainConfig, corpus, model, optimizer, sampler) -> None:
    """Write a checkpoint of the state after `step` steps to `folder`, replacing the one there atomically.

    Every rank calls it: rank 0 writes the model and the run's state, the optimizer state is written
    by rank 0 or, when it is sharded, by every rank for its shard; all ranks wait until it is in place."""
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
        if rank == 0:
            tensors = model.state_dict()
            _write_file(new / MODEL, lambda f: write_safetensors(f, tensors, {"format": "pt"}))
            _write_json(new / CONFIG, hf_config(model.config, corpus.tokenizer))
            _write_file(new / TOKENIZER, lambda f: f.write(corpus.tokenizer.to_str().encode()))
            _write_json(new / TOKENIZER_CONFIG, tokenizer_config(model.config, corpus.tokenizer))
            _write_json(new / STATE, trainer_state(step, cfg, corpus, model, optimizer, sampler, comm.world_size))
        if optimizer.sharded or rank == 0:
            _write_optimizer(new / optimizer_file(rank if optimizer.sharded else None), optimizer)
        comm.barrier()  # every file is written and synced
        if rank == 0:
            files = sorted(p.name for p in new.iterdir())
            _write_json(new / MANIFEST, {"format": FORMAT, "version": VERSION,
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

    def _corrupt(self, what: str) -> XtrainError:
        return XtrainError(f"checkpoint '{self.path}' is corrupt: {what}")

    def json(self, name: str) -> dict:
        try:
            data = loads_json(self.contents[name])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._corrupt(f"{name} is not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise self._corrupt(f"{name} is not a JSON object")
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
            raise self._corrupt(f"{STATE} lacks the step, model, optimizer, sampler, data or config of a run")
        return state

    def gpt_config(self) -> GPTConfig:
        """The model's shape from config.json, refusing a GPT-2 variant this trainer does not implement."""
        c = self.json(CONFIG)
        expected = {"model_type": "gpt2", "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                    "tie_word_embeddings": True, "n_inner": None, "scale_attn_weights": True,
                    "scale_attn_by_inverse_layer_idx": False}
        for key, value in expected.items():
            if c.get(key, value) != value:
                raise XtrainError(f"checkpoint '{self.path}': {CONFIG} has {key}={c[key]!r}; this trainer "
                                  f"implements GPT-2 with {key}={value!r}")
        try:
            if c.get("n_ctx", c["n_positions"]) != c["n_positions"]:
                raise self._corrupt(f"{CONFIG} has n_ctx {c['n_ctx']} != n_positions {c['n_positions']}")
            return GPTConfig(vocab_size=int(c["vocab_size"]), n_ctx=int(c["n_positions"]), n_layer=int(c["n_layer"]),
                             n_head=int(c["n_head"]), n_embd=int(c["n_embd"]))
        except (KeyError, TypeError, ValueError) as err:
            raise self._corrupt(f"{CONFIG} lacks a valid {err}") from None

    def model_state(self, config: GPTConfig) -> dict[str, np.ndarray]:
        """model.safetensors as name -> array, checked against the layout of `config`."""
        return self._checked_model(self.tensors(MODEL)[0], config)

    def _checked_model(self, tensors: dict[str, np.ndarray], config: GPTConfig) -> dict[str, np.ndarray]:
        specs, _ = param_layout(config)
        expected = {s.name: s.shape for s in specs}
        for name, shape in expected.items():
            if name not in tensors:
                raise self._corrupt(f"{MODEL} has no tensor '{name}'")
            if tensors[name].shape != shape or tensors[name].dtype != np.float32:
                raise self._corrupt(f"{MODEL}: '{name}' is {tensors[name].dtype} {list(tensors[name].shape)}, "
                                    f"expected float32 {list(shape)}")
        extra = sorted(set(tensors) - set(expected))
        if extra:
            raise self._corrupt(f"{MODEL} has tensors this model does not: {', '.join(extra[:3])}")
        return tensors

    def pretrained_state(self, config: GPTConfig) -> dict[str, np.ndarray]:
        """model.safetensors of any GPT-2 folder as model_state's name -> float32 array.

        Beside our names (GPT2LMHeadModel's, which save_pretrained writes) it reads the Hub's own GPT-2
        files: GPT2Model's names without "transformer.", with each block's causal-mask buffers
        (h.N.attn.bias, h.N.attn.masked_bias), which are not parameters and are dropped. A lm_head.weight
        must be wte's (GPT-2 ties them, and so does this trainer); float16 widens to float32 exactly."""
        tensors = {}
        for name, array in self.tensors(MODEL)[0].items():
            if name != "lm_head.weight" and not name.startswith("transformer."):
                name = f"transformer.{name}"
            if GPT2_MASK_BUFFER.fullmatch(name):
                continue
            tensors[name] = array.astype(np.float32) if array.dtype == np.float16 else array
        head = tensors.pop("lm_head.weight", None)
        if head is not None and not np.array_equal(head, tensors.get("transformer.wte.weight")):
            raise XtrainError(f"'{self.path}': its lm_head.weight is not its transformer.wte.weight; this trainer's "
                              "GPT-2 ties the output projection to the token embedding")
        return self._checked_model(tensors, config)

    def tokenizer(self) -> tokenizers.Tokenizer:
        try:
            return tokenizers.Tokenizer.from_str(self.contents[TOKENIZER].decode("utf-8"))
        except Exception as err:  # the Rust side raises a bare Exception
            raise self._corrupt(f"{TOKENIZER} is not a tokenizers JSON file ({str(err).splitlines()[0]})") from None

    def _optimizer_pieces(self, used: int):
        """(start, m, v) of every saved optimizer file in order, checked to continue one another from element 0
        and to cover the model's `used` elements; what they hold past those (ZeRO's padding) must be zero, as
        the flat buffer's padding is, or they are another model's state."""
        info = self.state["optimizer"]
        covered = 0
        for name in info["files"]:
            if not isinstance(name, str) or name not in self.contents:  # "../x", "config.json", 7
                raise self._corrupt(f"{STATE} names {name!r} as an optimizer file, which the checkpoint does not hold")
            tensors, meta = self.tensors(name)
            try:
                start, step_count = int(meta["start"]), int(meta["step_count"])
                shard_m, shard_v = tensors["m"], tensors["v"]
            except (KeyError, ValueError):
                raise self._corrupt(f"{name} is not an optimizer state (no m, v, start, step_count)") from None
            if start != covered or shard_m.shape != shard_v.shape or step_count != info["step_count"]:
                raise self._corrupt(f"{name} does not continue the optimizer state at element {covered}")
            past_used = slice(max(0, used - start), None)
            if shard_m[past_used].any() or shard_v[past_used].any():
                raise self._corrupt(f"{name} holds optimizer state past the model's {used} elements")
            yield start, shard_m, shard_v
            covered = start + shard_m.size
        if covered < used:
            raise self._corrupt(f"the optimizer files cover flat[0:{covered}], the model has {used} elements")

    def optimizer_state(self, lo: int, hi: int, used: int) -> dict:
        """An optimizer state for flat[lo:hi], assembled from the saved file or shards, whatever the
        sharding they were saved under. Past `used` the flat buffer is padding: m and v are zero there."""
        m, v = np.zeros(hi - lo, dtype=np.float32), np.zeros(hi - lo, dtype=np.float32)
        for start, shard_m, shard_v in self._optimizer_pieces(used):
            a, b = max(lo, start), min(hi, start + shard_m.size)
            if a < b:
                m[a - lo: b - lo], v[a - lo: b - lo] = shard_m[a - start: b - start], shard_v[a - start: b - start]
        return {"step_count": self.state["optimizer"]["step_count"], "start": lo, "m": m, "v": v}

    def check_contents(self, config: GPTConfig) -> None:
        """What restore() will load, checked on the host before any rank starts: the model's tensors by
        name, shape and dtype, their digest against param_sha256, and the optimizer files' coverage. The
        manifest vouches only for the bytes; this catches a file that another writer (or a hand edit that
        re-hashed the manifest) got wrong inside."""
        if params_sha256(self.model_state(config), config) != self.state["param_sha256"]:
            raise self._corrupt("its parameters do not hash to the saved param_sha256")
        for _ in self._optimizer_pieces(layout_size(config)):
            pass


def open_pretrained(path, read=(MODEL, CONFIG), what: str = "--init-from") -> Checkpoint:
    """The files `read` of a GPT-2 folder that a run starts from (--init-from) or `sample` draws from:
    one of our checkpoints (verified against its manifest), or any folder with a Hugging Face GPT-2's
    config.json and model.safetensors (and tokenizer.json where it is read), such as save_pretrained
    writes and the Hub's "gpt2" holds. `what` names the folder in errors."""
    path = Path(path)
    if is_checkpoint(path):  # ours, also one cut short by a save: open_checkpoint reads both
        return open_checkpoint(path, read=read)
    if not path.is_dir():
        raise XtrainError(f"{what} '{path}' " + ("not found" if not path.exists() else "is not a folder"))
    contents = {}
    for name in read:
        try:
            contents[name] = (path / name).read_bytes()
        except FileNotFoundError:
            needed = f"{', '.join(read[:-1])} and {read[-1]}"
            raise XtrainError(f"{what} '{path}' has no {name}: give a folder with a Hugging Face GPT-2's "
                              f"{needed} (or one of our checkpoints)") from None
        except OSError as err:
            raise XtrainError(f"{what} '{path}': cannot read {name} ({err.strerror})") from None
    return Checkpoint(path, path, {}, contents)


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


def load_pretrained(source, model) -> None:
    """Start `model` from pretrained weights: a Shared of them, or a folder (open_pretrained)."""
    if not isinstance(source, Shared):
        source = Shared(1, open_pretrained(source).pretrained_state(model.config), path=source)
    with source.use() as tensors:
        model.load_state_dict(tensors)


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
        raw = (folder / MANIFEST).read_bytes()
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
    if manifest.get("version") != VERSION:
        raise XtrainError(f"checkpoint '{path}' has format version {manifest.get('version')}; "
                          f"this xtrain-dist reads version {VERSION}")
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
            data = file.read_bytes()
        except FileNotFoundError:
            raise XtrainError(f"checkpoint '{path}' is corrupt: {name} is missing") from None
        except OSError as err:
            raise XtrainError(f"checkpoint '{path}': cannot read {name} ({err.strerror})") from None
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise XtrainError(f"checkpoint '{path}' is corrupt: {name} does not match its sha256 in {MANIFEST}")
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in read):
            contents[name] = data
    return Checkpoint(path, folder, manifest, contents)


# ---------------------------------------------------------------------------------------------- resume
class AlreadyTrained(XtrainError):
    """The checkpoint to resume holds STEPS steps or more: nothing is left to train."""

    def __init__(self, where: str, step: int, steps: int):
        super().__init__(f"{where} is already at step {step}: STEPS ({steps}) must be larger to train on")
        self.step = step


def _describe(model: dict) -> str:
    return (f"'{model['preset']}' ({model['n_layer']} layers, {model['n_head']} heads, width {model['n_embd']}, "
            f"context {model['n_ctx']}, vocabulary {model['vocab_size']})")


def check_resume(cfg: TrainConfig, corpus) -> tuple[int, list[str], Checkpoint]:
    """Can this run continue the checkpoint cfg.resume? Returns (its step, notes for the log, the verified
    checkpoint with the bytes restore() loads: a shared_restore of it reads nothing again), or raises
    XtrainError naming what does not fit."""
    ckpt = open_checkpoint(cfg.resume, read=(MODEL, STATE, "optimizer*"))
    state, where = ckpt.state, f"checkpoint '{cfg.resume}'"
    notes = [ckpt.note] if ckpt.note else []
    model = {"preset": cfg.model, **asdict(model_config(cfg.model, corpus.vocab_size))}
    if state["model"] != model:
        raise XtrainError(f"{where} holds model {_describe(state['model'])}, this run trains {_describe(model)}")
    if state["data"]["train_tokens_sha256"] != corpus.train_sha256:
        raise XtrainError(f"{where} was trained on other token ids (corpus '{state['data']['corpus']}' with "
                          f"tokenizer '{state['data']['tokenizer']}'): resume with the same files")
    saved = state["config"]
    for name, flag in (("batch", "BATCH"), ("seq", "SEQ"), ("seed", "--seed")):
        if name not in saved:
            raise XtrainError(f"{where} is corrupt: {STATE} has no {name} in its config")
        if saved[name] != getattr(cfg, name):
            raise XtrainError(f"{where} was trained with {flag} {saved[name]}, this run has {getattr(cfg, name)}: "
                              "its data order cannot continue")
    if saved.get("overfit_batch", False) != cfg.overfit_batch:
        saved_with, run_with = ("without", "with") if cfg.overfit_batch else ("with", "without")
        raise XtrainError(f"{where} was trained {saved_with} --overfit-batch and this run is {run_with} it: its "
                          "data order cannot continue")
    try:  # what restore() will load on every rank: a bad sampler state is bad input, found before any rank starts
        BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed).load_state(state["sampler"])
    except XtrainError as err:
        raise XtrainError(f"{where} is corrupt: {err}") from None
    ckpt.check_contents(model_config(cfg.model, corpus.vocab_size))
    step = state["step"]
    if cfg.steps <= step:
        raise AlreadyTrained(where, step, cfg.steps)
    # a checkpoint from before an option existed was trained with its default
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    changed = [f"{name} {saved.get(name, defaults[name])} -> {getattr(cfg, name)}" for name in CHANGEABLE
               if saved.get(name, defaults[name]) != getattr(cfg, name)]
    if changed:
        notes.append(f"resume: from step {step + 1} on, this run changes {', '.join(changed)}")
    saved_dtype = saved.get("dtype", "fp32")  # checkpoints from before --dtype were fp32 runs
    if saved_dtype != cfg.dtype:
        notes.append(f"resume: the checkpoint was trained with --dtype {saved_dtype}, this run uses {cfg.dtype}: "
                     "it continues from the saved float32 master weights and optimizer state, and its losses "
                     f"follow {cfg.dtype} arithmetic from step {step + 1} on")
    if state["world_size"] != cfg.world_size:
        notes.append(f"resume: the checkpoint was written by {state['world_size']} rank(s), this run has "
                     f"{cfg.world_size}: the state resumes exactly, but gradient sums now round in another "
                     "order, so losses follow the original world size to float rounding, not bitwise")
    return step, notes, ckpt


def shared_restore(path, ranks: int, opened: Checkpoint | None = None) -> Shared:
    """The checkpoint at `path` for `ranks` rank threads to restore from: check_resume's verified read
    where the caller has it (`opened`), else one read on first use."""
    return Shared(ranks, opened, read=lambda: open_checkpoint(path, read=(MODEL, STATE, "optimizer*")), path=path)


def restore(source, model, optimizer, sampler) -> int:
    """Load the parameters, optimizer and sampler state of the checkpoint (a path, or a shared_restore of
    it; checked by check_resume) into this rank's objects; returns the step to continue from."""
    shared = source if isinstance(source, Shared) else shared_restore(source, 1)
    with shared.use() as ckpt:
        return _restore(ckpt, shared.path, model, optimizer, sampler)


def _restore(ckpt: Checkpoint, path, model, optimizer, sampler) -> int:
    state = ckpt.state
    model.load_state_dict(ckpt.model_state(model.config))
    used = layout_size(model.config)
    if sha256_of(model.ops.to_host(model.params)[:used]) != state["param_sha256"]:
        raise XtrainError(f"checkpoint '{path}' is corrupt: its parameters do not hash to the saved param_sha256")
    lo, hi = optimizer.state_range
    optimizer.load_state_dict(ckpt.optimizer_state(lo, hi, used))
    sampler.load_state(state["sampler"])
    return state["step"]
