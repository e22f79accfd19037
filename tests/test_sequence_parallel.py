"""--sequence-parallel (model.py's notes, Megatron-LM's sequence parallelism on top of --tp): the residual stream,
the layernorms and dropout cut over the tensor-parallel group by tokens, reduce-scatters and all-gathers in place of
the all-reduces. The same model as one rank's, step by step and in its checkpoints, keeping 1/tp of every
activation."""

import numpy as np
import pytest
from test_tensor_parallel import CONFIG, on_thread_ranks, run, saved_params

from xtrain_dist.backend.numpy_ops import NumpyBackend
from xtrain_dist.comm.launch_env import Launch
from xtrain_dist.config import GPTConfig, TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.layout import join_flats
from xtrain_dist.model import GPT2
from xtrain_dist.planner.projection import Hardware, Mesh, Run, Shape, device_memory, step_time
from xtrain_dist.train import memory, preflight
from xtrain_dist.train.cadence import kept_folder
from xtrain_dist.train.cli import parse_config


class CountingGroup:
    """A tensor-parallel communicator that notes every collective it passes on: (name, elements sent)."""

    def __init__(self, comm):
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.calls: list[tuple[str, int]] = []

    def all_reduce(self, buf):
        self.calls.append(("all_reduce", buf.size))
        self.comm.all_reduce(buf)

    def reduce_scatter(self, send, recv, counts=None):
        self.calls.append(("reduce_scatter", send.size))
        self.comm.reduce_scatter(send, recv, counts)

    def all_gather(self, send, recv, counts=None):
        self.calls.append(("all_gather", send.size))
        self.comm.all_gather(send, recv, counts)


def one_step(config, tp, B, T, vocab_parallel, dropout=0.0, rows=None, grad_accum=1):
    """World 1's float64 losses and gradients, and those of every rank of a tp group with the token cut."""
    rng = np.random.default_rng(1)
    batches = [tuple(rng.integers(0, config.vocab_size, (B, T)).astype(np.int32) for _ in range(2))
               for _ in range(grad_accum)]
    one = GPT2(config, NumpyBackend(), seed=3, dtype=np.float64, dropout=dropout)
    # biases and gains away from their zeros and ones, so that a bias added on every rank would show
    full = join_flats([one.gather_flat(one.params) + rng.standard_normal(one.full_size) * 0.05], config)
    one.load_flat(full)
    one.set_dropout_step(2)

    def step(model):
        losses = []
        for i, (ids, targets) in enumerate(batches):
            out, tape = model.stage_forward(ids, None, targets, 1 / (B * T * grad_accum),
                                            rows=None if rows is None else rows[i])
            losses.append(out)
            model.stage_backward(tape)
        return np.concatenate(losses)

    losses = step(one)

    def rank(comm):
        group = CountingGroup(comm)
        model = GPT2(config, NumpyBackend(), seed=3, tp=group, dtype=np.float64, vocab_parallel=vocab_parallel,
                     sequence_parallel=True, dropout=dropout)
        model.load_flat(full)
        model.set_dropout_step(2)
        mine = step(model)
        calls = list(group.calls)
        return mine, calls, model.gather_flat(model.grads), model.grad_norm_squared(), model

    return losses, one, on_thread_ranks(tp, rank)


