"""What a run saves to be continued, and what continuing it checks and restores.

`save` writes the model in the Hugging Face layout (hf.py), the run's state (trainer_state.json: the step,
the model's shape, the schedule, the sampler's RNG, the data's digest, the config) and AdamW's state (one
optimizer file, or one per rank when it is sharded) into a folder replaced whole (store.py). `check_resume`
decides on the host, before any rank starts, whether this run can continue a checkpoint, reading it once for
all the rank threads; `restore` loads it into each rank's model, optimizer and sampler.
"""

from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from .. import __version__
from ..config import GPTConfig, TrainConfig, model_config
from ..data.sampler import BatchSampler
from ..errors import XtrainError
from .hf import gpt_config, hf_config, tokenizer_config
from .safetensors_io import write_safetensors
from .store import (
    CONFIG,
    FORMAT,
    MODEL,
    RUN_CONFIG,
    STATE,
    TOKENIZER,
    TOKENIZER_CONFIG,
    VERSION,
    Checkpoint,
    Shared,
    layout_size,
    open_checkpoint,
    optimizer_file,
    params_sha256,
    powersgd_file,
    sha256_of,
    write_file,
    write_folder,
    write_json,
)

# the learning-rate schedule's settings (optim.lr_at), kept in trainer_state.json for the reader
SCHEDULE = ("lr", "min_lr", "warmup_steps", "lr_decay_steps", "lr_schedule", "cooldown_steps")
# settings a resumed run may change (they take effect from its first step); anything that would
# change the model, the data or the batches it draws must match the checkpoint
CHANGEABLE = (*SCHEDULE, "weight_decay", "beta1", "beta2", "eps", "grad_clip", "backend", "grad_sync", "attention",
              "recompute", "tp", "pp", "pp_schedule")


# ---------------------------------------------------------------------------------------------- save
def trainer_state(step: int, cfg: TrainConfig, corpus, model, optimizer, sampler, world_size: int,
                  flat: np.ndarray | None = None) -> dict:
    """flat: the full layout's parameters (GPT2.gather_flat), where the caller has them already."""
    used = layout_size(model.config)
    flat = model.params_flat() if flat is None else flat
    return {
        "format": FORMAT, "version": VERSION, "xtrain_dist_version": __version__,
        "step": step,
        "world_size": world_size,
        "dtype": cfg.dtype,
        "model": {"preset": cfg.model, **asdict(model.config)},
        "param_sha256": sha256_of(flat[:used]),
        "optimizer": {"sharded": saves_shards(model, optimizer), "step_count": optimizer.step_count,
                      "files": [optimizer_file(r) for r in range(world_size)] if saves_shards(model, optimizer)
                      else [optimizer_file(None)]},
        "schedule": {name: getattr(cfg, name) for name in SCHEDULE},
        "sampler": sampler.state(),
        "data": {"tokenizer": str(corpus.tokenizer_path), "corpus": str(corpus.corpus_path),
                 "val_corpus": str(corpus.val_path or ""),
                 "train_tokens": len(corpus.train), "train_tokens_sha256": corpus.train_sha256},
        "config": cfg.to_dict(),
    }


def saves_shards(model, optimizer) -> bool:
    """Whether every rank writes its own optimizer file: ZeRO-1's shards of one whole model. A tensor- or
    pipeline-parallel run writes one file of the full layout instead (optimizer_state_to_save)."""
    return bool(optimizer.sharded) and not model.split_over_ranks


def optimizer_state_to_save(model, optimizer) -> dict:
    """The optimizer's state_dict, in the full layout where the model holds tensor-parallel shards: m and v
    (gathered first over the data-parallel group under ZeRO-1) gathered and joined like the parameters (a
    collective of both groups)."""
    if not model.split_over_ranks:
        return optimizer.state_dict()
    m, v = optimizer.m, optimizer.v
    if optimizer.sharded:  # the shard's m and v into the rank's whole flat buffer, over the data-parallel group
        m, v = (model.ops.xp.zeros(model.size, dtype=part.dtype) for part in (optimizer.m, optimizer.v))
        optimizer.comm.all_gather(optimizer.m, m, optimizer.counts)
        optimizer.comm.all_gather(optimizer.v, v, optimizer.counts)
    return {"step_count": optimizer.step_count, "start": 0, "m": model.gather_flat(m), "v": model.gather_flat(v)}


