"""HellaSwag (llm.c's multiple-choice eval files): the file layout against llm.c's writer, every bad file
one exact line, each completion's mean loss and the accuracy against transformers scoring the examples
the way llm.c's dev/data/hellaswag.py does, the same count for any world size, and the commands
(train_ddp --hellaswag, python -m xtrain_dist.hellaswag, bin/prepare_hellaswag)."""

import json
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from xtrain_dist import files
from xtrain_dist.backend import numpy_ops
from xtrain_dist.comm.local import LocalGroup
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus, read_tokenizer
from xtrain_dist.errors import XtrainError
from xtrain_dist.eval.hellaswag import Example, HellaSwag, eval_file_chunks, passes_by_length, read_eval_file, render
from xtrain_dist.model import GPT2
from xtrain_dist.train import metrics
from xtrain_dist.train.job import train
from xtrain_dist.train.launch import run_thread_ranks

REPO = Path(__file__).resolve().parent.parent
VOCAB = 4096  # the shipped tokenizer's


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def random_examples(n: int, seed: int, completions: int = 4, max_ctx: int = 20, max_completion: int = 9,
                    vocab: int = VOCAB):
    """Examples of random ids below `vocab`, contexts of 1..max_ctx ids and completions of 1..max_completion: the
    shortest cases (one context id, one completion id) come up too."""
    rng = np.random.default_rng(seed)

    def ids(most):
        return rng.integers(0, vocab, size=int(rng.integers(1, most + 1)), dtype=np.int32)

    return [Example(i, int(rng.integers(0, completions)), ids(max_ctx),
                    tuple(ids(max_completion) for _ in range(completions))) for i in range(n)]


def llmc_write_evalfile(datas: list[dict]) -> bytes:
    """dev/data/data_common.py's write_evalfile, written out again from its docstring, field by field."""
    stream, longest = [], 0
    for idx, data in enumerate(datas):
        example = [65535, 0, idx, data["label"], len(data["ending_tokens"]), len(data["ctx_tokens"]),
                   *data["ctx_tokens"]]
        for end in data["ending_tokens"]:
            example += [len(end), *end]
        example[1] = 2 * len(example)
        longest = max(longest, example[1])
        stream += example
    header = [20240522, 1, len(datas), longest] + [0] * 252
    return np.array(header, dtype="<i4").tobytes() + np.array(stream, dtype="<u2").tobytes()


def write(path: Path, examples) -> Path:
    files.write_atomic(path, eval_file_chunks(examples), "test")
    return path


# ------------------------------------------------------------------------------------------ the file
def test_eval_file_is_llmcs_layout_and_reads_back(tmp_path):
    examples = random_examples(30, seed=1)
    datas = [{"label": ex.label, "ctx_tokens": ex.context.tolist(),
              "ending_tokens": [c.tolist() for c in ex.completions]} for ex in examples]
    assert b"".join(eval_file_chunks(examples)) == llmc_write_evalfile(datas)
    back = read_eval_file(write(tmp_path / "e.bin", examples), VOCAB)
    assert [(e.index, e.label) for e in back] == [(e.index, e.label) for e in examples]
    for ours, theirs in zip(back, examples, strict=True):
        np.testing.assert_array_equal(ours.context, theirs.context)
        assert [c.tolist() for c in ours.completions] == [c.tolist() for c in theirs.completions]


def _damaged(tmp_path, change) -> Path:
    """A two-example file (contexts of 3 ids, completions of 2) with its uint16 stream changed by `change`."""
    examples = [Example(i, 1, np.array([5, 6, 7], np.int32), tuple(np.array([8, 9], np.int32) for _ in range(4)))
                for i in range(2)]
    header, stream = eval_file_chunks(examples)
    words = np.frombuffer(stream, "<u2").copy()
    header = np.frombuffer(header, "<i4").copy()
    raw = change(header, words)
    path = tmp_path / "bad.bin"
    path.write_bytes(raw if isinstance(raw, bytes) else header.tobytes() + words.tobytes())
    return path


def _set(array, i, value):
    array[i] = value


def _grown(words) -> bytes:
    """The stream with one more word in the last example, which its size counts but no field holds."""
    words[22] += 2
    return words.tobytes() + b"\0\0"


