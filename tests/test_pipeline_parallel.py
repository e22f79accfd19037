"""--pp M (model.py's stages, parallel/pipeline.py's schedules, the pp x dp x tp mesh in train/loop.py): one model
cut into pipeline stages is the model of one rank, step by step and in its checkpoints."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_tensor_parallel import CONFIG, MPIRUN, mpirun_train, on_thread_ranks, run, saved_params

from xtrain_dist.backend.numpy_ops import NumpyBackend
from xtrain_dist.comm.launch_env import Launch
from xtrain_dist.config import GPTConfig, TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.layout import WTE, join_flats, join_stages, param_layout, shard_flat, stage_blocks
from xtrain_dist.model import GPT2
from xtrain_dist.parallel import pipeline
from xtrain_dist.parallel.pipeline import run_schedule
from xtrain_dist.train import loop, memory
from xtrain_dist.train.cadence import kept_folder
from xtrain_dist.train.cli import parse_config
from xtrain_dist.train.job import train

DEEP = GPTConfig(vocab_size=100, n_ctx=16, n_layer=3, n_head=4, n_embd=32)  # 3 blocks: stages of 2 and 1 at pp 2


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


class CountingPipe:
    """A pipeline communicator that notes the elements of every array it sends (send and sendrecv)."""

    def __init__(self, comm):
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.sent: list[int] = []

    def send(self, buf, peer):
        self.sent.append(buf.size)
        self.comm.send(buf, peer)

    def recv(self, buf, peer):
        self.comm.recv(buf, peer)

    def sendrecv(self, send, dest, recv, source):
        self.sent.append(send.size)
        self.comm.sendrecv(send, dest, recv, source)

    def all_reduce(self, buf):
        self.comm.all_reduce(buf)

    def all_gather(self, send, recv, counts=None):
        self.comm.all_gather(send, recv, counts)


# ---------------------------------------------------------------------------------------------- the split
def test_stages_take_contiguous_blocks_the_first_ones_the_extra_and_their_layouts_join_back():
    assert [list(stage_blocks(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(stage_blocks(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]
    names = [[s.name for s in param_layout(DEEP, 1, 2, stage)[0]] for stage in range(2)]
    assert names[0][0] == "transformer.h.1.mlp.c_proj.weight" and names[0][-2:] == ["transformer.wpe.weight", WTE]
    assert names[1][:3] == ["transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.h.2.mlp.c_proj.weight"]
    assert names[1][-1] == WTE and "transformer.wpe.weight" not in names[1]
    full = np.random.default_rng(0).standard_normal(param_layout(DEEP)[1]).astype(np.float32)
    for tp, pp in ((1, 2), (2, 2), (1, 3), (2, 3)):
        stages = [join_flats([shard_flat(full, DEEP, tp, r, pp=pp, stage=s) for r in range(tp)], DEEP, pp, s)
                  for s in range(pp)]
        assert np.array_equal(join_stages(stages, DEEP), full)


@pytest.mark.parametrize("tp, pp, kind", [(1, 2, "1f1b"), (1, 2, "gpipe"), (1, 3, "1f1b"), (2, 2, "1f1b")])
def test_a_pipelined_step_is_world_one_s_and_sends_b_t_c_per_micro_batch_each_way(tp, pp, kind):
    """In float64, where the sums' other order changes nothing above 1e-12: the same losses, gradients and norm,
    both copies of wte with the whole gradient, and each boundary crossed by one (B_micro, T, C) activation
    forward and one gradient back per micro-batch."""
    rng = np.random.default_rng(1)
    micro, B, T = 3, 2, 8
    ids, targets = (rng.integers(0, DEEP.vocab_size, (micro, B, T)).astype(np.int32) for _ in range(2))
    one = GPT2(DEEP, NumpyBackend(), seed=3, dtype=np.float64)
    full = one.gather_flat(one.params) + rng.standard_normal(one.full_size) * 0.05
    one.load_flat(full)
    losses = []
    for i in range(micro):
        losses.append(one.forward(ids[i], targets[i], 1 / (micro * B * T)))
        one.backward()

    def rank(comm):
        mesh = loop.DeviceMesh(comm, dp=1, tp=tp, pp=pp)
        pipe = CountingPipe(mesh.pp)
        model = GPT2(DEEP, NumpyBackend(), seed=3, dtype=np.float64, tp=mesh.tp, pp=pipe)
        model.load_flat(full)
        tapes, mine = {}, {}

        def forward(i, inp):
            out, tapes[i] = model.stage_forward(ids[i], inp, targets[i], 1 / (micro * B * T))
            mine[i] = out
            return out

        def received(i):
            return np.empty((B, T, DEEP.n_embd))

        run_schedule(pipe, kind, micro, forward, lambda i, dout: model.stage_backward(tapes.pop(i), dout),
                     received, received)
        sent = list(pipe.sent)
        model.sum_tied_embedding_grads()
        wte_grad = model.g.wte.copy() if model.is_first or model.is_last else None  # the stages between have none
        return model.stage, mine, sent, wte_grad, model.gather_flat(model.grads), model.grad_norm_squared()

    results = on_thread_ranks(tp * pp, rank)
    for stage, mine, sent, _, grads, norm_squared in results:
        if stage == pp - 1:
            np.testing.assert_allclose([mine[i] for i in range(micro)], losses, rtol=1e-12)
        # every stage but the last sends its activations, every stage but the first the gradient of its input
        assert sent == [B * T * DEEP.n_embd] * micro * ((stage < pp - 1) + (stage > 0))
        np.testing.assert_allclose(grads, one.grads[:one.full_size], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(norm_squared, one.grad_norm_squared(), rtol=1e-12)
    # the first and last stages' wte gradients: the sum of both, the same bits on both (at tp 2 each
    # tensor-parallel rank holds its rows of the vocabulary: rank t of the first stage and rank t of the last)
    for t in range(tp):
        first, last = results[t][3], results[(pp - 1) * tp + t][3]
        assert np.array_equal(first, last)


def test_a_stage_keeps_the_activations_memory_counts():
    from test_memory import saved_arrays

    def rank(comm):
        model = GPT2(DEEP, NumpyBackend(), seed=3, pp=comm)
        ids = np.zeros((2, 8), dtype=np.int32)
        inp = None if model.is_first else np.zeros((2, 8, DEEP.n_embd), dtype=np.float32)
        _, model._saved = model.stage_forward(ids, inp, ids, 1.0)
        if not model.is_last:  # saved_arrays reads the head's part too: a stage before the last has none
            model._saved = model._saved._replace(lnf=model._saved.x, lnf_mean=model._saved.x,
                                                 lnf_rstd=model._saved.x, dlogits=model._saved.x)
        named = saved_arrays(model)
        # saved_arrays numbers the tape's blocks from 0: this stage's are stage_blocks'
        first = model.blocks[0]
        named = [(name.replace(f"h.{name.split('.')[1]}.", f"h.{int(name.split('.')[1]) + first}.")
                  if name.startswith("h.") else name, shape) for name, shape, _ in named]
        return named[:len(named) - (0 if model.is_last else 4)]

    expected = [[(name, shape) for name, shape, _ in memory.saved_activations(DEEP, 2, 8, "standard", 0, 1, 2, s)]
                for s in range(2)]
    assert on_thread_ranks(2, rank) == expected


# ---------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def world_one(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp")
    return folder, run(corpus, folder, "one", keep_every=10)


@pytest.mark.parametrize("mesh", [{"world_size": 2, "pp": 2, "pp_schedule": "gpipe"},
                                  {"world_size": 2, "pp": 2, "pp_schedule": "1f1b"},
                                  {"world_size": 8, "pp": 2, "tp": 2},
                                  {"world_size": 4, "pp": 2, "zero": 1}])
def test_training_at_pp_follows_world_one_and_keeps_replicas_and_wte_copies_bitwise_equal(corpus, world_one, tmp_path,
                                                                                        monkeypatch, mesh,
                                                                                        built_models):
    models, sends = built_models, []

    def counted(comm, kind, micro, *args):
        pipe = CountingPipe(comm)
        run_schedule(pipe, kind, micro, *args)
        sends.append((comm.rank, sum(pipe.sent)))

    monkeypatch.setattr(loop, "run_schedule", counted)
    folder, one = world_one
    report = run(corpus, tmp_path, "pp", grad_accum=2, **mesh)
    relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
    assert relative.max() < 1e-5, relative.max()
    reference, gathered = saved_params(folder, "one"), saved_params(tmp_path, "pp")
    # 20 steps of AdamW from float32 sums in another order (the micro-batches' and the two wte halves'): within
    # the bound test_tensor_parallel.py measured for its splits
    for name, tensor in reference.items():
        np.testing.assert_allclose(gathered[name], tensor, rtol=0, atol=2e-5, err_msg=name)
    # the data-parallel replicas (ranks tp apart on a stage) hold the same part, bit for bit
    world, tp = mesh["world_size"], mesh.get("tp", 1)
    dp = world // tp // 2
    digests = report["param_sha256"]
    for r in range(world):
        assert digests[r] == digests[r // (dp * tp) * dp * tp + r % tp]
    assert len(set(digests)) == 2 * tp
    # the first and last stages' copies of wte are one parameter: equal bits on every rank that holds the same
    # rows of it (at tp 2, the vocabulary-parallel classifier's: each tensor-parallel rank its own rows)
    assert len(models) == world
    wte = {}
    for m in models:
        [part] = [m.params[s.offset: s.offset + s.size] for s in m.layout if s.name == WTE]
        wte.setdefault(m.vocab_row0, []).append(part)
    assert len(wte) == tp and sum(map(len, wte.values())) == world
    assert all(np.array_equal(w, rows[0]) for rows in wte.values() for w in rows[1:])
    # each step, each rank sends its rows' (B_micro x T x C) activations or gradients once per micro-batch:
    # its data-parallel group's BATCH / dp rows x SEQ x C floats in all
    C = model_config("tiny", corpus.vocab_size).n_embd
    assert len(sends) == 20 * world
    assert {count for _, count in sends} == {4 // dp * 32 * C}


@pytest.mark.parametrize("kw", [{"grad_sync": "flat", "all_reduce": "ring"}, {"grad_sync": "per-param"},
                                {"attention": "flash", "recompute": 2}])
def test_every_sync_and_option_of_the_step_runs_on_each_stage_s_data_parallel_group(corpus, world_one, tmp_path, kw):
    _, one = world_one
    report = run(corpus, tmp_path, "pp", world_size=4, pp=2, grad_accum=2, **kw)
    relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
    assert relative.max() < 1e-5, relative.max()
    digests = report["param_sha256"]
    assert digests[0] == digests[1] != digests[2] == digests[3]


def test_stages_between_the_first_and_the_last_hold_blocks_only(corpus, tmp_path):
    """--model mini's 4 blocks over 4 stages (two with neither embedding nor head) and over 3 (2, 1 and 1)."""
    kw = {"model": "mini", "steps": 6, "grad_accum": 4}
    one = run(corpus, tmp_path, "one", **kw)
    for pp, schedule in ((4, "gpipe"), (3, "1f1b")):
        report = run(corpus, tmp_path, f"pp{pp}", world_size=pp, pp=pp, pp_schedule=schedule, **kw)
        relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
        assert relative.max() < 1e-5, (pp, relative.max())


