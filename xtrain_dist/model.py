"""GPT-2 (Hugging Face GPT2LMHeadModel semantics) over one flat parameter buffer and one flat gradient buffer.

Learned positions, pre-LayerNorm blocks, tanh GELU, biases everywhere, output projection tied to the
token embedding. The forward and backward passes are written out op by op against a backend
(numpy_ops or cuda/ops.py), so the same code runs on both and never branches on which it has.

The flat buffers' layout (which parameter lives where, in which order, at every cut) is layout.py's.

Tensor parallelism (--tp N, Megatron-LM's split of a block). The N ranks of a tensor-parallel group each hold
a shard of every block's four matrices: c_attn by heads (rank r holds heads r*NH/N .. (r+1)*NH/N - 1, their q,
k and v columns and biases), c_fc by columns ("column"), and the two c_proj by rows ("row"), so attention
runs on the rank's own heads and the MLP on its own quarter-width columns. A row-parallel product gives each
rank a partial sum of the (B, T, C) output, which one all-reduce over the group completes (Megatron's g);
in backward a column-parallel product gives a partial sum of its input's gradient, completed the same way
before the layernorm below it reads it (Megatron's f). Everything else is replicated: layernorms, the
row-parallel biases and wpe. wte, with the tied classifier, is split over the vocabulary (Megatron's
vocabulary-parallel embedding and cross-entropy; vocab_parallel=False, --tp-classifier replicated, keeps it whole
on every rank instead): rank r holds rows r*R .. (r+1)*R - 1 of the padded vocabulary, R = ceil(Vp / N)
(vocab_rows; Vp / N where N divides Vp, as it does GPT-2's 50304 = 2^7 x 3 x 131 for every N dividing 12 heads;
elsewhere the last rank's rows past Vp are more padding, zero and no token's, which no checkpoint holds). The
embedding is looked up on the rank that holds each token's row (the others give zeros) and completed by one
all-reduce of (B, T, C). Each rank's logits are its R columns (B, T, R); the cross-entropy comes from each row's
largest logit over the group (an all-gather of the ranks' (B, T) maxima, whose largest every rank takes), then
one all-reduce of (2, B, T): the sums of exp(logit - max) and the target's shifted logit, which the rank holding
its column gives. Each rank turns its own columns into their gradient from those, so no rank holds the whole
(B, T, Vp) logits or their gradient; the classifier's input gradient, a partial sum over the rank's columns, is
completed by one more all-reduce (Megatron's f), and wte's gradient stays with its shard. Sampling, which draws
from every token's probability, all-gathers the logits of the positions it runs (forward without targets).
Replicated parameters get equal gradients on every rank of the group by construction: each is computed from
tensors that are bitwise equal there (the residual stream after each all-reduce, and its gradient after each), by
the same ops in the same order. The layout's `split` says how each tensor is cut; the flat buffers hold the
rank's shards (shard_flat), and checkpoints join them back into the full tensors (join_flats).

Sequence parallelism (--sequence-parallel, with --tp; Korthikanti et al. 2022, Megatron-LM's). What tensor
parallelism leaves whole on every rank of the group (the residual stream, the layernorms' inputs and outputs, the
residual adds, dropout on the residual branches and the embeddings) is cut by tokens instead: rank r holds rows
r*S .. (r+1)*S - 1 of the micro-batch's B*T tokens (flattened in (b, t) order, S = B*T/N), an (S, C) slice. Before
a column-parallel product the slice is all-gathered into the whole (B, T, C) (Megatron's g), and a row-parallel
product's partial sums are reduce-scattered into the rank's slice instead of all-reduced (g-bar); backward is the
conjugate: the gradient reaching a row-parallel output is all-gathered, a column-parallel product's partial input
gradient reduce-scattered. An all-reduce is a reduce-scatter and an all-gather, so these move its bytes; and every
activation a rank keeps for backward is 1/N of it: the layernorms' outputs are kept as slices and all-gathered again
in backward for the products' weight gradients (two more all-gathers a block). The layernorms' weight and bias
gradients are then partial sums over the rank's tokens, all-reduced over the group as each layernorm's backward
ends (before the block's gradients are announced to the data-parallel sync). The row-parallel biases' gradients
come from the gathered (whole) output gradient, equal on every rank as without the cut. Dropout's masks are keyed by
each element's global place (backend/dropout.py), so a slice's elements draw the bits they draw whole. The
vocabulary-parallel embedding reduce-scatters its sum; the replicated one keeps the rank's slice (its gradient is
all-gathered back). The head all-gathers ln_f's output; the vocabulary-parallel classifier's input gradient is
reduce-scattered, the replicated one's (whole on every rank) sliced. A forward whose tokens do not divide by N
(generation with a key-value cache, HellaSwag's rows) runs without the cut: the same function.

Pipeline parallelism (--pp M). The n_layer blocks are cut into M contiguous stages (stage_blocks: as even as can
be, the extra blocks on the first stages, since the last one also runs the classifier); a rank holds its stage's
blocks, the first stage also wpe and wte (the embedding) and the last ln_f and wte again (the tied classifier).
Its layout is the full one's order with the other stages' tensors left out. stage_forward runs one micro-batch
through the stage's part (embed on the first stage, the blocks, the head on the last) and returns the tape
stage_backward needs, so a stage can hold several micro-batches at once (1F1B); between stages goes the
residual stream (B, T, C) forward and its gradient back. A stage before the last ends with the residual sum
alone, whose layernorm (the next block's ln_1) the next stage runs: residual_layernorm_forward is that sum
and that layernorm, so the stages compute what one rank does. The two copies of wte are one parameter: after
the data-parallel sync each of the two stages adds the other's gradient to its own (sum_tied_embedding_grads,
Megatron's embedding group), the same bits on both, so AdamW keeps them equal. Checkpoints gather every
stage's tensors into the full layout.

Precision. `params` holds the float32 master weights, which the optimizer updates and checkpoints
save. Forward and backward read `params_lowp`, the same layout in the backend's activation dtype:
`params` itself under fp32, a bfloat16 copy under bf16 that AdamW rewrites in the pass that updates
`params` (see precision.py). `grads` is float32 in both.
"""

import math
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from .backend.dropout import ATTENTION_OUT, ATTENTION_PROBS, EMBEDDINGS, MLP_OUT, DropoutSite, check_dropout
from .command import must_be, one_of
from .config import GPTConfig
from .errors import XtrainError
from .layout import (
    WTE,
    block_half,
    count_params,
    init_weights,
    join_flats,
    join_stages,
    named_views,
    param_layout,
    shard_flat,
    stage_blocks,
    vocab_rows,
)

# flash and cudnn run the same ops (flash_attention_forward/backward): ours or cuDNN's kernels under them,
# which the CUDA backend is told (get_backend(attention=)); numpy_ops' flash attention is the oracle of both
ATTENTIONS = ("standard", "flash", "cudnn")
FLASH_LIKE = ("flash", "cudnn")


