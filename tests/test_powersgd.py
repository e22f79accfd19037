"""PowerSGD (parallel/powersgd.py): one step against a float64 reference, Gram-Schmidt against PyTorch's,
the error feedback's bookkeeping, warm start as power iteration, exactness at full rank, bitwise equal
ranks, the start step, exact resume and the options' one-line errors."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from xtrain_dist.backend import get_backend, numpy_ops
from xtrain_dist.comm.local import LocalGroup
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.model import GPT2, ParamSpec
from xtrain_dist.parallel import ddp, powersgd
from xtrain_dist.train.cli import main
from xtrain_dist.train.job import train
from xtrain_dist.train.launch import run_thread_ranks

# a matrix compressed at rank 2, a vector, a matrix too small to gain ((4 + 4) 2 x 2 >= 16), a wide matrix
LAYOUT = [ParamSpec("a", (64, 48), 0, 0.02, True), ParamSpec("b", (48,), 3072, None, False),
          ParamSpec("c", (4, 4), 3136, 0.02, True), ParamSpec("d", (40, 96), 3168, 0.02, True)]
SIZE = 3168 + 40 * 96


def fake_model():
    return SimpleNamespace(grads=np.zeros(SIZE, np.float32), ops=numpy_ops, layout=LAYOUT, size=SIZE)


def rank_grads(step: int, rank: int) -> np.ndarray:
    """Normal draws in the parameters, zero in the padding between them (as a model's gradients are)."""
    draws = np.random.default_rng([step, rank]).standard_normal(SIZE).astype(np.float32)
    grads = np.zeros(SIZE, np.float32)
    for s in LAYOUT:
        grads[s.offset:s.offset + s.size] = draws[s.offset:s.offset + s.size]
    return grads


def view(flat, spec):
    return flat[spec.offset:spec.offset + spec.size].reshape(spec.shape)


def run_ranks(world, steps, rank=2, start_step=0, min_rate=powersgd.MIN_COMPRESSION_RATE, between=None):
    """Every rank's PowerSGD over `steps` steps of rank_grads: per rank, (Q before the first compressed step,
    each step's reduced buffer, the final error buffers)."""

    def body(r, comm):
        model = fake_model()
        state = powersgd.PowerSGD(comm, model, rank, start_step, seed=3, min_compression_rate=min_rate)
        q0 = {name: q.copy() for name, q in state.q.items()}
        reduced = []
        for step in range(steps):
            model.grads[...] = rank_grads(step, r)
            state(0, SIZE)
            state.step_done()
            reduced.append(model.grads.copy())
            if between:
                between(state)
        return q0, reduced, {name: e.copy() for name, e in state.error.items()}

    return run_thread_ranks(world, body)


def test_only_matrices_that_gain_are_compressed():
    assert powersgd.should_compress(64, 48, 2) and not powersgd.should_compress(4, 4, 2)
    state = powersgd.PowerSGD(LocalGroup(1).communicator(0), fake_model(), 2, 0, seed=3)
    assert state.compressed == {"a", "d"}
    assert {name: q.shape for name, q in state.q.items()} == {"a": (48, 2), "d": (96, 2)}
    # P and Q of a and d, b and c whole
    assert powersgd.sent_elements(LAYOUT, 2) == (64 + 48) * 2 + 48 + 16 + (40 + 96) * 2


def test_gram_schmidt_matches_pytorchs():
    torch = pytest.importorskip("torch")
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize_gram_schmidt

    a = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
    theirs = torch.from_numpy(a.copy())[None]
    _orthogonalize_gram_schmidt(theirs)
    ours = a.copy()
    powersgd.gram_schmidt(ours)
    np.testing.assert_allclose(ours, theirs[0].numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(ours.T @ ours, np.eye(4), atol=2e-6)
    zero = np.zeros((5, 2), np.float32)
    powersgd.gram_schmidt(zero)  # PyTorch's epsilon 0 would give NaN
    assert not zero.any()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_step_against_a_float64_reference(world):
    """P = sum_r M_r Q, orthonormalised, Q = sum_r M_r^T P: M_hat = P P^T sum_r M_r, whatever the signs of P's
    columns (so numpy's QR is an independent reference); vectors and small matrices are plain sums; each
    rank keeps M_r - M_hat / world."""
    results = run_ranks(world, 1)
    q0 = results[0][0]
    grads = [rank_grads(0, r).astype(np.float64) for r in range(world)]
    total = sum(grads)
    for q0_r, reduced, _ in results:
        assert reduced[0].tobytes() == results[0][1][0].tobytes()  # every rank the same bits
        assert all(q0_r[n].tobytes() == q0[n].tobytes() for n in q0)  # the same seeded start
        for spec in LAYOUT:
            if spec.name in ("b", "c"):
                np.testing.assert_allclose(view(reduced[0], spec), view(total, spec), rtol=1e-6, atol=1e-6)
                continue
            p = sum(view(g, spec) @ q0[spec.name] for g in grads)
            p = np.linalg.qr(p)[0]
            expected = p @ p.T @ view(total, spec)
            got = view(reduced[0], spec)
            assert np.max(np.abs(got - expected)) < 1e-5 * np.max(np.abs(expected))
            assert np.max(np.abs(got - view(total, spec))) > 0.1 * np.max(np.abs(view(total, spec)))  # compressed
    for r, (_, reduced, errors) in enumerate(results):
        for name in ("a", "d"):
            spec = LAYOUT[0] if name == "a" else LAYOUT[3]
            np.testing.assert_allclose(errors[name], view(grads[r], spec) - view(reduced[0], spec) / world,
                                       atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_what_was_sent_plus_the_errors_is_every_gradient(world):
    """Error feedback loses nothing: over the steps, the sum of what the ranks received plus every rank's
    error left equals the sum of all raw gradients (to float32 rounding)."""
    steps = 5
    results = run_ranks(world, steps, start_step=1)
    raw = sum(rank_grads(s, r).astype(np.float64) for s in range(steps) for r in range(world))
    received = sum(step.astype(np.float64) for step in results[0][1])
    for spec in (LAYOUT[0], LAYOUT[3]):
        kept = sum(errors[spec.name].astype(np.float64) for _, _, errors in results)
        np.testing.assert_allclose(view(received, spec) + kept, view(raw, spec), rtol=0, atol=2e-5)
        assert np.max(np.abs(kept)) > 0.5  # there is something not sent
    for _, reduced, _ in results[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(reduced, results[0][1], strict=True))


def test_before_the_start_step_it_is_a_plain_sum_and_keeps_no_error():
    results = run_ranks(2, 2, start_step=2)
    for step, reduced in enumerate(results[0][1]):
        assert reduced.tobytes() == (rank_grads(step, 0) + rank_grads(step, 1)).tobytes()
    assert not any(e.any() for _, _, errors in results for e in errors.values())


def test_at_full_rank_it_is_exact():
    """R >= min(m, n): P spans M's columns, so P P^T M = M (compressed anyway: min_compression_rate 0)."""
    results = run_ranks(2, 1, rank=48, min_rate=0)
    total = rank_grads(0, 0).astype(np.float64) + rank_grads(0, 1)
    for spec in (LAYOUT[0], LAYOUT[3]):
        np.testing.assert_allclose(view(results[0][1][0], spec), view(total, spec), rtol=0, atol=2e-5)
    assert {name: e.shape for name, e in results[0][2].items()} == {"a": (64, 48), "c": (4, 4), "d": (40, 96)}


def test_warm_start_is_power_iteration():
    """With the same gradient every step and no error fed back, reusing Q is the power method: M_hat tends
    to the best rank-1 approximation of M, s1 u1 v1^T (an independent SVD)."""
    spec = LAYOUT[0]
    u, _, vt = np.linalg.svd(np.random.default_rng(1).standard_normal((64, 48)), full_matrices=False)
    m = (u * (0.5 ** np.arange(48))) @ vt * 0.01  # singular values 1, 1/2, 1/4, ...: converges fast

    def body(rank, comm):
        model = fake_model()
        state = powersgd.PowerSGD(comm, model, 1, 0, seed=3)
        for _ in range(30):
            model.grads[...] = 0
            view(model.grads, spec)[...] = m
            state(0, SIZE)
            state.error[spec.name][...] = 0
        return view(model.grads, spec).copy()

    best = u[:, :1] * 0.01 @ vt[:1]
    got = run_thread_ranks(1, body)[0]
    assert np.max(np.abs(got - best)) < 1e-4 * np.max(np.abs(best))


def test_a_piece_must_hold_whole_parameters():
    state = powersgd.PowerSGD(LocalGroup(1).communicator(0), fake_model(), 2, 0, seed=3)
    with pytest.raises(RuntimeError, match=r"^grads\[0:100\] cuts a parameter"):
        state(0, 100)


# ---------------------------------------------------------------- in the gradient sync and in training
@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def run(corpus, world, steps=4, **kw):
    options = {"grad_compress": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 1, **kw}
    options = {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}
    cfg = TrainConfig(steps=steps, batch=6, seq=16, model="tiny", seed=7, world_size=world, **options).resolved()
    return train(cfg, corpus, log=lambda line: None)


def test_block_buckets_hold_whole_parameters_and_compress_as_backward_announces():
    cfg = TrainConfig(steps=1, batch=1, seq=4, model="tiny", grad_compress="powersgd", powersgd_start_step=0,
                      bucket_mb=1e-6)
    model = GPT2(model_config("tiny", 200), get_backend("numpy"), seed=0)
    buckets = ddp.block_bucket_bounds(model, 1e-6)
    assert buckets == model.layer_grad_ranges()  # tiny buckets: one announcement each
    assert ddp.block_bucket_bounds(model, 1e3) == [(0, model.size)]
    sync = ddp.make_grad_sync(cfg, LocalGroup(1).communicator(0), model)
    reduced = []
    real = sync.powersgd.__class__.__call__
    sync.powersgd.__class__ = type("Recorded", (powersgd.PowerSGD,), {
        "__call__": lambda self, lo, hi: (reduced.append((lo, hi)), real(self, lo, hi))})
    model.grads[...] = np.random.default_rng(0).standard_normal(model.size).astype(np.float32)
    sync.on_grads_ready(*buckets[0])
    sync.strategy._work.join()  # the communication thread has compressed the first block already
    assert reduced == [buckets[0]]
    sync.finish()
    assert reduced == buckets and sync.elements_sent == powersgd.sent_elements(model.layout, 1)
    sync.close()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_stay_bitwise_equal_and_every_strategy_gives_the_same_bits(corpus, world):
    runs = [run(corpus, world, grad_sync=s, bucket_mb=0.05) for s in ("bucketed", "flat", "per-param")]
    assert all(len(set(r["param_sha256"])) == 1 for r in runs)
    assert len({r["param_sha256"][0] for r in runs}) == 1
    plain = run(corpus, world, grad_compress="none")
    assert runs[0]["losses"][:2] == plain["losses"][:2]  # step 1 uncompressed; step 2's loss is before its update
    assert runs[0]["losses"][2:] != plain["losses"][2:]


def test_steps_before_the_start_step_are_the_uncompressed_run(corpus):
    assert run(corpus, 2, steps=3, powersgd_start_step=3)["param_sha256"] == \
        run(corpus, 2, steps=3, grad_compress="none")["param_sha256"]


def test_zero_1_trains_as_zero_0_does(corpus):
    """ZeRO-1 reads its shard of the same all-reduced approximation; only the norm's summation order differs."""
    sharded, whole = run(corpus, 2, zero=1), run(corpus, 2)
    np.testing.assert_allclose(sharded["losses"], whole["losses"], rtol=1e-5)


def test_resume_is_exact(corpus, tmp_path):
    """Q and each rank's error buffers are saved: 4 steps straight = 2, a checkpoint, 2 more."""
    full = run(corpus, 2, steps=4)
    run(corpus, 2, steps=2, save_dir=tmp_path / "ck")
    resumed = run(corpus, 2, steps=4, resume=tmp_path / "ck")
    assert resumed["param_sha256"] == full["param_sha256"] and resumed["losses"] == full["losses"][2:]
    assert sorted(p.name for p in (tmp_path / "ck").glob("powersgd*")) == \
        ["powersgd.rank0.safetensors", "powersgd.rank1.safetensors"]
    with pytest.raises(XtrainError, match=r"holds the PowerSGD error feedback of 2 rank\(s\), this run has 1: each "
                                          r"rank's error is its own, so resume with 2 rank\(s\)$"):
        run(corpus, 1, steps=4, resume=tmp_path / "ck")
    with pytest.raises(XtrainError, match=r"was trained with --powersgd-rank 2, this run has 4: its PowerSGD "
                                          r"state cannot continue$"):
        run(corpus, 2, steps=4, resume=tmp_path / "ck", powersgd_rank=4)


@pytest.mark.parametrize("args, message", [
    (["--grad-compress", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be at least 1, got 0"),
    (["--grad-compress", "powersgd", "--powersgd-start-step", "-1"], "--powersgd-start-step must be 0 or more, "
                                                                     "got -1"),
])
def test_bad_options_get_one_line(capsys, args, message):
    assert main(["2", "4", "16", "--model", "tiny", *args]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(message)


def test_the_cuda_backend_trains_as_numpy_does_on_the_simulator(tmp_path):
    """--backend cuda on tests/cudasim (kernels on the CPU, the stream checker watching the communication
    thread's own stream): PowerSGD through CuPy's arrays gives numpy's losses and norms, with ranks equal and
    bucketed = flat bit for bit."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    command = ["-m", "xtrain_dist.train_ddp", "3", "4", "16", "--model", "tiny", "--world-size", "2",
               "--grad-compress", "powersgd", "--powersgd-start-step", "1", "--powersgd-rank", "2"]
    reports = {}
    for name, prefix, extra in (("numpy", [sys.executable], ["--bucket-mb", "0.05"]),
                                ("bucketed", [sys.executable, str(root / "tests" / "cudasim" / "run.py")],
                                 ["--backend", "cuda", "--bucket-mb", "0.05"]),
                                ("flat", [sys.executable, str(root / "tests" / "cudasim" / "run.py")],
                                 ["--backend", "cuda", "--grad-sync", "flat"])):
        done = subprocess.run([*prefix, *command, *extra, "--report", str(tmp_path / f"{name}.json")], cwd=root,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for name in ("bucketed", "flat"):
        assert len(set(reports[name]["param_sha256"])) == 1
        np.testing.assert_allclose(reports[name]["losses"], reports["numpy"]["losses"], rtol=1e-5)
        np.testing.assert_allclose(reports[name]["grad_norms"], reports["numpy"]["grad_norms"], rtol=1e-5)
    assert reports["bucketed"]["param_sha256"] == reports["flat"]["param_sha256"]
    assert reports["flat"]["cuda_graph"]["without"] == ("PowerSGD decides on the host whether a step compresses "
                                                        "(--powersgd-start-step)")


# ---------------------------------------------------------------- bin/bench_powersgd
def bench(*args, out):
    import subprocess
    import sys
    script = Path(__file__).resolve().parents[1] / "bin" / "bench_powersgd"
    return subprocess.run([sys.executable, str(script), *map(str, args), "--out", str(out)], capture_output=True,
                          text=True, timeout=300)


def test_bench_powersgd_writes_its_rows(tmp_path):
    import json

    done = bench("--model", "tiny", "--batch", "4", "--seq", "16", "--steps", "4", "--start-step", "2",
                 "--eval-every", "2", "--eval-batches", "1", "--ranks", "1,64", out=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["powersgd.json", "powersgd.md", "powersgd.png"]
    rows = {r["name"]: r for r in json.loads((tmp_path / "powersgd.json").read_text())["rows"]}
    assert list(rows) == ["none", "bf16", "powersgd rank 1", "powersgd rank 64"]
    assert all(r["ranks_equal"] and len(r["losses"]) == 4 and len(r["val_losses"]) == 2 for r in rows.values())
    layout = GPT2(model_config("tiny", Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS).vocab_size),
                  get_backend("numpy"), seed=0)
    assert rows["none"]["bytes_compressed_step"] == rows["bf16"]["bytes_compressed_step"] == layout.size * 4
    assert rows["powersgd rank 1"]["bytes_compressed_step"] == powersgd.sent_elements(layout.layout, 1) * 4
    # rank 64 >= the tiny model's width: no matrix gains, every gradient goes whole
    assert rows["powersgd rank 64"]["bytes_compressed_step"] == sum(s.size for s in layout.layout) * 4
    assert rows["powersgd rank 1"]["losses"][:3] == rows["none"]["losses"][:3]  # steps 1-2 uncompressed


def test_bench_powersgd_bad_ranks_are_one_line(tmp_path):
    done = bench("--ranks", "1,x", out=tmp_path)
    assert done.returncode != 0 and done.stderr.strip() == "bench_powersgd: error: --ranks must be comma-separated " \
                                                           "integers, got '1,x'"


def test_the_memory_bound_counts_the_error_buffers_and_q():
    from xtrain_dist.train.memory import rank_memories

    config = model_config("tiny", 200)
    plain = TrainConfig(steps=1, batch=2, seq=16, model="tiny", world_size=2)
    compressed = TrainConfig(steps=1, batch=2, seq=16, model="tiny", world_size=2, grad_compress="powersgd",
                             powersgd_rank=2)
    model = GPT2(config, get_backend("numpy"), seed=0)
    sync = ddp.make_grad_sync(compressed, LocalGroup(1).communicator(0), model)
    held = sum(e.nbytes for e in sync.powersgd.error.values()) + sum(q.nbytes for q in sync.powersgd.q.values())
    sync.close()
    assert held > 0
    for a, b in zip(rank_memories(config, plain, 4), rank_memories(config, compressed, 4), strict=True):
        assert b.gradients - a.gradients == held


def test_bench_powersgd_checks_its_out_folder_before_running(tmp_path):
    a_file = tmp_path / "outfile"
    a_file.write_text("kept")
    done = bench("--model", "tiny", "--steps", "1", out=a_file)
    assert done.returncode != 0 and done.stdout == ""  # nothing ran
    assert done.stderr.strip() == f"bench_powersgd: error: --out '{a_file}' is a file, not a folder"