def _write_optimizer(path: Path, state: dict) -> None:
    meta = {"format": "xtrain-dist optimizer", "step_count": str(state["step_count"]), "start": str(state["start"])}
    write_file(path, lambda f: write_safetensors(f, {"m": state["m"], "v": state["v"]}, meta))


def _write_powersgd(path: Path, powersgd) -> None:
    tensors = powersgd.state_dict()
    write_file(path, lambda f: write_safetensors(f, tensors, {"format": "xtrain-dist powersgd",
                                                              "rank": str(powersgd.rank)}))


def save(folder, *, rank: int, comm, step: int, cfg: TrainConfig, corpus, model, optimizer, sampler,
         powersgd=None) -> None:
    """Write a checkpoint of the state after `step` steps to `folder`, replacing the one there atomically
    (store.write_folder).

    Every rank calls it: rank 0 writes the model and the run's state, the optimizer state is written
    by rank 0 or, when it is sharded, by every rank for its shard; all ranks wait until it is in place.
    With PowerSGD (`powersgd`, parallel/powersgd.py) every rank also writes its Q and error buffers. At
    ZeRO-2 the parameters are whole on every rank as at ZeRO-1; at ZeRO-3 every rank's shard is all-gathered
    first, so the folder is the same one Hugging Face folder at every stage, and m and v are saved as ZeRO-1
    saves them (one file per rank): a run resumes at any stage and world size.
    With tensor or pipeline parallelism every rank first gathers its groups' shards and stages (collectives of
    the groups), so the files hold the full model and its optimizer state whatever --tp and --pp were: a run
    resumes at any --tp and --pp."""
    # ZeRO-3's ranks hold shards of the parameters: every rank takes part in gathering them
    gathers = rank == 0 or model.split_over_ranks or model.params is None
    shards = saves_shards(model, optimizer)
    flat = model.params_flat() if gathers else None
    optimizer_state = optimizer_state_to_save(model, optimizer) if gathers or shards else None

    def write(new: Path) -> None:
        if rank == 0:
            tensors = model.state_dict(flat)
            write_file(new / MODEL, lambda f: write_safetensors(f, tensors, {"format": "pt"}))
            write_json(new / CONFIG, hf_config(model.config, corpus.tokenizer))
            write_file(new / TOKENIZER, lambda f: f.write(corpus.tokenizer.to_str().encode()))
            write_json(new / TOKENIZER_CONFIG, tokenizer_config(model.config, corpus.tokenizer))
            write_json(new / STATE, trainer_state(step, cfg, corpus, model, optimizer, sampler, comm.world_size,
                                                  flat))
            if cfg.options:
                write_file(new / RUN_CONFIG, lambda f: f.write(cfg.options_toml().encode()))
        if shards or rank == 0:
            _write_optimizer(new / optimizer_file(rank if shards else None), optimizer_state)
        if powersgd is not None:
            _write_powersgd(new / powersgd_file(rank), powersgd)

    write_folder(folder, rank=rank, comm=comm, write=write)


# ---------------------------------------------------------------------------------------------- resume
class AlreadyTrained(XtrainError):
    """The checkpoint to resume holds STEPS steps or more: nothing is left to train."""

    def __init__(self, where: str, step: int, steps: int):
        super().__init__(f"{where} is already at step {step}: STEPS ({steps}) must be larger to train on")
        self.step = step


def _describe(model: dict) -> str:
    return (f"'{model['preset']}' ({model['n_layer']} layers, {model['n_head']} heads, width {model['n_embd']}, "
            f"context {model['n_ctx']}, vocabulary {model['vocab_size']})")