def check_attention(attention: str) -> str:
    if attention not in ATTENTIONS:
        raise XtrainError(must_be("--attention", one_of(ATTENTIONS), attention))
    return attention


def check_dropout_attention(dropout: float, attention: str) -> None:
    """Dropout of attention's probabilities needs them: the standard attention holds them, the fused flash
    kernels never do (each tile's probabilities live in registers), so --attention flash takes no --dropout."""
    if dropout and attention != "standard":
        raise XtrainError(f"--dropout {dropout:g} needs --attention standard: --attention {attention} fuses the "
                          "softmax into its kernels and keeps no probabilities to drop")


# What backward recomputes instead of forward keeping it (llm.c's -r): 0 nothing; 1 each block's GELU output,
# the largest activation after attention's probabilities (B*T*4C); 2 also the two layernorm outputs
# (2 B*T*C), from the layernorm's input, which is kept anyway. The same op on the same input gives the same
# bits, so a run's parameters do not depend on the level: only its memory and its time do. One exception:
# with --matmul cublaslt in bf16, level 0 runs c_fc's GELU in the product's epilogue, on the float32 sum
# before its rounding, which backward cannot run again without the product; levels 1 and 2 run the GELU
# kernel on the stored sum, forward and backward, so their bits are each other's and a rounding off level 0's.
RECOMPUTE_LEVELS = (0, 1, 2)


def check_recompute(level: int) -> int:
    if level not in RECOMPUTE_LEVELS:
        raise XtrainError(must_be("--recompute", one_of(RECOMPUTE_LEVELS), level))
    return level


@dataclass
class _LayerActs:
    """What one block's backward needs from its forward; None where --recompute has backward make it again."""
    x_in: object
    ln1: object       # None under recompute 2
    ln1_mean: object
    ln1_rstd: object
    qkv: object
    atty: object
    att: object       # the softmax probabilities (standard attention) or each row's log-sum-exp (flash)
    x_mid: object
    ln2: object       # None under recompute 2
    ln2_mean: object
    ln2_rstd: object
    fch: object
    fch_gelu: object  # None under recompute >= 1


class Tape(NamedTuple):
    """What one micro-batch's backward on this stage needs from its forward: stage_forward returns it and
    stage_backward takes it, so a pipeline stage can hold several micro-batches in flight (1F1B). The head's
    part (lnf .. dlogits) is None on a pipeline stage before the last."""
    ids: object       # (B, T) int32: the embedding's backward reads them on the first stage
    acts: list        # _LayerActs of each of the stage's blocks, in order
    x: object         # the residual stream after the stage's last block
    lnf: object
    lnf_mean: object
    lnf_rstd: object
    dlogits: object   # the logits, turned into their gradient by the fused classifier
    rows: tuple | None = None  # dropout: (seq0, seq_stride), the micro-batch's sequences in the global batch


