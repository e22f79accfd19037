"""Where every parameter of GPT-2 lives: the flat layout of the parameter and gradient buffers, at every
tensor-parallel and pipeline cut, and the initial weights.

Flat layout. Every parameter is a named view into `params`, its gradient the same view into `grads`.
They are laid out in the order backward *finishes* them: ln_f, then the blocks from last to first,
then wpe and wte (wte last because the tied classifier adds to its gradient at the very start of
backward and the embedding at the very end). So the finished gradients always form a prefix
grads[:ready] that grows as backward runs, and every bucket of an overlapped all-reduce is one
contiguous slice. Offsets are aligned to ALIGN elements (zero padding between parameters), which
keeps every float32 view 128-byte aligned (the bf16 copy's views 64-byte) for vectorised kernels and cuBLAS.

Padded vocabulary. wte holds config.padded_vocab_size rows (50304 for GPT-2's 50257), so the logits are
(B, T, Vp) and the classifier's products run at a width cuBLAS tiles whole. Rows V..Vp-1 are no token's:
they start at zero, the classifier gives their logit columns exactly zero gradient and no token id reaches
them in the embedding, so their gradient is zero, AdamW's m and v stay zero and the update (weight decay
included) leaves them at zero, bit for bit. They are the last rows of the last parameter, so the Hugging Face
tensors (V rows: `state_dict`) are a prefix of wte's view and the layout before them is unchanged.

Cuts. With --tp N each tensor's `split` says how a tensor-parallel rank's shard is cut from it (by heads, columns,
rows or vocabulary rows; model.py says what the ranks then compute), and param_layout(config, tp) is one rank's
layout of its shards, in the same order; with --pp M, param_layout(config, pp=M, stage=s) is stage s's: its
blocks, wpe and wte on the first stage, ln_f and wte again on the last. shard_flat and join_flats (join_stages)
go between the full layout, which checkpoints hold, and a rank's.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .command import must_be
from .config import GPTConfig
from .errors import XtrainError

ALIGN = 32  # elements; 128 bytes of float32
WTE = "transformer.wte.weight"
WPE = "transformer.wpe.weight"
INIT_STD = 0.02


@dataclass(frozen=True)
class ParamSpec:
    name: str                 # Hugging Face GPT2LMHeadModel name, e.g. "transformer.h.0.attn.c_attn.weight"
    shape: tuple[int, ...]
    offset: int               # first element in the flat buffer
    init_std: float | None    # normal(0, std); None: ones for a layernorm weight, zeros otherwise
    decay: bool               # AdamW weight decay applies (matrices and embeddings only)
    rows: int = 0             # the rows that are parameters (wte: V of Vp); the rest, if any, stay zero. 0: all
    split: str = "replicated"  # how --tp cuts the tensor: replicated, column, qkv (columns by heads), row, or
    #                            vocab (wte's rows, vocab_rows each: the last rank's may run past Vp)

    def __post_init__(self):
        if not self.rows:
            object.__setattr__(self, "rows", self.shape[0])

    @property
    def size(self) -> int:
        """Elements in the layout, padded rows included."""
        return int(np.prod(self.shape))

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape in the Hugging Face files: the rows that are parameters."""
        return (self.rows, *self.shape[1:])

    @property
    def hf_size(self) -> int:
        """Elements that are parameters: the first hf_size of the view (padded rows come last)."""
        return int(np.prod(self.hf_shape))