@pytest.mark.parametrize("kind, held", [("gpipe", [4, 4]), ("1f1b", [2, 1])])
def test_a_stage_holds_the_tapes_its_schedule_promises(corpus, tmp_path, monkeypatch, kind, held):
    """The loop keeps one tape per micro-batch in flight: at pp 2 with 4 micro-batches, GPipe holds all 4 on both
    stages, 1F1B 2 on the first and 1 on the last (min(p - s, m), as memory.py counts them)."""
    live: dict[int, int] = {}  # tapes made and not yet consumed, by stage
    peaks: dict[int, int] = {}

    class Counted(GPT2):
        def stage_forward(self, *args, **kw):
            out, tape = super().stage_forward(*args, **kw)
            live[self.stage] = live.get(self.stage, 0) + 1
            peaks[self.stage] = max(peaks.get(self.stage, 0), live[self.stage])
            return out, tape

        def stage_backward(self, *args, **kw):
            live[self.stage] -= 1
            return super().stage_backward(*args, **kw)

    monkeypatch.setattr(loop, "GPT2", Counted)
    run(corpus, tmp_path, "held", steps=2, world_size=2, pp=2, grad_accum=4, pp_schedule=kind)
    assert [peaks[s] for s in range(2)] == held


def test_init_from_loads_each_stage_s_part_of_the_weights(corpus, world_one, tmp_path):
    """--init-from a checkpoint of world 1: each stage takes its tensors of it, and the run is world 1's."""
    folder, _ = world_one
    runs = [run(corpus, tmp_path, f"init{pp}", steps=3, init_from=str(folder / "one"), world_size=pp, pp=pp)
            for pp in (1, 2)]
    relative = np.abs(np.array(runs[1]["losses"]) - runs[0]["losses"]) / np.array(runs[0]["losses"])
    assert relative.max() < 1e-5, relative.max()
    assert runs[0]["losses"][0] < 7.5  # the trained weights, not the seed's draws (about 8.3 at step 1)