def _optimizer_pieces(ckpt: Checkpoint, used: int):
    """(start, m, v) of every saved optimizer file in order, checked to continue one another from element 0
    and to cover the model's `used` elements; what they hold past those (ZeRO's padding) must be zero, as
    the flat buffer's padding is, or they are another model's state."""
    info = ckpt.state["optimizer"]
    covered = 0
    for name in info["files"]:
        if not isinstance(name, str) or name not in ckpt.contents:  # "../x", "config.json", 7
            raise ckpt.corrupt(f"{STATE} names {name!r} as an optimizer file, which the checkpoint does not hold")
        tensors, meta = ckpt.tensors(name)
        try:
            start, step_count = int(meta["start"]), int(meta["step_count"])
            shard_m, shard_v = tensors["m"], tensors["v"]
        except (KeyError, ValueError):
            raise ckpt.corrupt(f"{name} is not an optimizer state (no m, v, start, step_count)") from None
        if start != covered or shard_m.shape != shard_v.shape or step_count != info["step_count"]:
            raise ckpt.corrupt(f"{name} does not continue the optimizer state at element {covered}")
        past_used = slice(max(0, used - start), None)
        if shard_m[past_used].any() or shard_v[past_used].any():
            raise ckpt.corrupt(f"{name} holds optimizer state past the model's {used} elements")
        yield start, shard_m, shard_v
        covered = start + shard_m.size
    if covered < used:
        raise ckpt.corrupt(f"the optimizer files cover flat[0:{covered}], the model has {used} elements")


def optimizer_state(ckpt: Checkpoint, lo: int, hi: int, used: int) -> dict:
    """An optimizer state for flat[lo:hi], assembled from the saved file or shards, whatever the
    sharding they were saved under. Past `used` the flat buffer is padding: m and v are zero there."""
    m, v = np.zeros(hi - lo, dtype=np.float32), np.zeros(hi - lo, dtype=np.float32)
    for start, shard_m, shard_v in _optimizer_pieces(ckpt, used):
        a, b = max(lo, start), min(hi, start + shard_m.size)
        if a < b:
            m[a - lo: b - lo], v[a - lo: b - lo] = shard_m[a - start: b - start], shard_v[a - start: b - start]
    return {"step_count": ckpt.state["optimizer"]["step_count"], "start": lo, "m": m, "v": v}


def check_contents(ckpt: Checkpoint, config: GPTConfig) -> None:
    """What restore() will load, checked on the host before any rank starts: the model's tensors by
    name, shape and dtype, their digest against param_sha256, and the optimizer files' coverage. The
    manifest vouches only for the bytes; this catches a file that another writer (or a hand edit that
    re-hashed the manifest) got wrong inside."""
    if params_sha256(ckpt.model_state(config), config, ckpt.version) != ckpt.state["param_sha256"]:
        raise ckpt.corrupt("its parameters do not hash to the saved param_sha256")
    for _ in _optimizer_pieces(ckpt, layout_size(config, ckpt.version)):
        pass


def check_resume(cfg: TrainConfig, corpus) -> tuple[int, list[str], Checkpoint]:
    """Can this run continue the checkpoint cfg.resume? Returns (its step, notes for the log, the verified
    checkpoint with the bytes restore() loads: a shared_restore of it reads nothing again), or raises
    XtrainError naming what does not fit."""
    powersgd = ("powersgd*",) if cfg.grad_compress == "powersgd" else ()  # the ranks' own PowerSGD state
    ckpt = open_checkpoint(cfg.resume, read=(MODEL, CONFIG, STATE, "optimizer*", *powersgd))
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
        raise XtrainError(f"{where} is corrupt: {STATE}: {err}") from None
    # config.json is the model Hugging Face and the other commands load: it must be the one that trains on
    if gpt_config(ckpt) != model_config(cfg.model, corpus.vocab_size):
        raise ckpt.corrupt(f"{CONFIG} describes another model than {STATE}'s {_describe(state['model'])}")
    check_contents(ckpt, model_config(cfg.model, corpus.vocab_size))
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
    if cfg.grad_compress == "powersgd" and any(name.startswith("powersgd.") for name in ckpt.contents):
        saved_rank = saved.get("powersgd_rank")
        if state["world_size"] != cfg.world_size:
            raise XtrainError(f"{where} holds the PowerSGD error feedback of {state['world_size']} rank(s), this run "
                              f"has {cfg.world_size}: each rank's error is its own, so resume with "
                              f"{state['world_size']} rank(s)")
        # each rank's Q and error buffers are those of the shards and stage it holds (parallel/powersgd.py):
        # another cut of the model gives every rank other matrices
        saved_mesh, mesh = _mesh(saved, defaults), _mesh(cfg.to_dict(), defaults)
        if saved_mesh != mesh:
            raise XtrainError(f"{where} holds the PowerSGD error feedback of each rank's own shards at {saved_mesh}, "
                              f"this run has {mesh}: resume with {saved_mesh}")
        if saved_rank != cfg.powersgd_rank:
            raise XtrainError(f"{where} was trained with --powersgd-rank {saved_rank}, this run has "
                              f"{cfg.powersgd_rank}: its PowerSGD state cannot continue")
    if state["world_size"] != cfg.world_size:
        notes.append(f"resume: the checkpoint was written by {state['world_size']} rank(s), this run has "
                     f"{cfg.world_size}: the state resumes exactly, but gradient sums now round in another "
                     "order, so losses follow the original world size to float rounding, not bitwise")
    return step, notes, ckpt