# each example is 5 + 4 + 4 x 3 = 21 words: the second starts at word 21
BAD_FILES = [
    (lambda h, w: h.tobytes()[:100], " is not an llm.c eval file (shorter than its 1024-byte header)"),
    (lambda h, w: _set(h, 0, 20240520), " is not an llm.c eval file (magic 20240520, not 20240522)"),
    (lambda h, w: _set(h, 1, 2), " is an llm.c eval file of version 2; this trainer reads version 1"),
    (lambda h, w: h.tobytes() + w.tobytes()[:-1], " is cut short: its examples are not a whole number of uint16"),
    (lambda h, w: h.tobytes() + w.tobytes()[:-2], ", example 1 is cut short or misstates its size (42 bytes)"),
    (lambda h, w: _set(w, 21, 65534), ", example 1 does not start with the marker 65535 (a damaged file?)"),
    (lambda h, w: _set(w, 23, 0), ", example 1 carries the index 0 (examples are numbered in file order)"),
    (lambda h, w: _set(w, 24, 4), ", example 1 has label 4 among 4 completions"),
    (lambda h, w: _set(w, 5, 0), ", example 0 has an empty context or completion"),
    (lambda h, w: _set(w, 9, 1), ", example 0: its context and completions run past its 42 bytes"),
    (lambda h, w: h.tobytes() + _grown(w), ", example 1: its context and completions end before its 44 bytes do"),
    (lambda h, w: _set(w, 27, 4096), ", example 1 holds the id 4096, outside the tokenizer's vocabulary of 4096 (a "
                                     "file made with another tokenizer)"),
    (lambda h, w: _set(h, 2, 3), " holds 2 examples, its header says 3"),
    (lambda h, w: h.tobytes(), " holds no examples"),
]


@pytest.mark.parametrize("change, message", BAD_FILES)
def test_a_bad_eval_file_is_one_exact_line(tmp_path, change, message):
    path = _damaged(tmp_path, change)
    with pytest.raises(XtrainError) as err:
        read_eval_file(path, VOCAB)
    assert str(err.value) == f"--hellaswag '{path}'{message}"


def test_every_example_of_a_file_has_the_same_number_of_completions(tmp_path):
    four, three = random_examples(1, 0, completions=4)[0], random_examples(1, 0, completions=3)[0]
    path = write(tmp_path / "e.bin", [four, Example(1, three.label, three.context, three.completions)])
    with pytest.raises(XtrainError, match=r", example 1 has 3 completions, example 0 has 4: every example of a "
                                          r"file needs the same number$"):
        read_eval_file(path, VOCAB)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(XtrainError, match=rf"^--hellaswag '{tmp_path}/none.bin' not found$"):
        read_eval_file(tmp_path / "none.bin", VOCAB)


# -------------------------------------------------------------------------------- rows and scores
def test_render_rows_follow_llmc_mask_and_targets():
    ex = Example(0, 0, np.array([10, 11, 12], np.int32), (np.array([20, 21], np.int32), np.array([30], np.int32)))
    ids, targets, mask = render([ex], width=6)
    assert ids.tolist() == [[10, 11, 12, 20, 0, 0], [10, 11, 12, 0, 0, 0]]
    assert targets.tolist() == [[11, 12, 20, 21, 0, 0], [11, 12, 30, 0, 0, 0]]
    # the last context position predicts the completion's first id, as llm.c's dataloader.h masks it
    assert mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]]


def tiny_model(seed: int = 0, scale: float = 0.3) -> GPT2:
    """The tiny GPT-2 with random weights of std `scale`: far from the initialisation, every part of the
    model changes the losses, and the completions' scores lie far apart."""
    model = GPT2(model_config("tiny", VOCAB), numpy_ops, seed=seed)
    used = sum(s.hf_size for s in model.layout)
    model.params[:] = 0
    rng = np.random.default_rng(seed)
    for s in model.layout:  # wte's padded rows stay zero
        model.params[s.offset: s.offset + s.hf_size] = rng.standard_normal(s.hf_size).astype(np.float32) * scale
    assert used == model.num_params
    return model