def block_params(config: GPTConfig, tp: int = 1):
    """(suffix, shape, init_std, split) of one transformer block, in the order backward finishes them; the
    shapes are one tensor-parallel rank's shards of a group of tp ranks."""
    C = config.n_embd
    # GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2 n_layer)
    proj_std = INIT_STD / np.sqrt(2 * config.n_layer)
    return [
        ("mlp.c_proj.weight", (4 * C // tp, C), proj_std, "row"), ("mlp.c_proj.bias", (C,), None, "replicated"),
        ("mlp.c_fc.weight", (C, 4 * C // tp), INIT_STD, "column"), ("mlp.c_fc.bias", (4 * C // tp,), None, "column"),
        ("ln_2.weight", (C,), None, "replicated"), ("ln_2.bias", (C,), None, "replicated"),
        ("attn.c_proj.weight", (C // tp, C), proj_std, "row"), ("attn.c_proj.bias", (C,), None, "replicated"),
        ("attn.c_attn.weight", (C, 3 * C // tp), INIT_STD, "qkv"), ("attn.c_attn.bias", (3 * C // tp,), None, "qkv"),
        ("ln_1.weight", (C,), None, "replicated"), ("ln_1.bias", (C,), None, "replicated"),
    ]


BLOCK_HALVES = ("mlp", "attn")  # in the order backward finishes them


def block_half(name: str) -> tuple[int, str] | None:
    """(block, half) of a parameter named transformer.h.<block>.<...>, None for any other: "mlp" for mlp.c_proj,
    mlp.c_fc and ln_2, "attn" for attn.c_proj, attn.c_attn and ln_1. Each half is a contiguous run of
    block_params' order, finished by backward as a whole: the pieces the overlapped sync announces
    (GPT2.grad_ready_ranges) and the units ZeRO-2 and -3 gather and reduce-scatter (parallel/zero.param_units)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["transformer", "h"]:
        return None
    return int(parts[2]), "mlp" if parts[3] in ("mlp", "ln_2") else "attn"


def check_tp(config: GPTConfig, tp: int) -> None:
    """A tensor-parallel group of tp ranks splits the heads (and with them C and 4C) evenly."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or config.n_head % tp:
        # NH divisible by tp makes C and 4C so too: C is NH heads of C/NH channels
        raise XtrainError(must_be("--tp", f"a divisor of the model's {config.n_head} heads", tp))


def vocab_rows(config: GPTConfig, tp: int) -> int:
    """The rows of wte (the classifier's columns) each of tp ranks holds under the vocabulary-parallel split: the
    padded vocabulary cut evenly, rounded up where tp does not divide it."""
    return -(-config.padded_vocab_size // tp)


def check_pp(config: GPTConfig, pp: int) -> None:
    """A pipeline of pp stages gives every stage one block at least."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or pp > config.n_layer:
        raise XtrainError(must_be("--pp", f"at most the model's {config.n_layer} layers", pp))


def stage_blocks(n_layer: int, pp: int, stage: int) -> range:
    """The blocks stage `stage` of a pipeline of pp runs: n_layer cut into pp contiguous runs as even as
    can be, the n_layer % pp extra blocks on the first stages (the last one also runs the classifier)."""
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_of(name: str, config: GPTConfig, pp: int) -> int:
    """The stage that holds a parameter (by its Hugging Face name); for wte, which the last stage holds too
    (the tied classifier), the first."""
    parts = name.split(".")
    if parts[1] == "h":
        layer = int(parts[2])
        return next(s for s in range(pp) if layer in stage_blocks(config.n_layer, pp, s))
    return pp - 1 if parts[1] == "ln_f" else 0


def param_layout(config: GPTConfig, tp: int = 1, pp: int = 1, stage: int = 0,
                 vocab_parallel: bool = True) -> tuple[list[ParamSpec], int]:
    """The flat layout: every parameter's spec, and the total number of elements (padding included). With
    tp > 1, that of one rank of a tensor-parallel group of tp: its shards, in the same order (wte's vocab_rows
    rows, or all of them where not vocab_parallel). With pp > 1,
    that of pipeline stage `stage`: its blocks, with wpe and wte on the first stage and ln_f and wte (the
    tied classifier's copy) on the last, in the same order."""
    check_tp(config, tp)
    check_pp(config, pp)
    first, last, blocks = stage == 0, stage == pp - 1, stage_blocks(config.n_layer, pp, stage)
    C = config.n_embd
    entries = [("transformer.ln_f.weight", (C,), None, "replicated"),
               ("transformer.ln_f.bias", (C,), None, "replicated")] if last else []
    for layer in reversed(blocks):
        entries += [(f"transformer.h.{layer}.{suffix}", *rest) for suffix, *rest in block_params(config, tp)]
    entries = [(name, shape, std, 0, split) for name, shape, std, split in entries]
    entries += [(WPE, (config.n_ctx, C), INIT_STD, 0, "replicated")] if first else []
    if first or last:
        entries += [(WTE, (vocab_rows(config, tp), C), INIT_STD, 0, "vocab") if tp > 1 and vocab_parallel else
                    (WTE, (config.padded_vocab_size, C), INIT_STD, config.vocab_size, "replicated")]
    specs, offset = [], 0
    for name, shape, std, rows, split in entries:
        specs.append(ParamSpec(name, shape, offset, std, decay=len(shape) == 2, rows=rows, split=split))
        offset += -(-int(np.prod(shape)) // ALIGN) * ALIGN
    return specs, offset


def _column_groups(split: str) -> int:
    """How many blocks of columns a column split cuts each of: c_attn's q, k and v are cut alike (by heads)."""
    return 3 if split == "qkv" else 1


def shard_tensor(full: np.ndarray, split: str, tp: int, index: int) -> np.ndarray:
    """Rank `index`'s shard of a full tensor (Conv1D's (in, out) layout) in a tensor-parallel group of tp."""
    if split == "replicated":
        return full
    if split == "vocab":  # rows of a last shard that run past the tensor's are zero padding
        rows = -(-full.shape[0] // tp)
        shard = np.zeros((rows, *full.shape[1:]), dtype=full.dtype)
        mine = full[index * rows: (index + 1) * rows]
        shard[:len(mine)] = mine
        return shard
    if split == "row":
        rows = full.shape[0] // tp
        return full[index * rows: (index + 1) * rows]
    grouped = full.reshape(*full.shape[:-1], _column_groups(split), -1)
    width = grouped.shape[-1] // tp
    return grouped[..., index * width: (index + 1) * width].reshape(*full.shape[:-1], -1)


def join_shards(shards: list[np.ndarray], split: str) -> np.ndarray:
    """The full tensor from every rank's shard, in rank order: shard_tensor undone (a vocab split's rows past the
    full tensor's, padding, left for the caller to cut)."""
    if split == "replicated":
        return shards[0]
    if split in ("row", "vocab"):
        return np.concatenate(shards, axis=0)
    groups = _column_groups(split)
    grouped = [s.reshape(*s.shape[:-1], groups, -1) for s in shards]
    return np.concatenate(grouped, axis=-1).reshape(*shards[0].shape[:-1], -1)


def shard_flat(full: np.ndarray, config: GPTConfig, tp: int, index: int, size: int | None = None, pp: int = 1,
               stage: int = 0, vocab_parallel: bool = True) -> np.ndarray:
    """A flat buffer of the full layout (parameters, or AdamW's m or v) as rank `index` of a tensor-parallel
    group of tp, on pipeline stage `stage` of pp, holds it: its shards in param_layout(config, tp, pp, stage),
    zero-padded to `size` elements."""
    specs, total = param_layout(config, tp, pp, stage, vocab_parallel)
    full_specs = {f.name: f for f in param_layout(config)[0]}
    out = np.zeros(size or total, dtype=full.dtype)
    for s in specs:
        f = full_specs[s.name]
        tensor = full[f.offset: f.offset + f.size].reshape(f.shape)
        out[s.offset: s.offset + s.size] = shard_tensor(tensor, s.split, tp, index).reshape(-1)
    return out


def join_flats(flats: list[np.ndarray], config: GPTConfig, pp: int = 1, stage: int = 0,
               vocab_parallel: bool = True) -> np.ndarray:
    """The full layout's flat buffer from every tensor-parallel rank's of one pipeline stage, in rank order:
    shard_flat undone. The tensors of other stages stay zero."""
    specs, _ = param_layout(config, len(flats), pp, stage, vocab_parallel)
    full_specs, total = param_layout(config)
    full_specs = {f.name: f for f in full_specs}
    out = np.zeros(total, dtype=flats[0].dtype)
    for s in specs:
        f = full_specs[s.name]
        shards = [flat[s.offset: s.offset + s.size].reshape(s.shape) for flat in flats]
        out[f.offset: f.offset + f.size] = join_shards(shards, s.split).reshape(-1)[:f.size]
    return out


def join_stages(stage_flats: list[np.ndarray], config: GPTConfig) -> np.ndarray:
    """The full layout's flat buffer from every pipeline stage's join_flats, in stage order: each tensor
    from the stage that holds it (wte from the first, whose copy the last stage's equals)."""
    pp = len(stage_flats)
    full_specs, total = param_layout(config)
    out = np.zeros(total, dtype=stage_flats[0].dtype)
    for f in full_specs:
        out[f.offset: f.offset + f.size] = stage_flats[stage_of(f.name, config, pp)][f.offset: f.offset + f.size]
    return out


def count_params(config: GPTConfig) -> int:
    """The model's parameters, as Hugging Face counts them (124,439,808 at GPT-2 124M): wte's padded rows are
    zero and no token's, so they are not counted; the layout (param_layout's total, what memory holds) is larger."""
    return sum(s.hf_size for s in param_layout(config)[0])


def named_views(flat, specs: list[ParamSpec], n_layer: int) -> SimpleNamespace:
    """Attribute access to the views: v.wte, v.ln_f_weight, v.h[l].attn_c_attn_weight, ..."""
    views = SimpleNamespace(h=[SimpleNamespace() for _ in range(n_layer)])
    bind_views(views, flat, specs)
    return views


def bind_views(views: SimpleNamespace, flat, specs: list[ParamSpec], start: int = 0) -> None:
    """Point the views of `specs` at `flat`, a buffer holding the flat layout from element `start` on (ZeRO-3
    binds a block's gathered parameters so, ZeRO-2 and -3 its gradient buffer); flat None unbinds them."""
    for s in specs:
        view = None if flat is None else flat[s.offset - start: s.offset - start + s.size].reshape(s.shape)
        parts = s.name.split(".")
        if parts[1] == "h":
            setattr(views.h[int(parts[2])], "_".join(parts[3:]), view)
        else:
            setattr(views, "_".join(parts[1:-1]) if parts[1] in ("wte", "wpe") else "_".join(parts[1:]), view)


def init_weights(config: GPTConfig, seed: int) -> np.ndarray:
    """The initial flat parameters on the host: normal draws from PCG64(seed) in layout order.

    Same seed, same bits, on every rank and for every backend (the device gets a copy of this). wte's
    padded rows are not drawn: they start at zero, and the draws are those of an unpadded layout."""
    specs, total = param_layout(config)
    flat = np.zeros(total, dtype=np.float32)
    rng = np.random.Generator(np.random.PCG64(seed))
    for s in specs:
        view = flat[s.offset: s.offset + s.hf_size]
        if s.init_std is not None:
            view[:] = rng.standard_normal(s.hf_size, dtype=np.float32) * np.float32(s.init_std)
        elif s.name.endswith(".weight"):  # the only weights without a std are layernorm gains
            view[:] = 1.0
    return flat
