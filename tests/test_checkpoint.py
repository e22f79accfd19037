"""Checkpoints: transformers loads the folder as is and computes our loss; resuming continues the run to
the bit; the optimizer state survives any sharding; a save cut short at any point leaves a complete
checkpoint; and every bad checkpoint is one exact line."""

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from padded_vocab import ODD_VOCAB, odd_vocab_files

from xtrain_dist.backend import numpy_ops
from xtrain_dist.checkpoint import resume, store
from xtrain_dist.checkpoint.safetensors_io import read_safetensors, write_safetensors
from xtrain_dist.comm.local import LocalGroup, _chunk
from xtrain_dist.config import TrainConfig, model_config
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.data.sampler import BatchSampler
from xtrain_dist.errors import XtrainError
from xtrain_dist.eval.evaluate import Evaluator
from xtrain_dist.layout import param_layout
from xtrain_dist.model import GPT2
from xtrain_dist.optim import AdamW
from xtrain_dist.train import loop as train_module
from xtrain_dist.train.job import StopRequest, train
from xtrain_dist.train.launch import RankFailed, run_thread_ranks
from xtrain_dist.train.preflight import RunComplete, resolve_auto_resume


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def config(steps, world=1, **kw) -> TrainConfig:
    base = {"batch": 4, "seq": 16, "model": "tiny", "seed": 5, "lr_decay_steps": 8, "eval_batches": 2}
    kw = {k: str(v) if isinstance(v, Path) else v for k, v in {**base, **kw}.items()}
    return TrainConfig(steps=steps, world_size=world, **kw).resolved()


def run(corpus, steps, world=1, log=lambda line: None, **kw) -> dict:
    return train(config(steps, world, **kw), corpus, log=log)


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """A 2-rank run of 3 steps that saved its checkpoint: (folder, report)."""
    folder = tmp_path_factory.mktemp("saved") / "ck"
    return folder, run(corpus, 3, world=2, save_dir=folder)


def copy_of(saved, tmp_path) -> Path:
    folder = tmp_path / "ck"
    shutil.copytree(saved[0], folder)
    return folder


def digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------- Hugging Face layout
def test_transformers_loads_the_folder_and_computes_our_loss(corpus, saved, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder, report = saved
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied, as trained

    # the run's own end-of-run validation loss, recomputed by transformers on the same held-out batches
    cfg = config(3, world=2)
    held_out = Evaluator(corpus.val, cfg.batch, cfg.seq, cfg.eval_batches, 0, 1, numpy_ops)
    total = 0.0
    with torch.no_grad():
        for ids, targets in held_out.batches:
            logits = hf(torch.from_numpy(ids.astype(np.int64))).logits
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                       torch.from_numpy(targets.astype(np.int64)).reshape(-1),
                                                       reduction="sum").item()
    (step, val_loss), = report["val_losses"]
    assert step == 3
    assert total / held_out.n_tokens == pytest.approx(val_loss, rel=1e-4)

    # what transformers writes for the model it loaded is our file, byte for byte: same names (with the
    # transformer. prefix, no lm_head), same order, same header
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    assert tokenizer(text)["input_ids"] == corpus.encode(text).tolist()
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == hf.config.eos_token_id == 4095


