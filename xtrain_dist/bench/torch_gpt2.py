"""The same GPT-2 in PyTorch: the peer that the benchmarks race and a second implementation to check against.

Same parameter names, shapes (Conv1D (in, out) weights), tied embedding and initial values as
model.GPT2 (load its state_dict), the same optimizer step (`adamw`, `train_step`), and the same
data-parallel run in PyTorch's own DDP (`ddp_run`: gloo, one process per rank). torch is imported here
only: it is a benchmark and test extra, never a dependency of the trainer.
"""

import math
import tempfile
import time
from pathlib import Path

import numpy as np

from ..config import GPTConfig, TrainConfig, model_config
from ..errors import XtrainError


def build(config: GPTConfig, state_dict: dict | None = None, device: str = "cpu", sdpa: bool = True,
          vocab_rows: int | None = None):
    """A torch.nn.Module computing GPT-2's mean cross-entropy: module(ids, targets) -> loss.

    sdpa=True uses torch's fused scaled_dot_product_attention (what a PyTorch user would run);
    False writes attention out like our backends do (scores, causal softmax, weighted sum).

    vocab_rows (at least config.vocab_size) pads the tied embedding to that many rows, as nanoGPT and
    llm.c pad GPT-2's 50257 to 50304 so that the classifier's products have a shape cuBLAS runs at full
    rate. The rows past V start at zero and the loss reads the first V logits only, as our padded layout
    does, so the module computes the same function as the unpadded one (same first loss; the padded rows
    get no gradient and stay zero). nanoGPT instead trains all 50304 logits, which only changes the
    softmax's sum by the padded columns' exp(logit): the products, where padding pays, are the same."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    C, NH, V = config.n_embd, config.n_head, config.vocab_size
    rows = vocab_rows or V
    if rows < V:
        raise ValueError(f"vocab_rows {rows} is below the vocabulary ({V})")

    def conv1d(n_in, n_out):
        return nn.ParameterDict({"weight": nn.Parameter(torch.zeros(n_in, n_out)),
                                 "bias": nn.Parameter(torch.zeros(n_out))})

    def linear(x, p):
        return torch.addmm(p["bias"], x.reshape(-1, x.shape[-1]), p["weight"]).reshape(*x.shape[:-1], -1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=1e-5), nn.LayerNorm(C, eps=1e-5)
            self.attn = nn.ModuleDict({"c_attn": conv1d(C, 3 * C), "c_proj": conv1d(C, C)})
            self.mlp = nn.ModuleDict({"c_fc": conv1d(C, 4 * C), "c_proj": conv1d(4 * C, C)})

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = linear(self.ln_1(x), self.attn["c_attn"]).split(C, dim=-1)
            q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // NH)
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
                y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + linear(y.transpose(1, 2).reshape(B, T, C), self.attn["c_proj"])
            h = F.gelu(linear(self.ln_2(x), self.mlp["c_fc"]), approximate="tanh")
            return x + linear(h, self.mlp["c_proj"])

    class GPT2Torch(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(rows, C), "wpe": nn.Embedding(config.n_ctx, C),
                "h": nn.ModuleList(Block() for _ in range(config.n_layer)), "ln_f": nn.LayerNorm(C, eps=1e-5)})

        def forward(self, ids, targets):
            t = self.transformer
            x = t["wte"](ids) + t["wpe"].weight[: ids.shape[1]]
            for block in t["h"]:
                x = block(x)
            logits = t["ln_f"](x) @ t["wte"].weight.T  # tied output projection, (B, T, rows)
            if rows > V:
                logits = logits[..., :V]  # the padded columns are no token's: not in the softmax
            return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    module = GPT2Torch()
    if state_dict is not None:
        # ParameterDict entries are named "...c_attn.weight" like Hugging Face's, so names match as they are
        tensors = {k: torch.from_numpy(v) for k, v in state_dict.items()}
        wte = tensors["transformer.wte.weight"][:V]  # a layout padded already gives its real rows
        tensors["transformer.wte.weight"] = torch.cat([wte, wte.new_zeros(rows - V, C)])
        module.load_state_dict(tensors, strict=True)
    return module.to(device)


def hf_model(config: GPTConfig, state_dict: dict):
    """Hugging Face transformers' own GPT2LMHeadModel holding these weights (our state_dict's names are
    its names; lm_head is the tied wte), in eval mode: the reference for what a checkpoint computes."""
    import torch
    import transformers

    from ..checkpoint.hf import GPT2_MASK_BUFFER, hf_config

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(hf_config(config)))
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict({**tensors, "lm_head.weight": tensors["transformer.wte.weight"]},
                                                strict=False)
    if unexpected or any(not GPT2_MASK_BUFFER.fullmatch(k) for k in missing):
        raise ValueError(f"weights do not fit GPT2LMHeadModel: missing {missing}, unexpected {unexpected}")
    return model.eval()


def adamw(module, cfg: TrainConfig, **options):
    """torch.optim.AdamW set up as our optim.AdamW: weight decay on the matrices (and embeddings) only.
    `options` go to torch.optim.AdamW as they are (fused=True on a GPU)."""
    import torch

    return torch.optim.AdamW(param_groups(module, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             **options)


def param_groups(module, cfg: TrainConfig) -> list[dict]:
    """The matrices (and embeddings) with weight decay, the vectors without."""
    return [{"params": [p for p in module.parameters() if p.dim() == 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def train_step(model, opt, ids, targets, step: int, cfg: TrainConfig, loss_scale: float = 1.0,
               float64_norm: bool = False):
    """One optimizer step as our trainer takes it: forward, backward, global-norm clipping, the lr of
    `step` (from 0) on our schedule, AdamW. Returns the loss times `loss_scale` and the gradient norm
    before clipping, as tensors (reading them is the caller's sync); float64_norm: that norm summed in
    float64, as ours is, rather than clip_grad_norm_'s float32 (2e-5 off on the tiny model's 370k numbers)."""
    import torch

    from ..optim import lr_at

    opt.zero_grad(set_to_none=False)
    loss = model(ids, targets) * loss_scale
    loss.backward()  # under DDP: the ranks' gradients are averaged bucket by bucket as backward runs
    exact = (torch.stack([p.grad.double().square().sum() for p in model.parameters()]).sum().sqrt()
             if float64_norm else None)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if exact is not None:
        norm = exact
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    opt.step()
    return loss, norm


def ddp_run(cfg: TrainConfig, world: int, threads: int = 1, sdpa: bool = True) -> dict:
    """ddp_runs of one configuration."""
    return ddp_runs([cfg], world, threads, sdpa)[0]


def ddp_runs(cfgs: list[TrainConfig], world: int, threads: int = 1, sdpa: bool = True) -> list[dict]:
    """Train each of `cfgs` (resolved; the shipped data where it names none) in PyTorch DDP: `world` processes on this
    machine, gloo over loopback, `threads` torch threads each, the same initial weights and the same
    global batches, rank r taking the sequences i % world == r as ours do. cfg.zero == 1 steps with
    PyTorch's ZeroRedundancyOptimizer around its AdamW, and cfg.grad_compress == "bf16" registers its
    bf16_compress_hook. The configurations run one after another in the same processes (each process imports
    torch once: seconds of CPU time apiece).

    DDP averages the ranks' gradients of their local mean losses. A rank of n sequences scales its loss
    by n * world / BATCH first (1 where world divides BATCH), so the average is the gradient of the
    global-batch mean loss however the batch splits, which our ranks get by summing gradients of losses
    scaled by 1/(BATCH*SEQ). So the two runs compute the same thing by different code and should agree
    to float32 rounding. Returns {"step_ms": per step (rank 0), "losses": global-batch mean losses,
    "grad_norms": before clipping, summed in float64 as ours are, "params": rank 0's final parameters by
    name, "ranks_equal": every rank's parameters bitwise equal to rank 0's}, one for each configuration."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="xtrain-torch-ddp-") as tmp:
        # the rendezvous is a file, not a port: no race for a free port with other tests or runs
        try:
            mp.spawn(_ddp_rank, args=(world, Path(tmp), cfgs, threads, sdpa), nprocs=world, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # the message ends with its traceback
            last = str(err).strip().splitlines()[-1]
            raise XtrainError(f"the PyTorch DDP peer failed in rank {err.error_index}: {last}") from None
        results = []
        for run in range(len(cfgs)):
            with np.load(Path(tmp) / f"run{run}-rank0.npz") as saved:
                result = {"step_ms": saved["step_ms"].tolist(), "losses": saved["losses"].tolist(),
                          "grad_norms": saved["grad_norms"].tolist(),
                          "params": {k[len("param/"):]: saved[k] for k in saved.files if k.startswith("param/")}}
            digests = [(Path(tmp) / f"run{run}-rank{r}.sha256").read_text() for r in range(world)]
            result["ranks_equal"] = len(set(digests)) == 1
            results.append(result)
    return results


def _ddp_rank(rank: int, world: int, tmp: Path, cfgs: list, threads: int, sdpa: bool) -> None:
    """One process of ddp_runs (started by torch.multiprocessing.spawn, which passes `rank` first)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank, world_size=world)
    try:
        for run, cfg in enumerate(cfgs):
            _ddp_train(rank, world, tmp, f"run{run}", cfg, sdpa)
        # no rank tears gloo down while another may still be talking to it: a peer's closed socket makes
        # gloo abort the process (a SIGABRT seen once in a full test run)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ddp_train(rank: int, world: int, tmp: Path, name: str, cfg: TrainConfig, sdpa: bool) -> None:
    """One configuration's run in one process of ddp_runs: rank 0 saves its figures and parameters
    (tmp/<name>-rank0.npz), every rank its parameters' sha256 (tmp/<name>-rank<r>.sha256)."""
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .. import model as our_model
    from ..backend import numpy_ops
    from ..data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
    from ..data.sampler import BatchSampler

    corpus = Corpus.load(cfg.tokenizer or DEFAULT_TOKENIZER, cfg.corpus or DEFAULT_CORPUS,
                         val_path=cfg.val_corpus or None)  # which decides what the train split is
    mcfg = model_config(cfg.model, corpus.vocab_size)
    module = build(mcfg, our_model.GPT2(mcfg, numpy_ops, seed=cfg.seed).state_dict(), sdpa=sdpa)
    model = DistributedDataParallel(module)  # PyTorch's defaults: 25 MiB buckets, overlapped with backward
    if cfg.grad_compress == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def bf16_compress(state, bucket):
            # PyTorch's hook itself, under another name: DDP refuses the name bf16_compress_hook without
            # NCCL, though gloo sums bfloat16 on the CPU as well
            return default_hooks.bf16_compress_hook(state, bucket)

        model.register_comm_hook(None, bf16_compress)
    if cfg.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(param_groups(module, cfg), optimizer_class=torch.optim.AdamW,
                                      lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    else:
        opt = adamw(module, cfg)
    sampler = BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=rank, world=world)
    loss_scale = sampler.n_local * world / cfg.batch
    step_ms, losses, norms = [], [], []
    for step in range(cfg.steps):
        ids, targets = (torch.from_numpy(a.astype(np.int64)) for a in sampler.next())
        t0 = time.perf_counter()
        loss, norm = train_step(model, opt, ids, targets, step, cfg, loss_scale, float64_norm=True)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        loss = loss.detach()
        dist.all_reduce(loss)  # the shards' scaled mean losses summed: world x the global-batch mean
        losses.append(loss.item() / world)
        norms.append(norm.item())  # of the averaged gradients: the same on every rank
    params = {key: p.detach().numpy() for key, p in module.state_dict().items()}
    digest = hashlib.sha256()
    for key in sorted(params):
        digest.update(params[key].tobytes())
    (tmp / f"{name}-rank{rank}.sha256").write_text(digest.hexdigest())
    if rank == 0:
        np.savez(tmp / f"{name}-rank0.npz", step_ms=np.array(step_ms), losses=np.array(losses),
                 grad_norms=np.array(norms), **{f"param/{key}": value for key, value in params.items()})


def has_fully_shard() -> str | None:
    """None where this torch has FSDP2's fully_shard (torch.distributed.fsdp, torch 2.6 on), else why not."""
    try:
        import torch
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        import torch

        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)"
    return None


