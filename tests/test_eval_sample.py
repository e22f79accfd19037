"""Evaluation (one held-out loss whatever the world size), the metrics file, sampling from a checkpoint
(against transformers' greedy generate and the sampling distribution itself), and the plot tool."""

import hashlib
import json
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from xtrain_dist.backend import numpy_ops
from xtrain_dist.checkpoint import hf, store
from xtrain_dist.checkpoint.safetensors_io import read_safetensors, write_safetensors
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.errors import XtrainError
from xtrain_dist.eval import evaluate
from xtrain_dist.eval.evaluate import Evaluator
from xtrain_dist.eval.sample import generate, load, sample_text
from xtrain_dist.model import GPT2, KVCache
from xtrain_dist.train import metrics
from xtrain_dist.train.cli import parse_config
from xtrain_dist.train.job import train
from xtrain_dist.train.launch import run_thread_ranks

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def run(corpus, steps, world=1, log=lambda line: None, **kw) -> dict:
    kw = {k: str(v) if isinstance(v, Path) else v for k, v in kw.items()}
    cfg = TrainConfig(steps=steps, batch=4, seq=16, model="tiny", seed=5, world_size=world, **kw).resolved()
    return train(cfg, corpus, log=log)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trained") / "ck"
    run(corpus, 4, save_dir=folder, eval_batches=1)
    return folder


# ------------------------------------------------------------------------------- evaluation
def held_out_loss(corpus, world, batch=5, seq=16, n_batches=3):
    def rank_fn(rank, comm):
        model = GPT2(model_config("tiny", corpus.vocab_size), numpy_ops, seed=2)
        return Evaluator(corpus.val, batch, seq, n_batches, rank, world, numpy_ops).loss(model, comm)
    return run_thread_ranks(world, rank_fn)


def test_the_validation_loss_is_the_same_for_any_world_size(corpus):
    one, = held_out_loss(corpus, 1)
    for world in (2, 3, 5):
        losses = held_out_loss(corpus, world)
        assert len(set(losses)) == 1  # every rank gets the all-reduced value
        assert abs(losses[0] - one) <= 1e-6 * one
    # the mean loss of 15 windows spread evenly from the first to the last start of the split, in float64
    seq, n, last = 16, 15, len(corpus.val) - 17
    starts = [i * last // (n - 1) for i in range(n)]
    assert starts[0] == 0 and starts[-1] == last and np.ptp(np.diff(starts)) <= 1
    windows = np.stack([corpus.val[s: s + seq + 1] for s in starts]).astype(np.int32)
    model64 = GPT2(model_config("tiny", corpus.vocab_size), numpy_ops, seed=2, dtype=np.float64)
    assert model64.forward(windows[:, :-1], windows[:, 1:]).mean() == pytest.approx(one, rel=1e-5)


def test_the_held_out_set_is_split_over_ranks_not_changed_by_them(corpus):
    def ids(world, b):
        ranks = [Evaluator(corpus.val, 5, 8, 2, r, world, numpy_ops).batches[b][0] for r in range(world)]
        return sorted(map(bytes, np.concatenate(ranks)))
    for b in range(2):
        assert ids(1, b) == ids(2, b) == ids(3, b)


def test_eval_every_reaches_the_report_the_progress_line_and_the_metrics(corpus, tmp_path):
    lines = []
    # 2 ranks: the all-reduced loss on every rank, one metrics line per step (rank 0 writes it)
    report = run(corpus, 6, world=2, eval_every=2, eval_batches=2, metrics=tmp_path / "m.jsonl", log=lines.append)
    assert [step for step, _ in report["val_losses"]] == [2, 4, 6]
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split("| val ")[1] for line in progress if "| val " in line] == \
        [f"{loss:.4f}" for _, loss in report["val_losses"]]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert set(records[0]) == {"step", "loss", "lr", "grad_norm", "ms", "tokens_per_s", "comm_ms", "exposed_comm_ms",
                               "peer_wait_ms"}  # thread ranks share a clock: the wait for a slower rank is known
    assert [r["loss"] for r in records] == report["losses"] and [r["lr"] for r in records] == report["lrs"]
    assert [[r["step"], r["val_loss"]] for r in records if "val_loss" in r] == report["val_losses"]