def test_the_report_counts_the_pipeline_s_payload_as_the_textbook_does(corpus, tmp_path):
    """comm_bytes_per_step, rank 0's bytes in a step by group, at dp 2 x pp 2 with 2 micro-batches: on the pipeline
    group stage 0 sends each micro-batch's (B_micro, T, C) activations, its wte gradient (Vp x C) to the last
    stage and the gradient norm's one float32; on the data-parallel group, the flat sync of its stage's
    buffer; on the world, the loss and stop request."""
    report = run(corpus, tmp_path, "bytes", steps=2, world_size=4, pp=2, grad_accum=2, grad_sync="flat")
    config = model_config("tiny", corpus.vocab_size)
    rows, seq, width = 4 // 2, 32, config.n_embd
    assert report["comm_bytes_per_step"] == {"pp": (rows * seq * width + config.padded_vocab_size * width + 1) * 4,
                                             "dp": param_layout(config, 1, 2, 0)[1] * 4, "world": 2 * 4}


def test_bench_mesh_measures_pipelined_meshes_against_the_textbook_and_world_one(tmp_path):
    """bin/bench_mesh at world 1, pp 2 and dp 2 x tp 2 x pp 2 of the tiny model with 2 micro-batches: its rows'
    bytes per group are the textbook's (it exits non-zero where they are not) and the meshes' losses follow
    world 1's."""
    script = Path(__file__).resolve().parents[1] / "bin" / "bench_mesh"
    done = subprocess.run([sys.executable, str(script), "--model", "tiny", "--batch", "4", "--seq", "16", "--steps",
                           "3", "--grad-accum", "2", "--meshes", "1,pp2,dp2xtp2xpp2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "mesh.json").read_text())["rows"]
    assert [(r["mesh"], r["ranks"]) for r in rows] == [("world 1", 1), ("pp 2", 2), ("dp 2 x tp 2 x pp 2", 8)]
    assert all(r["bytes"] == r["expected_bytes"] for r in rows)
    assert set(rows[2]["bytes"]) == {"tp", "pp", "dp", "world"}
    assert all(r["loss_rel_diff"] < 1e-5 for r in rows)


@pytest.mark.parametrize("mesh", [{"world_size": 2, "pp": 2}, {"world_size": 4, "pp": 2, "tp": 2,
                                                                "pp_schedule": "gpipe"},
                                  {"world_size": 4, "pp": 2, "zero": 1}])
def test_a_pp_2_checkpoint_resumes_at_pp_1_and_back(corpus, world_one, tmp_path, mesh):
    """The checkpoint holds the full model and AdamW state (gathered from every stage), so it resumes on
    another mesh, and world 1's on this one."""
    folder, one = world_one
    run(corpus, tmp_path, "pp", keep_every=10, **mesh)
    at_one = run(corpus, tmp_path, "resumed1", resume=str(kept_folder(tmp_path / "pp", 10)))
    at_two = run(corpus, tmp_path, "resumed2", resume=str(kept_folder(folder / "one", 10)), **mesh)
    for resumed in (at_one, at_two):
        assert resumed["start_step"] == 10
        relative = np.abs(np.array(resumed["losses"]) - one["losses"][10:]) / np.array(one["losses"][10:])
        assert relative.max() < 1e-5, relative.max()


def test_the_validation_loss_hellaswag_and_samples_at_pp_are_world_one_s(corpus, tmp_path):
    """Each batch runs through the stages, forward only; the last stage's sum (its count of right answers)
    reaches every rank. Rank 0's pipeline group draws the samples together, each stage with its own key and
    value cache, every draw from the last stage's logits."""
    from test_hellaswag import random_examples, write
    path = write(tmp_path / "hs.bin", random_examples(10, seed=4))
    reports = [run(corpus, tmp_path, f"eval{world}", world_size=world, pp=pp, eval_every=10, eval_batches=2,
                   hellaswag=str(path), sample_every=10, sample_tokens=16) for world, pp in ((1, 1), (2, 2), (4, 2))]
    for report in reports[1:]:
        assert [step for step, _ in report["val_losses"]] == [10, 20]
        np.testing.assert_allclose([v for _, v in report["val_losses"]], [v for _, v in reports[0]["val_losses"]],
                                   rtol=1e-5)
        assert report["hellaswag"] == reports[0]["hellaswag"]
        assert [step for step, _ in report["samples"]] == [10, 20] and report["samples"] == reports[0]["samples"]


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, line", [
    (["--pp", "0"], "--pp must be a positive integer, got '0'"),
    (["--pp-schedule", "zb"], "--pp-schedule must be one of gpipe, 1f1b, got 'zb'"),
])
def test_pp_options_on_the_command_line_are_one_line(argv, line):
    with pytest.raises(XtrainError) as info:
        parse_config(["5", "8", "32", *argv], Launch("single"))
    assert str(info.value) == line