def _mesh(config: dict, defaults: dict) -> str:
    """How a run's configuration (TrainConfig.to_dict's, or a checkpoint's) cuts the model over ranks: "--tp 2
    --pp 1", with its --tp-classifier where tp is above 1 (the vocabulary-parallel wte is a shard too)."""
    tp, pp = config.get("tp", defaults["tp"]), config.get("pp", defaults["pp"])
    classifier = f" --tp-classifier {config.get('tp_classifier', defaults['tp_classifier'])}" if tp > 1 else ""
    return f"--tp {tp} --pp {pp}{classifier}"


def shared_restore(path, ranks: int, opened: Checkpoint | None = None) -> Shared:
    """The checkpoint at `path` for `ranks` rank threads to restore from: check_resume's verified read
    where the caller has it (`opened`), else one read on first use."""
    return Shared(ranks, opened, read=lambda: open_checkpoint(path, read=(MODEL, STATE, "optimizer*", "powersgd*")),
                  path=path)


def restore(source, model, optimizer, sampler, powersgd=None, rank: int = 0) -> int:
    """Load the parameters, optimizer and sampler state of the checkpoint (a path, or a shared_restore of
    it; checked by check_resume) into this rank's objects, and this rank's PowerSGD state where the run
    compresses with it (the file of `rank`, the rank's place in the job: with --tp or --pp its PowerSGD runs
    on its data-parallel group, whose rank numbers repeat over the mesh); returns the step to continue from."""
    shared = source if isinstance(source, Shared) else shared_restore(source, 1)
    with shared.use() as ckpt:
        return _restore(ckpt, shared.path, model, optimizer, sampler, powersgd, rank)


def _restore(ckpt: Checkpoint, path, model, optimizer, sampler, powersgd, rank: int) -> int:
    state = ckpt.state
    # the full model, whatever --tp and --pp saved it: this rank loads its shards and stage of it
    flat = model.full_flat(ckpt.model_state(model.config))
    # a version 1 checkpoint (wte's V rows) is this layout's first `used` elements: the rest, wte's padded
    # rows, is zero in the parameters full_flat made and in the m and v optimizer_state assembles
    used = layout_size(model.config, ckpt.version)
    if sha256_of(flat[:used]) != state["param_sha256"]:
        raise XtrainError(f"checkpoint '{path}' is corrupt: its parameters do not hash to the saved param_sha256")
    model.load_flat(flat)
    if not model.split_over_ranks:
        lo, hi = optimizer.state_range
        optimizer.load_state_dict(optimizer_state(ckpt, lo, hi, used))
    else:  # AdamW of the rank's shards: m and v of the full layout, cut like the parameters (ZeRO-1 then takes
        # its part of them)
        full = optimizer_state(ckpt, 0, model.full_size, used)
        optimizer.load_state_dict({**full, "m": model.shard_flat(full["m"]), "v": model.shard_flat(full["v"])})
    sampler.load_state(state["sampler"])
    if powersgd is not None:
        # a checkpoint of a run without PowerSGD leaves it as it starts: Q from the seed, no error yet
        powersgd.steps_done = state["step"]
        name = powersgd_file(rank)
        if name in ckpt.contents:
            powersgd.load_state_dict(ckpt.tensors(name)[0], f"checkpoint '{path}'")
    return state["step"]
