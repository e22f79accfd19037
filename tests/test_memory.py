"""The pre-flight memory check (train/memory.py): its figures are the arrays a rank really holds, and a run that
cannot fit is refused in one line before anything is allocated."""

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from xtrain_dist.backend.numpy_ops import NumpyBackend
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.data.sampler import BatchSampler
from xtrain_dist.errors import XtrainError
from xtrain_dist.eval.evaluate import Evaluator
from xtrain_dist.model import GPT2
from xtrain_dist.parallel.zero import make_optimizer
from xtrain_dist.train import memory
from xtrain_dist.train.loop import micro_batches

ROOT = Path(__file__).resolve().parents[1]
KIND_DTYPE = {"f32": np.float32, "i32": np.int32}


def saved_arrays(model) -> list[tuple[str, tuple, np.dtype]]:
    """(name, shape, dtype) of every array GPT2.forward kept for backward, in memory.saved_activations'
    order: read from the model itself, the oracle for that list (also used by the GPU tests)."""
    ids, acts, x, lnf, lnf_mean, lnf_rstd, dlogits, _rows = model._saved  # rows: dropout's two numbers, no array
    named = [("ids", ids)]
    for layer, a in enumerate(acts):  # None: what --recompute leaves to backward
        named += [(f"h.{layer}.{f.name}", getattr(a, f.name)) for f in fields(a) if getattr(a, f.name) is not None]
    named += [("x", x), ("lnf", lnf), ("lnf_mean", lnf_mean), ("lnf_rstd", lnf_rstd), ("dlogits", dlogits)]
    return [(name, tuple(arr.shape), np.dtype(arr.dtype)) for name, arr in named]


def expected_arrays(config, B, T, attention, act_dtype, recompute=0) -> list[tuple[str, tuple, np.dtype]]:
    return [(name, shape, np.dtype(act_dtype if kind == "act" else KIND_DTYPE[kind]))
            for name, shape, kind in memory.saved_activations(config, B, T, attention, recompute)]


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