def test_transformers_computes_our_logits_for_weights_far_from_their_init(corpus, tmp_path):
    """A model a few steps from its initialisation attends almost uniformly, and its small weights hide
    a wrong attention scale or a swapped square matrix (attn.c_proj, 64 x 64, loads transposed without a
    shape error) below the loss comparison's tolerance: random weights of std 0.3 make every part count."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = config(20)
    model, optimizer, sampler = objects(corpus, cfg)
    used = store.layout_size(model.config)
    model.params[:used] = np.random.default_rng(0).standard_normal(used).astype(np.float32) * 0.3
    save_world1(tmp_path / "ck", corpus, cfg, model, optimizer, sampler)
    ids = corpus.val[:64].astype(np.int32).reshape(2, 32)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ck").eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(theirs, model.forward(ids), rtol=1e-4, atol=1e-4)


def test_config_json_is_the_trained_gpt2(saved):
    transformers = pytest.importorskip("transformers")
    c = transformers.GPT2Config.from_pretrained(saved[0])
    tiny = model_config("tiny", 4096)
    assert (c.model_type, c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == \
        ("gpt2", 4096, tiny.n_ctx, tiny.n_embd, tiny.n_layer, tiny.n_head)
    assert c.architectures == ["GPT2LMHeadModel"] and c.activation_function == "gelu_new"
    assert c.layer_norm_epsilon == 1e-5 and c.tie_word_embeddings
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.0  # trained without dropout
    assert c.bos_token_id == c.eos_token_id == 4095  # <|endoftext|>, as in OpenAI's GPT-2
    assert json.loads((saved[0] / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": tiny.n_ctx,
        "clean_up_tokenization_spaces": False, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}


def test_the_folder_holds_the_files_the_manifest_vouches_for(saved):
    folder, _ = saved
    names = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "optimizer.safetensors",
             "trainer_state.json", "manifest.json"}
    assert {p.name for p in folder.iterdir()} == names
    assert not list(folder.parent.glob(".ck.*"))  # no temporary or aside left behind
    ckpt = store.open_checkpoint(folder, read="*")
    assert set(ckpt.manifest["files"]) == names - {"manifest.json"}
    state = ckpt.state
    assert state["step"] == 3 and state["world_size"] == 2 and state["optimizer"]["step_count"] == 3
    assert state["schedule"] == {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "lr_decay_steps": 8,
                                 "lr_schedule": "cosine", "cooldown_steps": None}
    assert state["sampler"]["batches_drawn"] == 3


# ------------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("world, options", [
    (1, {}), (2, {}),
    (3, {}),                                      # BATCH 4 on 3 ranks: 2, 1 and 1 sequences
    (2, {"grad_accum": 2}),                       # two micro-batches of one sequence per rank
    (3, {"batch": 7, "grad_accum": 2}),           # micro-batches of 2+1, 1+1, 1+1
    (3, {"batch": 7, "grad_accum": 2, "zero": 1}),  # and ZeRO-1's uneven shards, one file per rank
], ids=["world1", "world2", "world3", "world2-accum2", "world3-accum2", "world3-accum2-zero1"])
def test_resume_continues_the_run_bitwise(corpus, tmp_path, world, options):
    full = run(corpus, 8, world, **options)
    first = run(corpus, 4, world, save_dir=tmp_path / "ck", **options)
    lines = []
    resumed = run(corpus, 8, world, resume=tmp_path / "ck", log=lines.append, **options)
    assert first["losses"] == full["losses"][:4]
    assert resumed["start_step"] == 4 and resumed["losses"] == full["losses"][4:]
    assert resumed["param_sha256"] == full["param_sha256"]
    assert resumed["val_losses"] == full["val_losses"]  # both evaluate at step 8 only
    assert f"resuming '{tmp_path / 'ck'}' after step 4" in lines
    assert not [line for line in lines if line.startswith("resume:")]  # nothing changed


def test_a_run_killed_after_a_periodic_save_resumes_bitwise(corpus, tmp_path, monkeypatch):
    full = run(corpus, 8)
    real_backward = train_module.GPT2.stage_backward
    calls = {"n": 0}

    def backward(self, tape, dout=None, on_grads_ready=None):
        calls["n"] += 1
        if calls["n"] == 8:
            raise RuntimeError("killed")
        return real_backward(self, tape, dout, on_grads_ready)

    lines = []
    with monkeypatch.context() as patch:
        patch.setattr(train_module.GPT2, "stage_backward", backward)
        with pytest.raises(RankFailed):
            run(corpus, 8, save_dir=tmp_path / "ck", save_every=3, log=lines.append)
    assert [line for line in lines if line.startswith("saved")] == \
        [f"saved checkpoint '{tmp_path / 'ck'}' at step {s}" for s in (3, 6)]
    resumed = run(corpus, 8, resume=tmp_path / "ck")
    assert resumed["start_step"] == 6 and resumed["losses"] == full["losses"][6:]
    assert resumed["param_sha256"] == full["param_sha256"]


def test_a_stop_request_ends_the_run_after_a_step_and_the_same_command_resumes_it_bitwise(corpus, tmp_path):
    """What SIGTERM does (job.StopRequest), and what a requeued job then does. The host reads a step's loss
    after queuing the next one, so rank 0 logs step 1 once step 2 is queued: set then, the request goes in
    with step 3 (whichever step rank 1 is in, the all-reduce of step 3 tells both), is read once step 4 is
    queued, and both stop after step 4, the step every rank is in, and save it. Run again, the same
    configuration (--resume auto) resumes from that checkpoint and ends on the uninterrupted run's bits."""
    full = run(corpus, 8, world=2)
    folder = tmp_path / "ck"
    stop = StopRequest(str(folder))
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("step     1/8"):
            stop.set()

    same = config(8, 2, save_dir=folder, log_every=100, resume="auto")
    stopped = train(same, corpus, log=log, stop=stop)
    assert lines[0] == f"--resume auto: no checkpoint in '{folder}' yet: starting at step 1"
    assert stopped["stopped"] == {"step": 4, "signal": None}
    assert stopped["losses"] == full["losses"][:4] and stopped["val_losses"] == []
    # the step it stopped after is shown, whatever --log-every
    assert lines[-2].startswith("step     4/8 | loss")
    assert lines[-1] == f"saved checkpoint '{folder}' at step 4"
    assert len(set(stopped["param_sha256"])) == 1
    lines.clear()
    resumed = train(same, corpus, log=lines.append)
    assert lines[0] == f"resuming '{folder}' after step 4"
    assert resumed["start_step"] == 4 and resumed["losses"] == full["losses"][4:]
    assert resumed["stopped"] is None and resumed["param_sha256"] == full["param_sha256"]
    # run once more (a job requeued after it finished): nothing to train, said as success, nothing written
    saved_bytes = {f.name: f.read_bytes() for f in folder.iterdir()}
    with pytest.raises(RunComplete, match=rf"^--resume auto: checkpoint '{re.escape(str(folder))}' is at step 8 and "
                                          r"STEPS is 8: nothing left to train$"):
        train(same, corpus, log=lines.append)
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == saved_bytes
    with pytest.raises(XtrainError, match=r"is already at step 8: STEPS \(8\) must be larger to train on$") as err:
        train(replace(same, resume=str(folder)), corpus)  # an explicit --resume still asks for more steps
    assert not isinstance(err.value, RunComplete)
    # --init-from is the first start's: once there is a checkpoint to resume, it is done with
    assert resolve_auto_resume(replace(same, init_from="gpt2")) == replace(same, resume=str(folder))


@pytest.mark.parametrize("mesh", [{"world": 2, "tp": 2}, {"world": 2, "pp": 2, "grad_accum": 2},
                                  {"world": 8, "tp": 2, "pp": 2, "grad_accum": 2, "batch": 4},
                                  {"world": 4, "tp": 2, "grad_compress": "powersgd", "powersgd_start_step": 1}])
def test_a_stop_request_and_resume_auto_at_every_mesh_continue_bitwise(corpus, tmp_path, mesh):
    """The test above on a mesh of rank threads (tp 2, pp 2, dp 2 x tp 2 x pp 2, and dp 2 x tp 2 with PowerSGD,
    each rank's error feedback saved and read back): the stop request goes round the whole world, so every rank
    of every group stops after step 4 and saves it; the same command resumes it and ends on the uninterrupted
    run's bits, every rank's."""
    full = run(corpus, 6, eval_batches=0, **mesh)
    folder = tmp_path / "ck"
    stop = StopRequest(str(folder))

    def log(line):
        if line.startswith("step     1/6"):
            stop.set()

    same = config(6, save_dir=folder, log_every=100, resume="auto", eval_batches=0, **{"world": 1, **mesh})
    stopped = train(same, corpus, log=log, stop=stop)
    assert stopped["stopped"] == {"step": 4, "signal": None} and stopped["losses"] == full["losses"][:4]
    resumed = train(same, corpus, log=lambda line: None)
    assert resumed["start_step"] == 4 and resumed["losses"] == full["losses"][4:]
    assert resumed["param_sha256"] == full["param_sha256"] and len(set(full["param_sha256"])) > 1


def test_a_stop_request_in_the_last_step_changes_nothing(corpus):
    """Set while step 2 of 3 is logged, the ranks hear it in step 3: the run is done, not stopped."""
    stop = StopRequest(None)

    def log(line):
        if line.startswith("step     2/3"):
            stop.set()

    assert train(config(3, 2), corpus, log=log, stop=stop)["stopped"] is None and stop.is_set()


def test_resuming_at_another_world_size_restores_the_state_and_says_what_differs(corpus, saved):
    folder, _ = saved
    full = run(corpus, 6, world=2)
    lines = []
    resumed = run(corpus, 6, world=1, resume=folder, log=lines.append, lr=2e-3, min_lr=1e-4)
    assert "resume: from step 4 on, this run changes lr 0.001 -> 0.002" in lines
    assert any(line.startswith("resume: the checkpoint was written by 2 rank(s), this run has 1") for line in lines)
    # with the original lr, a world-1 continuation follows the world-2 run as closely as world sizes agree
    same_lr = run(corpus, 6, world=1, resume=folder)
    np.testing.assert_allclose(same_lr["losses"], full["losses"][3:], rtol=1e-4)
    assert resumed["losses"] != same_lr["losses"]