def test_by_default_the_command_line_evaluates_once_at_the_end(corpus):
    cfg = parse_config(["3", "4", "16"])
    assert (cfg.eval_batches, cfg.eval_every) == (20, 0)
    assert [step for step, _ in run(corpus, 3, eval_batches=1)["val_losses"]] == [3]
    assert run(corpus, 3)["val_losses"] == []  # a TrainConfig evaluates only when asked


@pytest.mark.parametrize("args, message", [
    (["--eval-every", "-1"], "--eval-every must be an integer >= 0, got '-1'"),
    (["--eval-batches", "-2"], "--eval-batches must be an integer >= 0, got '-2'"),
    (["--save-every", "-1"], "--save-every must be an integer >= 0, got '-1'"),
    (["--save-every", "5"], "--save-every needs --save-dir"),
    (["--keep-every", "5"], "--keep-every needs --save-dir"),
    (["--keep-every", "-5"], "--keep-every must be an integer >= 0, got '-5'"),
])
def test_bad_flags_are_one_line(args, message):
    with pytest.raises(XtrainError) as info:
        parse_config(["3", "4", "16", *args])
    assert str(info.value) == message


def test_eval_every_without_batches_is_refused(corpus):
    with pytest.raises(XtrainError, match=r"^--eval-every needs --eval-batches of at least 1 \(or --hellaswag\)$"):
        run(corpus, 2, eval_every=1)


def test_a_validation_split_too_short_for_seq(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("To be, or not to be, that is the question:\n" * 12)
    short = Corpus.load(DEFAULT_TOKENIZER, text, cache_dir=tmp_path)
    assert len(short.val) < 17 <= len(short.train)
    reason = f"the validation split of corpus '{text}' has {len(short.val)} tokens, at least SEQ+1 = 17 are needed"
    with pytest.raises(XtrainError) as info:
        run(short, 2, eval_every=1, eval_batches=20)
    assert str(info.value) == f"--eval-every: {reason}"
    lines = []
    assert run(short, 2, eval_batches=20, log=lines.append)["val_losses"] == []
    assert f"no validation loss: {reason}" in lines
    # a --val-corpus too short is an error even for the default evaluation: the command line asked for it
    few = tmp_path / "few.txt"
    few.write_text("To be, or not to be")
    own_val = Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS, val_path=few, cache_dir=tmp_path)
    with pytest.raises(XtrainError) as info:
        run(own_val, 2, eval_batches=20)
    assert str(info.value) == (f"--val-corpus: validation corpus '{few}' has {len(own_val.val)} tokens, at least "
                               "SEQ+1 = 17 are needed")
    with pytest.raises(XtrainError, match=r"^--val-corpus needs --eval-batches of at least 1: with 0 no validation "
                                          r"loss is measured$"):
        run(own_val, 2, eval_batches=0)
    # exactly SEQ+1 tokens is enough: one window and its targets, the same for every batch
    seq = len(short.val) - 1
    cfg = TrainConfig(steps=2, batch=2, seq=seq, eval_every=1, eval_batches=2)
    assert evaluate.check(cfg, short, log=lines.append) is cfg
    evaluator = Evaluator(short.val, 2, seq, 2, 0, 1, numpy_ops)
    for ids, targets in evaluator.batches:
        assert ids.tolist() == [short.val[:-1].tolist()] * 2 and targets.tolist() == [short.val[1:].tolist()] * 2


# ------------------------------------------------------------------------------- metrics file
def test_a_resumed_run_continues_the_metrics_file_and_redone_steps_replace_lost_ones(corpus, tmp_path):
    path = tmp_path / "m.jsonl"
    run(corpus, 4, save_dir=tmp_path / "ck", metrics=path, eval_batches=0)
    run(corpus, 6, resume=tmp_path / "ck", metrics=path, eval_batches=0)
    assert [r["step"] for r in metrics.read(path)] == [1, 2, 3, 4, 5, 6]
    metrics.append(path, {"step": 5, "loss": 1.0})        # a run that redid step 5 after an older checkpoint
    with open(path, "a") as f:
        f.write('{"step": 7, "lo')                         # and was killed while writing
    records = metrics.read(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and records[4]["loss"] == 1.0
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"step": 8, "loss": 2.0}) + "\n")
    with pytest.raises(XtrainError, match=r"metrics file '.*m.jsonl', line 8: not a metrics record"):
        metrics.read(path)
    path.write_text("[" * 100_000 + "\n" + json.dumps({"step": 1, "loss": 2.0}) + "\n")  # nested too deeply
    with pytest.raises(XtrainError, match=r"metrics file '.*m.jsonl', line 1: not a metrics record"):
        metrics.read(path)