@pytest.mark.parametrize("tp, vocab_parallel", [(2, True), (4, True), (2, False), (4, False)])
def test_a_step_with_the_token_cut_is_world_one_s(tp, vocab_parallel):
    losses, one, ranks = one_step(CONFIG, tp, 2, 8, vocab_parallel)
    for mine, _calls, grads, norm_squared, _ in ranks:
        np.testing.assert_allclose(mine, losses, rtol=1e-12)
        np.testing.assert_allclose(grads, one.grads[:one.full_size], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(norm_squared, one.grad_norm_squared(), rtol=1e-12)


def expected_calls(config, tp, B, T, vocab_parallel):
    """The group's collectives of one step with the token cut, in order: (name, elements handed over)."""
    whole, mine, C = B * T * config.n_embd, B * T * config.n_embd // tp, config.n_embd
    forward = [("all_gather", mine), ("reduce_scatter", whole)] * 2  # a block: gather before, scatter after
    backward = [("all_gather", mine), ("all_gather", mine), ("reduce_scatter", whole), ("all_reduce", 2 * C)] * 2
    calls = [("reduce_scatter", whole)] if vocab_parallel else []  # the embedding's sum
    calls += forward * config.n_layer + [("all_gather", mine)]  # ln_f's output, for the classifier
    calls += [("all_gather", B * T), ("all_reduce", 2 * B * T)] if vocab_parallel else []  # the softmax's
    calls += [("all_gather", mine)] + ([("reduce_scatter", whole)] if vocab_parallel else [])  # ln_f again; dlnf
    calls += [("all_reduce", 2 * C)] + backward * config.n_layer + [("all_gather", mine)]  # ln_f's; the embedding's
    return calls


@pytest.mark.parametrize("tp, vocab_parallel", [(2, True), (4, False)])
def test_the_all_reduces_become_reduce_scatters_and_all_gathers(tp, vocab_parallel):
    """Megatron's g and g-bar: around each block two all-gathers of the rank's tokens and two reduce-scatters forward,
    four all-gathers (the output gradients, the layernorms' outputs again) and two reduce-scatters backward, and
    the layernorms' partial weight and bias gradients all-reduced; and each rank keeps its 1/tp of the tokens."""
    B, T = 2, 8
    _, _, ranks = one_step(CONFIG, tp, B, T, vocab_parallel)
    for _, calls, _, _, model in ranks:
        assert calls == expected_calls(CONFIG, tp, B, T, vocab_parallel)
        assert model.stream_shape((B, T)) == (B * T // tp, CONFIG.n_embd)


def test_a_cut_inside_sequences_keeps_dropout_s_bits_and_accumulates_micro_batches():
    """3 sequences of 8 tokens over 4 ranks: 6 tokens each, so rank 1 holds the last 2 of one sequence and the
    first 4 of the next; with dropout (keyed by each element's place in the global batch: rows 1, 3, 5 of it)
    and two micro-batches, whose layernorm gradients add up across the all-reduces, the step is world 1's."""
    losses, one, ranks = one_step(CONFIG, 4, 3, 8, True, dropout=0.25, rows=[(1, 2), (0, 2)], grad_accum=2)
    no_dropout, _, _ = one_step(CONFIG, 1, 3, 8, False, grad_accum=2)
    assert np.abs(losses - no_dropout).max() > 1e-3  # dropout changed the losses
    for mine, _, grads, norm_squared, _ in ranks:
        np.testing.assert_allclose(mine, losses, rtol=1e-12)
        np.testing.assert_allclose(grads, one.grads[:one.full_size], rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(norm_squared, one.grad_norm_squared(), rtol=1e-12)


def test_saved_activations_are_the_rank_s_tokens():
    from test_memory import saved_arrays

    def rank(comm):
        model = GPT2(CONFIG, NumpyBackend(), seed=3, tp=comm, sequence_parallel=True)
        ids = np.zeros((2, 8), dtype=np.int32)
        model.forward(ids, ids, 1.0)
        return [(name, shape) for name, shape, _ in saved_arrays(model)]

    expected = [(name, shape) for name, shape, _ in
                memory.saved_activations(CONFIG, 2, 8, "standard", 0, tp=2, sequence_parallel=True)]
    assert on_thread_ranks(2, rank) == [expected, expected]
    # every activation of the blocks is a 1/tp share: the residual stream's, the layernorms' and their statistics'
    # too, where tensor parallelism alone keeps them whole
    assert memory.block_activation_bytes(memory.saved_activations(CONFIG, 2, 8, "standard", 0, tp=2,
                                                                  sequence_parallel=True), 4) * 2 == \
        memory.block_activation_bytes(memory.saved_activations(CONFIG, 2, 8, "standard", 0), 4)


def test_the_textbook_count_is_korthikantis_formula():
    """At 16-bit activations, per layer s b h (34 + 5 a s / h) on one rank, s b h (10 + 24 / t + 5 a s / (h t)) at
    tp t, s b h (34 / t + 5 a s / (h t)) with sequence parallelism (Korthikanti et al. 2022, table 2)."""
    config = GPTConfig(vocab_size=100, n_ctx=64, n_layer=3, n_head=4, n_embd=32)
    s, b, h, a, L, t = 64, 2, 32, 4, 3, 4
    textbook = memory.textbook_activation_bytes
    assert textbook(config, b, s, L) == L * s * b * h * (34 + 5 * a * s / h)
    assert textbook(config, b, s, L, t) == L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert textbook(config, b, s, L, t, True) == pytest.approx(L * s * b * h * (34 / t + 5 * a * s / (h * t)))


def test_bf16_words_are_gathered_as_a_16_bit_type_nccl_has():
    """On a GPU bf16 activations are uint16 words, a type NCCL lacks: the all-gather moves them as float16, whose
    copies keep every bit (NaN patterns too)."""
    class NcclTypes(CountingGroup):
        def all_gather(self, send, recv, counts=None):
            assert send.dtype == recv.dtype == np.float16, send.dtype  # NCCL's types (comm/nccl.py) have no uint16
            super().all_gather(send, recv, counts)

    words = np.random.default_rng(2).integers(0, 1 << 16, (2, 8, 32)).astype(np.uint16)

    def rank(comm):
        model = GPT2(CONFIG, NumpyBackend(), seed=3, tp=NcclTypes(comm), sequence_parallel=True)
        return model._gather_tokens(words.reshape(-1, 32)[comm.rank * 8:(comm.rank + 1) * 8], words.shape)

    for whole in on_thread_ranks(2, rank):
        assert whole.dtype == np.uint16 and np.array_equal(whole, words)


# ---------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


@pytest.fixture(scope="module")
def world_one(corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    return folder, run(corpus, folder, "one", keep_every=10)


@pytest.mark.parametrize("world, classifier", [(2, "vocab"), (4, "vocab"), (2, "replicated")])
def test_training_with_the_token_cut_follows_world_one(corpus, world_one, tmp_path, world, classifier, built_models):
    models = built_models
    folder, one = world_one
    report = run(corpus, tmp_path, "sp", world_size=world, tp=2, sequence_parallel=True, tp_classifier=classifier)
    relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
    assert relative.max() < 1e-5, relative.max()
    reference, gathered = saved_params(folder, "one"), saved_params(tmp_path, "sp")
    for name, whole in reference.items():  # the bound test_tensor_parallel.py argues
        np.testing.assert_allclose(gathered[name], whole, rtol=0, atol=2e-5, err_msg=name)
    digests = report["param_sha256"]
    assert [digests[r] for r in range(world)] == [digests[r % 2] for r in range(world)]
    # the layernorms' gradients, partial sums over each rank's tokens, all-reduced: the same bits on every rank
    replicated = [s for s in models[0].layout if s.split == "replicated"]
    assert any(s.name.endswith("ln_1.weight") for s in replicated)
    for model in models[1:]:
        for s in replicated:
            assert np.array_equal(model.params[s.offset: s.offset + s.size],
                                  models[0].params[s.offset: s.offset + s.size]), s.name
    blocks = report["memory"]["rank0_block_activations"]
    assert blocks["bytes"] == memory.block_activation_bytes(memory.saved_activations(
        model_config("tiny", corpus.vocab_size), 4 // (world // 2), 32, "standard", tp=2, sequence_parallel=True), 4)


@pytest.mark.parametrize("kw", [{"grad_accum": 2, "attention": "flash", "recompute": 2},
                                {"zero": 1, "grad_sync": "flat", "all_reduce": "ring"}, {"grad_sync": "per-param"}])
def test_the_step_s_options_run_with_the_token_cut(corpus, world_one, tmp_path, kw):
    """--recompute 2 makes the layernorms' outputs again from the rank's tokens, then gathers them; ZeRO-1, the ring
    and the per-parameter sync take the layernorms' gradients once the group has completed them."""
    _, one = world_one
    report = run(corpus, tmp_path, "sp", world_size=4, tp=2, sequence_parallel=True, **kw)
    relative = np.abs(np.array(report["losses"]) - one["losses"]) / np.array(one["losses"])
    assert relative.max() < 1e-5, relative.max()
    digests = report["param_sha256"]
    assert digests[0] == digests[2] != digests[1] == digests[3]


def test_a_checkpoint_resumes_across_the_token_cut(corpus, world_one, tmp_path):
    """Sequence parallelism changes no tensor's layout: a checkpoint of dp 2 x tp 2 with it resumes at tp 1, and
    world 1's at tp 2 with it and with --pp 2 beside it (the stages send the rank's tokens), all on world 1's losses."""
    folder, one = world_one
    run(corpus, tmp_path, "sp", keep_every=10, world_size=4, tp=2, sequence_parallel=True)
    resumed = [run(corpus, tmp_path, "resumed1", resume=str(kept_folder(tmp_path / "sp", 10))),
               run(corpus, tmp_path, "resumed2", resume=str(kept_folder(folder / "one", 10)), world_size=2, tp=2,
                   sequence_parallel=True),
               run(corpus, tmp_path, "resumed3", resume=str(kept_folder(tmp_path / "sp", 10)), world_size=4, tp=2,
                   pp=2, grad_accum=2, sequence_parallel=True)]
    for report in resumed:
        assert report["start_step"] == 10
        relative = np.abs(np.array(report["losses"]) - one["losses"][10:]) / np.array(one["losses"][10:])
        assert relative.max() < 1e-5, relative.max()


# ---------------------------------------------------------------------------------------------- the planner
@pytest.mark.parametrize("preset, tp", [("mini", 2), ("gpt2-124m", 4)])
def test_the_planner_projects_what_the_preflight_counts(preset, tp):
    config = model_config(preset, 50257)
    cfg = TrainConfig(steps=1, batch=2, seq=64, model=preset, world_size=tp, tp=tp, attention="standard",
                      sequence_parallel=True)
    planned = device_memory(Shape.of(config), Mesh(tp=tp), Run(batch=2, seq=64, precision="fp32",
                                                              sequence_parallel=True))
    assert planned == memory.rank_memories(config, cfg, 4)[0]


def test_the_planner_times_the_reduce_scatters_and_all_gathers():
    """Per layer and micro-batch: 4 reduce-scatters and 4 all-gathers, an all-reduce's bytes a pair, and 2 more
    all-gathers in backward (ln_1's and ln_2's outputs again): 5 all-reduces' time in 10 calls' latency."""
    shape = Shape(n_layer=4, n_head=2, d_model=32, d_ff=64, vocab_size=100, n_ctx=16)
    hw = Hardware(peak_flops=1e12, mfu=1.0, bus_gbps=10.0, inter_node_gbps=1.0, tp_bus_gbps=10.0, latency_s=1e-5)
    run = Run(batch=8, seq=16, precision="bf16", grad_accum=4, sequence_parallel=True)
    message = 2 * 16 * 32 * 2  # a micro-batch of 2 sequences' activations, in bf16; a ring over 2: 2 (2 - 1) / 2 of it
    assert step_time(shape, Mesh(tp=2), run, hw).tp_comm_s == pytest.approx(4 * 4 * (5 * message / 10e9 + 10e-5))


# ---------------------------------------------------------------------------------------------- bad input
def test_the_token_cut_needs_tp():
    with pytest.raises(XtrainError) as info:
        parse_config(["5", "8", "32", "--sequence-parallel"], Launch("single"))
    assert str(info.value) == "--sequence-parallel has no effect without --tp (2 or more tensor-parallel ranks)"


def test_the_token_cut_needs_seq_divisible_by_tp(corpus):
    cfg = parse_config(["5", "8", "30", "--world-size", "4", "--tp", "4", "--sequence-parallel"], Launch("single"))
    with pytest.raises(XtrainError) as info:
        preflight.check_config(cfg, corpus)
    assert str(info.value) == ("--sequence-parallel cuts each micro-batch's tokens over the 4 tensor-parallel ranks: "
                               "SEQ must be divisible by --tp 4, got 30")