def test_keep_every_keeps_each_nth_step_in_its_own_folder_and_a_branch_from_it_is_exact(corpus, tmp_path):
    """--keep-every 2: steps 2, 4 and 6 each get a folder beside DIR that later saves leave alone, and a run
    branched from the kept step 2 (resumed with a new --save-dir) ends on the bits of the uninterrupted
    run, as a resume from DIR would."""
    full = run(corpus, 6, world=2)
    lines = []
    run(corpus, 6, world=2, save_dir=tmp_path / "ck", keep_every=2, log=lines.append)
    kept = [tmp_path / f"ck.step00000{s}" for s in (2, 4, 6)]
    assert [line for line in lines if line.startswith("saved")] == \
        [f"saved checkpoint '{kept[0]}' at step 2", f"saved checkpoint '{kept[1]}' at step 4",
         f"saved checkpoint '{tmp_path / 'ck'}' at step 6", f"saved checkpoint '{kept[2]}' at step 6"]
    assert [store.open_checkpoint(k).state["step"] for k in kept] == [2, 4, 6]
    assert digests(kept[2]) == digests(tmp_path / "ck")  # the same step, the same bytes
    branched = run(corpus, 6, world=2, resume=kept[0], save_dir=tmp_path / "branch")
    assert branched["losses"] == full["losses"][2:] and branched["param_sha256"] == full["param_sha256"]


def test_keep_every_never_replaces_a_folder_it_would_keep_into(corpus, saved, tmp_path):
    """Checked before training, from the step the run starts after: the kept steps a resumed run has passed
    are not its to write."""
    (tmp_path / "ck.step000004").mkdir()
    with pytest.raises(XtrainError) as err:
        run(corpus, 6, save_dir=tmp_path / "ck", keep_every=2)
    assert str(err.value) == (f"--keep-every 2: '{tmp_path / 'ck.step000004'}' already exists, and this run would "
                              "keep its step 4 there; move it away or give another --save-dir")
    assert not (tmp_path / "ck").exists()
    folder = copy_of(saved, tmp_path / "resumed")  # at step 3: it would keep steps 4 and 6 only
    (tmp_path / "resumed" / "ck.step000002").mkdir()
    run(corpus, 6, world=2, resume=folder, save_dir=folder, keep_every=2)
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == \
        ["ck", "ck.step000002", "ck.step000004", "ck.step000006"]


def test_a_resume_may_change_recompute_and_continues_bitwise(corpus, saved, tmp_path):
    """--recompute changes memory, not bits: switching it on at a resume is said once and the run goes on
    exactly. A checkpoint written before the option existed (no recompute in its config) was a run
    without it: nothing to say when this run has none either."""
    full = run(corpus, 6, world=2)
    lines = []
    resumed = run(corpus, 6, world=2, resume=saved[0], recompute=2, log=lines.append)
    assert [line for line in lines if "this run changes" in line] == \
        ["resume: from step 4 on, this run changes recompute 0 -> 2"]
    assert resumed["param_sha256"] == full["param_sha256"]
    older = copy_of(saved, tmp_path)
    rewrite_state(older, lambda state: state["config"].pop("recompute"))
    lines.clear()
    run(corpus, 4, world=2, resume=older, log=lines.append)
    assert not [line for line in lines if "this run changes" in line], lines


def test_a_wsd_run_resumed_from_its_stable_phase_cools_down_as_if_planned_from_the_start(corpus, tmp_path):
    """What warmup-stable-decay is for: the stable phase does not depend on where the decay will end, so a
    run saved there and resumed with a nearer end and cooldown is, to the bit, the run that had them all
    along (the sampler, optimizer and step count carry over; only the schedule's tail is new)."""
    wsd = {"lr_schedule": "wsd", "warmup_steps": 1}
    planned = run(corpus, 8, world=2, lr_decay_steps=8, cooldown_steps=3, **wsd)
    run(corpus, 4, world=2, lr_decay_steps=1000, save_dir=tmp_path / "ck", **wsd)  # cooldown 200 steps away
    lines = []
    cooled = run(corpus, 8, world=2, lr_decay_steps=8, cooldown_steps=3, resume=tmp_path / "ck", log=lines.append,
                 **wsd)
    assert [line for line in lines if "this run changes" in line] == \
        ["resume: from step 5 on, this run changes lr_decay_steps 1000 -> 8, cooldown_steps 200 -> 3"]
    assert cooled["lrs"] == planned["lrs"][4:] and cooled["lrs"][-1] < cooled["lrs"][0] == planned["lrs"][1]
    assert cooled["param_sha256"] == planned["param_sha256"]


def test_an_overfit_run_resumes_on_its_one_batch_and_no_other_run_resumes_it(corpus, saved, tmp_path):
    full = run(corpus, 6, overfit_batch=True)
    run(corpus, 3, overfit_batch=True, save_dir=tmp_path / "ck")
    resumed = run(corpus, 6, overfit_batch=True, resume=tmp_path / "ck")
    assert resumed["losses"] == full["losses"][3:] and resumed["param_sha256"] == full["param_sha256"]
    with pytest.raises(XtrainError) as err:
        run(corpus, 6, resume=tmp_path / "ck")
    assert str(err.value) == (f"checkpoint '{tmp_path / 'ck'}' was trained with --overfit-batch and this run is "
                              "without it: its data order cannot continue")
    with pytest.raises(XtrainError) as err:
        run(corpus, 6, world=2, overfit_batch=True, resume=saved[0])
    assert str(err.value) == (f"checkpoint '{saved[0]}' was trained without --overfit-batch and this run is "
                              "with it: its data order cannot continue")


@pytest.mark.parametrize("world", [1, 2])
def test_zero1_resume_continues_the_run_bitwise(corpus, tmp_path, world):
    zero1 = {"zero": 1}
    full = run(corpus, 8, world, **zero1)
    run(corpus, 4, world, save_dir=tmp_path / "ck", **zero1)
    assert {p.name for p in (tmp_path / "ck").glob("optimizer*")} == \
        {f"optimizer.rank{r}.safetensors" for r in range(world)}
    resumed = run(corpus, 8, world, resume=tmp_path / "ck", **zero1)
    assert resumed["losses"] == full["losses"][4:] and resumed["param_sha256"] == full["param_sha256"]
    # and the shards reassemble for a run without ZeRO, or with another world size
    other = run(corpus, 8, 3 - world, resume=tmp_path / "ck")
    np.testing.assert_allclose(other["losses"], full["losses"][4:], rtol=1e-4)


def test_the_command_line_resumes_bitwise(tmp_path):
    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", *map(str, args)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out

    common = [4, 16, "--world-size", 2, "--lr-decay-steps", 6, "--eval-batches", 1, "--seed", 9]
    cli(3, *common, "--save-dir", tmp_path / "ck")
    cli(6, *common, "--resume", tmp_path / "ck", "--report", tmp_path / "resumed.json")
    cli(6, *common, "--report", tmp_path / "full.json")
    import json
    resumed, full = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("resumed", "full"))
    assert resumed["losses"] == full["losses"][3:] and resumed["param_sha256"] == full["param_sha256"]