def test_a_resumed_run_drops_a_torn_metrics_line_rather_than_writing_onto_it(corpus, tmp_path):
    """A run stopped mid-line (a full disk: "wrote 94 of 229 bytes") leaves half a record at the end of the
    file. The resumed run drops it, with a note, before its first record, so the file stays readable; a
    reader of a file that still ends torn skips that line, with a note."""
    path = tmp_path / "m.jsonl"
    run(corpus, 4, save_dir=tmp_path / "ck", metrics=path, eval_batches=0)
    with open(path, "a") as f:
        f.write('{"step": 5, "loss": 3.1, "lr"')
    notes = []
    assert [r["step"] for r in metrics.read(path, note=notes.append)] == [1, 2, 3, 4]
    assert notes == [f"metrics file '{path}', line 5: skipped a torn last line (a run stopped while writing it)"]
    lines = []
    run(corpus, 6, resume=tmp_path / "ck", metrics=path, eval_batches=0, log=lines.append)
    assert f"--metrics '{path}': dropped a torn last line (29 bytes, a run stopped while writing it) before " \
           "appending" in lines
    assert [r["step"] for r in metrics.read(path)] == [1, 2, 3, 4, 5, 6]
    assert path.read_text().count("\n") == 6


def test_a_full_disk_mid_line_stops_the_append_and_the_next_append_starts_a_line_of_its_own(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    assert metrics.append(path, {"step": 1, "loss": 2.0}) is None
    real_write = metrics.os.write
    with monkeypatch.context() as patch:  # the disk fills up halfway through the second line
        patch.setattr(metrics.os, "write", lambda fd, data: real_write(fd, data[:len(data) // 2]))
        with pytest.raises(XtrainError, match=r"cannot append to --metrics '.*' \(wrote 12 of 25 bytes: disk full\?\)"):
            metrics.append(path, {"step": 2, "loss": 2.0})
    assert metrics.append(path, {"step": 2, "loss": 1.5}) == \
        f"--metrics '{path}': dropped a torn last line (12 bytes, a run stopped while writing it) before appending"
    assert metrics.read(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def test_a_fresh_run_refuses_a_metrics_file_that_holds_another_runs_records(corpus, tmp_path):
    """Appending would double the file (two step 1s, the last one winning in every reader): a run that does not
    continue another refuses, before training, and leaves the file as it was; an empty file is taken."""
    path = tmp_path / "m.jsonl"
    run(corpus, 2, metrics=path, eval_batches=0)
    before = path.read_bytes()
    with pytest.raises(XtrainError) as info:
        run(corpus, 2, metrics=path, eval_batches=0)
    assert str(info.value) == (f"--metrics '{path}' already holds another run's records: remove it, or pass "
                               "--resume to continue that run")
    assert path.read_bytes() == before
    path.write_bytes(b"")
    run(corpus, 2, metrics=path, eval_batches=0)
    assert [r["step"] for r in metrics.read(path)] == [1, 2]


@pytest.mark.parametrize("world", [1, 2])
def test_the_evaluate_command_gives_the_runs_own_validation_loss(corpus, tmp_path, world, monkeypatch):
    """DIR alone: the held-out windows the run measured (its corpus, BATCH, SEQ and --eval-batches, from
    trainer_state.json), so the loss the run printed at its last step: to the bit from a world-1 run, to
    float32 GEMM rounding from a world-2 one (its batches are split into other shapes). The checkpoint is
    read and verified once, its model and trainer state together."""
    report = run(corpus, 3, world=world, save_dir=tmp_path / "ck", eval_batches=3)
    reads, real_open = [], store.open_checkpoint
    monkeypatch.setattr(hf, "open_checkpoint", lambda path, read: reads.append(read) or real_open(path, read))
    loss, line = evaluate.evaluate_checkpoint([str(tmp_path / "ck")])
    assert reads == [(store.MODEL, store.CONFIG, store.TOKENIZER, store.STATE)]
    # a save cut short between its two renames leaves only .ck.new: evaluate reads all of it from there
    (tmp_path / "ck").rename(tmp_path / ".ck.new")
    assert evaluate.evaluate_checkpoint([str(tmp_path / "ck")]) == (loss, line)
    if world == 1:
        assert loss == report["val_losses"][-1][1]
    assert loss == pytest.approx(report["val_losses"][-1][1], rel=1e-6)
    assert line == (f"evaluate: loss {loss:.6f} (perplexity {np.exp(loss):.2f}) on 3 x 4 windows of 16 tokens of "
                    f"the validation split of corpus '{DEFAULT_CORPUS}'")


@pytest.mark.long
def test_the_evaluate_command_on_a_corpus_is_transformers_loss_on_its_windows(trained, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "other.txt"
    text.write_text(Path(DEFAULT_CORPUS).read_text()[:20000])
    loss, line = evaluate.evaluate_checkpoint([str(trained), str(text), "--batch", "3", "--seq", "32",
                                               "--batches", "2"])
    assert line.endswith(f"on 2 x 3 windows of 32 tokens of corpus '{text}'")
    # the oracle: six windows spread evenly over all of the text, scored by transformers in float64
    ids = np.asarray(load(trained, numpy_ops)[1].encode(text.read_text(), add_special_tokens=False).ids)
    starts = np.arange(6) * (len(ids) - 33) // 5
    windows = torch.from_numpy(np.stack([ids[s:s + 33] for s in starts]).astype(np.int64))
    hf = transformers.GPT2LMHeadModel.from_pretrained(trained).double().eval()
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()
    assert loss == pytest.approx(want, rel=1e-5)


def test_the_evaluate_command_says_what_it_cannot_do_in_one_line(corpus, trained, tmp_path):
    hf_only = tmp_path / "hf"
    hf_only.mkdir()
    for name in (store.CONFIG, store.MODEL, store.TOKENIZER):
        (hf_only / name).write_bytes((trained / name).read_bytes())
    text = tmp_path / "corpus.txt"
    text.write_text(Path(DEFAULT_CORPUS).read_text()[:50000])
    changed = tmp_path / "ck"
    run(Corpus.load(DEFAULT_TOKENIZER, text), 2, save_dir=changed, eval_batches=1)
    text.write_text(text.read_text()[:40000])
    few = tmp_path / "few.txt"
    few.write_text("To be, or not to be")
    n_few = len(Corpus.load(DEFAULT_TOKENIZER, few, val_path=few).val)
    for args, message in [
        ([hf_only], f"checkpoint '{hf_only}' has no trainer_state.json (it is not a run of ours): give CORPUS to "
                    "evaluate it on"),
        ([changed], f"corpus '{text}' no longer gives the ids checkpoint '{changed}' was trained on: it changed "
                    "since the run; give CORPUS to evaluate on it as it is"),
        ([trained, "--seq", "129"], "--seq (129) exceeds the model's context length (128)"),
        ([tmp_path / "nope"], f"checkpoint '{tmp_path / 'nope'}' not found"),
        ([trained, few], f"corpus '{few}' has {n_few} tokens, too few for one window of SEQ=16 and its targets"),
        # sizes no machine holds: numpy's allocation error as one line, not its traceback
        ([trained, "--batches", "99999999999"], "not enough memory: Unable to allocate 2.91 TiB for an array with "
                                                "shape (399999999996,) and data type int64"),
    ]:
        out = subprocess.run([sys.executable, "-m", "xtrain_dist.evaluate", *map(str, args)], capture_output=True,
                             text=True, timeout=120)
        assert (out.returncode, out.stdout, out.stderr) == (2, "", f"evaluate: error: {message}\n")
    # with CORPUS, any GPT-2 folder; a run of ours gives its BATCH, SEQ and --eval-batches as the defaults
    ours, line = evaluate.evaluate_checkpoint([str(trained), str(DEFAULT_CORPUS)])
    assert line.endswith(f"on 1 x 4 windows of 16 tokens of corpus '{DEFAULT_CORPUS}'")
    hf_loss, line = evaluate.evaluate_checkpoint([str(hf_only), str(DEFAULT_CORPUS)])
    assert line.endswith(f"on 20 x 8 windows of 64 tokens of corpus '{DEFAULT_CORPUS}'")
    assert ours == evaluate.evaluate_checkpoint([str(hf_only), str(DEFAULT_CORPUS), "--batch", "4", "--seq", "16",
                                                 "--batches", "1"])[0] != hf_loss


# ------------------------------------------------------------------------------- sampling
def test_greedy_sampling_is_what_transformers_generates(trained):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, tokenizer, _ = load(trained, numpy_ops)
    prompt = tokenizer.encode("ROMEO:\nBut soft", add_special_tokens=False).ids
    ours = generate(model, prompt, 24, temperature=0, top_k=None, rng=np.random.default_rng(0))
    hf = transformers.GPT2LMHeadModel.from_pretrained(trained).eval()
    ids = torch.tensor([prompt])
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                         pad_token_id=hf.config.eos_token_id)[0, len(prompt):].tolist()
    assert ours == theirs
    # the top-1 draw at any temperature is the greedy choice
    assert generate(model, prompt, 24, temperature=1.5, top_k=1, rng=np.random.default_rng(1)) == ours


def test_a_cached_forward_gives_the_logits_of_a_full_forward(trained):
    """A context of 17 ids in one cached pass (the causal mask inside a pass), then 23 ids one at a time
    (each over every cached key): the logits of one full forward of all 40, to float32 rounding."""
    model, _, _ = load(trained, numpy_ops)
    ids = np.random.default_rng(0).integers(0, 4096, size=(1, 40)).astype(np.int32)
    full = model.forward(ids)
    cache = KVCache(model, batch=1)
    pieces = [model.forward(ids[:, :17], cache=cache)] + [model.forward(ids[:, t:t + 1], cache=cache)
                                                         for t in range(17, 40)]
    assert cache.length == 40
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-4, atol=1e-4 * np.abs(full).max())


@pytest.mark.parametrize("prompt_ids, temperature, top_k", [(10, 0, None), (10, 0.9, 50), (200, 0.9, None)])
def test_sampling_with_the_cache_draws_what_full_forwards_draw(trained, prompt_ids, temperature, top_k):
    """150 draws from a 10-id prompt fill the model's 128 positions and go on past them (the window
    slides, full forwards again); a prompt of 200 ids starts past them."""
    model, _, _ = load(trained, numpy_ops)
    prompt = np.random.default_rng(prompt_ids).integers(0, 4096, size=prompt_ids).tolist()
    draws = [generate(model, prompt, 150, temperature, top_k, np.random.default_rng(3), cache=cache)
             for cache in (True, False)]
    assert draws[0] == draws[1]


class FixedLogits:
    """A 'model' whose next-token logits are always log(p): lets us check the draw itself."""

    def __init__(self, p, n_ctx=8):
        self.ops, self.config, self.logits = numpy_ops, SimpleNamespace(n_ctx=n_ctx), np.log(np.asarray(p))
        self.contexts = []

    def forward(self, ids):
        assert ids.shape[1] <= self.config.n_ctx  # the context is cropped to the model's
        self.contexts.append(ids[0].tolist())
        return np.broadcast_to(self.logits, (*ids.shape, self.logits.size)).astype(np.float32)


@pytest.mark.parametrize("temperature, top_k, expected", [
    (1.0, None, [0.5, 0.3, 0.15, 0.05]),
    (1.0, 2, [0.625, 0.375, 0, 0]),                       # renormalised over the two likeliest
    (0.5, None, np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365),  # p ** (1 / T), renormalised
    (1.0, 3, np.array([0.5, 0.3, 0.15, 0]) / 0.95),      # all but one: still a cut
])
def test_draws_follow_the_tempered_top_k_distribution(temperature, top_k, expected):
    model = FixedLogits([0.5, 0.3, 0.15, 0.05])
    draws = generate(model, list(range(20)), 4000, temperature, top_k, np.random.default_rng(7), cache=False)
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, expected, atol=0.025)
    if top_k:
        assert set(draws) == set(range(top_k))


@pytest.mark.parametrize("cache", [True, False])
def test_sampling_never_draws_a_padded_id(cache):
    """V = 100 pads wte to 128 rows. With every real logit far below 0 and the padded rows at zero, the padded
    columns' logits (0) would win every draw if sampling saw them: greedy, tempered and top-k draws are all
    token ids, and greedy is the argmax of the real logits."""
    from xtrain_dist.config import GPTConfig

    cfg = GPTConfig(vocab_size=100, n_ctx=16, n_layer=1, n_head=2, n_embd=8)
    model = GPT2(cfg, numpy_ops, seed=0)
    rng = np.random.default_rng(5)
    state = model.state_dict()
    bias = rng.standard_normal(8).astype(np.float32)
    state["transformer.ln_f.weight"][:] = 0  # ln_f's output is its bias at every position
    state["transformer.ln_f.bias"][:] = bias
    # every token's logit is -(40..60) * |bias|^2: all far below the padded columns' 0
    state["transformer.wte.weight"][:] = -rng.uniform(40, 60, (100, 1)).astype(np.float32) * bias
    model.load_state_dict(state)
    logits = model.forward(np.zeros((1, 1), dtype=np.int32))
    assert logits.shape == (1, 1, 100) and logits.max() < -10
    greedy = generate(model, [0], 8, 0, None, np.random.default_rng(0), cache=cache)
    assert greedy == [int(np.argmax(logits[0, 0]))] * 8
    for temperature, top_k in ((1.0, None), (5.0, None), (1.0, 3)):
        draws = generate(model, [0], 15, temperature, top_k, np.random.default_rng(1), cache=cache)
        assert max(draws) < 100, (temperature, top_k)


def test_each_draw_sees_the_last_n_ctx_tokens():
    model = FixedLogits([0.1, 0.6, 0.3], n_ctx=8)
    prompt = list(range(100, 105))
    new = generate(model, prompt, 10, 0, None, np.random.default_rng(0), cache=False)
    assert new == [1] * 10
    text = prompt + new
    assert model.contexts == [text[max(0, n - 8): n] for n in range(5, 15)]


@pytest.mark.parametrize("temperature", [1e-3, 1e-300, 1e-320, 5e-324])
@pytest.mark.parametrize("top_k", [None, 2])
def test_a_tiny_temperature_is_greedy_without_warnings(temperature, top_k):
    # logits / T overflowed to inf, inf - inf was NaN: warnings, NaN probabilities and a garbage draw
    model = FixedLogits([0.1, 0.25, 0.4, 0.15, 0.1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draws = generate(model, [0], 50, temperature, top_k, np.random.default_rng(3), cache=False)
    assert draws == generate(model, [0], 50, 0, None, np.random.default_rng(3), cache=False) == [2] * 50


@pytest.mark.parametrize("n_head, message", [(5, ": config.json: n_embd (64) must be divisible by n_head (5)"),
                                              (0, " is corrupt: config.json: n_head is 0, expected an integer >= 1")])
def test_a_checkpoint_shape_error_names_the_checkpoint(trained, tmp_path, n_head, message):
    folder = tmp_path / "bad_heads"
    folder.mkdir()
    for p in trained.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["n_head"] = n_head
    raw = json.dumps(config).encode()
    (folder / "config.json").write_bytes(raw)
    manifest = json.loads((folder / "manifest.json").read_text())  # consistent, so that only the shape is wrong
    manifest["files"]["config.json"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(XtrainError) as err:
        load(folder, numpy_ops)
    assert str(err.value) == f"checkpoint '{folder}'{message}"


def test_same_seed_same_text_another_seed_another_text(trained):
    args = [str(trained), "--prompt", "KING:", "--tokens", "12", "--temperature", "0.9", "--top-k", "50"]
    first = sample_text([*args, "--seed", "3"])
    assert first == sample_text([*args, "--seed", "3"])
    assert first != sample_text([*args, "--seed", "4"])
    assert first.startswith("KING:") and len(first) > len("KING:")


def test_without_a_prompt_the_draws_start_from_endoftext_which_is_not_printed(trained):
    model, tokenizer, _ = load(trained, numpy_ops)
    eos = tokenizer.token_to_id("<|endoftext|>")
    new = generate(model, [eos], 12, 1.0, None, np.random.Generator(np.random.PCG64(5)))
    assert sample_text([str(trained), "--tokens", "12", "--seed", "5"]) == \
        tokenizer.decode(new, skip_special_tokens=False)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(trained, tmp_path):
    """A model.safetensors and config.json of 4000 ids beside the 4096-id tokenizer: a draw could be an id
    the tokenizer has but the model has no embedding for."""
    folder = tmp_path / "small_vocab"
    folder.mkdir()
    for p in trained.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    tensors, meta = read_safetensors(folder / "model.safetensors")
    tensors = {**tensors, "transformer.wte.weight": np.array(tensors["transformer.wte.weight"][:4000])}
    config = {**json.loads((folder / "config.json").read_text()), "vocab_size": 4000}
    manifest = json.loads((folder / "manifest.json").read_text())
    with open(folder / "model.safetensors", "wb") as f:
        write_safetensors(f, tensors, meta)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "config.json"):  # consistent, so that only the vocabulary is wrong
        raw = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(XtrainError) as err:
        load(folder, numpy_ops)
    assert str(err.value) == f"checkpoint '{folder}': its tokenizer has more ids than the model's vocabulary (4000)"


def sample_cli(*args):
    return subprocess.run([sys.executable, "-m", "xtrain_dist.sample", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_the_sample_command_line(trained, tmp_path):
    out = sample_cli(trained, "--prompt", "To be", "--tokens", 8, "--seed", 1)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("To be") and out.stdout == sample_cli(trained, "--prompt", "To be", "--tokens", 8,
                                                                       "--seed", 1).stdout

    def error(*args):
        out = sample_cli(*args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr.strip()

    assert error(tmp_path / "nope") == f"sample: error: checkpoint '{tmp_path / 'nope'}' not found"
    assert error(trained, "--temperature", "-1") == "sample: error: --temperature must be a number >= 0, got '-1'"
    assert error(trained, "--tokens", "0") == "sample: error: --tokens must be a positive integer, got '0'"
    if not Path("/dev/nvidia0").exists():
        assert error(trained, "--backend", "cuda").startswith("sample: error: --backend cuda")
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in trained.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    size = (broken / "model.safetensors").stat().st_size
    (broken / "model.safetensors").write_bytes((trained / "model.safetensors").read_bytes()[:size // 2])
    assert error(broken) == (f"sample: error: checkpoint '{broken}' is corrupt: model.safetensors has {size // 2} "
                             f"bytes, its manifest says {size}")


def test_a_prompt_that_is_not_utf8_is_one_line(trained):
    """Bytes that are not UTF-8 reach Python as lone surrogates; the tokenizer raised a TypeError on them."""
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.sample", str(trained), "--prompt", b"ROMEO\xff"],
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "sample: error: --prompt must be UTF-8 text, got 'ROMEO\\udcff'\n"


def test_a_reader_that_goes_away_ends_the_sample_quietly(trained):
    """`sample ... | head -c 1`: the write fails with EPIPE once the reader has closed the pipe; that ends
    the command with a SIGPIPE-like status and nothing on stderr, not a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "xtrain_dist.sample", str(trained), "--tokens", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (141, b"")


# ------------------------------------------------------------------------------- plots
def test_plot_metrics_draws_several_runs_into_a_png(tmp_path):
    for name, scale in (("a", 1.0), ("b", 0.9)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for step in range(1, 61):
                record = {"step": step, "loss": scale * 8 / step ** 0.2, "lr": 1e-3, "grad_norm": 1.0, "ms": 10.0,
                          "tokens_per_s": 1000.0 * scale}
                if step % 20 == 0:
                    record["val_loss"] = record["loss"] + 0.1
                f.write(json.dumps(record) + "\n")
    plot = [sys.executable, str(REPO / "bin" / "plot_metrics")]
    out = subprocess.run([*plot, tmp_path / "a.jsonl", tmp_path / "b.jsonl", "-o", tmp_path / "plot.png",
                          "--labels", "one,two"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (990, 360)  # 11 x 4 inches at 90 dpi
    # a run that scored HellaSwag adds a panel for it
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write(json.dumps({"step": 60, "loss": 1.0, "hellaswag": 0.3}) + "\n")
    out = subprocess.run([*plot, tmp_path / "a.jsonl", tmp_path / "b.jsonl", "-o", tmp_path / "plot.png"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert struct.unpack(">II", (tmp_path / "plot.png").read_bytes()[16:24]) == (1350, 360)
    missing = subprocess.run([*plot, tmp_path / "x.jsonl", "-o", tmp_path / "x.png"], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip() == \
        f"plot_metrics: error: metrics file '{tmp_path / 'x.jsonl'}' cannot be read (No such file or directory)"


# ------------------------------------------------------------------------------- sampling while training
def test_samples_while_training_are_what_the_checkpoint_of_that_step_draws(corpus, tmp_path):
    """--sample-every 3 on 2 ranks: rank 0 draws after steps 3, 6 and the last (7), from a generator of its
    own, so the run's parameters and losses are those of the run that draws nothing; the draw at step 7 is
    the text the sample command draws from the step-7 checkpoint with the run's seed, prompt shown."""
    plain = run(corpus, 7, world=2)
    lines, metrics_file = [], tmp_path / "m.jsonl"
    sampled = run(corpus, 7, world=2, sample_every=3, sample_tokens=10, sample_prompt="KING:", log=lines.append,
                  save_dir=tmp_path / "ck", metrics=metrics_file)
    assert sampled["param_sha256"] == plain["param_sha256"] and sampled["losses"] == plain["losses"]
    assert [step for step, _ in sampled["samples"]] == [3, 6, 7]
    last = sample_text([str(tmp_path / "ck"), "--prompt", "KING:", "--tokens", "10", "--seed", "5"])
    assert sampled["samples"][-1][1] == last and last.startswith("KING:")
    assert sampled["samples"][0][1] != last  # other weights, other text
    i = lines.index("--- sample at step 7 ---\n" + last + "\n---")
    assert lines[i - 1].startswith("step     7/7 | loss ")
    records = metrics.read(metrics_file)
    assert [r["step"] for r in records if "sample" in r] == [3, 6, 7]


def test_without_a_prompt_a_training_draw_starts_from_endoftext(corpus, tmp_path):
    report = run(corpus, 2, sample_every=2, sample_tokens=6, save_dir=tmp_path / "ck")
    assert report["samples"] == [[2, sample_text([str(tmp_path / "ck"), "--tokens", "6", "--seed", "5"])]]


def test_sampling_options_are_checked_before_training(corpus, tmp_path, unencodable_tokenizer):
    with pytest.raises(XtrainError) as err:
        parse_config(["4", "4", "16", "--sample-prompt", "KING:"])
    assert str(err.value) == "--sample-prompt needs --sample-every"
    with pytest.raises(XtrainError) as err:
        parse_config(["4", "4", "16", "--sample-tokens", "8"])
    assert str(err.value) == "--sample-tokens needs --sample-every"
    # a tokenizer without <|endoftext|>, and one that cannot encode the prompt: refused before step 1
    text = tmp_path / "cat.txt"
    text.write_text("cat " * 400)
    lines = []
    for prompt, message in [("", "give a --sample-prompt: the tokenizer has no <|endoftext|> to start from"),
                            ("dog", f"tokenizer '{unencodable_tokenizer}' cannot encode the --sample-prompt (")]:
        cfg = TrainConfig(steps=2, batch=2, seq=8, tokenizer=str(unencodable_tokenizer), corpus=str(text),
                          sample_every=1, sample_prompt=prompt, eval_batches=0).resolved()
        with pytest.raises(XtrainError) as err:
            train(cfg, log=lines.append)
        assert str(err.value).startswith(message), str(err.value)
    assert not any(line.startswith("step ") for line in lines)


def test_the_sample_command_names_a_prompt_its_tokenizer_cannot_encode(trained, tmp_path, unencodable_tokenizer):
    """A checkpoint whose tokenizer.json knows two words and has no unknown-word token: a prompt with another
    word, and one of whitespace only (no ids at all), are one line each, where they were a traceback."""
    folder = tmp_path / "ck"
    folder.mkdir()
    for p in trained.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    raw = unencodable_tokenizer.read_bytes()
    (folder / "tokenizer.json").write_bytes(raw)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["tokenizer.json"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert sample_text([str(folder), "--prompt", "cat", "--tokens", "3"]).startswith("cat")
    with pytest.raises(XtrainError) as err:
        sample_text([str(folder), "--prompt", "dog"])
    assert str(err.value).startswith(f"tokenizer '{folder / 'tokenizer.json'}' cannot encode the --prompt ("), err
    with pytest.raises(XtrainError) as err:
        sample_text([str(folder), "--prompt", "  "])
    assert str(err.value) == "the --prompt '  ' encodes to no ids: nothing to continue"
