"""Plain configuration: the model's shape (GPTConfig, with named presets) and the run (TrainConfig)."""

from dataclasses import asdict, dataclass, field

from . import config_file
from .command import must_be, one_of
from .errors import XtrainError

# The classifier's rows (wte's rows in the parameter layout) are padded to a multiple of this, as nanoGPT and
# llm.c pad GPT-2's 50257 to 50304: the logits' products then run at a width cuBLAS tiles whole, about 4x
# faster on an H100 for 0.09% more columns. The padded rows are no token's: they start at zero and stay zero.
VOCAB_ALIGN = 128


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2's shape. vocab_size comes from the tokenizer, the rest from a preset."""

    vocab_size: int
    n_ctx: int = 1024      # longest sequence; the number of learned positions
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    def __post_init__(self):
        for name in ("vocab_size", "n_ctx", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise XtrainError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise XtrainError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def padded_vocab_size(self) -> int:
        """wte's rows in the parameter layout and the logits' width: vocab_size rounded up to VOCAB_ALIGN. Only
        the first vocab_size are tokens; the Hugging Face files hold those alone."""
        return -(-self.vocab_size // VOCAB_ALIGN) * VOCAB_ALIGN


# name -> (n_layer, n_head, n_embd, n_ctx). gpt2-124m and up are OpenAI's GPT-2 sizes.
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 4, 64, 128),          # trains on a CPU in seconds: the tests' model
    "mini": (4, 4, 128, 256),         # a CPU run of minutes that writes readable text
    "small": (6, 6, 384, 256),        # nanoGPT's Shakespeare size
    "gpt2-124m": (12, 12, 768, 1024),
    "gpt2-350m": (24, 16, 1024, 1024),
    "gpt2-774m": (36, 20, 1280, 1024),
}


GPT2_VOCAB_SIZE = 50257  # GPT-2's tokenizer: what the benchmarks size the classifier by