@pytest.mark.parametrize("kw, line", [
    ({"world_size": 4, "pp": 3}, "--pp must be a divisor of the world size (4), got '3'"),
    ({"world_size": 8, "tp": 2, "pp": 8}, "--pp must be a divisor of the world size over --tp (8 / 2 = 4), got '8'"),
    ({"world_size": 4, "pp": 4}, "--pp must be at most the model's 2 layers, got '4'"),
    ({"world_size": 2, "pp": 2, "pp_schedule": "zb"}, "--pp-schedule must be one of gpipe, 1f1b, got 'zb'"),
    ({"world_size": 4, "pp": 2, "batch": 2, "grad_accum": 2}, "BATCH (2) must be at least the data-parallel size "
     "(the world size over --pp) times --grad-accum (2 x 2 = 4): every micro-batch needs a sequence in every "
     "data-parallel group"),
])
def test_bad_pp_runs_are_one_line_before_any_rank_starts(corpus, kw, line):
    cfg = TrainConfig(**{"steps": 2, "batch": 8, "seq": 32, "model": "tiny", "eval_batches": 0, **kw}).resolved()
    with pytest.raises(XtrainError) as info:
        train(cfg, corpus, log=lambda line: None)
    assert str(info.value) == line


def test_a_bad_pp_on_the_command_line_is_one_line_and_exit_status_2():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "4", "32", "--world-size", "4",
                          "--pp", "3"], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert (out.returncode, out.stdout, out.stderr) == (
        2, "", "train_ddp: error: --pp must be a divisor of the world size (4), got '3'\n")


