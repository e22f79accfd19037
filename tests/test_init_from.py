"""--init-from: a run starts from the weights of a GPT-2 folder (save_pretrained's layout, the Hub's own
files, or one of our checkpoints) with a fresh optimizer and data order, as llm.c and nanoGPT fine-tune
OpenAI's GPT-2."""

import copy
import json
import re
import shutil

import numpy as np
import pytest

from xtrain_dist.backend import numpy_ops
from xtrain_dist.checkpoint import store
from xtrain_dist.checkpoint.safetensors_io import write_safetensors
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.data.sampler import BatchSampler
from xtrain_dist.errors import XtrainError
from xtrain_dist.model import GPT2
from xtrain_dist.train.cli import main
from xtrain_dist.train.job import train


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory, corpus):
    """A transformers GPT2LMHeadModel of the tiny preset's shape with random weights everywhere (layernorms
    and biases too), saved by save_pretrained: (folder, model)."""
    folder = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    return folder, saved_random_gpt2(folder, model_config("tiny", corpus.vocab_size), eos=0, seed=0)


def saved_random_gpt2(folder, mcfg, eos: int, seed: int):
    """A transformers GPT2LMHeadModel of `mcfg`'s shape with random weights everywhere (layernorms and biases
    too), saved into `folder` by save_pretrained; returns the model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)  # transformers' own init draws from the global generator
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(bos_token_id=eos, eos_token_id=eos,
        vocab_size=mcfg.vocab_size, n_positions=mcfg.n_ctx, n_embd=mcfg.n_embd, n_layer=mcfg.n_layer,
        n_head=mcfg.n_head, activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def run(corpus, tmp_path=None, **fields):
    cfg = TrainConfig(**{"steps": 2, "batch": 4, "seq": 16, "model": "tiny", "seed": 3, "eval_batches": 0,
                         **fields}).resolved()
    return train(cfg, corpus, log=lambda line: None)


def first_batch_loss(forward_logits, corpus, seed=3):
    """The mean cross-entropy of a model (ids -> logits, numpy) on the first global batch of `seed`."""
    ids, targets = BatchSampler(corpus.train, 4, 16, seed=seed).next()
    logits = forward_logits(ids).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    return float(np.mean(logz - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]))


def test_training_starts_from_hugging_face_weights(corpus, hf_gpt2):
    """The first loss is transformers' own loss of the saved model on the run's first batch (two ranks,
    bitwise equal); without --init-from the run starts from our init, and its first loss is not that."""
    import torch

    folder, hf = hf_gpt2
    report = run(corpus, init_from=str(folder), world_size=2)
    with torch.no_grad():
        expected = first_batch_loss(lambda ids: hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy(), corpus)
    assert report["losses"][0] == pytest.approx(expected, rel=1e-5)
    assert len(set(report["param_sha256"])) == 1
    assert abs(run(corpus, world_size=2)["losses"][0] - expected) > 1e-3  # 1e-5 relative is 1e-4 here


def test_the_hubs_own_layout_gives_the_same_bits(corpus, hf_gpt2, tmp_path):
    """The Hub's gpt2 files name tensors as GPT2Model does (no "transformer."), keep each block's causal
    mask buffers and may hold the tied lm_head; float16 widens exactly. All of it trains to the same bits
    as save_pretrained's layout of the same (float16-representable) weights."""
    import torch

    folder, hf = hf_gpt2
    state = {k: v.numpy().astype(np.float16).astype(np.float32) for k, v in hf.state_dict().items()
             if not k.endswith(".attn.bias")}
    n_ctx = hf.config.n_positions
    hub = {re.sub(r"^transformer\.", "", k): v.astype(np.float16) for k, v in state.items()}
    for layer in range(hf.config.n_layer):
        hub[f"h.{layer}.attn.bias"] = np.tril(np.ones((n_ctx, n_ctx), np.float32))[None, None]
        hub[f"h.{layer}.attn.masked_bias"] = np.array(-1e4, np.float32)
    config = json.loads((folder / "config.json").read_text())
    write_model(tmp_path / "hub", config, hub)
    state.pop("lm_head.weight", None)  # save_pretrained leaves the tied head out
    write_model(tmp_path / "ours", config, state)
    assert "lm_head.weight" in hub and hub["wte.weight"].dtype == np.float16
    from_hub = run(corpus, init_from=str(tmp_path / "hub"))
    assert from_hub["param_sha256"] == run(corpus, init_from=str(tmp_path / "ours"))["param_sha256"]
    rounded = copy.deepcopy(hf)  # the fixture's model stays the saved one for the other tests
    with torch.no_grad():
        rounded.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
        expected = first_batch_loss(lambda ids: rounded(torch.from_numpy(ids.astype(np.int64))).logits.numpy(),
                                    corpus)
    assert from_hub["losses"][0] == pytest.approx(expected, rel=1e-5)