def test_the_ranks_of_a_process_share_one_read_and_the_last_lets_it_go():
    """Three rank threads restore from one read of a checkpoint (store.Shared): read once, on first
    use, the same object for all, and dropped once the last rank is done, also where one of them failed."""
    import threading

    reads, seen = [], []

    def read():
        reads.append(1)
        return {"bytes": bytearray(8)}

    shared = store.Shared(3, read=read, path="ck")
    barrier = threading.Barrier(3)

    def rank(r):
        try:
            with shared.use() as value:
                seen.append(value)
                barrier.wait(10)  # every rank holds it at once
                if r == 1:
                    raise ValueError("rank 1 fails while it loads")
        except ValueError:
            pass

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(reads) == 1 and len(seen) == 3 and all(v is seen[0] for v in seen)
    assert shared._value is None  # the process no longer holds the bytes
    given = store.Shared(1, value={"w": 1}, read=lambda: pytest.fail("a given value is never read again"))
    with given.use() as value:
        assert value == {"w": 1}


# ------------------------------------------------------------------------------- the state, any sharding
def objects(corpus, cfg, pad=1, rank=0, world=1, optimizer_class=AdamW):
    model = GPT2(model_config(cfg.model, corpus.vocab_size), numpy_ops, seed=cfg.seed, pad_to_multiple=pad)
    optimizer = optimizer_class(model, cfg) if optimizer_class is AdamW else optimizer_class(model, cfg, rank, world)
    return model, optimizer, BatchSampler(corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, rank=rank, world=world)


def scramble(model, optimizer, sampler, seed):
    """Give every piece of state values that a restore could not get right by accident."""
    rng = np.random.default_rng(seed)
    used = store.layout_size(model.config)
    model.params[:used] += rng.standard_normal(used).astype(np.float32) * 1e-3
    optimizer.m[:used] = rng.standard_normal(used).astype(np.float32)
    optimizer.v[:used] = rng.random(used).astype(np.float32)
    optimizer.step_count = 17
    for _ in range(seed % 5 + 1):
        sampler.next()


def save_world1(folder, corpus, cfg, model, optimizer, sampler, step=17):
    resume.save(folder, rank=0, comm=LocalGroup(1).communicator(0), step=step, cfg=cfg, corpus=corpus,
                model=model, optimizer=optimizer, sampler=sampler)


class ShardOfAdamW(AdamW):
    """Stands in for ZeRO-1's ShardedAdamW (issue 4) until it merges: the same state API, holding
    only its rank's range."""

    sharded = True

    def __init__(self, model, cfg, rank, world):
        super().__init__(model, cfg)
        self.rank, self.world = rank, world

    @property
    def state_range(self):
        return _chunk(self.m.size, self.world, self.rank)

    def state_dict(self):
        lo, hi = self.state_range
        return {"step_count": self.step_count, "start": lo, "m": self.m[lo:hi].copy(), "v": self.v[lo:hi].copy()}

    def load_state_dict(self, state):
        lo, hi = self.state_range
        assert state["start"] == lo and state["m"].size == hi - lo
        self.m[:] = 0
        self.v[:] = 0
        self.m[lo:hi], self.v[lo:hi] = state["m"], state["v"]
        self.step_count = state["step_count"]


def test_restore_gives_back_every_bit(corpus, tmp_path):
    cfg = config(20)
    model, optimizer, sampler = objects(corpus, cfg)
    scramble(model, optimizer, sampler, 3)
    save_world1(tmp_path / "ck", corpus, cfg, model, optimizer, sampler)
    again = objects(corpus, cfg)
    assert resume.restore(tmp_path / "ck", *again) == 17
    assert again[0].params.tobytes() == model.params.tobytes()
    assert again[1].m.tobytes() == optimizer.m.tobytes() and again[1].v.tobytes() == optimizer.v.tobytes()
    assert again[1].step_count == 17
    assert again[2].state() == sampler.state()
    assert [a.tobytes() for a in again[2].next()] == [a.tobytes() for a in sampler.next()]


def test_the_optimizer_state_reassembles_across_shardings_and_paddings(corpus, tmp_path):
    """Shards saved by 2 ranks of a padded model restore into one plain AdamW, and into 3 shards."""
    cfg = config(20)
    state = {}

    def save_rank(rank, comm):
        model, optimizer, sampler = objects(corpus, cfg, pad=7, rank=rank, world=2, optimizer_class=ShardOfAdamW)
        scramble(model, optimizer, sampler, 4)  # the same values on both ranks
        state[rank] = optimizer.m.copy(), optimizer.v.copy()
        resume.save(tmp_path / "ck", rank=rank, comm=comm, step=17, cfg=cfg, corpus=corpus, model=model,
                    optimizer=optimizer, sampler=sampler)

    run_thread_ranks(2, save_rank)
    assert {p.name for p in (tmp_path / "ck").glob("optimizer*")} == \
        {"optimizer.rank0.safetensors", "optimizer.rank1.safetensors"}
    m, v = state[0]
    used = store.layout_size(model_config("tiny", corpus.vocab_size))
    plain = objects(corpus, cfg)
    resume.restore(tmp_path / "ck", *plain)
    assert plain[1].m.tobytes() == m[:used].tobytes() and plain[1].v.tobytes() == v[:used].tobytes()
    for rank in range(3):
        shard = objects(corpus, cfg, pad=3, rank=rank, world=3, optimizer_class=ShardOfAdamW)
        resume.restore(tmp_path / "ck", *shard)
        lo, hi = shard[1].state_range
        expected = np.zeros(shard[1].m.size, dtype=np.float32)
        expected[:used] = m[:used]
        assert shard[1].m[lo:hi].tobytes() == expected[lo:hi].tobytes()


def test_load_state_dict_takes_its_range_from_a_covering_state_and_refuses_a_short_one(corpus):
    cfg = config(20)
    _, optimizer, _ = objects(corpus, cfg)
    n = optimizer.m.size
    m = np.arange(n + 10, dtype=np.float32)
    optimizer.load_state_dict({"step_count": 4, "start": 0, "m": m, "v": m * 2})
    assert np.array_equal(optimizer.m, m[:n]) and np.array_equal(optimizer.v, 2 * m[:n])
    with pytest.raises(XtrainError, match=rf"optimizer state for flat\[1:{n}\] cannot restore flat\[0:{n}\]"):
        optimizer.load_state_dict({"step_count": 4, "start": 1, "m": m[:n - 1], "v": m[:n - 1]})


# ------------------------------------------------------------------------------- atomic replacement
@pytest.fixture
def two_states(corpus, tmp_path):
    """A checkpoint at step 17 in tmp_path/ck, and the objects of a later state to save over it."""
    cfg = config(40)
    first = objects(corpus, cfg)
    scramble(*first, 1)
    save_world1(tmp_path / "ck", corpus, cfg, *first)
    later = objects(corpus, cfg)
    scramble(*later, 2)
    return cfg, later