def test_pp_with_the_cuda_backend_takes_the_overlapped_sync_and_powersgd():
    """Checked here without a GPU (tests/test_cuda_ops.py runs the overlapped sync beside --pp on the CUDA
    backend, with the flat sync's bits; PowerSGD at --pp runs on each stage's data-parallel group,
    tests/test_powersgd.py)."""
    for extra in ({"grad_sync": "bucketed"}, {"grad_compress": "powersgd"}):
        pipeline.check_config(TrainConfig(steps=2, batch=8, seq=32, world_size=2, pp=2, backend="cuda", **extra),
                              CONFIG)


def test_a_stage_s_memory_counts_its_part_and_the_micro_batches_its_schedule_holds(corpus):
    config = model_config("tiny", corpus.vocab_size)

    def memories(**kw):
        return memory.rank_memories(config, TrainConfig(steps=1, batch=8, seq=32, grad_accum=4, **kw), 4)

    one = memories()[0]
    gpipe, onef1b = memories(world_size=2, pp=2, pp_schedule="gpipe"), memories(world_size=2, pp=2)
    assert [m.gradients for m in onef1b] == [4 * param_layout(config, 1, 2, s)[1] for s in range(2)]
    assert all(m.gradients < one.gradients for m in onef1b)
    per_micro = [sum(np.prod(shape) * 4 for _, shape, _ in memory.saved_activations(config, 2, 32, "standard", 0,
                                                                                       1, 2, s)) for s in range(2)]
    # GPipe keeps all 4 micro-batches on both stages; 1F1B 2 on the first (p - s) and 1 on the last
    assert [m.activations for m in gpipe] == [4 * per_micro[0], 4 * per_micro[1]]
    assert [m.activations for m in onef1b] == [2 * per_micro[0], per_micro[1]]