def model_config(preset: str, vocab_size: int, option: str = "--model") -> GPTConfig:
    """The shape of model `preset`; `option` names where it came from in the line that refuses it."""
    if preset not in PRESETS:
        raise XtrainError(must_be(option, one_of(PRESETS), preset))
    n_layer, n_head, n_embd, n_ctx = PRESETS[preset]
    return GPTConfig(vocab_size=vocab_size, n_ctx=n_ctx, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


@dataclass
class TrainConfig:
    """Everything one run needs; the command line fills it and every rank reads it."""

    steps: int
    batch: int                  # sequences per optimizer step, summed over all ranks
    seq: int                    # tokens per sequence
    tokenizer: str = ""
    corpus: str = ""
    model: str = "tiny"
    backend: str = "numpy"      # numpy | cuda
    world_size: int = 1
    tp: int = 1                 # tensor-parallel ranks per model (parallel/tensor.py); world = pp x dp x tp
    pp: int = 1                 # pipeline stages per model (parallel/pipeline.py)
    pp_schedule: str = "1f1b"   # gpipe | 1f1b
    tp_classifier: str = "vocab"  # vocab | replicated: wte and the classifier cut over --tp by rows, or whole
    sequence_parallel: bool = False  # with --tp: the residual stream and the layernorms cut over the group by tokens
    seed: int = 1337
    overfit_batch: bool = False     # every step trains on the first global batch (llm.c's -a): a sanity check
    # AdamW and the schedule (nanoGPT's defaults, lr for small models)
    lr: float = 1e-3
    min_lr: float | None = None     # default lr / 10
    warmup_steps: int | None = None  # default lr_decay_steps // 20, at least 1
    lr_decay_steps: int | None = None  # default steps: the decay ends here
    lr_schedule: str = "cosine"     # after warmup: cosine | linear | constant | wsd (optim.lr_at)
    cooldown_steps: int | None = None  # wsd: the decay's length, ending at lr_decay_steps (default a fifth)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # data parallelism
    comm_timeout_s: float = 300.0   # a rank waiting longer than this in a collective fails the run
    cpu_threads: int | None = None  # BLAS and op threads per rank (numpy backend); default 1
    tf32: bool = False              # cuda backend: TF32 tensor-core matmuls (fp32 storage)
    matmul: str = "auto"            # cuda backend: cublas | cublaslt, the library of products with a bias;
                                    # auto: cublas on numpy, the fastest measured on cuda (backend/cuda/defaults.py)
    cuda_graph: str = "auto"        # cuda backend: auto | off, the step captured and replayed (train/graph.py)
    # processes and launchers (see comm/launch_env.py and comm/world.py); world_size above counts every rank
    # of the job: processes x rank threads per process
    comm: str = "auto"                  # auto | local | mpi | tcp | nccl
    rdzv_bind: str | None = None        # HOST[:PORT] rank 0's rendezvous listens on (default: the advertised one)
    rdzv_advertise: str | None = None   # HOST:PORT the other processes connect to (default MASTER_ADDR:MASTER_PORT)
    rdzv_timeout_s: float = 300.0       # how long processes wait for each other at the start
    # ---- gradient sync strategies, compression, ZeRO-1, accumulation (parallel/ddp.py, parallel/zero.py) ----
    grad_sync: str = "bucketed"     # per-param | flat | bucketed
    bucket_mb: float = 25.0         # bucketed: MiB per bucket, like torch DDP's bucket_cap_mb
    grad_compress: str = "none"     # none | bf16 | powersgd: bf16 rounding, or low-rank factors (parallel/powersgd.py)
    powersgd_rank: int = 1          # powersgd: the rank R of each matrix's P Q^T (PyTorch's default)
    powersgd_start_step: int = 100  # powersgd: steps all-reduced uncompressed before compression starts
    comm_priority: str = "auto"     # auto | realtime | normal: the communication threads' scheduling priority
    zero: int = 0                   # 1: optimizer state sharded over the ranks; 2: gradients too; 3: parameters too
    zero3_prefetch: int = 1         # --zero 3: pass steps whose parameters are gathered ahead of the one running
    grad_accum: int = 1             # micro-batches per optimizer step; communication after the last
    all_reduce: str = "library"     # library | ring: the communicator's all-reduce, or comm/ring.py's over send/recv
    # ---- precision (precision.py) ----
    dtype: str = "fp32"             # fp32 | bf16: bf16 activations and matmuls, fp32 master weights and grads
    attention: str = "auto"         # standard | flash | cudnn: keep the T x T probabilities, or recompute them
                                    # (model.py); auto: standard on numpy, the fastest measured on cuda
    recompute: int = 0              # 0 | 1 | 2: backward recomputes GELU (1), and the layernorms (2) (model.py)
    dropout: float = 0.0            # Hugging Face GPT-2's three dropouts, Philox masks (backend/dropout.py); 0: off
    # output
    config: str = ""                # the --config file the run's options came from (an input it must not write)
    report: str | None = None
    log_every: int = 1
    profile_step: int = 0           # time every op of this step on each rank (profile.py); 0: none
    # checkpoints, evaluation and metrics (checkpoint/, eval/evaluate.py, train/metrics.py)
    save_dir: str | None = None     # the latest checkpoint lives here, replaced atomically at each save
    save_every: int = 0             # also save every N steps; 0: only at the end
    keep_every: int = 0             # also save every N-th step into a folder of its own, DIR.stepNNNNNN
    resume: str | None = None       # a checkpoint folder to continue from
    init_from: str | None = None    # a GPT-2 folder whose weights the run starts from (fine-tuning)
    eval_every: int = 0             # also evaluate every N steps; 0: only at the end
    eval_batches: int = 0           # held-out batches of BATCH x SEQ per evaluation; 0: none (the CLI's default: 20)
    val_corpus: str = ""            # validation text or token files; "": the corpus's last 10% (corpus.Corpus.load)
    hellaswag: str = ""             # an llm.c eval file: multiple-choice accuracy at each evaluation (eval/hellaswag)
    metrics: str | None = None      # append one JSON line per step here
    tensorboard: str | None = None  # rank 0 writes the same records as TensorBoard event files here
    wandb: str | None = None        # rank 0 logs the same scalars to this Weights & Biases project (train/wandb_log.py)
    sample_every: int = 0           # rank 0 draws text from the model every N steps and at the end; 0: never
    sample_tokens: int = 64         # tokens per draw
    sample_prompt: str = ""         # what the draw continues; "": <|endoftext|> (eval/sample.py)
    extra: dict = field(default_factory=dict)
    # the command line's options as the trainer read them (given, from --config, or defaulted), keyed as a
    # --config file keys them; {} for a TrainConfig made in code. What options_toml() writes.
    options: dict = field(default_factory=dict)

    def resolved(self) -> "TrainConfig":
        """A copy with every derived default filled in."""
        cfg = TrainConfig(**asdict(self))
        if cfg.lr_decay_steps is None:
            cfg.lr_decay_steps = cfg.steps
        if cfg.min_lr is None:
            cfg.min_lr = cfg.lr / 10
        if cfg.warmup_steps is None:
            cfg.warmup_steps = max(1, cfg.lr_decay_steps // 20)
        if cfg.cooldown_steps is None and cfg.lr_schedule == "wsd":
            cfg.cooldown_steps = max(1, cfg.lr_decay_steps // 5)
        if cfg.backend != "cuda":  # numpy's only paths; on cuda, auto is the GPU's choice (train/preflight.py)
            cfg.attention = "standard" if cfg.attention == "auto" else cfg.attention
            cfg.matmul = "cublas" if cfg.matmul == "auto" else cfg.matmul
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)

    def options_toml(self) -> str:
        """The run's configuration as a --config file: `--config` of it runs the same run again, from step 1.
        --resume is where the run started, not part of what it is: a key would make the replay continue
        that checkpoint (or stop, "already at step N"), so it is written as a comment."""
        options = {key: value for key, value in self.options.items() if key != "resume"}
        comment = RUN_CONFIG_COMMENT
        if "resume" in self.options:
            comment += (f"\nThe run was started with --resume {self.options['resume']!r}, left out here: this file "
                        "replays it from step 1.")
        return config_file.dumps(options, comment=comment)


RUN_CONFIG_COMMENT = """The configuration of a training run, every option as the run used it.
xtrain-train --config THIS_FILE runs it again; options on the command line override what is here.
Relative paths are relative to the folder the command is run in."""