def fsdp_run(cfg: TrainConfig, world: int, threads: int = 1) -> dict:
    """Train `cfg` (resolved) in PyTorch FSDP2 as ddp_run trains it in DDP: `world` processes, gloo over loopback,
    the same initial weights and global batches, fully_shard on each block and then on the whole model (the
    root unit: wte, tied with the classifier, wpe and ln_f), PyTorch's defaults otherwise (parameters resharded
    after forward, gradients reduce-scattered per unit). Returns {"step_ms": per step (rank 0), "losses",
    "state_bytes": rank 0's local shards of the parameters, gradients and AdamW's exp_avg and exp_avg_sq after
    the last step, "rss_growth_bytes": per rank, its process's peak RSS less its RSS before the model was built
    (everything the run took: shards, gathered units, activations, the allocator's caches)}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="xtrain-torch-fsdp-") as tmp:
        try:
            mp.spawn(_fsdp_rank, args=(world, Path(tmp), cfg, threads), nprocs=world, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            last = str(err).strip().splitlines()[-1]
            raise XtrainError(f"the PyTorch FSDP2 peer failed in rank {err.error_index}: {last}") from None
        with np.load(Path(tmp) / "rank0.npz") as saved:
            result = {"step_ms": saved["step_ms"].tolist(), "losses": saved["losses"].tolist(),
                      "state_bytes": {k: int(saved[k]) for k in ("parameters", "gradients", "optimizer")}}
        result["rss_growth_bytes"] = [int((Path(tmp) / f"rank{r}.rss").read_text()) for r in range(world)]
    return result


def _fsdp_rank(rank: int, world: int, tmp: Path, cfg: TrainConfig, threads: int) -> None:
    """One process of fsdp_run."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .. import model as our_model
    from ..backend import numpy_ops
    from ..data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
    from ..data.sampler import BatchSampler

    def rss() -> int:  # this process's resident set now, from /proc (ru_maxrss is the peak)
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'rendezvous'}", rank=rank, world_size=world)
    try:
        corpus = Corpus.load(cfg.tokenizer or DEFAULT_TOKENIZER, cfg.corpus or DEFAULT_CORPUS,
                             val_path=cfg.val_corpus or None)
        mcfg = model_config(cfg.model, corpus.vocab_size)
        state = our_model.GPT2(mcfg, numpy_ops, seed=cfg.seed).state_dict()
        before = rss()
        module = build(mcfg, state, sdpa=True)
        del state
        mesh = init_device_mesh("cpu", (world,))
        for block in module.transformer["h"]:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        opt = adamw(module, cfg)
        sampler = BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=rank, world=world)
        loss_scale = sampler.n_local * world / cfg.batch  # FSDP averages the ranks' gradients, as DDP does
        step_ms, losses = [], []
        for step in range(cfg.steps):
            ids, targets = (torch.from_numpy(a.astype(np.int64)) for a in sampler.next())
            t0 = time.perf_counter()
            loss, _ = train_step(module, opt, ids, targets, step, cfg, loss_scale)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            loss = loss.detach()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        params = list(module.parameters())
        local = [p.to_local() for p in params]
        nbytes = {"parameters": sum(t.nbytes for t in local),
                  "gradients": sum(p.grad.to_local().nbytes for p in params if p.grad is not None),
                  "optimizer": sum(v.to_local().nbytes for p in params for v in opt.state[p].values()
                                   if torch.is_tensor(v) and v.dim() > 0)}
        (tmp / f"rank{rank}.rss").write_text(str(peak - before))
        if rank == 0:
            np.savez(tmp / "rank0.npz", step_ms=np.array(step_ms), losses=np.array(losses), **nbytes)
        dist.barrier()
    finally:
        dist.destroy_process_group()