# ---------------------------------------------------------------------------------------------- MPI processes
def assert_follows_world_one(report, world_one, tmp_path, world: int, tp: int) -> None:
    """Losses within 1e-5 of world 1's, the gathered checkpoint world 1's model, and one digest per part of the
    model (stage and tensor-parallel shard), the same on each of its data-parallel replicas."""
    folder, one = world_one
    relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
    assert relative.max() < 1e-5, relative.max()
    reference, gathered = saved_params(folder, "one"), saved_params(tmp_path, "run")
    for name, tensor in reference.items():
        np.testing.assert_allclose(gathered[name], tensor, rtol=0, atol=2e-5, err_msg=name)
    digests, stage = report["param_sha256"], world // 2  # pp 2: a stage's ranks are world / 2 apart
    assert len(digests) == world and len(set(digests)) == 2 * tp
    assert digests == [digests[r // stage * stage + r % tp] for r in range(world)]


@pytest.mark.skipif(not MPIRUN.exists(), reason="no mpirun beside this Python: pip install -e '.[mpi]'")
@pytest.mark.parametrize("processes, world, tp", [(2, 2, 1), (8, 8, 2), (2, 8, 2)])
def test_pipelines_through_mpi_processes_follow_world_one(world_one, tmp_path, processes, world, tp):
    """pp 2 and dp 2 x tp 2 x pp 2, one rank per MPI process; dp 2 x tp 2 x pp 2 over two MPI processes of 4 rank
    threads (a stage per process: tp and dp groups inside it, the pipeline groups process communicators). dp 2 x
    pp 2 over processes of 2 threads runs below, through TCP."""
    out = mpirun_train(processes, "20", "4", "32", "--world-size", str(world), "--tp", str(tp), "--pp", "2",
                       "--grad-accum", "2", "--seed", "7", "--eval-batches", "0", "--report", str(tmp_path / "r.json"),
                       "--save-dir", str(tmp_path / "run"), timeout=180)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["launch"]["comm"] == "mpi" and report["config"]["pp"] == 2
    assert report["launch"]["threads_per_process"] == world // processes
    assert_follows_world_one(report, world_one, tmp_path, world, tp)


def test_dp_2_x_pp_2_over_rank_threads_of_two_tcp_processes_follows_world_one(world_one, tmp_path):
    """The same over TCP (torchrun's variables, without torchrun), with the other schedule."""
    from test_multiprocess import free_port, reaped, torchrun_style
    args = ["-m", "xtrain_dist.train_ddp", "20", "4", "32", "--world-size", "4", "--pp", "2", "--pp-schedule",
            "gpipe", "--grad-accum", "2", "--seed", "7", "--eval-batches", "0", "--report", str(tmp_path / "r.json"),
            "--save-dir", str(tmp_path / "run")]
    port = free_port()
    with reaped([torchrun_style(r, 2, port, args) for r in range(2)]) as procs:
        outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["launch"] == {"kind": "torchrun", "processes": 2, "threads_per_process": 2, "comm": "tcp"}
    assert_follows_world_one(report, world_one, tmp_path, 4, 1)
