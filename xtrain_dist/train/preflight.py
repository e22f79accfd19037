"""Everything a process checks and loads before its ranks start: the configuration against the corpus,
the files a run reads and writes, --resume and --init-from, the memory the ranks need, and what every
process of the job must agree on. Each problem is one XtrainError naming it, raised before any rank
trains, so bad input never costs a rendezvous, a compile or a half-written checkpoint.
"""

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import files, precision
from ..backend import numpy_ops, rank_device
from ..checkpoint import hf, resume, store
from ..comm.hybrid import WORLD_POINT_TO_POINT
from ..comm.launch_env import Launch, gpu_for
from ..comm.ring import ALL_REDUCES
from ..comm.world import choose_engine, config_fingerprint
from ..config import PRESETS, TrainConfig, model_config
from ..data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from ..errors import XtrainError
from ..eval import evaluate, hellaswag, sample
from ..model import check_dropout_attention, check_recompute
from ..optim import check_schedule
from ..parallel import ddp, pipeline, tensor, zero
from . import memory, metrics, tensorboard, wandb_log
from .cadence import Cadence, kept_folder
from .graph import MODES as GRAPH_MODES

AUTO_RESUME = "auto"  # --resume auto
NO_RESUME = "none"  # --resume none: start at step 1, whatever a --config file says