class KVCache:
    """The keys and values of every position a generation has run, layer by layer, so that each new
    token runs the blocks for itself alone, its query attending over the cached keys (eval/sample.py).

    Written with the backend's array module (numpy, or CuPy's cuBLAS products and elementwise kernels)
    rather than kernels of its own: it serves sampling, not the training step. Scores and softmax are
    float32, as attention_forward computes them, so a cached forward gives the logits of a full one
    to float32 rounding. It holds up to n_ctx positions; past them a generation runs full forwards."""

    def __init__(self, model: "GPT2", batch: int):
        c, xp = model.config, model.ops.xp
        # a tensor-parallel rank caches its own heads; a pipeline stage fills only its own blocks' layers
        shape = (c.n_layer, batch, c.n_head // model.tp_size, c.n_ctx, c.n_embd // c.n_head)
        self.keys = xp.zeros(shape, dtype=model.act_dtype)
        self.values = xp.zeros(shape, dtype=model.act_dtype)
        self.length = 0  # positions cached, in every layer
        self.xp = xp

    def attention(self, layer: int, qkv, n_head: int):
        """Causal attention of n new positions (qkv (B, n, 3C), positions length .. length + n - 1) over
        the cached ones and themselves, after caching their keys and values. -> (B, n, C)"""
        xp = self.xp
        B, n, C3 = qkv.shape
        hs = C3 // 3 // n_head
        q, k, v = qkv.reshape(B, n, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # each (B, NH, n, hs)
        start, end = self.length, self.length + n
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        keys = self.keys[layer, :, :, :end].astype(xp.float32)
        scores = (q.astype(xp.float32) @ keys.transpose(0, 1, 3, 2)) * xp.float32(1.0 / np.sqrt(hs))
        # query i is position start + i: it sees keys 0 .. start + i
        future = xp.arange(end)[None, :] > (start + xp.arange(n))[:, None]
        scores = xp.where(future, -xp.inf, scores)
        e = xp.exp(scores - scores.max(axis=-1, keepdims=True))
        y = (e / e.sum(axis=-1, keepdims=True)) @ self.values[layer, :, :, :end].astype(xp.float32)
        return y.transpose(0, 2, 1, 3).reshape(B, n, C3 // 3).astype(qkv.dtype)


class WholeBuffers:
    """The passes' parameters and gradients are views of the whole flat buffers, bound once: nothing to do at a
    block's start (ZeRO-0 and -1; parallel/zero.py's ZeRO-2 and -3 stages are the other `units`)."""

    # whether every rank of the data-parallel group must run each forward together (ZeRO-3 gathers the
    # parameters of each block from all of them): evaluation and sampling then run on every rank alike
    forward_is_collective = False

    # whether backward takes the tied classifier's wte gradient at the embedding's backward rather than at the
    # head's (the same product, later: ZeRO-2 and -3 then keep no wte gradient buffer through the blocks)
    wte_grad_at_end = False

    def before_forward(self, step) -> None:
        """step: "embed", ("attn", i) or ("mlp", i) (block i's halves: the MLP's from the residual sum with ln_2
        on) or "head", about to run forward."""

    def before_backward(self, step) -> None:
        """step: "head", ("mlp", i), ("attn", i) (block i's halves, from its ln_2's backward on the attention's)
        or "embed", about to run backward."""

    def forward_done(self) -> None:
        """A forward that keeps nothing for backward (evaluation, generation) has ended."""


class GPT2:
    """A GPT-2 whose parameters and gradients each live in one flat float32 buffer on the backend, with
    the parameters also in the activation dtype (`params_lowp`) when that is not float32."""

    def __init__(self, config: GPTConfig, backend, seed: int = 0, pad_to_multiple: int = 1, dtype=np.float32,
                 attention: str = "standard", recompute: int = 0, init: np.ndarray | None = None, tp=None,
                 pp=None, dropout: float = 0.0, vocab_parallel: bool = True, sequence_parallel: bool = False):
        """init: the initial parameters init_weights(config, seed) would draw, already drawn (a benchmark building
        many models of one seed draws them once: 3.4 s at GPT-2 124M); by default they are drawn here.
        tp: the communicator of this rank's tensor-parallel group (comm/mesh.py's mesh.tp), or None: the
        model holds the rank's shards and its passes all-reduce over the group (see the module's notes).
        pp: the communicator of this rank's pipeline group (mesh.pp), or None: the model holds its stage's
        blocks (stage_blocks), the embeddings on the first stage, ln_f and the tied classifier on the last, and
        runs them with stage_forward and stage_backward (see the module's notes).
        dropout: Hugging Face GPT-2's dropout probability (embeddings, attention probabilities, residual
        branches), applied in a training forward (stage_forward given `rows`) with masks keyed by seed,
        step, layer and each element's global index (backend/dropout.py); 0: none.
        vocab_parallel: with tp, wte (and the tied classifier) cut over the group by the vocabulary; False: whole
        on every rank (see the module's notes).
        sequence_parallel: with tp, the residual stream and the layernorms cut over the group by tokens (see the
        module's notes)."""
        check_attention(attention)
        self.dropout_p = check_dropout(dropout)
        check_dropout_attention(self.dropout_p, attention)
        self.seed = seed
        self.config = config
        self.ops = backend
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.tp_size, self.tp_rank = (tp.world_size, tp.rank) if self.tp is not None else (1, 0)
        self.pp = pp if pp is not None and pp.world_size > 1 else None
        self.pp_size, self.stage = (pp.world_size, pp.rank) if self.pp is not None else (1, 0)
        self.is_first, self.is_last = self.stage == 0, self.stage == self.pp_size - 1
        self.blocks = stage_blocks(config.n_layer, self.pp_size, self.stage)  # the blocks this rank runs
        self.n_head = config.n_head // self.tp_size  # the heads this rank attends with
        self.vocab_parallel = vocab_parallel and self.tp is not None
        self.sequence_parallel = sequence_parallel and self.tp is not None
        if self.vocab_parallel and not hasattr(backend, "vocab_max"):
            raise XtrainError(f"the vocabulary-parallel classifier has no ops on the {backend.name} backend yet: "
                              "use --tp-classifier replicated")
        # the first row of wte (the first logit column) this rank holds: vocab_parallel's shard starts there
        self.vocab_row0 = self.tp_rank * vocab_rows(config, self.tp_size) if self.vocab_parallel else 0
        self.full_size = param_layout(config)[1]  # of the full layout, which checkpoints hold
        # standard: attention keeps its (B, NH, T, T) probabilities for backward; flash (and cudnn): only a
        # log-sum-exp per row, and backward recomputes them (the same function, less memory and traffic)
        self.attention = attention
        self.recompute = check_recompute(recompute)  # see RECOMPUTE_LEVELS
        self.layout, used = param_layout(config, self.tp_size, self.pp_size, self.stage, self.vocab_parallel)
        # a caller that shards the buffers (ZeRO) may ask for a total divisible by the world size
        self.size = -(-used // pad_to_multiple) * pad_to_multiple
        self.num_params = count_params(config)  # without wte's padded rows; self.size counts them
        xp = backend.xp
        # dtype float64 is for the numpy gradient checks; training is float32
        host = np.zeros(self.size, dtype=dtype)
        full = init_weights(config, seed) if init is None else init[:self.full_size]
        # every rank draws the full model and keeps its shards: the same model at any --tp
        host[:used] = shard_flat(full, config, self.tp_size, self.tp_rank, pp=self.pp_size, stage=self.stage,
                                 vocab_parallel=self.vocab_parallel) if self.split_over_ranks else full
        self.params = backend.from_host(host)
        # what forward and backward read: params itself, or its copy in the activation dtype (float64 values
        # rounded to bf16 in a float64 check: the numpy emulation computing in float64)
        lowp_dtype = backend.act_dtype if host.dtype == np.float32 else host.dtype
        self.params_lowp = self.params if backend.dtype == "fp32" else xp.empty(self.size, dtype=lowp_dtype)
        self.act_dtype = self.params_lowp.dtype  # what forward and backward read the parameters in
        self.refresh_lowp()
        self.grads = xp.zeros(self.size, dtype=host.dtype)
        mask = np.zeros(self.size, dtype=np.uint8)
        for s in self.layout:
            mask[s.offset: s.offset + s.size] = s.decay
        self.decay_mask = backend.from_host(mask)
        self.p = named_views(self.params_lowp, self.layout, config.n_layer)  # the weights the passes read
        self.g = named_views(self.grads, self.layout, config.n_layer)
        self._saved = None  # forward's tape, for backward() without one
        # the optimizer step dropout's masks are drawn for (the loop sets it, set_dropout_step): in memory on the
        # backend, so a step captured as a CUDA graph reads each replay's number
        self.dropout_step = xp.zeros(1, dtype=np.uint32)
        # where the passes' parameters and gradients come from: the whole flat buffers, or a ZeRO-2/3 stage
        # (parallel/zero.py) that binds a block's views before the pass needs them (before_forward,
        # before_backward) and takes its gradients once backward announces them final
        self.units = WholeBuffers()

    @property
    def split_over_ranks(self) -> bool:
        """Whether this rank holds part of the model only (tensor-parallel shards, or a pipeline stage)."""
        return self.tp is not None or self.pp is not None

    @property
    def lowp_copy(self):
        """The separate activation-dtype copy of params that the optimizer must keep current, or None
        (fp32: forward reads params itself)."""
        return None if self.params_lowp is self.params else self.params_lowp

    def refresh_lowp(self) -> None:
        """Rewrite params_lowp from params. Whoever writes params other than through the optimizer's
        step (a checkpoint load, ZeRO-1's all-gather, a test) calls this before the next forward."""
        if self.lowp_copy is not None:
            self.ops.lowp_copy(self.params_lowp, self.params)

    @property
    def param_bytes(self) -> int:
        """Memory of the parameters: the float32 master and, under bf16, the copy forward reads (ZeRO-3: the
        rank's float32 shard, parallel/zero.py)."""
        if self.params is None:
            return self.units.param_bytes
        return self.params.nbytes + (self.lowp_copy.nbytes if self.lowp_copy is not None else 0)

    # ---------------------------------------------------------------- the layout, for gradient sync
    def grad_ready_ranges(self) -> list[tuple[int, int]]:
        """[start, end) of the flat buffer that becomes final at each announcement of backward, in order:
        ln_f with the last block's MLP half (c_proj, c_fc, ln_2), that block's attention products (c_proj,
        c_attn: announced once c_attn's weight gradient is in, before the product that gives its input's),
        its ln_1, then each earlier block's three, then both embeddings. layout.block_params lists a block in
        the order backward finishes it, so each is the next piece of a growing prefix. Finer than whole blocks:
        the overlapped sync (parallel/ddp.py) starts on a block's MLP, two thirds of its parameters, while
        backward still runs its attention; and on the first block's attention products while backward still
        runs the product that gives their input's gradient, the last product of the step (its ln_1 and the
        embeddings are all that backward's end makes final). A pipeline stage's: its blocks (ln_f with the
        last stage's last), then what its layout holds after them (the embeddings on the first stage, wte on
        the last, nothing but padding on those between)."""
        ends = self._half_ends()
        products = {block_half(s.name)[0]: s.offset + s.size for s in self.layout
                    if s.name.endswith(".attn.c_attn.bias")}  # each attention's products' last
        bounds = [0] + [end for layer in reversed(self.blocks)
                        for end in (ends[layer, "mlp"], products[layer], ends[layer, "attn"])] + [self.size]
        return list(pairwise(bounds))

    def layer_grad_ranges(self) -> list[tuple[int, int]]:
        """grad_ready_ranges joined a block at a time: ln_f with the last block, one block at a time, then both
        embeddings (PowerSGD's buckets of whole blocks, parallel/ddp.py)."""
        ends = self._half_ends()
        return list(pairwise([0] + [ends[layer, "attn"] for layer in reversed(self.blocks)] + [self.size]))

    def _half_ends(self) -> dict:
        """(block, half) -> where that half's last parameter ends in the flat buffer."""
        return {half: s.offset + s.size for s in self.layout if (half := block_half(s.name))}

    def grad_norm_squared(self, lo: int = 0, hi: int | None = None):
        """The squared norm of the model's gradient in grads[lo:hi] (all of it by default), a (1,) array. With
        tensor parallelism, that of the whole model's tensors there: the shards' squares summed over the
        group and the replicated parameters' (equal on every rank) added once, so every rank of the group
        gets the same bits. (ZeRO-1 asks for its shard's, which every rank of the group cuts alike.) With
        pipeline parallelism, the stages' sums added over the pipeline group, the last stage's copy of wte
        left out (the first stage's counts it), so every stage gets the whole model's."""
        hi = self.size if hi is None else hi
        if not self.split_over_ranks:
            return self.ops.global_norm_squared(self.grads[lo:hi])
        xp = self.ops.xp
        parts = {kind: xp.zeros(1, dtype=self.grads.dtype) for kind in ("sharded", "replicated", "tied copy")}
        for kind, start, end in self._norm_ranges:
            if max(lo, start) < min(hi, end):
                parts[kind] = parts[kind] + self.ops.global_norm_squared(self.grads[max(lo, start):min(hi, end)])
        if self.tp is not None:
            self.tp.all_reduce(parts["sharded"])
        stage = parts["sharded"] + parts["replicated"]
        if self.pp is not None:
            self.pp.all_reduce(stage)
        return stage

    @property
    def _norm_ranges(self) -> list[tuple[str, int, int]]:
        """(kind, lo, hi) runs of the flat buffer whose parameters are all sharded, all replicated, or the
        last pipeline stage's copy of wte (the tied copy, which the norm counts on the first stage only)."""
        runs = []
        for s, end in zip(self.layout, [s.offset for s in self.layout[1:]] + [self.size], strict=True):
            kind = "replicated" if s.split == "replicated" else "sharded"
            if s.name == WTE and not self.is_first:
                kind = "tied copy"
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], end)
            else:
                runs.append((kind, s.offset, end))
        return runs

    # ---------------------------------------------------------------- state in Hugging Face names
    def gather_flat(self, buf) -> np.ndarray:
        """A host copy of a flat buffer of this model's layout (the parameters, AdamW's m or v) in the full
        layout, param_layout(config)'s: with tensor parallelism every rank's shards gathered and joined, with
        pipeline parallelism every stage's tensors (collectives of the groups: every rank of them calls this)."""
        if not self.split_over_ranks:
            return np.array(self.ops.to_host(buf)[:self.full_size])
        xp = self.ops.xp
        if self.tp is None:
            flats = [np.array(self.ops.to_host(buf))]
        else:
            everyone = xp.empty(buf.size * self.tp_size, dtype=buf.dtype)
            self.tp.all_gather(buf, everyone)
            flats = list(np.array(self.ops.to_host(everyone)).reshape(self.tp_size, buf.size))
        stage_flat = join_flats(flats, self.config, self.pp_size, self.stage, self.vocab_parallel)
        if self.pp is None:
            return stage_flat
        stages = xp.empty(stage_flat.size * self.pp_size, dtype=buf.dtype)
        self.pp.all_gather(self.ops.from_host(stage_flat), stages)
        return join_stages(list(np.array(self.ops.to_host(stages)).reshape(self.pp_size, -1)), self.config)

    def shard_flat(self, full: np.ndarray) -> np.ndarray:
        """A host flat buffer of the full layout as this rank holds it: gather_flat undone, self.size long."""
        if not self.split_over_ranks:
            out = np.zeros(self.size, dtype=full.dtype)
            out[:self.full_size] = full[:self.full_size]
            return out
        return shard_flat(full[:self.full_size], self.config, self.tp_size, self.tp_rank, self.size, self.pp_size,
                          self.stage, self.vocab_parallel)

    @property
    def tied_range(self) -> tuple[int, int] | None:
        """[start, end) of wte in this rank's flat buffers, or None where the stage has none."""
        return next(((s.offset, s.offset + s.size) for s in self.layout if s.name == WTE), None)

    def sum_tied_embedding_grads(self) -> None:
        """Pipeline parallelism: the first stage's wte (the embedding) and the last's (the tied classifier) are
        one parameter, so each adds the other's gradient to its own (Megatron's embedding group) before the
        optimizer reads them. a + b and b + a are the same bits, so both copies get the same update and stay
        equal. One sendrecv between the two stages; the stages between them have no wte."""
        if self.pp is None or not (self.is_first or self.is_last):
            return
        peer = self.pp_size - 1 if self.is_first else 0
        other = self.ops.xp.empty_like(self.g.wte)
        self.pp.sendrecv(self.g.wte, peer, other, peer)
        self.g.wte += other

    def state_dict(self, flat: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Host copies of the parameters under GPT2LMHeadModel's names and shapes (lm_head is tied to wte):
        wte's V rows, without the padded ones. The full tensors whatever the tensor parallelism: from
        `flat`, gather_flat(params) already made, or gathered here (a collective of the group)."""
        flat = self.params_flat() if flat is None else flat
        return {s.name: flat[s.offset: s.offset + s.hf_size].reshape(s.hf_shape).copy()
                for s in param_layout(self.config)[0]}

    def full_flat(self, state: dict[str, np.ndarray]) -> np.ndarray:
        """The full layout's flat parameters on the host from tensors in state_dict's names and shapes."""
        host = np.zeros(self.full_size, dtype=(self.params if self.params is not None else self.units.params).dtype)
        for s in param_layout(self.config)[0]:
            host[s.offset: s.offset + s.hf_size] = np.asarray(state[s.name]).reshape(-1)
        return host

    def params_flat(self) -> np.ndarray:
        """A host copy of the parameters in the full layout (a collective of the groups that hold them)."""
        return self.gather_flat(self.params) if self.params is not None else self.units.params_flat()

    def load_flat(self, full: np.ndarray) -> None:
        """Parameters from a host flat buffer of the full layout: this rank's shards of it."""
        if self.params is None:  # ZeRO-3: the rank's shard only (parallel/zero.py)
            self.units.load_flat(self.shard_flat(full))
            return
        self.params[...] = self.ops.from_host(self.shard_flat(full))
        self.refresh_lowp()

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Parameters in state_dict's names and shapes (V rows of wte): the padded rows become zero."""
        self.load_flat(self.full_flat(state))

    def zero_grad(self) -> None:
        if self.grads is not None:  # ZeRO-2/3 keep no whole gradient buffer (parallel/zero.py)
            self.grads.fill(0)

    # ---------------------------------------------------------------- tensor parallelism
    def _row_bias(self, bias):
        """A row-parallel product's bias, on the group's first rank only: each rank's product is a partial
        sum, and the all-reduce that completes them then adds the bias once. (Megatron adds it after the
        all-reduce; here it rides in the product's own bias epilogue, which needs no op of its own.)"""
        return bias if self.tp_rank == 0 else None

    def _row_parallel(self, partial):
        """Megatron's g: a row-parallel product's partial sums, completed over the group (in place). Under bf16
        the partials are summed in float32 and the sum rounded once (on a GPU bf16 activations are 16-bit
        words, which a sum of their bits would garble): the bytes sent are float32's, twice bf16's."""
        if self.tp is None:
            return partial
        if self.ops.dtype == "fp32":
            self.tp.all_reduce(partial)
            return partial
        wide = self.ops.xp.empty(partial.shape, dtype=np.float32)
        self.ops.widen_copy(wide, partial)
        self.tp.all_reduce(wide)
        self.ops.lowp_copy(partial, wide)
        return partial

    def _column_parallel_dinp(self, partial):
        """Megatron's f in backward: the input gradient of a column-parallel product, a partial sum over
        the rank's columns, completed over the group before the replicated layernorm reads it."""
        return self._row_parallel(partial)

    # ---------------------------------------------------------------- sequence parallelism
    def token_cut(self, ids_shape, cache: "KVCache | None" = None) -> bool:
        """Whether a forward of ids of this (B, T) shape runs with sequence parallelism: the cut asked for, no
        key-value cache, and the B*T tokens dividing by the group (a training micro-batch's always do: SEQ is
        divisible by --tp)."""
        return self.sequence_parallel and cache is None and ids_shape[0] * ids_shape[1] % self.tp_size == 0

    def stream_shape(self, ids_shape, cache: "KVCache | None" = None) -> tuple[int, ...]:
        """The residual stream's shape on this rank for ids of this (B, T) shape, what a pipeline stage sends and
        receives: (B, T, C), or under sequence parallelism the rank's (B*T/N, C) slice of the tokens."""
        if self.token_cut(ids_shape, cache):
            return (ids_shape[0] * ids_shape[1] // self.tp_size, self.config.n_embd)
        return (*ids_shape, self.config.n_embd)

    def _my_tokens(self, whole):
        """The rank's (S, C) slice of a (B, T, C) tensor that is whole and the same on every rank of the group."""
        C = whole.shape[-1]
        S = whole.size // C // self.tp_size
        return self.ops.xp.ascontiguousarray(whole.reshape(-1, C)[self.tp_rank * S:(self.tp_rank + 1) * S])

    def _token_gather(self, ids_shape, cache: "KVCache | None" = None):
        """(cut, gather) of a pass over ids of this (B, T) shape: whether it runs with sequence parallelism
        (token_cut), and what gives a product its whole (B, T, C) input from the rank's tokens (_gather_tokens;
        without the cut the input is already whole)."""
        if not self.token_cut(ids_shape, cache):
            return False, lambda x: x
        whole = (*ids_shape, self.config.n_embd)
        return True, lambda part: self._gather_tokens(part, whole)

    def _gather_tokens(self, part, shape):
        """Megatron's g under sequence parallelism: every rank's (S, C) slice in rank order, the whole tensor of
        `shape` (B, T, C) on every rank, the same bits on each (an all-gather: copies, no sums)."""
        xp = self.ops.xp
        whole = xp.empty(shape, dtype=part.dtype)
        if part.dtype == np.uint16:  # bf16's bits on a GPU: an all-gather only copies them, as any 16-bit type NCCL has
            self.tp.all_gather(part.view(xp.float16), whole.view(xp.float16))
        else:
            self.tp.all_gather(part, whole)
        return whole

    def _scatter_sum(self, partial):
        """Megatron's g-bar: a row-parallel product's (or a column-parallel product's input gradient's) partial
        sums (B, T, C), summed over the group, each rank keeping its (S, C) slice (a reduce-scatter). Under bf16
        summed in float32 and rounded once, as _row_parallel does."""
        xp, C = self.ops.xp, partial.shape[-1]
        S = partial.size // C // self.tp_size
        if self.ops.dtype == "fp32":
            out = xp.empty((S, C), dtype=partial.dtype)
            self.tp.reduce_scatter(partial, out)
            return out
        wide = xp.empty(partial.shape, dtype=np.float32)
        self.ops.widen_copy(wide, partial)
        mine = xp.empty((S, C), dtype=np.float32)
        self.tp.reduce_scatter(wide, mine)
        out = xp.empty((S, C), dtype=partial.dtype)
        self.ops.lowp_copy(out, mine)
        return out

    def _layernorm_backward(self, cut: bool, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
        """ops.layernorm_backward; under sequence parallelism (cut) on the rank's tokens, whose weight and bias
        gradients are partial sums over them: summed into a buffer of their own, all-reduced over the group (the
        same bits on every rank), then added to the gradients (which may hold earlier micro-batches' sums)."""
        if not cut:
            self.ops.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd)
            return
        part = self.ops.xp.zeros((2, dweight.size), dtype=dweight.dtype)
        self.ops.layernorm_backward(dinp, part[0], part[1], dout, inp, weight, mean, rstd)
        self.tp.all_reduce(part)
        dweight += part[0]
        dbias += part[1]

    # ---------------------------------------------------------------- dropout
    def set_dropout_step(self, step: int) -> None:
        """The optimizer step (from 1) the next training forwards and backwards draw their masks for."""
        self.ops.upload(self.dropout_step, np.array([step], dtype=np.uint32))

    def _dropout_site(self, rows, layer: int, site: int, groups: int = 1, group0: int = 0):
        """The DropoutSite of one of the model's dropouts for the micro-batch whose sequences `rows` names, or
        None where nothing drops (no dropout, or a forward that is not training's: rows None)."""
        if rows is None or not self.dropout_p:
            return None
        return DropoutSite(self.dropout_p, self.seed, self.dropout_step, layer, site, *rows, groups, group0)

    def _attention_site(self, rows, layer: int):
        """Attention's probabilities (B, NH, T, T) at their global heads: a tensor-parallel rank's come after
        the heads of the ranks before it in its group."""
        return self._dropout_site(rows, layer, ATTENTION_PROBS, self.n_head, self.tp_rank * self.n_head)

    def _dropped(self, x, site):
        return x if site is None else self.ops.dropout(x, site)

    def _dropped_stream(self, x, site, cut: bool, T: int):
        """Dropout of the residual stream (or its gradient) at `site`: x whole (B, T, C), or under sequence
        parallelism (cut) the rank's (S, C) slice of the tokens, whose elements get the bits they get whole. The
        slice is walked one run of a sequence's tokens at a time, each read as the DropoutSite's (1, groups, L)
        with L = C gcd(t0, t1 - t0) elements a group, so that its first token t0 starts group t0 C / L."""
        if site is None or not cut:
            return self._dropped(x, site)
        C = x.shape[-1]
        S = x.shape[0]
        first = self.tp_rank * S  # the slice's first token in the micro-batch's B*T
        pieces, row = [], first
        while row < first + S:
            b, t0 = divmod(row, T)
            t1 = min(T, t0 + first + S - row)
            L = C * math.gcd(t0, t1 - t0)
            piece = replace(site, seq0=site.seq0 + b * site.seq_stride, groups=(t1 - t0) * C // L, group0=t0 * C // L)
            part = x[row - first: row - first + t1 - t0].reshape(1, -1, L)
            pieces.append(self.ops.dropout(part, piece).reshape(t1 - t0, C))
            row += t1 - t0
        return pieces[0] if len(pieces) == 1 else self.ops.xp.concatenate(pieces)

    # ---------------------------------------------------------------- forward
    def _layernorm_after(self, layer: int):
        """(weight, bias) of the layernorm that reads the residual stream block `layer` writes (-1: the
        embeddings): the next block's ln_1, or ln_f after the last block."""
        if layer + 1 < self.config.n_layer:
            return self.p.h[layer + 1].ln_1_weight, self.p.h[layer + 1].ln_1_bias
        return self.p.ln_f_weight, self.p.ln_f_bias

    def forward(self, ids, targets=None, dloss: float | None = None, cache: KVCache | None = None):
        """ids, targets: (B, T) int32 on the backend. The whole model's forward (one pipeline stage).

        No targets: returns the logits of the V tokens (B, T, V), a view of the (B, T, Vp) product that leaves
        out the padded columns, so a caller never sees an id that is no token's. Targets but no dloss: returns
        per-token losses (B, T) (evaluation). Targets and dloss: returns the losses and keeps what backward()
        needs (its tape), with the logits already turned into their gradient for dloss * sum(losses) by the
        fused classifier.
        A cache (generation): ids are the positions after those it holds, and attention reads it."""
        out, self._saved = self.stage_forward(ids, None, targets, dloss, cache)
        return out

    def backward(self, on_grads_ready=None) -> None:
        """Accumulate the gradient of dloss * sum(losses) of the last forward into self.grads (see
        stage_backward)."""
        tape, self._saved = self._saved, None
        self.stage_backward(tape, None, on_grads_ready)

    def stage_forward(self, ids, inp=None, targets=None, dloss: float | None = None, cache: KVCache | None = None,
                      rows: tuple[int, int] | None = None):
        """This rank's part of the forward of one micro-batch -> (out, tape).

        rows: (seq0, seq_stride) when this is a training forward with dropout: row b of ids is sequence
        seq0 + b * seq_stride of the step's global batch, which dropout's masks are keyed by (the tape keeps
        it for backward). None (evaluation, sampling): no dropout, model.eval()'s semantics.

        The first stage embeds ids; a later one starts from `inp`, the residual stream (stream_shape: (B, T, C),
        or the rank's tokens under sequence parallelism) the stage before it sent. Every stage runs its blocks;
        the last one then the head, and `out` is what forward() returns; on the others `out` is the residual
        stream after their last block, for the next stage.
        The tape holds what stage_backward needs (None unless targets and dloss are given)."""
        ops, p, n_head = self.ops, self.p, self.n_head
        x = inp  # the residual stream the stage before sent, or on the first stage the embeddings of ids
        keep = targets is not None and dloss is not None
        # sequence parallelism: the stream is the rank's tokens; the products read them all-gathered (gather), and
        # the row-parallel ones' sums are reduce-scattered into the rank's tokens (complete) instead of all-reduced
        (cut, gather), T = self._token_gather(ids.shape, cache), ids.shape[1]
        complete = self._scatter_sum if cut else self._row_parallel
        self.units.before_forward("embed")
        if self.is_first:
            wpe = p.wpe if cache is None else p.wpe[cache.length:]
            if self.vocab_parallel:  # the rank holding each token's row gives its embedding, the others zeros
                x = complete(ops.vocab_encoder_forward(ids, p.wte, wpe, self.vocab_row0))
            else:
                x = ops.encoder_forward(ids, p.wte, wpe)
                x = self._my_tokens(x) if cut else x
            x = self._dropped_stream(x, self._dropout_site(rows, 0, EMBEDDINGS), cut, T)
        # every residual sum is followed by a layernorm (ln_2 in the block, then the next block's ln_1 or ln_f):
        # one op makes both, so the stream is written once and not read back (residual_layernorm_forward); at
        # the end of a stage before the last the next layernorm is the next stage's, so it runs the sum alone
        ln1, ln1_mean, ln1_rstd = ops.layernorm_forward(x, *self._layernorm_after(self.blocks[0] - 1))
        acts = []
        for layer in self.blocks:
            self.units.before_forward(("attn", layer))
            w = p.h[layer]
            qkv = ops.matmul_forward(gather(ln1), w.attn_c_attn_weight, w.attn_c_attn_bias)
            if cache is not None:
                atty, att = cache.attention(layer, qkv, n_head), None
            elif self.attention in FLASH_LIKE:
                atty, att = ops.flash_attention_forward(qkv, n_head)
            elif self.dropout_p and rows is not None:
                atty, att = ops.attention_forward(qkv, n_head, dropout=self._attention_site(rows, layer))
            else:
                atty, att = ops.attention_forward(qkv, n_head)
            attproj = complete(ops.matmul_forward(atty, w.attn_c_proj_weight, self._row_bias(w.attn_c_proj_bias)))
            # the residual branch's dropout after the row-parallel sum: the whole (B, T, C) output, as one rank's
            # (under the cut the rank's tokens of it, with the bits they have whole)
            attproj = self._dropped_stream(attproj, self._dropout_site(rows, layer, ATTENTION_OUT), cut, T)
            self.units.before_forward(("mlp", layer))
            x_mid, ln2, ln2_mean, ln2_rstd = ops.residual_layernorm_forward(x, attproj, w.ln_2_weight, w.ln_2_bias)
            if self.recompute < 1:  # bias and GELU after the product in one op (an epilogue: cublaslt)
                fch, fch_gelu = ops.matmul_gelu_forward(gather(ln2), w.mlp_c_fc_weight, w.mlp_c_fc_bias)
            else:  # GELU as backward runs it again: the same op on the same stored input (RECOMPUTE_LEVELS)
                fch = ops.matmul_forward(gather(ln2), w.mlp_c_fc_weight, w.mlp_c_fc_bias)
                fch_gelu = ops.gelu_forward(fch)
            fcproj = complete(ops.matmul_forward(fch_gelu, w.mlp_c_proj_weight, self._row_bias(w.mlp_c_proj_bias)))
            fcproj = self._dropped_stream(fcproj, self._dropout_site(rows, layer, MLP_OUT), cut, T)
            keep_ln, keep_gelu = self.recompute < 2, self.recompute < 1
            # under sequence parallelism x, ln1, x_mid, ln2 (and their statistics) are the rank's tokens only:
            # backward all-gathers the layernorms' outputs again for the weight gradients (Megatron's)
            acts.append(_LayerActs(x, ln1 if keep_ln else None, ln1_mean, ln1_rstd, qkv, atty, att, x_mid,
                                   ln2 if keep_ln else None, ln2_mean, ln2_rstd, fch, fch_gelu if keep_gelu else None))
            if layer == self.blocks[-1] and not self.is_last:
                x = ops.residual_forward(x_mid, fcproj)
            else:
                x, ln1, ln1_mean, ln1_rstd = ops.residual_layernorm_forward(x_mid, fcproj,
                                                                            *self._layernorm_after(layer))
        if cache is not None:  # each stage's cache holds its own blocks' keys and values
            cache.length += ids.shape[1]
        if not self.is_last:
            return x, (Tape(ids, acts, x, None, None, None, None, rows) if keep else None)
        self.units.before_forward("head")
        lnf, lnf_mean, lnf_rstd = ln1, ln1_mean, ln1_rstd  # after the last block, ln1 is ln_f's
        out, dlogits = self.head_forward(gather(lnf), targets, dloss)
        if dlogits is None:
            self.units.forward_done()
            return out, None
        return out, Tape(ids, acts, x, lnf, lnf_mean, lnf_rstd, dlogits, rows)

    def head_forward(self, lnf, targets=None, dloss: float | None = None):
        """The tied classifier and the loss on ln_f's output (B, T, C) -> (out, dlogits): out as forward() returns
        it (the logits of the V tokens without targets, else the per-token losses); with dloss also dlogits, the
        logits turned into their gradient for head_backward (else None). Vocabulary-parallel: the rank's columns
        only, the cross-entropy from the group's maxima and sums (see the module's notes); the logits are
        gathered over the group for sampling alone."""
        ops, V = self.ops, self.config.vocab_size
        logits = ops.matmul_forward(lnf, self.p.wte.T)  # tied output projection: (B, T, Vp), or (B, T, R) of a shard
        if targets is None:
            return (self._gathered_logits(logits) if self.vocab_parallel else logits)[..., :V], None
        if self.vocab_parallel:
            xp, row0 = ops.xp, self.vocab_row0
            maxes = ops.vocab_max(logits, V, row0)
            every_max = xp.empty((self.tp_size, *maxes.shape), dtype=maxes.dtype)
            self.tp.all_gather(maxes, every_max)  # every rank takes the largest of the same gathered bits
            maxes = every_max.max(axis=0)
            sums = ops.vocab_sums(logits, targets, maxes, V, row0)
            self.tp.all_reduce(sums)
            losses = ops.vocab_classifier(logits, targets, maxes, sums, dloss, V, row0)
        elif dloss is None:
            losses = ops.crossentropy_forward(logits, targets, V)
        else:
            losses = ops.fused_classifier(logits, targets, dloss, V)  # logits now hold dlogits, 0 past V
        return losses, (None if dloss is None else logits)

    def _gathered_logits(self, logits):
        """The (B, T, R) logits of every rank of the group side by side: (B, T, N R), the padded vocabulary's
        columns in order (an all-gather)."""
        xp = self.ops.xp
        everyone = xp.empty((self.tp_size, *logits.shape), dtype=logits.dtype)
        self.tp.all_gather(logits, everyone)
        return xp.moveaxis(everyone, 0, -2).reshape(*logits.shape[:-1], -1)

    def head_backward(self, dlogits, lnf, weight_grad: bool = True, cut: bool = False):
        """head_forward's backward: wte's gradient (the rank's rows) += dlogits^T lnf (unless weight_grad is
        False: ZeRO-2/3 add it at the embedding's backward, where wte's gradient unit is); returns the gradient
        of lnf, completed over the group where the classifier is vocabulary-parallel (a partial sum over the
        rank's columns: Megatron's f). Under sequence parallelism (cut) the rank's tokens of it: reduce-scattered
        (vocabulary-parallel), or sliced from the whole gradient every rank of a replicated classifier computes."""
        dlnf = self.ops.matmul_backward(self.g.wte.T if weight_grad else None, None, dlogits, lnf, self.p.wte.T)
        if cut:
            return self._scatter_sum(dlnf) if self.vocab_parallel else self._my_tokens(dlnf)
        return self._column_parallel_dinp(dlnf) if self.vocab_parallel else dlnf

    def pipelined_losses(self, ids, targets):
        """Per-token losses (B, T) of a forward through every pipeline stage (evaluation: nothing kept for
        backward): each stage runs its part on the stream the stage before sent and sends its own to the next.
        The losses on the last stage, None on the others (a collective of the pipeline group)."""
        inp = None
        if not self.is_first:
            inp = self.ops.xp.empty(self.stream_shape(ids.shape), dtype=self.params_lowp.dtype)
            self.pp.recv(inp, self.stage - 1)
        out, _ = self.stage_forward(ids, inp, targets)
        if self.is_last:
            return out
        self.pp.send(out, self.stage + 1)
        return None

    def pipelined_logits(self, ids, cache: KVCache | None = None):
        """The logits (B, T, V) of a forward through every pipeline stage (generation), on every stage: the
        last one's, broadcast over the pipeline group, so each stage draws the same next token from the same
        generator (a collective of the pipeline group)."""
        inp = None
        if not self.is_first:
            inp = self.ops.xp.empty(self.stream_shape(ids.shape, cache), dtype=self.params_lowp.dtype)
            self.pp.recv(inp, self.stage - 1)
        out, _ = self.stage_forward(ids, inp, cache=cache)
        if self.is_last:
            out = self.ops.xp.ascontiguousarray(out)
        else:
            self.pp.send(out, self.stage + 1)
            out = self.ops.xp.empty((*ids.shape, self.config.vocab_size), dtype=self.params_lowp.dtype)
        self.pp.broadcast(out, root=self.pp_size - 1)
        return out

    # ---------------------------------------------------------------- backward
    def stage_backward(self, tape: Tape, dout=None, on_grads_ready=None):
        """Accumulate this rank's part of the gradient of dloss * sum(losses) of one micro-batch (the one
        stage_forward made `tape` for) into self.grads. Returns the gradient of the stage's input, for the
        stage before it (None on the first stage).

        The last stage starts from its classifier's gradient; a stage before it from `dout`, the gradient
        of its output residual stream that the next stage sent (and writes into it).
        on_grads_ready(start, end) is called each time grads[start:end] is final (see
        grad_ready_ranges), so gradient sync can reduce it while earlier blocks still compute."""
        ops, p, g, n_head = self.ops, self.p, self.g, self.n_head
        ids, acts, x_final, lnf, lnf_mean, lnf_rstd, dlogits, rows = tape
        ranges = iter(self.grad_ready_ranges())
        announce = on_grads_ready or (lambda start, end: None)
        # sequence parallelism (stage_forward's notes): the stream's gradient dres is the rank's tokens; a
        # row-parallel output's gradient is all-gathered (gather), and a column-parallel product's input gradient
        # reduce-scattered into the rank's tokens (complete)
        (cut, gather), T = self._token_gather(ids.shape), ids.shape[1]
        complete = self._scatter_sum if cut else self._column_parallel_dinp

        if self.is_last:
            self.units.before_backward("head")
            late = self.units.wte_grad_at_end and self.is_first  # the classifier's wte gradient comes at the end
            # ln_f's output whole again for wte's gradient (kept as the rank's tokens under the cut), only for this
            dlnf = self.head_backward(dlogits, gather(lnf), weight_grad=not late, cut=cut)
            dres = self.ops.xp.zeros_like(x_final)  # gradient of the residual stream, carried down the blocks
            self._layernorm_backward(cut, dres, g.ln_f_weight, g.ln_f_bias, dlnf, x_final, p.ln_f_weight, lnf_mean,
                                     lnf_rstd)
        else:
            dres = dout
        for a, layer in zip(reversed(acts), reversed(self.blocks), strict=True):
            self.units.before_backward(("mlp", layer))
            w, gw = p.h[layer], g.h[layer]
            # MLP: x_out = x_mid + c_proj(gelu(c_fc(ln_2(x_mid))))
            fch_gelu = ops.gelu_forward(a.fch) if a.fch_gelu is None else a.fch_gelu  # --recompute 1
            # c_proj's backward and GELU's in one op (the derivative in the product's epilogue: cublaslt)
            # dropout's backward: the gradient through the forward's mask, drawn again from the same counters
            dfcproj = gather(self._dropped_stream(dres, self._dropout_site(rows, layer, MLP_OUT), cut, T))
            dfch = ops.matmul_backward_gelu(gw.mlp_c_proj_weight, gw.mlp_c_proj_bias, dfcproj, fch_gelu,
                                            w.mlp_c_proj_weight, a.fch)
            del dfcproj
            del fch_gelu  # a recomputed one goes now, not at the next block's
            ln2 = ops.layernorm_forward(a.x_mid, w.ln_2_weight, w.ln_2_bias)[0] if a.ln2 is None else a.ln2
            dln2 = complete(ops.matmul_backward(gw.mlp_c_fc_weight, gw.mlp_c_fc_bias, dfch, gather(ln2),
                                                w.mlp_c_fc_weight))
            del ln2
            self._layernorm_backward(cut, dres, gw.ln_2_weight, gw.ln_2_bias, dln2, a.x_mid, w.ln_2_weight,
                                     a.ln2_mean, a.ln2_rstd)  # dres is now d x_mid
            announce(*next(ranges))  # the MLP half (with ln_f at the last block)
            self.units.before_backward(("attn", layer))
            # attention: x_mid = x_in + c_proj(attention(c_attn(ln_1(x_in))))
            dattproj = gather(self._dropped_stream(dres, self._dropout_site(rows, layer, ATTENTION_OUT), cut, T))
            datty = ops.matmul_backward(gw.attn_c_proj_weight, gw.attn_c_proj_bias, dattproj, a.atty,
                                        w.attn_c_proj_weight)
            del dattproj
            if self.attention in FLASH_LIKE:
                dqkv = ops.flash_attention_backward(datty, a.qkv, a.atty, a.att, n_head)
            elif self.dropout_p and rows is not None:
                dqkv = ops.attention_backward(datty, a.qkv, a.att, n_head, dropout=self._attention_site(rows, layer))
            else:
                dqkv = ops.attention_backward(datty, a.qkv, a.att, n_head)
            ln1 = ops.layernorm_forward(a.x_in, w.ln_1_weight, w.ln_1_bias)[0] if a.ln1 is None else a.ln1
            ln1 = gather(ln1)
            # c_attn's weight gradient, then its input's: the same two products as one matmul_backward, with the
            # attention's products announced between (the overlapped sync starts on them one product earlier)
            ops.matmul_backward(gw.attn_c_attn_weight, gw.attn_c_attn_bias, dqkv, ln1, None)
            announce(*next(ranges))  # the attention's products (c_proj, c_attn)
            dln1 = complete(ops.matmul_backward(None, None, dqkv, ln1, w.attn_c_attn_weight))
            del ln1
            self._layernorm_backward(cut, dres, gw.ln_1_weight, gw.ln_1_bias, dln1, a.x_in, w.ln_1_weight,
                                     a.ln1_mean, a.ln1_rstd)  # dres is now d x_in
            announce(*next(ranges))  # ln_1
        if self.is_first:
            self.units.before_backward("embed")
            if self.is_last and late:  # the head's weight gradient, deferred (same operands, same order into g.wte)
                ops.matmul_backward(g.wte.T, None, dlogits, gather(lnf), None)
            dembed = gather(self._dropped_stream(dres, self._dropout_site(rows, 0, EMBEDDINGS), cut, T))
            if self.vocab_parallel:
                ops.vocab_encoder_backward(g.wte, g.wpe, dembed, ids, self.vocab_row0)
            else:
                ops.encoder_backward(g.wte, g.wpe, dembed, ids)
        announce(*next(ranges))
        return None if self.is_first else dres