@pytest.mark.parametrize("recompute", [0, 1, 2])
@pytest.mark.parametrize("attention", ["standard", "flash"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_saved_activations_are_what_forward_keeps(corpus, attention, dtype, recompute):
    config = model_config("tiny", corpus.vocab_size)
    backend = NumpyBackend(dtype)
    model = GPT2(config, backend, seed=3, attention=attention, recompute=recompute)
    B, T = 3, 24
    ids, targets = BatchSampler(corpus.train, B, T, seed=1).next()
    model.forward(ids, targets, dloss=1.0 / (B * T))
    assert saved_arrays(model) == expected_arrays(config, B, T, attention, backend.act_dtype, recompute)


def test_the_figures_count_the_padded_vocabulary():
    """V = 1000: wte holds 1024 rows and the logits are 1024 wide, and the bound counts them so: the
    parameters, gradients and AdamW state are the model's layout, and the saved dlogits are (B, T, 1024)."""
    config = model_config("tiny", 1000)
    B, T = 2, 16
    cfg = TrainConfig(steps=1, batch=B, seq=T, model="tiny")
    got = memory.rank_memories(config, cfg, act_itemsize=4)[0]
    model = GPT2(config, NumpyBackend("fp32"), seed=1)
    ids = np.random.default_rng(0).integers(0, 1000, (B, T + 1)).astype(np.int32)
    model.forward(ids[:, :-1], ids[:, 1:], dloss=1.0)
    assert saved_arrays(model)[-1] == ("dlogits", (B, T, 1024), np.dtype(np.float32))
    assert saved_arrays(model) == expected_arrays(config, B, T, "standard", np.float32)
    assert got.parameters == model.params.nbytes + model.decay_mask.nbytes and got.gradients == model.grads.nbytes
    assert model.params.size >= model.num_params + 24 * config.n_embd  # the layout holds the padded rows


def test_recompute_saves_what_it_leaves_out(corpus):
    """Per layer at 4 x 32 on tiny (C 64): level 1 drops GELU's B*T*4C float32s, level 2 also the two
    layernorm outputs (2 B*T*C)."""
    config = model_config("tiny", corpus.vocab_size)
    saved = [memory.rank_memories(config, TrainConfig(steps=1, batch=4, seq=32, recompute=level), 4)[0].activations
             for level in (0, 1, 2)]
    per_layer = 4 * 32 * 64 * 4  # B*T*C float32 bytes
    assert saved[0] - saved[1] == config.n_layer * 4 * per_layer
    assert saved[1] - saved[2] == config.n_layer * 2 * per_layer


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_ranks_figures_are_its_arrays(corpus, zero, dtype):
    """World 3, BATCH 7, --grad-accum 2: rank 0 gets 3 sequences (micro-batches of 2 and 1), ranks 1 and 2
    get 2 (1 and 1); each rank's parameters, gradients, optimizer state (its ZeRO shard) and largest
    micro-batch's activations are the nbytes of the arrays that rank builds."""
    cfg = TrainConfig(steps=1, batch=7, seq=16, model="tiny", world_size=3, grad_accum=2, zero=zero, dtype=dtype)
    config = model_config("tiny", corpus.vocab_size)
    figures = memory.rank_memories(config, cfg, act_itemsize=4)
    assert len(figures) == 3
    for rank, got in enumerate(figures):
        backend = NumpyBackend(dtype)
        model = GPT2(config, backend, seed=1)
        optimizer = make_optimizer(model, cfg, SimpleNamespace(rank=rank, world_size=3))
        lowp = model.lowp_copy.nbytes if model.lowp_copy is not None else 0
        assert got.parameters == model.params.nbytes + lowp + model.decay_mask.nbytes
        assert got.gradients == model.grads.nbytes
        assert got.optimizer == optimizer.state_bytes
        sampler = BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=1, rank=rank, world=3)
        saved = []
        for ids, targets in micro_batches(*sampler.next(), cfg.grad_accum):
            model.forward(ids, targets, dloss=1.0)
            saved.append(sum(int(np.prod(shape)) * dt.itemsize for _, shape, dt in saved_arrays(model)))
            model.backward()
        assert got.activations == max(saved), (rank, got.activations, saved)
    assert figures[0].activations > figures[1].activations == figures[2].activations


def test_every_ranks_validation_figure_is_the_held_out_windows_it_keeps(corpus):
    """World 3, BATCH 7, 4 evaluation batches: rank 0 keeps 3 windows a batch, ranks 1 and 2 keep 2, each
    as ids and targets; the figure is the nbytes of the Evaluator's arrays, and counts as persistent."""
    cfg = TrainConfig(steps=1, batch=7, seq=16, model="tiny", world_size=3, eval_batches=4)
    figures = memory.rank_memories(model_config("tiny", corpus.vocab_size), cfg, act_itemsize=4)
    for rank, got in enumerate(figures):
        evaluator = Evaluator(corpus.val, cfg.batch, cfg.seq, cfg.eval_batches, rank, 3, NumpyBackend())
        assert got.validation == sum(a.nbytes for pair in evaluator.batches for a in pair) > 0, rank
        assert got.persistent == got.parameters + got.gradients + got.optimizer + got.validation
    assert figures[0].validation == 3 * 4 * 16 * 2 * 4


def test_a_held_out_set_too_large_for_the_machine_is_refused_before_it_starts(tmp_path):
    """--eval-batches 10**9 of 16 x 64 is 4 TiB of windows a rank: refused in one line naming them, where the
    run used to start and end in a MemoryError from numpy."""
    run = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "16", "64", "--world-size", "2",
                          "--eval-batches", str(10**9), "--report", str(tmp_path / "r.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    [line] = run.stderr.splitlines()
    assert line.startswith("train_ddp: error: not enough memory for this run: its 2 ranks need at least "), line
    assert "of AdamW state and 3814.70 GiB of validation windows, and one rank at a time" in line, line
    assert line.endswith("lower BATCH, SEQ, --world-size or --eval-batches, or raise --grad-accum, or use "
                         "--zero 1, --attention flash or --recompute 2"), line
    assert not (tmp_path / "r.json").exists()


def test_bf16_on_a_gpu_halves_the_activations_and_the_copy_forward_reads(corpus):
    config = model_config("tiny", corpus.vocab_size)
    cfg = TrainConfig(steps=1, batch=4, seq=32, model="tiny", dtype="bf16")
    wide, narrow = memory.rank_memories(config, cfg, 4)[0], memory.rank_memories(config, cfg, 2)[0]
    size = GPT2(config, NumpyBackend(), seed=0).size
    assert wide.parameters - narrow.parameters == 2 * size
    saved = memory.saved_activations(config, 4, 32, "standard")
    act_elements = sum(int(np.prod(shape)) for _, shape, kind in saved if kind == "act")
    assert wide.activations - narrow.activations == 2 * act_elements


def test_the_cublas_workspaces_are_in_every_cuda_ranks_state(corpus):
    """--backend cuda: each rank's cuBLAS handle holds a workspace for the whole run (cublas.WORKSPACE_BYTES), and
    with --matmul cublaslt its LtMatmul another (cublaslt.WORKSPACE_BYTES; test_cuda_ops holds the allocations
    to them), counted as persistent state and named when a run is refused; numpy ranks hold none."""
    from xtrain_dist.backend.cuda import cublas, cublaslt

    config = model_config("tiny", corpus.vocab_size)
    plain, lt = (memory.rank_memories(config, TrainConfig(steps=1, batch=4, seq=32, model="tiny", world_size=2,
                                                           backend="cuda", dtype="bf16", matmul=matmul), 2)
                 for matmul in ("cublas", "cublaslt"))
    numpy_ranks = memory.rank_memories(config, TrainConfig(steps=1, batch=4, seq=32, model="tiny", world_size=2), 4)
    assert [r.workspace for r in numpy_ranks] == [0, 0]
    assert [r.workspace for r in plain] == [32 << 20] * 2 and [r.workspace for r in lt] == [64 << 20] * 2
    assert cublaslt.WORKSPACE_BYTES == cublas.WORKSPACE_BYTES == 32 << 20
    assert [b.persistent - a.persistent for a, b in zip(plain, lt, strict=True)] == [32 << 20] * 2
    assert memory.least_bytes(lt) - memory.least_bytes(plain) == 2 * (32 << 20)
    with pytest.raises(XtrainError) as e:
        memory.check_fits(lt[:1], memory.least_bytes(lt[:1]) - 1, "GPU 0", TrainConfig(steps=1, batch=4, seq=32))
    assert "2.8 MiB of AdamW state and 64.0 MiB of cuBLAS workspace, and 0.8 MiB of activations" in str(e.value)


def needs(persistent, activations):
    return memory.RankMemory(parameters=persistent, gradients=0, optimizer=0, activations=activations)


def test_ranks_sharing_memory_count_all_their_state_and_one_ranks_activations():
    cfg = TrainConfig(steps=1, batch=4, seq=8)
    group = [needs(100, 40), needs(100, 70), needs(90, 70)]
    assert memory.least_bytes(group) == 360
    memory.check_fits(group, 360, "this machine", cfg)   # exactly full fits
    memory.check_fits(group, None, "this machine", cfg)  # unknown: not checked
    with pytest.raises(XtrainError) as e:
        memory.check_fits(group, 359, "GPU 1", cfg)
    assert str(e.value) == (
        "not enough memory for this run: its 3 ranks need at least 360 B and GPU 1 has 359 B available (a rank "
        "holds up to 100 B of parameters, 0 B of gradients and 0 B of AdamW state, and one rank at a time at "
        "least 70 B of activations kept for backward); lower BATCH, SEQ or --world-size, or raise --grad-accum, "
        "or use --zero 1, --attention flash or --recompute 2")


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
def test_a_zero1_run_short_of_memory_is_offered_zero3(backend):
    cfg = TrainConfig(steps=1, batch=4, seq=8, zero=1, attention="flash", recompute=2, backend=backend)
    with pytest.raises(XtrainError) as e:
        memory.check_fits([needs(3 << 30, 1 << 29)], 1 << 30, "this machine", cfg)
    assert str(e.value).endswith("lower BATCH, SEQ or --world-size, or raise --grad-accum, or use --zero 3")


@pytest.mark.parametrize("zero, cfg", [(3, {}), (1, {"grad_sync": "flat"}), (2, {"tp": 2, "world_size": 2})],
                         ids=["zero3", "zero1-flat", "zero2-tp"])
def test_the_remedies_leave_out_what_the_run_already_does(zero, cfg):
    """...and ZeRO-3 where it does not run yet (parallel/zero.py)."""
    cfg = TrainConfig(steps=1, batch=4, seq=8, zero=zero, attention="flash", recompute=2, **cfg)
    with pytest.raises(XtrainError) as e:
        memory.check_fits([needs(3 << 30, 1 << 29)], 1 << 30, "this machine", cfg)
    assert str(e.value) == (
        "not enough memory for this run: it needs at least 3.50 GiB and this machine has 1.00 GiB available "
        "(3.00 GiB of parameters, 0 B of gradients and 0 B of AdamW state, and 0.50 GiB of activations kept for "
        "backward); lower BATCH, SEQ or --world-size, or raise --grad-accum")


def test_this_machines_available_memory_is_read():
    available = memory.host_available_bytes()
    if not Path("/proc/meminfo").exists():
        assert available is None
        return
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    assert 0 < available <= total


def test_a_run_too_large_for_the_machine_is_refused_before_it_starts(tmp_path):
    """5000 ranks of GPT-2 774M need terabytes: one line, exit 2, at once, and nothing written."""
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "5000", "64", "--model", "gpt2-774m",
                          "--world-size", "5000", "--zero", "1", "--report", str(report)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    [line] = run.stderr.splitlines()
    assert line.startswith("train_ddp: error: not enough memory for this run: its 5000 ranks need at least "), line
    assert "this machine has" in line, line
    assert line.endswith("or raise --grad-accum, or use --zero 3, --attention flash or --recompute 2"), line
    assert not report.exists()


def test_more_blas_threads_than_cores_is_said_once(tmp_path):
    cores = len(os.sched_getaffinity(0))
    command = [sys.executable, "-m", "xtrain_dist.train_ddp", "1", "2", "16", "--world-size", "2"]
    over = subprocess.run([*command, "--cpu-threads", str(cores)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert over.returncode == 0, over.stderr
    assert over.stdout.splitlines()[0] == (
        f"note: --cpu-threads {cores} x 2 rank(s) on this machine is {2 * cores} BLAS threads on {cores} cores: "
        "threads beyond the cores slow the step down, often many times over (leave --cpu-threads out for one a "
        "rank)")
    shared = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert shared.returncode == 0 and "note:" not in shared.stdout, shared.stdout


@pytest.mark.long
def test_the_report_sets_the_bound_beside_what_the_run_took(tmp_path):
    """A run whose activations dominate (mini, 32 x 256: about 0.5 GiB of them): the process's peak RSS is
    above the bound, as a lower bound must be, and not far above it (Python, numpy and the corpus take
    about 0.1 GiB before any array of the run), so the bound counts what matters. The peak is the
    kernel's count of the process's pages, not only of its arrays: on the 2-core development machine,
    0.77 GiB with the token cache written, 0.81 GiB when the corpus is encoded first (0.98 GiB before
    corpus._encode_text went a group of paragraphs at a time), and once 1.07 GiB inside a full test run,
    never explained, hence a margin of 2x."""
    report = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "1", "32", "256", "--model", "mini",
                          "--eval-batches", "0", "--report", str(report)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    figures = json.loads(report.read_text())["memory"]
    bound, peak = sum(figures["rank0_bytes_at_least"].values()), figures["peak_rss_bytes"]
    assert figures["rank0_bytes_at_least"]["activations"] > 0.9 * bound
    assert bound <= peak <= 2 * bound + (256 << 20), (bound, peak)
    assert run.stdout.splitlines()[-1].endswith(f", peak RSS {memory.gib(peak)}, report {report}")


def test_ranks_that_fit_only_one_at_a_time_get_a_note_and_run(corpus, monkeypatch):
    """Between the two figures (all the state and one rank's activations; every rank's activations at once)
    the run goes ahead, saying it may run out of memory."""
    from xtrain_dist.train import job

    cfg = TrainConfig(steps=1, batch=4, seq=32, world_size=2, eval_batches=0).resolved()
    figures = memory.rank_memories(model_config("tiny", corpus.vocab_size), cfg, 4)
    least, overlapping = memory.least_bytes(figures), sum(n.persistent + n.activations for n in figures)
    assert least < overlapping
    monkeypatch.setattr(memory, "host_available_bytes", lambda: least)
    lines = []
    report = job.train(cfg, corpus, log=lines.append)
    assert len(report["losses"]) == 1
    assert lines[0] == (f"note: the 2 ranks on this machine need at least {memory.gib(least)}, and "
                        f"{memory.gib(overlapping)} when their steps overlap, as they usually do; this machine has "
                        f"{memory.gib(least)} available, so the run may run out of memory: lower BATCH, SEQ or "
                        "--world-size, or raise --grad-accum, or use --zero 1, --attention flash or --recompute 2")
    monkeypatch.setattr(memory, "host_available_bytes", lambda: overlapping)
    lines.clear()
    job.train(cfg, corpus, log=lines.append)
    assert not any(line.startswith("note:") for line in lines), lines
    monkeypatch.setattr(memory, "host_available_bytes", lambda: least - 1)
    with pytest.raises(XtrainError, match=r"^not enough memory for this run: its 2 ranks need at least "):
        job.train(cfg, corpus, log=lines.append)