def check_config(cfg: TrainConfig, corpus: Corpus) -> None:
    """What needs the corpus to check: the model fits the sequence, the text fits the batch."""
    model = model_config(cfg.model, corpus.vocab_size)
    if cfg.seq > model.n_ctx:
        raise XtrainError(f"SEQ ({cfg.seq}) exceeds the context length of model '{cfg.model}' ({model.n_ctx})")
    corpus.check_seq(cfg.seq)
    if cfg.min_lr is not None and cfg.min_lr > cfg.lr:
        raise XtrainError(f"--min-lr ({cfg.min_lr:g}) must not exceed --lr ({cfg.lr:g}): the schedule decays from "
                          "the one to the other")
    check_schedule(cfg)
    if cfg.cuda_graph not in GRAPH_MODES:
        raise XtrainError(f"--cuda-graph must be one of {', '.join(GRAPH_MODES)}, not {cfg.cuda_graph!r}")
    tensor.check_config(cfg, model)
    pipeline.check_config(cfg, model)
    ddp.check_config(cfg)
    zero.check_config(cfg)
    if cfg.all_reduce not in ALL_REDUCES:
        raise XtrainError(f"--all-reduce must be one of {', '.join(ALL_REDUCES)}, not {cfg.all_reduce!r}")
    precision.check_config(cfg)
    check_recompute(cfg.recompute)
    check_dropout_attention(cfg.dropout, cfg.attention)
    if cfg.attention == "flash" and cfg.backend == "cuda":
        from ..backend.cuda.attention import check_flash_attention
        check_flash_attention(cfg.dtype, model.n_embd // model.n_head, cfg.model)
    if cfg.attention == "cudnn":
        if cfg.backend != "cuda":
            raise XtrainError(f"--attention cudnn runs cuDNN's attention on a GPU: it needs --backend cuda, not "
                              f"{cfg.backend}")
        from ..backend.cuda import cudnn_sdpa
        cudnn_sdpa.check_cudnn_attention(cfg.dtype, model.n_embd // model.n_head, cfg.model)
        cudnn_sdpa.load()  # a missing package or library: one line naming the extra, before any rank starts


def resolve_auto(cfg: TrainConfig, model) -> tuple[TrainConfig, str]:
    """--attention and --matmul at auto: numpy's only paths (standard, cublas), or on cuda the fastest measured
    that the run can take (backend/cuda/defaults.py), with the line that says what a cuda run chose ("" on
    numpy, whose results must not change)."""
    if cfg.backend != "cuda":
        return replace(cfg, attention="standard" if cfg.attention == "auto" else cfg.attention,
                       matmul="cublas" if cfg.matmul == "auto" else cfg.matmul), ""
    from ..backend.cuda import cudnn_sdpa, defaults, tuned
    from ..backend.cuda.device import device_name
    table = tuned.load_table(device_name(0)) if "auto" in (cfg.attention, cfg.matmul) else {}
    choice = defaults.choose(cfg.attention, cfg.matmul, cfg.dtype, model.n_embd // model.n_head, table,
                             cudnn_sdpa.loads, cfg.dropout)
    return replace(cfg, attention=choice.attention, matmul=choice.matmul), choice.line(cfg.cuda_graph)


def config_beside(report) -> Path:
    """Where a run writes its configuration beside its --report: report.json -> report.config.toml."""
    report = Path(report)
    return report.with_name(f"{report.stem}.config.toml")


# what each output holds, for the line that refuses two of them on one path
_OUTPUT_NOUNS = {"--save-dir": "checkpoint", "--report": "report", "--report's configuration": "configuration",
                 "--metrics": "metrics", "--tensorboard": "event files"}


def run_outputs(cfg: TrainConfig) -> list[tuple[str, str]]:
    """Every path a run writes, (flag, path), known before its first step: the checkpoint folder, the report
    and the configuration written beside it (not beside a device or a pipe, which has no folder of its
    own), the metrics file and the TensorBoard folder. (The kept checkpoints, DIR.stepNNNNNN, lie beside
    DIR, and what --profile-step and --sample-every produce goes to the console and into the report.)"""
    outputs = [("--save-dir", cfg.save_dir), ("--report", cfg.report)]
    if cfg.report and not files.written_in_place(Path(cfg.report)):
        outputs.append(("--report's configuration", str(config_beside(cfg.report))))
    outputs += [("--metrics", cfg.metrics), ("--tensorboard", cfg.tensorboard)]
    return [(flag, path) for flag, path in outputs if path]


def check_outputs(cfg: TrainConfig) -> None:
    """Refuse a run that would write over its own files, before anything is touched: an output on an input
    file (the tokenizer, the corpora, the --hellaswag file, the --config file), two outputs on one path,
    an output inside the folder of --resume or --init-from (which it reads), and an output or a corpus
    inside --save-dir (which every save replaces whole). Files are compared, not names, so a relative path,
    a symlink or a hard link is caught too."""
    outputs = run_outputs(cfg)
    inputs = [("the tokenizer", cfg.tokenizer), ("the corpus", cfg.corpus), ("the validation corpus", cfg.val_corpus),
              ("the --hellaswag file", cfg.hellaswag), ("the --config file", cfg.config)]
    for flag, out in outputs:
        if flag == "--report's configuration" and cfg.config and files.same_file(out, cfg.config):
            # the replay of a written configuration, as it stands: the report beside it is the first run's
            raise XtrainError(f"--report '{cfg.report}' would write its configuration over the --config file "
                              f"'{cfg.config}': give another --report")
        files.refuse_output_on_inputs(out, flag, inputs, "the run would write into its own input")
    for i, (flag, out) in enumerate(outputs):
        for other, path in outputs[i + 1:]:
            if files.same_file(out, path):
                kind = "path" if {flag, other} & {"--save-dir", "--tensorboard"} else "file"
                raise XtrainError(f"{flag} '{out}' and {other} '{path}' are the same {kind}: the "
                                  f"{_OUTPUT_NOUNS[flag]} would replace the {_OUTPUT_NOUNS[other]}")
    resume = cfg.resume if cfg.resume != AUTO_RESUME else None  # auto: --save-dir, where outputs are refused below
    for flag, folder in (("--resume", resume), ("--init-from", cfg.init_from)):
        for name, path in outputs if folder else []:
            if name != "--save-dir" and files.inside(path, folder):
                raise XtrainError(f"{name} '{path}' is inside {flag} '{folder}': the run would write into the "
                                  "checkpoint it reads")
    if cfg.save_dir and cfg.init_from and files.inside(cfg.save_dir, cfg.init_from):
        raise XtrainError(f"--save-dir '{cfg.save_dir}' is inside --init-from '{cfg.init_from}': the run would "
                          "write into the checkpoint it reads")
    inputs_in_run = [("corpus", cfg.corpus), ("--val-corpus", cfg.val_corpus), ("--hellaswag", cfg.hellaswag)]
    written_folders = [("the --wandb folder", str(wandb_log.folder()))] if cfg.wandb is not None else []
    for name, path in [*outputs, *inputs_in_run, *written_folders] if cfg.save_dir else []:
        if name != "--save-dir" and path and files.inside(path, cfg.save_dir):
            raise XtrainError(f"{name} '{path}' is inside --save-dir '{cfg.save_dir}': every checkpoint save "
                              "replaces that folder")


def hold_outputs(cfg: TrainConfig) -> list[files.OutputLock]:
    """Take every output of the run for its whole life (files.OutputLock; the configuration beside --report
    goes with it): a second run on any of them is refused in one line naming this one, before it touches
    anything. A device or a pipe is shared, not held. On a refusal, what was taken is let go."""
    consequences = {"--save-dir": "two runs would replace each other's checkpoints",
                    "--report": "two runs would replace each other's report",
                    "--metrics": "two runs would mix their records in one file",
                    "--tensorboard": "two runs would mix their event files in one folder"}
    writable = {"--report": lambda path: files.check_writable(path, "--report"),
                "--report's configuration": lambda path: files.check_writable(path, "--report's configuration"),
                "--metrics": metrics.check_path, "--tensorboard": tensorboard.check}
    held = []
    try:
        for flag, path in run_outputs(cfg):
            if flag in writable:  # before the lock, which makes its folders: a path through a file is said as such
                writable[flag](path)
            if flag in consequences and not files.written_in_place(Path(path)):
                held.append(store.SaveDirLock(path) if flag == "--save-dir" else
                            files.OutputLock(path, flag, consequences[flag]))
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return held


# what every process of a run must agree on; paths and addresses may differ from node to node, and so may
# --recompute (a node short of memory may recompute: the bits are the same), --comm-priority (a scheduling
# choice) and the sampling options (only the process of rank 0 draws); `options` holds the same values again,
# as the command line gave them
_PER_PROCESS_FIELDS = {"tokenizer", "corpus", "val_corpus", "hellaswag", "init_from", "report", "metrics", "log_every",
                       "rdzv_bind", "rdzv_advertise", "cpu_threads", "profile_step", "recompute", "sample_every",
                       "sample_tokens", "sample_prompt", "extra", "options",
                       "tensorboard", "config", "wandb", "comm_priority"}


@dataclass
class Prepared:
    """What a process checked and loaded before it meets the others."""
    engine: str                 # the communicator it joins the world with
    corpus: Corpus
    devices: list               # each local rank's device
    cfg: TrainConfig            # with what the checks settled (evaluation switched off for a short split)
    fingerprint: bytes          # of what every process must agree on (config_fingerprint)
    resume_from: object         # the verified checkpoint to resume from, or None
    init_weights: dict | None   # the --init-from parameters
    hellaswag: list | None      # the --hellaswag examples
    locks: list = field(default_factory=list)  # the outputs held for the run (process rank 0): hold_outputs


def prepare(cfg: TrainConfig, corpus: Corpus | None, launch: Launch, local_world: int, log) -> Prepared:
    """Everything a process checks and loads before it meets the others, or one XtrainError naming what
    is wrong. The outputs are checked against each other and the inputs first (check_outputs), then the
    process that writes them takes them for the run (hold_outputs, in Prepared.locks for the caller to
    release at the end), before anything reads or clears them: a second run on --save-dir, refused, must
    not have touched the first run's save in progress."""
    check_outputs(cfg)
    locks = hold_outputs(cfg) if launch.process_rank == 0 else []
    try:
        return replace(_prepare(cfg, corpus, launch, local_world, log), locks=locks)
    except BaseException:
        for lock in locks:
            lock.release()
        raise


def _prepare(cfg: TrainConfig, corpus: Corpus | None, launch: Launch, local_world: int, log) -> Prepared:
    if corpus is None:  # a TrainConfig made in code trains on the shipped data where it names none, as the CLI does
        cfg = replace(cfg, tokenizer=cfg.tokenizer or str(DEFAULT_TOKENIZER), corpus=cfg.corpus or str(DEFAULT_CORPUS))
    auto_resume = cfg.resume == AUTO_RESUME
    cfg = resolve_auto_resume(cfg)
    gpus = 0
    if cfg.backend == "cuda":  # a missing CUDA is one clean line, before anything starts
        from ..backend.cuda.device import device_count
        gpus = device_count()
    engine = choose_engine(cfg.comm, cfg.backend, launch, local_world, gpus)
    # with --tp or --pp the ring runs on the data-parallel group, split from the world (comm/hybrid.py)
    if cfg.all_reduce == "ring" and engine in ("mpi", "tcp") and local_world > 1 and cfg.tp == cfg.pp == 1:
        raise XtrainError(f"--all-reduce ring sends between ranks, and {WORLD_POINT_TO_POINT}: run one rank thread "
                          "per process (mpirun -n N, torchrun --nproc-per-node N)")
    corpus = corpus or Corpus.load(cfg.tokenizer, cfg.corpus, val_path=cfg.val_corpus or None)
    cfg, chosen = resolve_auto(cfg, model_config(cfg.model, corpus.vocab_size))
    if chosen and launch.process_rank == 0:
        log(chosen)
    check_config(cfg, corpus)
    # devices are checked before any thread starts, so a missing CUDA is one clean line. NCCL ranks
    # take a GPU each (the process's slice of its node's GPUs); thread ranks of one process take the
    # visible GPUs in turn, several virtual ranks sharing one when the world is larger
    if engine == "nccl":
        devices = [gpu_for(launch, local_world, local, gpus) for local in range(local_world)]
    else:
        devices = [rank_device(cfg.backend, local) for local in range(local_world)]
    # checkpoints, evaluation, metrics: fail before training rather than after it
    if cfg.save_dir and launch.process_rank == 0:
        if note := store.prepare_save_dir(cfg.save_dir):
            log(note)
        store.refuse_another_runs_checkpoint(cfg.save_dir, cfg.resume)
        if auto_resume and not cfg.resume:  # said once --save-dir is known to take the run's checkpoints
            log(f"--resume {AUTO_RESUME}: no checkpoint in '{cfg.save_dir}' yet: starting at step 1")
    if cfg.metrics:
        metrics.check_path(cfg.metrics)
        if launch.process_rank == 0 and not (cfg.resume or auto_resume):  # the process whose rank 0 writes it
            metrics.refuse_another_runs_records(cfg.metrics)
    if cfg.wandb is not None and launch.process_rank == 0:
        wandb_log.check(cfg.wandb)
    cfg = evaluate.check(cfg, corpus, log)
    examples = hellaswag.load(cfg, corpus) if cfg.hellaswag else None
    if cfg.sample_every and launch.process_rank == 0:  # where rank 0 will draw: a prompt it cannot encode fails now
        sample.prompt_ids(corpus.tokenizer, cfg.sample_prompt, cfg.tokenizer, "--sample-prompt")
    if cfg.resume and cfg.init_from:
        raise XtrainError("--init-from and --resume both say where the weights start: give one")
    first, resume_from = 1, None
    if cfg.resume:
        try:
            step, notes, resume_from = resume.check_resume(cfg, corpus)
        except resume.AlreadyTrained as done:
            if not auto_resume:  # an explicit --resume asks for more steps than it gave
                raise
            raise RunComplete(f"--resume {AUTO_RESUME}: checkpoint '{cfg.save_dir}' is at step {done.step} and "
                              f"STEPS is {cfg.steps}: nothing left to train") from None
        first = step + 1
        if launch.process_rank == 0:
            for line in [f"resuming '{cfg.resume}' after step {step}", *notes]:
                log(line)
    if cfg.keep_every and launch.process_rank == 0:
        refuse_existing_kept_folders(cfg, first - 1)
    init_weights = check_init_from(cfg, corpus) if cfg.init_from else None
    if init_weights is not None and launch.process_rank == 0:
        log(f"starting from the weights in '{cfg.init_from}'")
    if cfg.profile_step and not first <= cfg.profile_step <= cfg.steps:
        raise XtrainError(f"--profile-step {cfg.profile_step} is not a step of this run (it runs steps {first} "
                          f"to {cfg.steps})")
    for note in check_memory(cfg, model_config(cfg.model, corpus.vocab_size), local_world * launch.local_processes,
                             devices):
        if launch.local_rank == 0:  # one process a machine says it
            log(note)
    warn_oversubscribed(cfg, local_world * launch.local_processes, log)
    if launch.process_rank == 0:
        where = f" on GPUs {devices}" if cfg.backend == "cuda" else ""
        processes = f" in {launch.num_processes} processes ({launch.kind}, {engine})" if launch.multi_process else ""
        dp = cfg.world_size // cfg.tp // cfg.pp
        cut = ", sequence parallel" if cfg.sequence_parallel else ""
        mesh = f" (dp {dp} x tp {cfg.tp}{cut})" if cfg.tp > 1 else ""
        if cfg.pp > 1:
            mesh = f" (pp {cfg.pp} x dp {dp} x tp {cfg.tp}{cut}, {cfg.pp_schedule})"
        products = (" with TF32 products" if cfg.tf32 else "") + \
            (", biases in cuBLASLt's epilogue" if cfg.matmul == "cublaslt" else "")
        log(f"{cfg.model}: {model_config(cfg.model, corpus.vocab_size)} | {cfg.backend} backend, {cfg.dtype}"
            f"{products}, {cfg.world_size} rank(s){mesh}{processes}{where}, batch {cfg.batch} x {cfg.seq} tokens")
    # the files' paths may differ from node to node; the token ids read from them may not, or ranks would
    # train on different data with nothing to say so
    same_everywhere = {k: v for k, v in cfg.to_dict().items() if k not in _PER_PROCESS_FIELDS}
    if init_weights is not None:  # so are the weights every rank starts from
        same_everywhere["init_params"] = store.params_sha256(init_weights, model_config(cfg.model, corpus.vocab_size))
    if examples is not None:
        same_everywhere["hellaswag_examples"] = hellaswag.sha256(examples)
    fingerprint = config_fingerprint({**same_everywhere, "train_tokens": corpus.train_sha256,
                                      "val_tokens": corpus.val_sha256})
    return Prepared(engine, corpus, devices, cfg, fingerprint, resume_from, init_weights, examples)


class RunComplete(XtrainError):
    """--resume auto found the run already trained to STEPS: a requeued job that ended after its last save
    runs its command once more, and that is success (exit status 0), not bad input."""


def resolve_auto_resume(cfg: TrainConfig) -> TrainConfig:
    """--resume auto: from the checkpoint in --save-dir where there is one (the weights of --init-from were
    the first start's, and the checkpoint has moved on from them), else a first start. So a job requeued
    after a stop signal runs the very command it started with. Every process decides alone, and the
    configuration they compare at the rendezvous holds the outcome: processes that see different
    --save-dir contents are refused there. (train says which it was, once --save-dir has passed its checks.)"""
    if cfg.resume != AUTO_RESUME:
        return cfg
    if not cfg.save_dir:
        raise XtrainError(f"--resume {AUTO_RESUME} continues from the checkpoint in --save-dir: give --save-dir")
    if store.is_checkpoint(cfg.save_dir):
        return replace(cfg, resume=cfg.save_dir, init_from=None)
    return replace(cfg, resume=None)


def refuse_existing_kept_folders(cfg: TrainConfig, start: int) -> None:
    """A kept checkpoint is written once and never replaced: a folder already where this run (continuing
    after step `start`) would keep one is refused before training, whatever it holds."""
    for step in Cadence(cfg, start).kept_steps:
        if os.path.lexists(folder := kept_folder(cfg.save_dir, step)):
            raise XtrainError(f"--keep-every {cfg.keep_every}: '{folder}' already exists, and this run would keep "
                              f"its step {step} there; move it away or give another --save-dir")


def _shape(c) -> str:
    return f"{c.n_layer} layers, {c.n_head} heads, width {c.n_embd}, context {c.n_ctx}, vocabulary {c.vocab_size}"


def check_init_from(cfg: TrainConfig, corpus: Corpus) -> dict:
    """--init-from: the pretrained parameters, checked to be the model this run trains with this tokenizer."""
    pretrained = hf.open_pretrained(cfg.init_from)
    theirs, ours = hf.gpt_config(pretrained), model_config(cfg.model, corpus.vocab_size)
    if theirs != ours:
        if theirs.vocab_size != corpus.vocab_size:
            hint = f"train with the tokenizer it was trained with (its vocabulary of {theirs.vocab_size})"
        elif preset := next((p for p in PRESETS if model_config(p, theirs.vocab_size) == theirs), None):
            hint = f"pass --model {preset}"
        else:
            hint = "no --model preset has its shape"
        raise XtrainError(f"--init-from '{cfg.init_from}' holds a GPT-2 of {_shape(theirs)}; --model {cfg.model} "
                          f"with this tokenizer is {_shape(ours)}: {hint}")
    return hf.pretrained_state(pretrained, ours)


def act_itemsize(cfg: TrainConfig) -> int:
    """Bytes of an activation: bf16 on a GPU is 2, float32 and numpy's bf16 emulation (in float32) 4."""
    return 2 if cfg.backend == "cuda" and cfg.dtype == "bf16" else 4


def check_memory(cfg: TrainConfig, config, ranks_on_node: int, devices: list) -> list[str]:
    """Refuse a run whose ranks cannot fit in the memory they share (train/memory.py): on the CPU, this machine's
    for all the job's ranks on it; on GPUs, each GPU's for the ranks placed on it. The job's smallest
    per-rank figures are used, so whichever ranks are here, the bound holds. Returns the notes for runs
    that fit only if their ranks' steps do not overlap."""
    needs = sorted(memory.rank_memories(config, cfg, act_itemsize(cfg)), key=lambda n: (n.persistent, n.activations))
    if cfg.backend != "cuda":
        note = memory.check_fits(needs[:ranks_on_node], memory.host_available_bytes(), "this machine", cfg)
        return [note] if note else []
    from ..backend.cuda.device import device_free_bytes
    notes = [memory.check_fits(needs[:devices.count(device)], device_free_bytes(device), f"GPU {device}", cfg)
             for device in sorted(set(devices))]
    return [note for note in notes if note]


def warn_oversubscribed(cfg: TrainConfig, ranks_on_node: int, log) -> None:
    """--cpu-threads asking for more BLAS threads than the cores is allowed (the user may know the machine
    better than its affinity mask), but said: OpenBLAS threads past the cores spin against each other, and
    the step slows down many times over (docs/options.md, --cpu-threads)."""
    cores = numpy_ops.available_cores()
    if cfg.backend == "numpy" and cfg.cpu_threads and cfg.cpu_threads * ranks_on_node > cores:
        log(f"note: --cpu-threads {cfg.cpu_threads} x {ranks_on_node} rank(s) on this machine is "
            f"{cfg.cpu_threads * ranks_on_node} BLAS threads on {cores} cores: threads beyond the cores slow "
            "the step down, often many times over (leave --cpu-threads out for one a rank)")
