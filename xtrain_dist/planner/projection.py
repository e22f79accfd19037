"""A training run projected onto many GPUs: the memory each device holds and the time a step takes.

The memory is train/memory.py's model of a rank (what the pre-flight check refuses runs by), extended to
the splits the trainer does not have yet, with the formulas of Megatron-LM (Shoeybi et al. 2019; Narayanan
et al. 2021): tensor parallelism (tp) cuts every matrix product's weights, the attention heads and the
MLP's hidden width across tp devices, and the classifier's vocabulary; pipeline parallelism (pp) gives
each device a run of ceil(L / pp) layers. With tp = pp = 1 the figures are the pre-flight's to the byte
(tests/test_plan.py holds them equal).

The step time is compute plus what communication the overlap does not hide:

    compute   = tokens per model replica x FLOPs per token / (tp x pp) / (peak x MFU)
    bubble    = compute x (pp - 1) / m                       (1F1B's fill and drain; m micro-batches)
    ring(S,n) = 2 (n - 1) / n x S / bus bandwidth            (a ring all-reduce of S bytes over n devices)
    tp comm   = 4 all-reduces per layer and micro-batch of b x T x C activations (2 forward, 2 backward),
                on the critical path; with sequence parallelism 4 reduce-scatters and 6 all-gathers (the
                layernorms' outputs gathered again in backward): 5 all-reduces' bytes in 10 calls
    pp comm   = 2 sends per micro-batch of b x T x C activations (forward, and their gradient back), at
                the inter-node bandwidth once tp x pp spans more than a node
    dp comm   = ring(gradient bytes, dp), plus a per-call latency for each bucket; the buckets go out
                while backward runs, so the exposed part is
                max(the last bucket's time, dp comm - overlap x backward of the last micro-batch)
                ZeRO-1 sends the same bytes as a reduce-scatter (overlapped alike) and then all-gathers
                the float32 parameters after the optimizer step, which nothing hides.

FLOPs per token are nanoGPT's count (profile.nanogpt_flops_per_token), generalised to any MLP width.
"""

from dataclasses import dataclass, field, replace

from ..config import VOCAB_ALIGN, GPTConfig
from ..errors import XtrainError
from ..layout import ALIGN
from ..parallel.zero import shard_bounds, transient_bytes
from ..train.memory import ITEMSIZE, RankMemory, array_bytes, saved_activations

# bytes of one activation element: bf16 on a GPU, float32 otherwise (train/job.py's act_itemsize)
ACT_ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2}
GRAD_ITEMSIZE = {"none": 4, "bf16": 2}  # what the gradient all-reduce sends per element (--grad-compress)

# the activations each of tp devices holds a 1/tp share of: those cut by heads or by the MLP's width (the
# layernorms' inputs and outputs and the residual stream are whole on every device, unless sequence
# parallelism cuts them by tokens)
TP_SPLIT = {"qkv", "atty", "att", "fch", "fch_gelu"}


