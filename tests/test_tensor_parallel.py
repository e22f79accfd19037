"""--tp N (model.py's Megatron split, parallel/tensor.py, the dp x tp mesh in train/loop.py): one model cut over
a tensor-parallel group is the model of one rank, step by step and in its checkpoints."""

import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from xtrain_dist.backend.numpy_ops import NumpyBackend
from xtrain_dist.checkpoint.safetensors_io import read_safetensors
from xtrain_dist.checkpoint.store import MODEL
from xtrain_dist.comm.launch_env import Launch
from xtrain_dist.comm.local import LocalGroup
from xtrain_dist.config import GPTConfig, TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.layout import join_flats, param_layout, shard_flat, vocab_rows
from xtrain_dist.model import GPT2
from xtrain_dist.train import memory
from xtrain_dist.train.cadence import kept_folder
from xtrain_dist.train.cli import parse_config
from xtrain_dist.train.job import train

CONFIG = GPTConfig(vocab_size=100, n_ctx=16, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def on_thread_ranks(world: int, fn) -> list:
    """fn(comm) on `world` rank threads of one local group: their results in rank order."""
    group = LocalGroup(world)
    results, errors = [None] * world, []

    def rank(r):
        comm = group.communicator(r)
        try:
            results[r] = fn(comm)
        except BaseException as err:  # raised on the test's thread below
            errors.append(err)
            comm.abort(str(err))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


class CountingGroup:
    """A tensor-parallel communicator that notes the size of every all-reduce it passes on."""

    def __init__(self, comm):
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.all_reduced: list[int] = []

    def all_reduce(self, buf):
        self.all_reduced.append(buf.size)
        self.comm.all_reduce(buf)

    def all_gather(self, send, recv, counts=None):
        self.comm.all_gather(send, recv, counts)


# ---------------------------------------------------------------------------------------------- the split
# 6 heads at tp 3: the padded vocabulary's 128 rows do not divide by 3, so each rank holds 43 and the last one's
# 129th row is more padding; ranks 1 and 2 (rows 43 .. 128) hold only padded rows of the 10 tokens
ODD = GPTConfig(vocab_size=10, n_ctx=16, n_layer=1, n_head=6, n_embd=24)


@pytest.mark.parametrize("config, tps", [(CONFIG, (1, 2, 4)), (ODD, (3, 6))])
@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_shards_join_back_into_the_full_layout_and_cut_c_attn_by_heads(config, tps, vocab_parallel):
    full = np.random.default_rng(0).standard_normal(param_layout(config)[1]).astype(np.float32)
    full = join_flats([full], config)  # zero between the tensors (ALIGN's padding), as a model's buffers are
    for tp in tps:
        shards = [shard_flat(full, config, tp, r, vocab_parallel=vocab_parallel) for r in range(tp)]
        assert np.array_equal(join_flats(shards, config, vocab_parallel=vocab_parallel), full)
    if config is not CONFIG:
        return
    specs = {s.name: s for s in param_layout(CONFIG)[0]}
    c_attn = specs["transformer.h.0.attn.c_attn.weight"]
    weight = full[c_attn.offset: c_attn.offset + c_attn.size].reshape(c_attn.shape)  # (C, 3C): q | k | v
    local = {s.name: s for s in param_layout(CONFIG, 2)[0]}["transformer.h.0.attn.c_attn.weight"]
    assert (local.shape, local.split) == ((32, 48), "qkv")
    rank1 = shard_flat(full, CONFIG, 2, 1)[local.offset: local.offset + local.size].reshape(local.shape)
    # rank 1 of 2 holds heads 2 and 3 (channels 16..31) of each of q, k and v
    assert np.array_equal(rank1, np.concatenate([weight[:, 16:32], weight[:, 48:64], weight[:, 80:96]], axis=1))
    # and rows 64 .. 127 of wte (the padded vocabulary's 128 cut in two) under the vocabulary-parallel split
    wte = {s.name: s for s in param_layout(CONFIG, 2, vocab_parallel=vocab_parallel)[0]}["transformer.wte.weight"]
    assert (wte.shape, wte.split) == (((64, 32), "vocab") if vocab_parallel else ((128, 32), "replicated"))


def test_the_vocab_ops_on_shards_are_the_whole_vocabulary_s_ops():
    """The oracle of the vocabulary-parallel ops, one by one: 3 shards of 43 columns of a 128-wide padded vocabulary
    of 100 tokens (the last shard one column past it, the last two mostly padding), their collectives done by hand.
    The embedding and its gradient are the whole op's bits; the loss and dlogits are fused_classifier's but for
    the sum's order."""
    ops, rng, V, Vp, tp, C = NumpyBackend(), np.random.default_rng(5), 100, 128, 3, 8
    R = -(-Vp // tp)
    ids = rng.integers(0, V, (2, 5)).astype(np.int32)
    wte = np.zeros((R * tp, C), dtype=np.float32)
    wte[:V] = rng.standard_normal((V, C))
    wpe = rng.standard_normal((5, C)).astype(np.float32)
    whole = ops.encoder_forward(ids, wte[:Vp], wpe)
    parts = [ops.vocab_encoder_forward(ids, wte[r * R:(r + 1) * R], wpe, r * R) for r in range(tp)]
    assert np.array_equal(sum(parts), whole)
    dout = rng.standard_normal((2, 5, C)).astype(np.float32)
    dwte, dwpe = np.zeros((Vp, C), dtype=np.float32), np.zeros_like(wpe)
    ops.encoder_backward(dwte, dwpe, dout, ids)
    shards, shard_dwpe = np.zeros((tp, R, C), dtype=np.float32), np.zeros_like(wpe)
    for r in range(tp):
        ops.vocab_encoder_backward(shards[r], shard_dwpe if r == 0 else np.zeros_like(wpe), dout, ids, r * R)
    assert np.array_equal(shards.reshape(-1, C)[:Vp], dwte) and np.array_equal(shard_dwpe, dwpe)

    logits = (rng.standard_normal((2, 5, R * tp)) * 3).astype(np.float32)
    logits[..., V:] = 0  # the padded columns' logits, as zero rows of wte make them
    targets = rng.integers(0, V, (2, 5)).astype(np.int32)
    dlogits = logits[..., :Vp].copy()
    losses = ops.fused_classifier(dlogits, targets, 0.25, V)
    pieces = [logits[..., r * R:(r + 1) * R].copy() for r in range(tp)]
    maxes = np.max([ops.vocab_max(piece, V, r * R) for r, piece in enumerate(pieces)], axis=0)
    sums = sum(ops.vocab_sums(piece, targets, maxes, V, r * R) for r, piece in enumerate(pieces))
    np.testing.assert_allclose(ops.vocab_classifier(pieces[0].copy(), targets, maxes, sums, None, V, 0), losses,
                               rtol=1e-6)
    mine = [ops.vocab_classifier(piece, targets, maxes, sums, 0.25, V, r * R) for r, piece in enumerate(pieces)]
    assert all(np.array_equal(m, mine[0]) for m in mine)
    np.testing.assert_allclose(mine[0], losses, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate(pieces, axis=-1)[..., :Vp], dlogits, rtol=1e-5, atol=1e-8)
    assert not np.concatenate(pieces, axis=-1)[..., V:].any()  # no gradient for a padded row


@pytest.mark.parametrize("config, tp, vocab_parallel", [(CONFIG, 2, False), (CONFIG, 4, False), (CONFIG, 2, True),
                                                       (CONFIG, 4, True), (ODD, 3, True)])
def test_a_step_at_tp_is_world_one_s_with_four_all_reduces_of_b_t_c_per_layer(config, tp, vocab_parallel):
    """In float64, where the sums' other order changes nothing above 1e-12: the same losses and gradients.
    The vocabulary-parallel classifier adds one all-reduce of (B, T, C) for the embedding, one of (2, B, T) for
    the softmax's sums and one of (B, T, C) for the classifier's input gradient, and never gathers the logits:
    each rank keeps its vocab_rows columns of them, and its rows of wte's gradient."""
    CONFIG = config
    rng = np.random.default_rng(1)
    ids, targets = (rng.integers(0, CONFIG.vocab_size, (2, 8)).astype(np.int32) for _ in range(2))
    one = GPT2(CONFIG, NumpyBackend(), seed=3, dtype=np.float64)
    init = one.gather_flat(one.params)
    # biases and gains away from their zeros and ones, so that a bias added on every rank would show
    full = join_flats([init + rng.standard_normal(one.full_size) * 0.05], CONFIG)  # zero between the tensors
    one.load_flat(full)
    losses = one.forward(ids, targets, 1 / 16)
    one.backward()

    def rank(comm):
        group = CountingGroup(comm)
        model = GPT2(CONFIG, NumpyBackend(), seed=3, tp=group, dtype=np.float64, vocab_parallel=vocab_parallel)
        assert np.array_equal(model.gather_flat(model.params), init)  # the full draws, sliced: the same model
        model.load_flat(full)
        mine = model.forward(ids, targets, 1 / 16)
        dlogits_shape = model._saved.dlogits.shape
        model.backward()
        calls = list(group.all_reduced)
        return (mine, calls, model.gather_flat(model.params), model.gather_flat(model.grads), model.grad_norm_squared(),
                dlogits_shape, model.g.wte.shape)

    width = vocab_rows(CONFIG, tp) if vocab_parallel else CONFIG.padded_vocab_size
    for mine, calls, params, grads, norm_squared, dlogits_shape, wte_grad_shape in on_thread_ranks(tp, rank):
        assert np.array_equal(params, full)
        np.testing.assert_allclose(mine, losses, rtol=1e-12)
        np.testing.assert_allclose(grads, one.grads[:one.full_size], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(norm_squared, one.grad_norm_squared(), rtol=1e-12)
        assert dlogits_shape == (2, 8, width) and wte_grad_shape == (width, CONFIG.n_embd)
        # Megatron's g after both row-parallel products in forward, f before both column-parallel ones in backward
        blocks = [2 * 8 * CONFIG.n_embd] * (2 * CONFIG.n_layer)
        if vocab_parallel:  # the embedding's sum first, the softmax's sums and the classifier's input gradient last
            blocks = [2 * 8 * CONFIG.n_embd, *blocks, 2 * 2 * 8, 2 * 8 * CONFIG.n_embd, *blocks]
        else:
            blocks = blocks + blocks
        assert calls == blocks


def test_saved_activations_are_a_tensor_parallel_rank_s():
    from test_memory import saved_arrays

    def rank(comm):
        model = GPT2(CONFIG, NumpyBackend(), seed=3, tp=comm)
        ids = np.zeros((2, 8), dtype=np.int32)
        model.forward(ids, ids, 1.0)
        return [(name, shape) for name, shape, _ in saved_arrays(model)]

    expected = [(name, shape) for name, shape, _ in memory.saved_activations(CONFIG, 2, 8, "standard", 0, tp=2)]
    assert on_thread_ranks(2, rank) == [expected, expected]


# ---------------------------------------------------------------------------------------------- training
def run(corpus, tmp_path, name, **kw):
    kw = {"steps": 20, "batch": 4, "seq": 32, "model": "tiny", "seed": 7, "eval_batches": 0, "cpu_threads": 1,
          "save_dir": str(tmp_path / name), **kw}
    cfg = TrainConfig(**kw).resolved()
    return train(cfg, corpus, log=lambda line: None)


def saved_params(tmp_path, name) -> dict:
    return read_safetensors(tmp_path / name / MODEL)[0]


@pytest.fixture(scope="module")
def world_one(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    return folder, run(corpus, folder, "one", keep_every=10)


@pytest.mark.parametrize("world, tp", [(2, 2), (4, 2)])
def test_training_at_tp_follows_world_one_and_keeps_shared_shards_bitwise_equal(corpus, world_one, tmp_path,
                                                                                 world, tp, built_models):
    models = built_models
    folder, one = world_one
    report = run(corpus, tmp_path, "tp", world_size=world, tp=tp)
    relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
    assert relative.max() < 1e-5, relative.max()
    reference, gathered = saved_params(folder, "one"), saved_params(tmp_path, "tp")
    # 20 steps of AdamW from float32 sums in another order (the products' split over ranks, then the all-reduce):
    # AdamW's m / sqrt(v) magnifies their rounding where a gradient is near zero. Measured at most 8.4e-6 (tp 2,
    # dp 2 x tp 2) and 2.1e-6 for plain data parallelism at world 2, on steps of lr = 1e-3; 2e-5 is 2% of one step
    for name, tensor in reference.items():
        np.testing.assert_allclose(gathered[name], tensor, rtol=0, atol=2e-5, err_msg=name)
    # the data-parallel replicas (ranks tp apart) hold the same shard, bit for bit, and the shards differ
    digests = report["param_sha256"]
    assert [digests[r] for r in range(world)] == [digests[r % tp] for r in range(world)]
    assert len(set(digests)) == tp
    # what every rank of a tensor-parallel group holds whole is bitwise the same on all of them
    assert len(models) == world
    replicated = [s for s in models[0].layout if s.split == "replicated"]
    for model in models[1:]:
        for s in replicated:
            assert np.array_equal(model.params[s.offset: s.offset + s.size],
                                  models[0].params[s.offset: s.offset + s.size]), s.name


@pytest.mark.parametrize("kw", [{"grad_sync": "flat", "all_reduce": "ring"}, {"grad_sync": "per-param"},
                                {"grad_accum": 2, "attention": "flash", "recompute": 2}, {"zero": 1}])
def test_every_sync_and_option_of_the_step_runs_inside_the_mesh(corpus, world_one, tmp_path, kw):
    _, one = world_one
    report = run(corpus, tmp_path, "tp", world_size=4, tp=2, **kw)
    relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
    assert relative.max() < 1e-5, relative.max()
    digests = report["param_sha256"]
    assert digests[0] == digests[2] != digests[1] == digests[3]
    # the time in collectives by group adds up to the whole, and so does the part the rank waited for
    groups = report["comm_s_by_group"]
    assert set(groups) == {"dp", "tp", "world"}
    assert sum(g["comm_s"] for g in groups.values()) == pytest.approx(report["comm_s"])
    assert sum(g["exposed_s"] for g in groups.values()) == pytest.approx(report["exposed_comm_s"])
    assert groups["tp"]["exposed_s"] == pytest.approx(groups["tp"]["comm_s"])  # the rank's own thread runs them


@pytest.mark.parametrize("mesh", [{"world_size": 2, "tp": 2}, {"world_size": 4, "tp": 2, "zero": 1}])
def test_a_tp_2_checkpoint_resumes_at_tp_1_and_back(corpus, world_one, tmp_path, mesh):
    """The checkpoint holds the full model and AdamW state (gathered over the tensor-parallel group, and under
    ZeRO-1 over the data-parallel one first), so it resumes on another mesh and world 1's on this one."""
    folder, one = world_one
    run(corpus, tmp_path, "tp", keep_every=10, **mesh)
    at_one = run(corpus, tmp_path, "resumed1", resume=str(kept_folder(tmp_path / "tp", 10)))
    at_two = run(corpus, tmp_path, "resumed2", resume=str(kept_folder(folder / "one", 10)), **mesh)
    for resumed in (at_one, at_two):
        assert resumed["start_step"] == 10
        relative = np.abs(np.array(resumed["losses"]) - one["losses"][10:]) / np.array(one["losses"][10:])
        assert relative.max() < 1e-5, relative.max()


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, line", [
    (["--tp", "0"], "--tp must be a positive integer, got '0'"),
    (["--tp", "two"], "--tp must be a positive integer, got 'two'"),
    (["--tp-classifier", "replicated"], "--tp-classifier has no effect without --tp (2 or more tensor-parallel ranks)"),
])
def test_tp_must_be_a_positive_integer(argv, line):
    with pytest.raises(XtrainError) as info:
        parse_config(["5", "8", "32", *argv], Launch("single"))
    assert str(info.value) == line


@pytest.mark.parametrize("kw, line", [
    ({"world_size": 4, "tp": 3}, "--tp must be a divisor of the world size (4), got '3'"),
    ({"world_size": 8, "tp": 8}, "--tp must be a divisor of the model's 4 heads, got '8'"),
    ({"world_size": 2, "tp": 2, "tp_classifier": "rows"}, "--tp-classifier must be one of vocab, replicated, got "
     "'rows'"),
    ({"world_size": 4, "tp": 2, "batch": 2, "grad_accum": 2}, "BATCH (2) must be at least the data-parallel size "
     "(the world size over --tp) times --grad-accum (2 x 2 = 4): every micro-batch needs a sequence in every "
     "data-parallel group"),
])
def test_bad_tp_runs_are_one_line_before_any_rank_starts(corpus, kw, line):
    cfg = TrainConfig(**{"steps": 2, "batch": 8, "seq": 32, "model": "tiny", **kw}).resolved()
    with pytest.raises(XtrainError) as info:
        train(cfg, corpus, log=lambda line: None)
    assert str(info.value) == line


def test_the_vocabulary_parallel_classifier_passes_the_cuda_backend_s_checks(corpus):
    """--tp 2 --backend cuda takes the vocabulary-parallel classifier (the default) and the replicated one:
    parallel/tensor.py's check, which the trainer runs once it has found a GPU (this machine may have none),
    refuses neither (tests/test_cuda_ops.py trains both)."""
    from xtrain_dist.parallel import tensor
    config = model_config("tiny", corpus.vocab_size)
    cfg = TrainConfig(steps=2, batch=8, seq=32, world_size=2, tp=2, backend="cuda", grad_sync="flat")
    assert cfg.tp_classifier == "vocab"
    tensor.check_config(cfg, config)
    tensor.check_config(replace(cfg, tp_classifier="replicated"), config)


def test_a_tp_rank_s_memory_counts_its_shards(corpus):
    config = model_config("tiny", corpus.vocab_size)
    cfg = TrainConfig(steps=1, batch=4, seq=32, world_size=4, tp=2)
    two, one = memory.rank_memories(config, cfg, 4), memory.rank_memories(config, TrainConfig(steps=1, batch=4,
                                                                                           seq=32, world_size=2), 4)
    assert two[0].gradients == 4 * param_layout(config, 2)[1] < one[0].gradients
    # each rank of the 2 x 2 mesh takes its data-parallel group's two rows, as each rank of world 2 does, and keeps
    # its heads', its MLP columns' and its logit columns' activations of them: less than a whole model's, more than
    # half (the residual stream is whole on every rank)
    assert one[0].activations / 2 < two[0].activations < one[0].activations
    # --tp-classifier replicated keeps wte and the logits whole: the bound counts the Vp x C rows and B x T x Vp
    # logits that the vocabulary-parallel rank holds half of
    whole = memory.rank_memories(config, replace(cfg, tp_classifier="replicated"), 4)
    C, V, tokens = config.n_embd, config.padded_vocab_size, 2 * 32
    assert whole[0].gradients - two[0].gradients == 4 * (V - V // 2) * C
    assert whole[0].activations - two[0].activations == 4 * tokens * (V - V // 2)
    assert len({m.activations for m in two}) == 1
    # ZeRO-1 shards each rank's buffer over its data-parallel group: ranks 0 and 1 hold the first half's state
    from xtrain_dist.parallel.zero import shard_bounds
    zero = memory.rank_memories(config, TrainConfig(steps=1, batch=4, seq=32, world_size=4, tp=2, zero=1), 4)
    halves = [8 * (hi - lo) for lo, hi in shard_bounds(param_layout(config, 2)[1], 2)]
    assert [m.optimizer for m in zero] == [halves[0], halves[0], halves[1], halves[1]]


def test_an_mpi_library_without_thread_multiple_refuses_the_overlapped_sync(corpus, tmp_path, monkeypatch):
    from xtrain_dist.comm.local import LocalCommunicator
    from xtrain_dist.train.launch import RankFailed
    monkeypatch.setattr(LocalCommunicator, "concurrent_groups", False, raising=False)  # as MpiCommunicator's may be
    with pytest.raises(RankFailed) as info:
        run(corpus, tmp_path, "refused", world_size=2, tp=2)
    assert str(info.value.error) == (
        "--tp with --grad-sync bucketed calls MPI from two threads at once (the tensor-parallel all-reduces and the "
        "overlapped gradient sync), and this MPI library was initialised without MPI_THREAD_MULTIPLE: use "
        "--grad-sync flat")
    run(corpus, tmp_path, "flat", world_size=2, tp=2, grad_sync="flat")


# ---------------------------------------------------------------------------------------------- MPI processes
MPIRUN = Path(sys.executable).parent / "mpirun"


def mpirun_train(processes: int, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """python -m xtrain_dist.train_ddp ARGS under mpirun -n PROCESSES, from this checkout."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.run([str(MPIRUN), "-n", str(processes), sys.executable, "-m", "xtrain_dist.train_ddp", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun beside this Python: pip install -e '.[mpi]'")
def test_dp_2_x_tp_2_through_mpi_processes_follows_world_one(world_one, tmp_path):
    folder, one = world_one
    out = mpirun_train(4, "20", "4", "32", "--tp", "2", "--seed", "7", "--eval-batches", "0", "--report",
                       str(tmp_path / "r.json"), "--save-dir", str(tmp_path / "mpi"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["launch"]["comm"] == "mpi" and report["config"]["tp"] == 2
    assert_follows_world_one(report, one["losses"], folder, tmp_path)


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun beside this Python: pip install -e '.[mpi]'")
def test_world_one_s_checkpoint_goes_on_at_dp_2_x_tp_2_over_rank_threads_of_two_mpi_processes(world_one, tmp_path):
    """Two MPI processes of two rank threads: each tensor-parallel group the threads of one process, each
    data-parallel group a process communicator (comm/hybrid.py); started from world 1's step 10."""
    folder, one = world_one
    out = mpirun_train(2, "20", "4", "32", "--world-size", "4", "--tp", "2", "--seed", "7", "--eval-batches", "0",
                       "--resume", str(kept_folder(folder / "one", 10)), "--report", str(tmp_path / "r.json"),
                       "--save-dir", str(tmp_path / "mpi"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["launch"] == {"kind": "mpirun", "processes": 2, "threads_per_process": 2, "comm": "mpi"}
    assert report["start_step"] == 10
    assert_follows_world_one(report, one["losses"][10:], folder, tmp_path)


def assert_follows_world_one(report, losses, folder, tmp_path) -> None:
    """Losses within 1e-5 of world 1's, the final checkpoint world 1's model within 2e-5, and the data-parallel
    replicas of each tp 2 shard bitwise equal."""
    relative = np.abs(np.array(report["losses"]) - losses) / np.array(losses)
    assert relative.max() < 1e-5, relative.max()
    digests = report["param_sha256"]
    assert digests[0] == digests[2] != digests[1] == digests[3]
    reference, gathered = saved_params(folder, "one"), saved_params(tmp_path, "mpi")
    for name, tensor in reference.items():
        np.testing.assert_allclose(gathered[name], tensor, rtol=0, atol=2e-5, err_msg=name)


def test_evaluation_hellaswag_and_samples_at_tp_are_world_one_s(corpus, tmp_path):
    """Each data-parallel group scores its share of the held-out set; rank 0's tensor-parallel group draws the
    samples together (with one seed, on logits that are the same bits on each of its ranks)."""
    from test_hellaswag import random_examples, write
    path = write(tmp_path / "hs.bin", random_examples(10, seed=4))
    reports = [run(corpus, tmp_path, f"eval{world}", world_size=world, tp=tp, eval_every=10, eval_batches=2,
                   hellaswag=str(path), sample_every=10, sample_tokens=16) for world, tp in ((1, 1), (4, 2))]
    (loss_one, loss_tp), (score_one, score_tp) = ([r[key] for r in reports] for key in ("val_losses", "hellaswag"))
    assert [step for step, _ in loss_tp] == [step for step, _ in score_tp] == [10, 20]
    np.testing.assert_allclose([v for _, v in loss_tp], [v for _, v in loss_one], rtol=1e-5)
    assert score_tp == score_one
    samples = [r["samples"] for r in reports]
    assert [step for step, _ in samples[1]] == [10, 20] and samples[1] == samples[0]


def test_a_bad_tp_on_the_command_line_is_one_line_and_exit_status_2():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "4", "32", "--world-size", "4",
                          "--tp", "3"], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert (out.returncode, out.stdout, out.stderr) == (
        2, "", "train_ddp: error: --tp must be a divisor of the world size (4), got '3'\n")


@pytest.mark.parametrize("classifier", ["vocab", "replicated"])
def test_the_report_counts_each_groups_payload_as_the_textbook_does(corpus, tmp_path, classifier):
    """comm_bytes_per_step, rank 0's bytes handed to collectives in a step by group: at dp 2 x tp 2, the
    tensor-parallel group's four all-reduces of (B/dp, T, C) float32 per layer and the gradient norm's one
    float32, and with the vocabulary-parallel classifier two more of (B/dp, T, C) (the embedding, the classifier's
    input gradient), the all-gather of each row's largest logit (B/dp, T) and the all-reduce of the softmax's two
    sums (2, B/dp, T); the data-parallel group's flat gradient sync of the rank's shards; the world's loss and stop
    request (two float32)."""
    report = run(corpus, tmp_path, "bytes", steps=2, world_size=4, tp=2, grad_sync="flat", tp_classifier=classifier)
    config = model_config("tiny", corpus.vocab_size)
    rows, seq, width = 4 // 2, 32, config.n_embd
    vocab = classifier == "vocab"
    shards = param_layout(config, 2, vocab_parallel=vocab)[1]
    assert report["comm_bytes_per_step"] == {
        "tp": (4 * config.n_layer + 2 * vocab) * rows * seq * width * 4 + 3 * vocab * rows * seq * 4 + 4,
        "dp": shards * 4, "world": 2 * 4}


def test_bench_mesh_measures_each_mesh_against_the_textbook_and_world_one(tmp_path):
    """bin/bench_mesh at world 1, tp 2 and dp 2 x tp 2 of the tiny model: its rows' bytes per group are the
    textbook's (it exits non-zero where they are not), the meshes' losses follow world 1's, and a bad mesh is one
    line."""
    script = Path(__file__).resolve().parents[1] / "bin" / "bench_mesh"
    done = subprocess.run([sys.executable, str(script), "--model", "tiny", "--batch", "4", "--seq", "16", "--steps",
                           "3", "--meshes", "1,tp2,dp2xtp2,tp2sp", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mesh.json", "mesh.md", "mesh.png"]
    rows = json.loads((tmp_path / "mesh.json").read_text())["rows"]
    assert [(r["mesh"], r["ranks"]) for r in rows] == [("world 1", 1), ("tp 2", 2), ("dp 2 x tp 2", 4),
                                                       ("tp 2 sp", 2)]
    assert all(r["bytes"] == r["expected_bytes"] for r in rows)
    assert rows[2]["bytes"]["tp"] * 2 == rows[1]["bytes"]["tp"] + 4  # half the rows each, the norm's float the same
    # --sequence-parallel: the same losses, and every activation the blocks keep halved (the residual stream and
    # the layernorms' too: 4 of tp 2's 16 values a token and channel were whole)
    assert rows[3]["losses"] == rows[1]["losses"] or rows[3]["loss_rel_diff"] < 1e-5
    assert rows[3]["block_activation_bytes"] * 2 == rows[0]["block_activation_bytes"]
    assert all(r["loss_rel_diff"] < 1e-5 for r in rows)
    # the classifier alone: at tp 2 the vocabulary-parallel rank holds half of wte's rows and of the logits' columns
    # (the shipped tokenizer's 4096 rows, split evenly), hands its group the maxima, the sums and the input
    # gradient (4 x 16 tokens: 4 x 64 x (1 + 2 + 64) bytes), and its loss is world 1's
    heads = json.loads((tmp_path / "mesh.json").read_text())["classifier"]
    assert [(h["tp"], h["classifier"]) for h in heads] == [(1, "replicated"), (2, "replicated"), (2, "vocab")]
    assert heads[0]["wte_bytes"] == heads[1]["wte_bytes"] == 2 * heads[2]["wte_bytes"] == 4096 * 64 * 4
    assert heads[0]["logits_bytes"] == heads[1]["logits_bytes"] == 2 * heads[2]["logits_bytes"] == 4 * 16 * 4096 * 4
    assert (heads[1]["comm_bytes"], heads[2]["comm_bytes"]) == (0, 4 * 64 * (1 + 2 + 64))
    assert heads[1]["loss_rel_diff"] == 0 and heads[2]["loss_rel_diff"] < 1e-6
    bad = subprocess.run([sys.executable, str(script), "--meshes", "1,ep2"], capture_output=True, text=True,
                         timeout=60)
    assert (bad.returncode, bad.stderr) == (2, "bench_mesh: error: --meshes must be a comma-separated list of 1, dpN, "
                                               "tpN, tpNsp, ppN or dpNxtpNxppN, got '1,ep2'\n")