def test_an_error_in_the_middle_of_a_save_leaves_the_previous_checkpoint(corpus, tmp_path, two_states, monkeypatch):
    cfg, later = two_states
    before = digests(tmp_path / "ck")

    def disk_full(path, optimizer):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resume, "_write_optimizer", disk_full)
    with pytest.raises(XtrainError) as info:
        save_world1(tmp_path / "ck", corpus, cfg, *later, step=30)
    assert str(info.value) == f"cannot write checkpoint '{tmp_path / 'ck'}' (No space left on device)"
    assert digests(tmp_path / "ck") == before
    assert store.open_checkpoint(tmp_path / "ck").state["step"] == 17
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_crash_between_the_two_renames_leaves_a_complete_checkpoint_aside(corpus, tmp_path, two_states, monkeypatch):
    cfg, later = two_states
    before = digests(tmp_path / "ck")
    real_rename = os.rename

    def power_cut(src, dst):
        if Path(src).name == ".ck.new":
            raise KeyboardInterrupt("power cut")
        real_rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(store.os, "rename", power_cut)
        with pytest.raises(KeyboardInterrupt):
            save_world1(tmp_path / "ck", corpus, cfg, *later, step=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.new", ".ck.old"]
    assert digests(tmp_path / ".ck.old") == before
    # readers take the newer complete sibling and change nothing
    ckpt = store.open_checkpoint(tmp_path / "ck")
    assert ckpt.state["step"] == 30 and ckpt.folder == tmp_path / ".ck.new"
    assert ckpt.note == f"checkpoint '{tmp_path / 'ck'}' is missing after an interrupted save: reading '{ckpt.folder}'"
    # the next run with --save-dir puts it in place and cleans up
    assert store.prepare_save_dir(tmp_path / "ck") == \
        f"checkpoint '{tmp_path / 'ck'}' recovered from '{tmp_path / '.ck.new'}' after an interrupted save"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert store.open_checkpoint(tmp_path / "ck").state["step"] == 30


def test_a_read_that_races_a_save_reads_the_checkpoint_the_save_put_in_place(corpus, tmp_path, two_states,
                                                                           monkeypatch):
    """A save that swaps the folder while a reader hashes its files is no corruption: the reader reads again."""
    cfg, later = two_states
    real_read, reads = store._read_verified, []

    def racing(path, folder, manifest, read):
        reads.append(manifest)
        if len(reads) == 1:
            save_world1(tmp_path / "ck", corpus, cfg, *later, step=30)
        return real_read(path, folder, manifest, read)

    monkeypatch.setattr(store, "_read_verified", racing)
    assert store.open_checkpoint(tmp_path / "ck").state["step"] == 30
    assert len(reads) == 2 and reads[0] != reads[1]


def test_an_unfinished_new_folder_is_never_taken_for_a_checkpoint(corpus, tmp_path, two_states):
    cfg, later = two_states
    os.rename(tmp_path / "ck", tmp_path / ".ck.old")        # as if cut between the renames ...
    shutil.copytree(tmp_path / ".ck.old", tmp_path / ".ck.new")
    (tmp_path / ".ck.new" / "manifest.json").unlink()          # ... of a save whose manifest was never written
    assert store.open_checkpoint(tmp_path / "ck").folder == tmp_path / ".ck.old"
    save_world1(tmp_path / "ck", corpus, cfg, *later, step=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert store.open_checkpoint(tmp_path / "ck").state["step"] == 30


def test_save_dir_never_replaces_a_folder_that_is_not_a_checkpoint(corpus, tmp_path):
    precious = tmp_path / "results"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(XtrainError) as info:
        run(corpus, 2, save_dir=precious)
    assert str(info.value) == (f"--save-dir '{precious}' exists and is not an xtrain-dist checkpoint "
                               "(no manifest.json): refusing to replace it; give a new or empty folder")
    assert (precious / "thesis.tex").read_text() == "years of work"
    lines = []  # --resume auto finds no checkpoint there, but says "starting at step 1" only where it would start
    with pytest.raises(XtrainError, match=r"^--save-dir '.*results' exists and is not an xtrain-dist checkpoint"):
        run(corpus, 2, save_dir=precious, resume="auto", log=lines.append)
    assert lines == []
    with pytest.raises(XtrainError, match="is a file, not a folder"):
        run(corpus, 2, save_dir=precious / "thesis.tex")
    (tmp_path / "fresh").mkdir()  # an empty folder is what the refusal asks for: it takes the checkpoint
    run(corpus, 1, save_dir=tmp_path / "fresh", eval_batches=0)
    assert store.open_checkpoint(tmp_path / "fresh").state["step"] == 1


def test_save_dir_never_replaces_the_checkpoint_of_another_run(corpus, saved, tmp_path):
    """Forgetting --resume must not cost the run in --save-dir: a run that did not start from that
    checkpoint is refused before it trains, and one that did start from it replaces it as it goes."""
    folder = tmp_path / "ck"
    shutil.copytree(saved[0], folder)
    before = digests(folder)
    refusal = (f"--save-dir '{folder}' holds the checkpoint of another run (step 3): give --resume '{folder}' "
               "to continue it, or a new folder; it is not replaced")
    with pytest.raises(XtrainError) as info:
        run(corpus, 2, save_dir=folder)
    assert str(info.value) == refusal
    with pytest.raises(XtrainError) as info:  # continuing some other checkpoint does not make this one ours
        run(corpus, 5, world=2, save_dir=folder, resume=saved[0])
    assert str(info.value) == refusal
    assert digests(folder) == before
    run(corpus, 5, world=2, save_dir=folder, resume=tmp_path / "." / "ck")  # the same folder, spelled otherwise
    assert store.open_checkpoint(folder).state["step"] == 5


def test_a_run_refused_a_save_dir_in_use_leaves_the_owners_save_in_progress_alone(corpus, saved, tmp_path):
    """Two runs on one --save-dir would replace each other's checkpoints, and the second one's start-up used to
    clear the first one's save in progress (.DIR.new) before it was refused, so the first died at its next
    write. The owner holds an exclusive lock on .DIR.lock beside the folder (store.SaveDirLock) from before
    it touches anything until it ends: another run, fresh, --resume auto (a requeue racing the job) or
    --resume DIR, is refused first, naming the owner, and changes nothing."""
    folder = tmp_path / "ck"
    shutil.copytree(saved[0], folder)
    in_progress = tmp_path / ".ck.new"
    in_progress.mkdir()
    (in_progress / "model.safetensors").write_bytes(b"half written")
    before = digests(folder)
    with open(tmp_path / ".ck.lock", "w") as owner:  # what the running job holds
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner.write("host node7, pid 4242")
        owner.flush()
        for resume_from in (None, "auto", folder):
            with pytest.raises(XtrainError) as info:
                run(corpus, 5, save_dir=folder, resume=resume_from)
            assert str(info.value) == (f"--save-dir '{folder}' is in use by another run (host node7, pid 4242): two "
                                       "runs would replace each other's checkpoints; wait for it to end or give "
                                       "another --save-dir")
        assert (in_progress / "model.safetensors").read_bytes() == b"half written" and digests(folder) == before
    # once the owner has let go (at its end, or killed: the kernel lets go), the folder is free
    run(corpus, 5, world=2, save_dir=folder, resume="auto")
    assert store.open_checkpoint(folder).state["step"] == 5
    assert not list(tmp_path.glob(".ck.*"))  # the lock file goes with the run that held it last


def test_a_save_dir_that_is_a_symbolic_link_saves_into_the_folder_it_points_to(corpus, saved, tmp_path):
    """A save replaces the folder at the path; through a link it must replace the link's target and leave
    the link in place, run after run (it used to swap the link out for a folder, then fail deleting it)."""
    target = copy_of(saved, tmp_path)
    link = tmp_path / "latest"
    link.symlink_to(target.name)
    run(corpus, 5, world=2, save_dir=link, resume=link)
    run(corpus, 6, world=2, save_dir=link, resume=target)
    assert link.is_symlink() and os.readlink(link) == target.name
    assert store.open_checkpoint(target).state["step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "latest"]  # no .new or .old left beside either


# ------------------------------------------------------------------------------- bad checkpoints
def resume_error(corpus, folder, steps=6, **kw) -> str:
    with pytest.raises(XtrainError) as info:
        run(corpus, steps, resume=folder, **kw)
    return str(info.value)


def test_a_missing_or_non_checkpoint_folder(corpus, tmp_path):
    assert resume_error(corpus, tmp_path / "nope") == f"checkpoint '{tmp_path / 'nope'}' not found"
    (tmp_path / "empty").mkdir()
    assert resume_error(corpus, tmp_path / "empty") == (
        f"checkpoint '{tmp_path / 'empty'}' has no manifest.json: it is not an xtrain-dist checkpoint, "
        "or its save never finished")


def test_corrupt_files_are_named(corpus, saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    model = folder / "model.safetensors"
    raw = bytearray(model.read_bytes())
    raw[-1] ^= 1
    model.write_bytes(raw)
    assert resume_error(corpus, folder) == \
        f"checkpoint '{folder}' is corrupt: model.safetensors does not match its sha256 in manifest.json"
    model.write_bytes(raw[:1000])
    assert resume_error(corpus, folder) == \
        f"checkpoint '{folder}' is corrupt: model.safetensors has 1000 bytes, its manifest says {len(raw)}"
    model.unlink()
    assert resume_error(corpus, folder) == f"checkpoint '{folder}' is corrupt: model.safetensors is missing"
    for garbage in ("{not json", "[" * 100_000):  # the second, nested past Python's recursion limit
        (folder / "manifest.json").write_text(garbage)
        assert resume_error(corpus, folder) == \
            f"checkpoint '{folder}' is corrupt: manifest.json is not an xtrain-dist manifest"


def test_a_checkpoint_of_another_model_or_run(corpus, saved, tmp_path):
    folder, _ = saved
    assert resume_error(corpus, folder, model="mini") == (
        f"checkpoint '{folder}' holds model 'tiny' (2 layers, 4 heads, width 64, context 128, vocabulary 4096), "
        "this run trains 'mini' (4 layers, 4 heads, width 128, context 256, vocabulary 4096)")
    assert resume_error(corpus, folder, batch=8) == \
        f"checkpoint '{folder}' was trained with BATCH 4, this run has 8: its data order cannot continue"
    assert resume_error(corpus, folder, seed=6) == \
        f"checkpoint '{folder}' was trained with --seed 5, this run has 6: its data order cannot continue"
    assert resume_error(corpus, folder, steps=3) == \
        f"checkpoint '{folder}' is already at step 3: STEPS (3) must be larger to train on"
    text = tmp_path / "other.txt"
    text.write_text("Some other text entirely, with words of its own.\n\n" * 400)
    other = Corpus.load(DEFAULT_TOKENIZER, text, cache_dir=tmp_path)
    assert resume_error(other, folder).startswith(f"checkpoint '{folder}' was trained on other token ids")


def test_the_command_line_says_it_in_one_line(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    (folder / "config.json").write_text((folder / "config.json").read_text().replace("64", "65"))
    out = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "6", "4", "16", "--resume", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == \
        [f"train_ddp: error: checkpoint '{folder}' is corrupt: config.json does not match its sha256 in manifest.json"]


def rehash(folder: Path, name: str) -> None:
    """Vouch for the edited file `name` in the manifest: a file that passes the integrity check but is
    wrong inside (a bug in another writer, a hand edit)."""
    path, manifest_path = folder / name, folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


def rewrite_state(folder: Path, change) -> None:
    state_path = folder / "trainer_state.json"
    state = json.loads(state_path.read_text())
    change(state)
    state_path.write_text(json.dumps(state))
    rehash(folder, "trainer_state.json")


def test_evaluate_reads_a_checkpoint_from_before_val_corpus_and_names_a_corrupt_state(corpus, saved, tmp_path):
    """python -m xtrain_dist.evaluate DIR reads trainer_state.json as resuming does: a checkpoint written
    before --val-corpus existed held out its corpus's split, and a state that is not what a run writes is
    one line, not a traceback."""
    from xtrain_dist.eval import evaluate
    older = copy_of(saved, tmp_path)
    rewrite_state(older, lambda state: state["data"].pop("val_corpus"))
    loss, _ = evaluate.evaluate_checkpoint([str(older)])
    assert loss == pytest.approx(saved[1]["val_losses"][-1][1], rel=1e-6)
    rewrite_state(older, lambda state: state.update(step="three"))
    with pytest.raises(XtrainError) as err:
        evaluate.evaluate_checkpoint([str(older)])
    assert str(err.value) == (f"checkpoint '{older}' is corrupt: {store.STATE} lacks the step, model, optimizer, "
                              "sampler, data or config of a run")


def rewrite_tensors(folder: Path, name: str, change) -> None:
    tensors, meta = read_safetensors(folder / name)
    tensors = {k: np.array(v) for k, v in tensors.items()}
    change(tensors, meta)
    with open(folder / name, "wb") as f:
        write_safetensors(f, tensors, meta)
    rehash(folder, name)


def _python_says(action) -> str:
    """The exception an action raises, as the trainer's messages quote one: Python's own words, which differ
    between versions (3.10: "string indices must be integers"; 3.11 adds ", not 'str'")."""
    try:
        action()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the action raised nothing")


@pytest.mark.parametrize("change, message", [
    (lambda s: s["config"].pop("batch"), "is corrupt: trainer_state.json has no batch in its config"),
    (lambda s: s.update(step=-5), "is corrupt: trainer_state.json lacks the step, model, optimizer, sampler, data "
                                  "or config of a run"),
    (lambda s: s["sampler"].update(pcg64="x"),
     "is corrupt: trainer_state.json: sampler.pcg64 is 'x', expected an object with state, inc, has_uint32 and "
     "uinteger"),
    # each field a resume reads, named with its file: numpy's OverflowError, a NaN learning rate or a negative
    # count were a traceback or taken as they were
    (lambda s: s["sampler"]["pcg64"].update(state="-5"),
     "is corrupt: trainer_state.json: sampler.pcg64.state is '-5', expected an integer in [0, 2**128)"),
    (lambda s: s["sampler"]["pcg64"].update(inc=str(2**128)),
     f"is corrupt: trainer_state.json: sampler.pcg64.inc is '{2**128}', expected an integer in [0, 2**128)"),
    (lambda s: s["sampler"]["pcg64"].update(uinteger=2**32),
     f"is corrupt: trainer_state.json: sampler.pcg64.uinteger is {2**32}, expected an integer in [0, 2**32)"),
    (lambda s: s["sampler"].update(batches_drawn=-3),
     "is corrupt: trainer_state.json: sampler.batches_drawn is -3, expected an integer >= 0"),
    (lambda s: s["schedule"].update(lr=float("nan")),
     "is corrupt: trainer_state.json: schedule.lr is nan, expected a finite number >= 0"),
    (lambda s: s["config"].update(lr=float("inf")),
     "is corrupt: trainer_state.json: config.lr is inf, expected a finite number >= 0"),
    (lambda s: s["config"].update(beta2="0.95"),
     "is corrupt: trainer_state.json: config.beta2 is '0.95', expected a finite number >= 0"),
    (lambda s: s["config"].update(batch=4.0),
     "is corrupt: trainer_state.json: config.batch is 4.0, expected an integer >= 1"),
    (lambda s: s["config"].update(overfit_batch="no"),
     "is corrupt: trainer_state.json: config.overfit_batch is 'no', expected true or false"),
    (lambda s: s["optimizer"].update(step_count=-1),
     "is corrupt: trainer_state.json: optimizer.step_count is -1, expected an integer >= 0"),
    (lambda s: s["optimizer"].update(files=["../ck/optimizer.safetensors"]),
     "is corrupt: trainer_state.json names '../ck/optimizer.safetensors' as an optimizer file, which the "
     "checkpoint does not hold"),
    (lambda s: s["optimizer"].update(files=[["optimizer.safetensors"]]),
     "is corrupt: trainer_state.json names ['optimizer.safetensors'] as an optimizer file, which the checkpoint "
     "does not hold"),
])
def test_a_rehashed_but_wrong_trainer_state_is_refused_before_training(corpus, saved, tmp_path, change, message):
    folder = copy_of(saved, tmp_path)
    rewrite_state(folder, change)
    assert resume_error(corpus, folder) == f"checkpoint '{folder}' {message}"


def rewrite_config(folder: Path, text: str) -> None:
    (folder / "config.json").write_text(text)
    rehash(folder, "config.json")


def test_a_rehashed_but_wrong_config_json_is_refused_before_training(corpus, saved, tmp_path):
    """config.json is what Hugging Face and the other commands load as the model: a resume reads and checks it
    too, each field an integer, the model the one trainer_state.json and this run train."""
    folder = copy_of(saved, tmp_path)
    good = json.loads((folder / "config.json").read_text())
    rewrite_config(folder, "{not json")
    assert resume_error(corpus, folder).startswith(f"checkpoint '{folder}' is corrupt: config.json is not valid "
                                                   "JSON (")
    rewrite_config(folder, "[1, 2]")
    assert resume_error(corpus, folder) == f"checkpoint '{folder}' is corrupt: config.json is not a JSON object"
    for key, value in (("n_layer", 2.5), ("n_embd", "64"), ("n_head", True), ("vocab_size", -1)):
        rewrite_config(folder, json.dumps({**good, key: value}))
        assert resume_error(corpus, folder) == \
            f"checkpoint '{folder}' is corrupt: config.json: {key} is {value!r}, expected an integer >= 1"
    rewrite_config(folder, json.dumps({k: v for k, v in good.items() if k != "n_head"}))
    assert resume_error(corpus, folder) == f"checkpoint '{folder}' is corrupt: config.json has no n_head"
    rewrite_config(folder, json.dumps({**good, "n_layer": 3}))
    assert resume_error(corpus, folder) == (
        f"checkpoint '{folder}' is corrupt: config.json describes another model than trainer_state.json's "
        "'tiny' (2 layers, 4 heads, width 64, context 128, vocabulary 4096)")


def _nudge_first_bias(tensors, meta):
    tensors["transformer.h.0.attn.c_attn.bias"][0] += 1e-3


def _transpose_c_attn(tensors, meta):
    """The classic GPT-2 export bug: nn.Linear's [out, in] where GPT-2's Conv1D keeps [in, out]."""
    name = "transformer.h.0.attn.c_attn.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)


@pytest.mark.parametrize("name, change, message", [
    ("model.safetensors", _nudge_first_bias, "is corrupt: its parameters do not hash to the saved param_sha256"),
    ("model.safetensors", lambda t, m: t.pop("transformer.wpe.weight"),
     "is corrupt: model.safetensors has no tensor 'transformer.wpe.weight'"),
    ("model.safetensors", _transpose_c_attn,
     "is corrupt: model.safetensors: 'transformer.h.0.attn.c_attn.weight' is float32 [192, 64], "
     "expected float32 [64, 192]"),
    ("model.safetensors", lambda t, m: t.update({"transformer.wpe.weight": t["transformer.wpe.weight"].astype("f2")}),
     "is corrupt: model.safetensors: 'transformer.wpe.weight' is float16 [128, 64], expected float32 [128, 64]"),
    ("model.safetensors", lambda t, m: t.update({"lm_head.weight": t["transformer.wte.weight"]}),
     "is corrupt: model.safetensors has tensors this model does not: lm_head.weight"),
    ("optimizer.safetensors", lambda t, m: m.update(start="32"),
     "is corrupt: optimizer.safetensors does not continue the optimizer state at element 0"),
    ("optimizer.safetensors", lambda t, m: m.update(step_count="2"),  # trainer_state.json says 3
     "is corrupt: optimizer.safetensors does not continue the optimizer state at element 0"),
    ("optimizer.safetensors", lambda t, m: t.update(v=t["v"][:-1]),
     "is corrupt: optimizer.safetensors does not continue the optimizer state at element 0"),
    ("optimizer.safetensors", lambda t, m: t.update(m=t["m"][:-64], v=t["v"][:-64]),
     "is corrupt: the optimizer files cover flat[0:{short}], the model has {used} elements"),
    # another (larger) model's optimizer state, re-hashed in: resumed, it silently changed the losses
    ("optimizer.safetensors", lambda t, m: t.update(m=np.ones(t["m"].size + 64, "f4"),
                                                   v=np.ones(t["v"].size + 64, "f4")),
     "is corrupt: optimizer.safetensors holds optimizer state past the model's {used} elements"),
])
def test_rehashed_but_wrong_tensors_are_refused_before_training(corpus, saved, tmp_path, name, change, message):
    """What the ranks would load is checked in preflight.prepare: the same one line as any bad input (exit 2 on the
    command line), not a rank failing after the run has started."""
    folder = copy_of(saved, tmp_path)
    rewrite_tensors(folder, name, change)
    used = store.layout_size(model_config("tiny", corpus.vocab_size))
    expected = message.format(short=used - 64, used=used)
    assert resume_error(corpus, folder) == f"checkpoint '{folder}' {expected}"


def test_the_rank_threads_of_a_process_read_the_checkpoint_once(corpus, saved, monkeypatch):
    """Resuming 2 rank threads reads and verifies the checkpoint once in all, not once per rank nor again
    after check_resume, and every rank still resumes exactly."""
    reads = []
    real_open = store.open_checkpoint

    def counting_open(path, read):
        reads.append(tuple(read))
        return real_open(path, read=read)

    monkeypatch.setattr(resume, "open_checkpoint", counting_open)
    resumed = run(corpus, 5, world=2, resume=saved[0])
    assert reads == [(store.MODEL, store.CONFIG, store.STATE, "optimizer*")]  # check_resume's read serves the ranks
    full = run(corpus, 5, world=2)
    assert resumed["losses"] == full["losses"][3:] and resumed["param_sha256"] == full["param_sha256"]


# ------------------------------------------------------------------------------- padded vocabulary
@pytest.fixture(scope="module")
def odd_corpus(tmp_path_factory):
    """A corpus whose tokenizer has 1000 ids: the model's wte pads them to 1024 rows."""
    return Corpus.load(*odd_vocab_files(tmp_path_factory.mktemp("odd")))


def test_a_padded_vocabulary_saves_its_v_rows_as_save_pretrained_writes_them(odd_corpus, tmp_path):
    """The layout holds 1024 rows of wte; model.safetensors and config.json hold the tokenizer's 1000, and
    transformers loads the folder, computes our logits, and writes the same model.safetensors back."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "ck"
    run(odd_corpus, 2, save_dir=folder)
    tensors, _ = read_safetensors(folder / "model.safetensors")
    assert tensors["transformer.wte.weight"].shape == (ODD_VOCAB, 64)
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == ODD_VOCAB
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    model = GPT2(model_config("tiny", ODD_VOCAB), numpy_ops)
    model.load_state_dict(tensors)
    ids = odd_corpus.val[:64].astype(np.int32).reshape(2, 32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    assert theirs.shape == (2, 32, ODD_VOCAB)
    np.testing.assert_allclose(theirs, model.forward(ids), rtol=1e-4, atol=1e-4)


def as_version_1(folder: Path, config) -> None:
    """Rewrite a version 2 checkpoint (one optimizer file) as the code before the padded vocabulary wrote it:
    the same model.safetensors (V rows), m and v over a layout whose wte has V rows, param_sha256 over that
    layout, and version 1 in trainer_state.json and the manifest."""
    old = store.layout_size(config, 1)
    assert old < store.layout_size(config)
    tensors, meta = read_safetensors(folder / "optimizer.safetensors")
    assert not tensors["m"][old:].any() and not tensors["v"][old:].any()  # wte's padded rows: zero
    with open(folder / "optimizer.safetensors", "wb") as f:
        write_safetensors(f, {"m": tensors["m"][:old].copy(), "v": tensors["v"][:old].copy()}, meta)
    rehash(folder, "optimizer.safetensors")
    model, _ = read_safetensors(folder / "model.safetensors")
    flat = np.zeros(old, dtype=np.float32)  # the old layout, built by hand: wte last, its V rows then alignment
    for spec in param_layout(config)[0]:
        flat[spec.offset: spec.offset + spec.hf_size] = model[spec.name].reshape(-1)

    def old_state(state):
        state["version"] = 1
        state["param_sha256"] = store.sha256_of(flat)
    rewrite_state(folder, old_state)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["version"] = 1
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_from_before_the_padded_vocabulary_resumes_bitwise(odd_corpus, tmp_path):
    """A version 1 checkpoint (wte's V rows in the flat layout) is converted on load: its optimizer state and
    parameters are this layout's prefix, wte's padded rows start at zero, and the resumed run ends where an
    uninterrupted one does, bit for bit. Its next save is version 2. A version this code does not know is
    one line."""
    mcfg = model_config("tiny", ODD_VOCAB)
    full = run(odd_corpus, 6)
    first = run(odd_corpus, 3, save_dir=tmp_path / "ck")
    as_version_1(tmp_path / "ck", mcfg)
    assert store.open_checkpoint(tmp_path / "ck").version == 1
    resumed = run(odd_corpus, 6, resume=tmp_path / "ck", save_dir=tmp_path / "ck")
    assert first["losses"] == full["losses"][:3]
    assert resumed["start_step"] == 3 and resumed["losses"] == full["losses"][3:]
    assert resumed["param_sha256"] == full["param_sha256"]
    ckpt = store.open_checkpoint(tmp_path / "ck")
    assert ckpt.version == store.VERSION == 2 and ckpt.state["version"] == 2
    assert read_safetensors(tmp_path / "ck" / "optimizer.safetensors")[0]["m"].size == store.layout_size(mcfg)

    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    manifest["version"] = 3
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(XtrainError) as info:
        run(odd_corpus, 8, resume=tmp_path / "ck")
    assert str(info.value) == (f"checkpoint '{tmp_path / 'ck'}' has format version 3; this xtrain-dist reads "
                               "versions 1, 2")


def test_param_sha256_follows_the_padded_layout(odd_corpus, tmp_path):
    """param_sha256 is the digest of the flat layout's parameters, wte's padded zero rows included; params_sha256
    computes it from the V-row tensors, and for a version 1 checkpoint over the layout it was written in."""
    cfg = config(20)
    model, optimizer, sampler = objects(odd_corpus, cfg)
    used = store.layout_size(model.config)
    assert used == param_layout(model.config)[1]
    save_world1(tmp_path / "ck", odd_corpus, cfg, model, optimizer, sampler)
    state = json.loads((tmp_path / "ck" / "trainer_state.json").read_text())
    assert state["param_sha256"] == store.sha256_of(model.params[:used])
    assert store.params_sha256(model.state_dict(), model.config) == state["param_sha256"]
    old = store.layout_size(model.config, 1)
    assert store.params_sha256(model.state_dict(), model.config, 1) == store.sha256_of(model.params[:old])
    assert old < used and store.sha256_of(model.params[:old]) != state["param_sha256"]