def transformers_scores(model: GPT2, examples) -> np.ndarray:
    """Each completion's mean loss, computed as llm.c's dev/data/hellaswag.py does: a transformers
    GPT2LMHeadModel with our weights, each example's rows padded to its own longest, the mask shifted."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from xtrain_dist.bench.torch_gpt2 import hf_model

    hf = hf_model(model.config, model.state_dict())
    scores = []
    with torch.no_grad():
        for ex in examples:
            rows = [np.concatenate([ex.context, e]) for e in ex.completions]
            width = max(len(r) for r in rows)
            tokens = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                tokens[i, :len(r)] = torch.from_numpy(r.astype(np.int64))
                mask[i, len(ex.context):len(r)] = 1
            logits = hf(tokens).logits
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).double(),
                                                       tokens[:, 1:].reshape(-1), reduction="none")
            shift_mask = mask[:, 1:]
            losses = (losses.view(len(rows), -1) * shift_mask).sum(dim=1) / shift_mask.sum(dim=1)
            scores.append(losses.numpy())
    return np.array(scores)


def test_scores_and_accuracy_match_transformers_scoring_as_llmc_does():
    examples = random_examples(24, seed=2)
    model = tiny_model()
    theirs = transformers_scores(model, examples)
    # passes of 300 positions: a few examples each, shortest first, where the oracle runs one at a time in
    # file order; the scores come back in file order
    evaluator = HellaSwag(examples, 300, rank=0, world=1, backend=numpy_ops)
    assert 1 < len(evaluator.passes) < len(examples)
    ours = evaluator.completion_losses(model)
    np.testing.assert_allclose(ours, theirs, rtol=2e-5)
    gaps = np.sort(theirs, axis=1)[:, 1] - theirs.min(axis=1)
    assert gaps.min() > 1e-3  # no near-tie that rounding could flip: the predictions below are the oracle's
    predictions = theirs.argmin(axis=1)
    labels = np.array([ex.label for ex in examples])
    assert 0 < (predictions == labels).sum() < len(examples)  # a count that tells right from wrong
    assert evaluator.correct(model) == (predictions == labels).sum()
    assert evaluator.accuracy(model) == (predictions == labels).mean()


@pytest.mark.parametrize("tokens", [1, 120, 500, 10**6])
def test_passes_take_the_shortest_examples_first_within_the_budget(tokens):
    """Every example once; each pass within `tokens` positions (rows x its widest row) unless it is one
    example alone; passes in order of width, so little of a pass is padding."""
    examples = random_examples(40, seed=6)
    passes = passes_by_length(examples, tokens)
    assert sorted(i for chunk in passes for i in chunk) == list(range(40))
    widths = [examples[i].longest_row for chunk in passes for i in chunk]
    assert widths == sorted(widths)
    for chunk in passes:
        cost = len(chunk) * 4 * max(examples[i].longest_row for i in chunk)
        assert cost <= tokens or len(chunk) == 1, (chunk, cost)
    if tokens == 1:
        assert len(passes) == 40
    if tokens == 10**6:
        assert len(passes) == 1
    # greedy: a pass ends only where the next example would not fit
    for chunk, following in pairwise(passes):
        assert (len(chunk) + 1) * 4 * examples[following[0]].longest_row > tokens


@pytest.mark.parametrize("world", [2, 3, 30])
def test_every_world_size_counts_the_same_examples(world):
    """Example i on rank i % world, counts all-reduced; 30 ranks leave some with no example at all."""
    examples = random_examples(25, seed=3)
    model = tiny_model(1)
    alone = HellaSwag(examples, 400, rank=0, world=1, backend=numpy_ops).correct(model)
    group = LocalGroup(world)

    def rank_fn(rank, comm):
        evaluator = HellaSwag(examples, 150, rank, world, numpy_ops)
        return len(evaluator.completion_losses(model)), evaluator.correct(model, comm)

    outcomes = run_thread_ranks(world, lambda r, comm: rank_fn(r, comm), timeout_s=60, group=group)
    assert [n for n, _ in outcomes] == [len(range(r, 25, world)) for r in range(world)]
    assert {c for _, c in outcomes} == {alone}


# ------------------------------------------------------------------------------------- the commands
def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_train_ddp_reports_hellaswag_at_each_evaluation(corpus, tmp_path):
    examples = random_examples(10, seed=4)
    path = write(tmp_path / "hs.bin", examples)
    lines = []
    cfg = TrainConfig(steps=4, batch=4, seq=16, model="tiny", seed=5, world_size=2, eval_every=2, eval_batches=0,
                      hellaswag=str(path), metrics=str(tmp_path / "m.jsonl"), save_dir=str(tmp_path / "ck")).resolved()
    report = train(cfg, corpus, log=lines.append)
    assert [step for step, _ in report["hellaswag"]] == [2, 4] and report["val_losses"] == []
    assert [r.get("hellaswag") for r in metrics.read(tmp_path / "m.jsonl")] == [None, report["hellaswag"][0][1],
                                                                               None, report["hellaswag"][1][1]]
    assert any(line.endswith(f"| hellaswag {report['hellaswag'][1][1]:.4f}") for line in lines)
    # the checkpoint scored on its own says the same, in one process on one rank
    out = cli("-m", "xtrain_dist.hellaswag", tmp_path / "ck", path)
    right = round(report["hellaswag"][1][1] * 10)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"hellaswag: {right}/10 = {right / 10:.4f}\n", "")


def test_an_example_longer_than_the_model_is_refused_before_training(tmp_path):
    """The tiny model has 128 positions: a context of 120 ids and a completion of 10 need 129."""
    long = Example(0, 0, np.arange(120, dtype=np.int32), (np.arange(10, dtype=np.int32), np.arange(8, dtype=np.int32)))
    path = write(tmp_path / "hs.bin", [long])
    out = cli("-m", "xtrain_dist.train_ddp", 2, 4, 16, "--hellaswag", path, "--report", tmp_path / "r.json")
    assert (out.returncode, out.stderr) == (2, f"train_ddp: error: --hellaswag '{path}', example 0: its context and "
                                               "longest completion need 129 positions, the model has 128\n")
    assert not (tmp_path / "r.json").exists()


def test_prepare_hellaswag_encodes_as_llmc_does(tmp_path):
    records = [{"ctx": "ROMEO: But soft, what light", "label": 2,
                "endings": ["through yonder window breaks.", "is that?", "is the east.", "no."]},
               {"ctx": "Good night, good night!", "label": "0",
                "endings": ["Parting is such sweet sorrow", "Ay me", "Wherefore art thou", "What's in a name?"]}]
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    out = cli(REPO / "bin/prepare_hellaswag", DEFAULT_TOKENIZER, jsonl, tmp_path / "hs.bin")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"wrote {tmp_path / 'hs.bin'}: 2 examples of 4 completions, ")
    tokenizer = read_tokenizer(DEFAULT_TOKENIZER)
    back = read_eval_file(tmp_path / "hs.bin", VOCAB)
    assert [ex.label for ex in back] == [2, 0]
    for ex, record in zip(back, records, strict=True):
        assert ex.context.tolist() == tokenizer.encode(record["ctx"], add_special_tokens=False).ids
        assert [c.tolist() for c in ex.completions] == [tokenizer.encode(" " + e, add_special_tokens=False).ids
                                                       for e in record["endings"]]
    limited = cli(REPO / "bin/prepare_hellaswag", DEFAULT_TOKENIZER, jsonl, tmp_path / "one.bin", "--limit", 1)
    assert limited.returncode == 0 and len(read_eval_file(tmp_path / "one.bin", VOCAB)) == 1


def test_prepare_hellaswag_names_the_line_its_tokenizer_cannot_encode(tmp_path, unencodable_tokenizer):
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text('{"ctx": "cat", "label": 0, "endings": ["cat", "cat"]}\n'
                     '{"ctx": "cat dog", "label": 0, "endings": ["cat", "cat"]}\n')
    out = cli(REPO / "bin/prepare_hellaswag", unencodable_tokenizer, jsonl, tmp_path / "hs.bin")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"prepare_hellaswag: error: tokenizer '{tmp_path / 't.json'}' cannot encode "
                                 f"JSONL '{jsonl}', line 2 (")
    assert not (tmp_path / "hs.bin").exists()


@pytest.mark.parametrize("line, message", [
    ("{", "line 2: not JSON (Expecting property name enclosed in double quotes)"),
    pytest.param("[" * 100_000, "line 2: not JSON (nested too deeply)", id="nested-past-the-recursion-limit"),
    ('{"ctx": "a", "label": 4, "endings": ["b", "c", "d", "e"]}', 'line 2: "label" 4 is not the index of one of its '
                                                                  "4 endings"),
    ('{"ctx": "a", "label": 0, "endings": ["b"]}', 'line 2: "endings" is not a list of at least two texts'),
    ('{"label": 0, "endings": ["b", "c"]}', 'line 2: no "ctx" text'),
    ("[1]", "line 2: not a JSON object"),
])
def test_prepare_hellaswag_names_the_bad_line(tmp_path, line, message):
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text('{"ctx": "a", "label": 0, "endings": ["b", "c"]}\n' + line + "\n")
    out = cli(REPO / "bin/prepare_hellaswag", DEFAULT_TOKENIZER, jsonl, tmp_path / "hs.bin")
    assert (out.returncode, out.stderr) == (2, f"prepare_hellaswag: error: JSONL '{jsonl}', {message}\n")
    assert not (tmp_path / "hs.bin").exists()