def test_fine_tuning_from_our_own_checkpoint(corpus, tmp_path):
    """A checkpoint of ours starts a new run (another seed, so another data order) from its weights, with
    a fresh optimizer; its files are verified against the manifest first."""
    run(corpus, steps=3, save_dir=str(tmp_path / "base"))
    ckpt = store.open_checkpoint(tmp_path / "base")
    mcfg = model_config("tiny", corpus.vocab_size)
    model = GPT2(mcfg, numpy_ops, seed=0)
    model.load_state_dict(ckpt.model_state(mcfg))
    tuned = run(corpus, steps=1, seed=5, init_from=str(tmp_path / "base"))
    assert tuned["losses"][0] == pytest.approx(first_batch_loss(model.forward, corpus, seed=5), rel=1e-5)

    raw = bytearray((tmp_path / "base" / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "base" / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(XtrainError, match=r"is corrupt: model.safetensors does not match its sha256 in manifest"):
        run(corpus, init_from=str(tmp_path / "base"))


def test_a_checkpoint_cut_short_by_a_save_is_still_read(corpus, tmp_path, capsys):
    """Where a save was interrupted between its renames, DIR is missing and its complete .DIR.new holds the
    checkpoint: --init-from and sample read it there (with sample's note), as --resume does."""
    from xtrain_dist.eval.sample import main as sample_main

    run(corpus, steps=2, save_dir=str(tmp_path / "ck"))
    whole = run(corpus, steps=1, seed=5, init_from=str(tmp_path / "ck"))
    (tmp_path / "ck").rename(tmp_path / ".ck.new")
    assert run(corpus, steps=1, seed=5, init_from=str(tmp_path / "ck"))["losses"] == whole["losses"]
    assert sample_main([str(tmp_path / "ck"), "--tokens", "3"]) == 0
    assert "is missing after an interrupted save: reading" in capsys.readouterr().err


def error_line(capsys, *args) -> str:
    assert main(["2", "4", "16", "--eval-batches", "0", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0].removeprefix("train_ddp: error: ")


def test_a_model_of_another_shape_is_one_line_naming_the_preset(capsys, hf_gpt2):
    folder, _ = hf_gpt2
    assert error_line(capsys, "--init-from", folder, "--model", "mini") == (
        f"--init-from '{folder}' holds a GPT-2 of 2 layers, 4 heads, width 64, context 128, vocabulary 4096; "
        "--model mini with this tokenizer is 4 layers, 4 heads, width 128, context 256, vocabulary 4096: "
        "pass --model tiny")


def write_model(folder, config: dict, tensors: dict):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    with open(folder / "model.safetensors", "wb") as f:
        write_safetensors(f, tensors, {"format": "pt"})


def test_bad_pretrained_folders_are_one_line(capsys, hf_gpt2, tmp_path, corpus):
    folder, _ = hf_gpt2
    config = json.loads((folder / "config.json").read_text())
    state = GPT2(model_config("tiny", corpus.vocab_size), numpy_ops, seed=1).state_dict()
    assert error_line(capsys, "--init-from", tmp_path / "nothing") == f"--init-from '{tmp_path / 'nothing'}' not found"
    (tmp_path / "empty").mkdir()
    assert error_line(capsys, "--init-from", tmp_path / "empty") == (
        f"--init-from '{tmp_path / 'empty'}' has no model.safetensors: give a folder with a Hugging Face GPT-2's "
        "model.safetensors and config.json (or one of our checkpoints)")
    assert error_line(capsys, "--init-from", folder, "--resume", folder) == (
        "--init-from and --resume both say where the weights start: give one")

    write_model(tmp_path / "gpt2-vocab", {**config, "vocab_size": 50257},
                {**state, "transformer.wte.weight": np.zeros((50257, 64), np.float32)})
    assert error_line(capsys, "--init-from", tmp_path / "gpt2-vocab") == (
        f"--init-from '{tmp_path / 'gpt2-vocab'}' holds a GPT-2 of 2 layers, 4 heads, width 64, context 128, "
        "vocabulary 50257; --model tiny with this tokenizer is 2 layers, 4 heads, width 64, context 128, "
        "vocabulary 4096: train with the tokenizer it was trained with (its vocabulary of 50257)")

    write_model(tmp_path / "odd", {**config, "n_layer": 3}, state)
    assert error_line(capsys, "--init-from", tmp_path / "odd").endswith(": no --model preset has its shape")

    untied = {**state, "lm_head.weight": state["transformer.wte.weight"] + 1}
    write_model(tmp_path / "untied", config, untied)
    assert error_line(capsys, "--init-from", tmp_path / "untied") == (
        f"'{tmp_path / 'untied'}': its lm_head.weight is not its transformer.wte.weight; this trainer's GPT-2 ties "
        "the output projection to the token embedding")

    write_model(tmp_path / "relu", {**config, "activation_function": "relu"}, state)
    assert error_line(capsys, "--init-from", tmp_path / "relu") == (
        f"checkpoint '{tmp_path / 'relu'}': config.json has activation_function='relu'; this trainer implements "
        "GPT-2 with activation_function='gelu_new'")

    short = {k: v for k, v in state.items() if k != "transformer.ln_f.bias"}
    write_model(tmp_path / "short", config, short)
    assert error_line(capsys, "--init-from", tmp_path / "short") == (
        f"checkpoint '{tmp_path / 'short'}' is corrupt: model.safetensors has no tensor 'transformer.ln_f.bias'")

    wide = {**state, "transformer.ln_f.bias": state["transformer.ln_f.bias"].astype(np.float64)}
    write_model(tmp_path / "f64", config, wide)
    assert error_line(capsys, "--init-from", tmp_path / "f64") == (
        f"checkpoint '{tmp_path / 'f64'}' is corrupt: model.safetensors: 'transformer.ln_f.bias' is float64 [64], "
        "expected float32 [64]")


def test_processes_must_start_from_the_same_weights(corpus, hf_gpt2, tmp_path):
    """The weights join the fingerprint that processes compare at the rendezvous (their path does not: it
    may differ from node to node), so processes started from different files are refused by name."""
    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.train.preflight import prepare

    def fingerprint(init_from):
        cfg = TrainConfig(steps=2, batch=2, seq=16, eval_batches=0, init_from=str(init_from)).resolved()
        return prepare(cfg, corpus, Launch("single"), 1, lambda line: None).fingerprint

    folder, _ = hf_gpt2
    shutil.copytree(folder, tmp_path / "copy")
    assert fingerprint(tmp_path / "copy") == fingerprint(folder)
    state = GPT2(model_config("tiny", corpus.vocab_size), numpy_ops, seed=1).state_dict()
    write_model(tmp_path / "other", json.loads((folder / "config.json").read_text()), state)
    assert fingerprint(tmp_path / "other") != fingerprint(folder)


def test_sample_draws_from_a_hugging_face_folder(hf_gpt2, tmp_path):
    """`sample` takes the same folders: a Hugging Face GPT-2 with its tokenizer.json (the Hub's gpt2 has
    one) draws greedily what transformers generates from it; without a tokenizer.json it is one line."""
    import torch

    from xtrain_dist.eval.sample import generate, load, sample_text

    folder, hf = hf_gpt2
    with pytest.raises(XtrainError) as missing:
        sample_text([str(folder)])
    assert str(missing.value) == (f"checkpoint '{folder}' has no tokenizer.json: give a folder with a Hugging Face "
                                  "GPT-2's model.safetensors, config.json and tokenizer.json (or one of our "
                                  "checkpoints)")
    shutil.copytree(folder, tmp_path / "with-tokenizer")
    shutil.copy(DEFAULT_TOKENIZER, tmp_path / "with-tokenizer" / "tokenizer.json")
    model, tokenizer, _ = load(tmp_path / "with-tokenizer", numpy_ops)
    prompt = tokenizer.encode("ROMEO:", add_special_tokens=False).ids
    ours = generate(model, prompt, 12, temperature=0, top_k=None, rng=np.random.default_rng(0))
    ids = torch.tensor([prompt])
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    assert sample_text([str(tmp_path / "with-tokenizer"), "--prompt", "ROMEO:", "--tokens", "12",
                        "--temperature", "0"]) == tokenizer.decode(prompt + ours, skip_special_tokens=False)


@pytest.fixture(scope="module")
def odd_hf_gpt2(tmp_path_factory):
    """A save_pretrained GPT-2 of the tiny shape whose vocabulary (1000 ids) is not a multiple of 128, with
    random weights and the tokenizer it pairs with: (folder, model, corpus)."""
    from padded_vocab import ODD_VOCAB, odd_vocab_files

    tokenizer, text = odd_vocab_files(tmp_path_factory.mktemp("odd"))
    folder = tmp_path_factory.mktemp("hf-odd") / "gpt2-tiny-1000"
    hf = saved_random_gpt2(folder, model_config("tiny", ODD_VOCAB), eos=ODD_VOCAB - 1, seed=1)
    shutil.copy(tokenizer, folder / "tokenizer.json")
    return folder, hf, Corpus.load(tokenizer, text)


def test_a_hugging_face_folder_of_an_unpadded_vocabulary_is_padded_on_load(odd_hf_gpt2, tmp_path):
    """Its 1000 rows of wte become the first 1000 of the layout's 1024, the rest zero; --init-from, sample,
    evaluate and hellaswag all compute what transformers computes from the folder."""
    import torch

    from xtrain_dist.eval import evaluate, hellaswag
    from xtrain_dist.eval.sample import generate, load

    folder, hf, corpus = odd_hf_gpt2
    model, tokenizer, _ = load(folder, numpy_ops)
    wte = next(s for s in model.layout if s.name == "transformer.wte.weight")
    assert wte.shape == (1024, 64) and wte.hf_shape == (1000, 64)
    assert not model.params[wte.offset + wte.hf_size: wte.offset + wte.size].view(np.uint32).any()
    assert np.array_equal(model.p.wte[:1000], hf.transformer.wte.weight.detach().numpy())

    # sample: greedy draws are transformers' own
    prompt = tokenizer.encode("ROMEO:", add_special_tokens=False).ids
    ours = generate(model, prompt, 10, temperature=0, top_k=None, rng=np.random.default_rng(0))
    ids = torch.tensor([prompt])
    assert ours == hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()

    # --init-from: the first loss is transformers' on the first batch
    report = run(corpus, init_from=str(folder))
    with torch.no_grad():
        expected = first_batch_loss(lambda ids: hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy(), corpus)
    assert report["losses"][0] == pytest.approx(expected, rel=1e-5)

    # evaluate: the loss of windows of a corpus
    text = tmp_path / "text.txt"
    text.write_text(corpus.corpus_path.read_text()[:20000])
    loss, _ = evaluate.evaluate_checkpoint([str(folder), str(text), "--batch", "2", "--seq", "32", "--batches", "1"])
    windows = np.asarray(tokenizer.encode(text.read_text(), add_special_tokens=False).ids)
    starts = np.arange(2) * (len(windows) - 33) // 1
    windows = torch.from_numpy(np.stack([windows[s:s + 33] for s in starts]).astype(np.int64))
    with torch.no_grad():
        logits = hf.double()(windows[:, :-1]).logits
        hf.float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 1000), windows[:, 1:].reshape(-1)).item()
    assert loss == pytest.approx(want, rel=1e-5)

    # hellaswag: each completion's loss is transformers'; the command counts the examples it gets right
    rng = np.random.default_rng(3)
    examples = [hellaswag.Example(i, int(rng.integers(0, 4)), rng.integers(0, 1000, 6, dtype=np.int32),
                                  tuple(rng.integers(0, 1000, 3, dtype=np.int32) for _ in range(4)))
                for i in range(8)]
    path = tmp_path / "eval.bin"
    path.write_bytes(b"".join(hellaswag.eval_file_chunks(examples)))
    evaluator = hellaswag.HellaSwag(examples, 1000, 0, 1, numpy_ops)
    with torch.no_grad():
        rows = torch.from_numpy(np.stack([np.concatenate([ex.context, c]) for ex in examples
                                          for c in ex.completions]).astype(np.int64))
        logp = torch.log_softmax(hf(rows).logits.double(), dim=-1)
    picked = torch.gather(logp[:, 5:-1], 2, rows[:, 6:, None])[..., 0]
    theirs = (-picked.mean(dim=1)).numpy().reshape(8, 4)
    np.testing.assert_allclose(evaluator.completion_losses(model), theirs, rtol=2e-5)
    right = int((theirs.argmin(axis=1) == [ex.label for ex in examples]).sum())
    assert hellaswag.evaluate([str(folder), str(path)]) == f"hellaswag: {right}/8 = {right / 8:.4f}"