@dataclass(frozen=True)
class Shape:
    """A GPT-2 shaped model: d_ff is the MLP's hidden width (4 d_model in GPT-2)."""
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    vocab_size: int
    n_ctx: int

    @staticmethod
    def of(config: GPTConfig) -> "Shape":
        return Shape(config.n_layer, config.n_head, config.n_embd, 4 * config.n_embd, config.vocab_size,
                     config.n_ctx)

    def padded_vocab(self, tp: int) -> int:
        """The classifier's rows over tp devices that cut the vocabulary: a multiple of 128 (config.VOCAB_ALIGN),
        split evenly, each device's share rounded up where tp does not divide it (layout.vocab_rows)."""
        padded = -(-self.vocab_size // VOCAB_ALIGN) * VOCAB_ALIGN
        return -(-padded // tp) * tp


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Run:
    batch: int                  # sequences per optimizer step, summed over the data-parallel ranks
    seq: int
    precision: str = "bf16"     # fp32 | tf32 | bf16
    zero: int = 0
    recompute: int = 0
    attention: str = "standard"
    grad_accum: int = 1         # micro-batches per step; the pipeline's m
    grad_compress: str = "none"
    sequence_parallel: bool = False  # the tp group also cuts the layernorms and the residual stream by tokens


@dataclass(frozen=True)
class Hardware:
    peak_flops: float           # FLOP/s of one device at the run's precision
    mfu: float                  # the share of it a step reaches
    bus_gbps: float             # all-reduce bus bandwidth inside a node, GB/s (10^9 B/s)
    inter_node_gbps: float      # the same across nodes (the data-parallel ring once it leaves a node)
    tp_bus_gbps: float          # the tensor-parallel group's (inside a node)
    node_gpus: int = 8
    latency_s: float = 0.0      # the fixed cost of one collective call
    bucket_bytes: int = 25 << 20
    overlap: float = 1.0        # the share of backward under which gradient buckets can travel


def pad(n: int) -> int:
    """Elements a tensor takes in the flat buffer: model.py pads each to ALIGN."""
    return -(-n // ALIGN) * ALIGN


def layer_tensors(shape: Shape, tp: int) -> list[int]:
    """Element counts of one block's tensors on one of tp devices: the column-parallel products (qkv, fc)
    cut their weights and biases, the row-parallel ones (the two projections) their weights; layernorms and
    the row-parallel biases are whole."""
    C, F = shape.d_model, shape.d_ff
    return [F * C // tp, C, C * F // tp, F // tp, C, C, C * C // tp, C, C * 3 * C // tp, 3 * C // tp, C, C]


def device_params(shape: Shape, mesh: Mesh) -> int:
    """Parameter elements (the flat buffer's, padding included) of the device that holds the most: the first
    pipeline stage, with ceil(L / pp) blocks, wpe, and wte (cut by the vocabulary across tp); with pp = 1
    also ln_f. (The last stage keeps its own copy of the tied wte, and ln_f, and no more blocks.)"""
    layers = -(-shape.n_layer // mesh.pp)
    total = layers * sum(pad(n) for n in layer_tensors(shape, mesh.tp))
    total += pad(shape.n_ctx * shape.d_model) + pad(shape.padded_vocab(mesh.tp) * shape.d_model // mesh.tp)
    return total + (2 * pad(shape.d_model) if mesh.pp == 1 else 0)


def model_params(shape: Shape) -> int:
    """The model's parameters as Hugging Face counts them (vocab_size rows of wte, no padding)."""
    C, F = shape.d_model, shape.d_ff
    return shape.n_layer * (4 * C * C + 2 * C * F + 9 * C + F) + (shape.vocab_size + shape.n_ctx) * C + 2 * C


def flops_per_token(shape: Shape, seq: int) -> float:
    """nanoGPT's count: 6 per parameter that enters a product (all but wpe), and 12 L C T for attention's two
    T x T products, forward and backward. profile.nanogpt_flops_per_token for d_ff = 4 d_model."""
    return 6.0 * (model_params(shape) - shape.n_ctx * shape.d_model) + 12.0 * shape.n_layer * shape.d_model * seq


def activation_bytes(shape: Shape, mesh: Mesh, run: Run, rows: int) -> int:
    """What forward keeps for backward on the device that holds the most, for micro-batches of `rows`
    sequences: memory.saved_activations' arrays (the MLP's at width d_ff), those cut by heads or by width
    divided by tp (with sequence parallelism, Korthikanti et al. 2022, every array but the token ids).
    Under 1F1B the first stage holds min(pp, m) micro-batches of its ceil(L / pp) blocks;
    the last stage holds the final layernorm and the logits (cut by the vocabulary) of one."""
    config = GPTConfig(vocab_size=shape.padded_vocab(mesh.tp), n_ctx=max(shape.n_ctx, run.seq), n_layer=1,
                       n_head=shape.n_head, n_embd=shape.d_model)
    act = ACT_ITEMSIZE[run.precision]
    block, rest = 0, 0
    for name, dims, kind in saved_activations(config, rows, run.seq, run.attention, run.recompute):
        field_ = name.rpartition(".")[2]
        if name.startswith("h."):
            if field_ in ("fch", "fch_gelu"):
                dims = (*dims[:-1], shape.d_ff)
            block += array_bytes(dims, kind, act) // (mesh.tp if field_ in TP_SPLIT or run.sequence_parallel else 1)
        else:
            if field_ == "dlogits":  # the device's columns of the logits, vocab_rows of the padded vocabulary
                dims = (*dims[:-1], shape.padded_vocab(mesh.tp) // mesh.tp)
            cut = run.sequence_parallel and field_ not in ("ids", "dlogits")
            rest += array_bytes(dims, kind, act) // (mesh.tp if cut else 1)
    layers = -(-shape.n_layer // mesh.pp)
    if mesh.pp == 1:
        return layers * block + rest
    ids = array_bytes((rows, run.seq), "i32", act)
    first = min(mesh.pp, run.grad_accum) * layers * block + ids
    last = max(0, shape.n_layer - (mesh.pp - 1) * layers) * block + rest - ids
    return max(first, last)


def unit_elements(shape: Shape, mesh: Mesh) -> dict:
    """ZeRO-2/3's units (parallel/zero.py's param_units) in elements, from the shape: a block's MLP half (its
    projection, its first layer, ln_2) and attention half (its projection, q|k|v, ln_1), wte, wpe, ln_f."""
    tensors = [pad(n) for n in layer_tensors(shape, mesh.tp)]
    sizes = {"wte": pad(shape.padded_vocab(mesh.tp) * shape.d_model // mesh.tp),
             "wpe": pad(shape.n_ctx * shape.d_model), "ln_f": 2 * pad(shape.d_model) if mesh.pp == 1 else 0}
    for i in range(-(-shape.n_layer // mesh.pp)):
        sizes["mlp", i], sizes["attn", i] = sum(tensors[:6]), sum(tensors[6:])
    return sizes


def device_memory(shape: Shape, mesh: Mesh, run: Run) -> RankMemory:
    """memory.RankMemory of the device that holds the most (data-parallel rank 0, which takes the most
    sequences when dp does not divide the batch): the float32 master, the bf16 copy forward reads under
    bf16, the weight-decay mask (one byte each), float32 gradients, AdamW's m and v (this rank's ZeRO-1
    shard), and the saved activations."""
    size = device_params(shape, mesh)
    act = ACT_ITEMSIZE[run.precision]
    parameters = 4 * size + (act * size if run.precision == "bf16" else 0) + ITEMSIZE["u8"] * size
    lo, hi = shard_bounds(size, mesh.dp)[0] if run.zero else (0, size)
    gradients = 4 * size
    if run.zero >= 2:  # ZeRO-2 and -3 (parallel/zero.py): the shards, and what the pass step that holds the most
        # holds beside them (gathered units at ZeRO-3, gradient buffers), walked over the units' closed-form sizes
        # at the trainer's default --zero3-prefetch 1
        layers = -(-shape.n_layer // mesh.pp)
        gathered, buffers = transient_bytes(unit_elements(shape, mesh), list(range(layers)), run.zero, 1,
                                            act if run.precision == "bf16" else 4)
        gradients = 4 * (hi - lo) + buffers
        if run.zero == 3:
            parameters = (4 + ITEMSIZE["u8"]) * (hi - lo) + gathered
    rows = len(range(0, run.batch, mesh.dp))
    return RankMemory(parameters=parameters, gradients=gradients, optimizer=2 * 4 * (hi - lo),
                      activations=activation_bytes(shape, mesh, run, -(-rows // run.grad_accum)))


def ring_all_reduce_s(nbytes: float, n: int, bus_gbps: float) -> float:
    """A ring all-reduce of `nbytes` over n devices: each sends and receives 2 (n - 1) / n of the buffer, so
    at bus bandwidth B (nccl-tests' busbw, which is defined to make this true) it takes 2 (n - 1) / n x S / B."""
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / (bus_gbps * 1e9)


def exposed_comm_s(comm_s: float, last_bucket_s: float, backward_s: float, overlap: float) -> float:
    """The part of bucketed gradient communication that backward does not hide: buckets leave as backward
    fills them, so at most `overlap` x backward of it hides, and never the last bucket, which is filled
    only when backward ends."""
    return max(last_bucket_s, comm_s - overlap * backward_s) if comm_s > 0 else 0.0


@dataclass
class StepTime:
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    dp_exposed_s: float
    step_s: float
    tokens_per_s: float
    memory: RankMemory = field(repr=False, default=None)

    @property
    def exposed_s(self) -> float:
        """Every communication on the step's critical path."""
        return self.tp_comm_s + self.pp_comm_s + self.dp_exposed_s


def step_time(shape: Shape, mesh: Mesh, run: Run, hw: Hardware) -> StepTime:
    """The step of the slowest device (data-parallel rank 0's share of the batch), by the model in the module
    docstring."""
    rows = len(range(0, run.batch, mesh.dp))
    micro_rows = -(-rows // run.grad_accum)
    compute = rows * run.seq * flops_per_token(shape, run.seq) / (mesh.tp * mesh.pp) / (hw.peak_flops * hw.mfu)
    bubble = compute * (mesh.pp - 1) / run.grad_accum
    act = ACT_ITEMSIZE[run.precision]
    layers = -(-shape.n_layer // mesh.pp)
    activation_msg = micro_rows * run.seq * shape.d_model * act
    tp_comm = 0.0
    if mesh.tp > 1 and run.sequence_parallel:
        # each all-reduce becomes a reduce-scatter and an all-gather, half its bytes each; backward gathers the two
        # layernorms' outputs again (model.py): 5 all-reduces' bytes a layer in 10 calls
        tp_comm = layers * run.grad_accum * (
            5 * ring_all_reduce_s(activation_msg, mesh.tp, hw.tp_bus_gbps) + 10 * hw.latency_s)
    elif mesh.tp > 1:
        tp_comm = 4 * layers * run.grad_accum * (
            ring_all_reduce_s(activation_msg, mesh.tp, hw.tp_bus_gbps) + hw.latency_s)
    # a pipeline boundary sends each micro-batch's activations forward and their gradient back; the stages
    # share a node's links while tp x pp fits in one node, and cross nodes once it does not
    stage_link = hw.tp_bus_gbps if mesh.tp * mesh.pp <= hw.node_gpus else hw.inter_node_gbps
    pp_comm = 2 * run.grad_accum * activation_msg / (stage_link * 1e9) if mesh.pp > 1 else 0.0
    size = device_params(shape, mesh)
    bus = hw.bus_gbps if mesh.gpus <= hw.node_gpus else hw.inter_node_gbps
    grad_bytes = GRAD_ITEMSIZE[run.grad_compress] * size
    dp_comm = dp_exposed = 0.0
    if mesh.dp > 1:
        buckets = max(1, -(-grad_bytes // hw.bucket_bytes))
        send = ring_all_reduce_s(grad_bytes, mesh.dp, bus)  # ZeRO-1's reduce-scatter is half of it
        send = send / 2 if run.zero else send
        last = send * min(1.0, hw.bucket_bytes / grad_bytes) + hw.latency_s
        dp_comm = send + buckets * hw.latency_s
        backward_last_micro = compute * 2 / 3 / run.grad_accum
        dp_exposed = exposed_comm_s(dp_comm, last, backward_last_micro, hw.overlap)
        if run.zero == 3:  # every block gathered before forward and again before backward: twice the float32
            # parameters' half ring, which prefetch hides behind compute in this projection
            dp_comm += 2 * (ring_all_reduce_s(4 * size, mesh.dp, bus) / 2) + 2 * (shape.n_layer + 3) * hw.latency_s
        elif run.zero:  # the float32 parameters gathered after the step: half a ring all-reduce, nothing hides it
            gather = ring_all_reduce_s(4 * size, mesh.dp, bus) / 2 + hw.latency_s
            dp_comm += gather
            dp_exposed += gather
    step = compute + bubble + tp_comm + pp_comm + dp_exposed
    return StepTime(compute, bubble, tp_comm, pp_comm, dp_comm, dp_exposed, step,
                    run.batch * run.seq / step, device_memory(shape, mesh, run))


def scaling_table(shape: Shape, mesh: Mesh, run: Run, hw: Hardware, max_gpus: int = 1024) -> list[dict]:
    """The same run at 1, 2, 4, ... max_gpus devices: tp and pp as given, dp = gpus / (tp pp), and every
    data-parallel rank keeps the sequences it has at `mesh` (weak scaling: the global batch grows with dp).
    Efficiency is tokens/s over gpus x the tokens/s one device computes alone (at the same MFU, with no
    communication), so it is 1 at one device."""
    per_rank = run.batch / mesh.dp
    alone = hw.peak_flops * hw.mfu / flops_per_token(shape, run.seq)
    rows = []
    gpus = 1
    while gpus <= max_gpus:
        if gpus % (mesh.tp * mesh.pp) == 0:
            scaled = Mesh(dp=gpus // (mesh.tp * mesh.pp), tp=mesh.tp, pp=mesh.pp)
            scaled_run = replace(run, batch=max(1, round(per_rank * scaled.dp)))
            t = step_time(shape, scaled, scaled_run, hw)
            rows.append({"gpus": gpus, "dp": scaled.dp, "tp": mesh.tp, "pp": mesh.pp, "batch": scaled_run.batch,
                         "step_s": t.step_s, "tokens_per_s": t.tokens_per_s,
                         "efficiency": t.tokens_per_s / (gpus * alone), "dp_comm_s": t.dp_comm_s,
                         "exposed_s": t.exposed_s, "memory_bytes": least(t.memory)})
        gpus *= 2
    return rows


def least(m: RankMemory) -> int:
    """A device's whole figure: its persistent state and its activations (one rank per device)."""
    return m.persistent + m.activations


def check(shape: Shape, mesh: Mesh, run: Run) -> None:
    """One line for a combination the formulas cannot split."""
    if shape.d_model % shape.n_head:
        raise XtrainError(f"--d-model ({shape.d_model}) must be divisible by --heads ({shape.n_head})")
    if shape.n_head % mesh.tp:
        raise XtrainError(f"--heads ({shape.n_head}) must be divisible by --tp ({mesh.tp}): tensor parallelism "
                          "gives each device whole heads")
    if shape.d_ff % mesh.tp:
        raise XtrainError(f"--d-ff ({shape.d_ff}) must be divisible by --tp ({mesh.tp})")
    if mesh.pp > shape.n_layer:
        raise XtrainError(f"--pp ({mesh.pp}) must be at most the number of layers ({shape.n_layer})")
    if run.batch < mesh.dp:
        raise XtrainError(f"--batch ({run.batch}) must be at least --dp ({mesh.dp}): every data-parallel rank "
                          "needs a sequence")
    if run.grad_accum > -(-run.batch // mesh.dp):
        raise XtrainError(f"--grad-accum ({run.grad_accum}) must be at most the sequences of a data-parallel "
                          f"rank ({-(-run.batch // mesh.dp)})")
    if run.seq > shape.n_ctx:
        raise XtrainError(f"--seq ({run.seq}) must be at most the model's context ({shape.n_ctx})")
