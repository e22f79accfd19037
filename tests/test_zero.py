"""ZeRO-1: the optimizer state is split over the ranks, 1/world each, and training does not notice."""

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from ddp_oracle import hand_synced_run

from xtrain_dist.config import TrainConfig
from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
from xtrain_dist.layout import ALIGN
from xtrain_dist.parallel.zero import shard_bounds
from xtrain_dist.train.job import train

TINY_SIZE = 370432  # elements of the tiny model's flat buffer: 11576 x ALIGN, not a multiple of 3 x ALIGN


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS)


def run(corpus, world, steps=5, **kw):
    kw = {k: str(v) if isinstance(v, Path) else v for k, v in kw.items()}
    cfg = TrainConfig(steps=steps, batch=8, seq=32, model="tiny", seed=7, world_size=world, **kw).resolved()
    return train(cfg, corpus, log=lambda line: None)


def max_rel_diff(a, b) -> float:
    a, b = np.array(a), np.array(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_shards_partition_the_buffer_on_aligned_cuts(world):
    shards = shard_bounds(TINY_SIZE, world)
    assert shards[0][0] == 0 and shards[-1][1] == TINY_SIZE
    assert all(a[1] == b[0] for a, b in pairwise(shards))
    assert all(lo % ALIGN == 0 for lo, _ in shards)
    sizes = [hi - lo for lo, hi in shards]
    assert max(sizes) - min(sizes) <= ALIGN
    if world == 3:
        assert sizes == [123456, 123488, 123488]  # uneven, and not padded


def test_more_ranks_than_aligned_groups_leaves_some_shards_empty():
    assert shard_bounds(2 * ALIGN, 3) == [(0, 0), (0, ALIGN), (ALIGN, 2 * ALIGN)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero1_follows_the_unsharded_run_with_1_over_world_of_the_state(corpus, world):
    plain = run(corpus, world)
    sharded = run(corpus, world, zero=1)
    assert sharded["zero"] == 1 and plain["zero_shards"] is None
    assert len(set(sharded["param_sha256"])) == 1
    assert max_rel_diff(sharded["losses"], plain["losses"]) < 1e-5
    # optimizer state: m and v for the own shard only
    full = plain["optimizer_state_bytes"][0]
    assert full == 2 * 4 * TINY_SIZE and set(plain["optimizer_state_bytes"]) == {full}
    per_rank = sharded["optimizer_state_bytes"]
    assert sum(per_rank) == full
    assert all(abs(b - full / world) <= 2 * 4 * ALIGN for b in per_rank)
    assert [[lo, hi] for lo, hi in shard_bounds(TINY_SIZE, world)] == sharded["zero_shards"]
    # parameters and gradients stay whole on every rank (that is ZeRO-2 and -3)
    assert sharded["param_bytes"] == sharded["grad_bytes"] == [4 * TINY_SIZE] * world


@pytest.mark.parametrize("grad_sync", ["per-param", "flat", "bucketed"])
def test_without_clipping_zero1_is_bitwise_the_unsharded_run(corpus, grad_sync):
    """Reduce-scatter sums in the same rank order as all-reduce and AdamW is elementwise, so only the
    global norm's summation order can differ; with clipping off the runs are identical."""
    kw = {"grad_sync": grad_sync, "bucket_mb": 0.05, "grad_clip": 0.0}
    plain = run(corpus, 3, **kw)
    sharded = run(corpus, 3, zero=1, **kw)
    assert sharded["losses"] == plain["losses"]
    assert sharded["param_sha256"] == plain["param_sha256"]


def test_zero1_with_bf16_and_accumulation_is_the_hand_synced_step(corpus):
    """ZeRO-1, bf16 compression and two micro-batches at once against tests/ddp_oracle.py, which rounds
    where the run rounds: losses, gradient norms and parameters to the bit (clipping off, so the sharded
    norm's summation order does not reach the parameters; the clipped run follows the unsharded one above)."""
    cfg = TrainConfig(steps=5, batch=8, seq=32, model="tiny", seed=7, world_size=3, zero=1, grad_compress="bf16",
                      grad_accum=2, bucket_mb=0.05, grad_clip=0.0).resolved()
    combined = train(cfg, corpus, log=lambda line: None)
    oracle = hand_synced_run(corpus, cfg)
    assert combined["losses"] == oracle["losses"]
    assert combined["grad_norms"] == oracle["grad_norms"]
    assert combined["param_sha256"] == [oracle["param_sha256"]] * 3


# ---------------------------------------------------------------------------------------------- ZeRO-2 and -3
STEPS = 20  # of --model tiny: --model mini takes 4 to 7 s a run on the 2-core CPU machine, tiny under 1


@pytest.fixture(scope="module")
def world1(corpus):
    return {accum: run(corpus, 1, steps=STEPS, grad_accum=accum) for accum in (1, 2)}


@pytest.fixture(scope="module")
def zero1(corpus):
    return {world: run(corpus, world, steps=STEPS, zero=1) for world in (2, 4)}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_zero2_and_zero3_follow_world1_with_zero1s_bits_and_shards_of_what_they_shard(corpus, world1, zero1, stage,
                                                                                      world):
    sharded = run(corpus, world, steps=STEPS, zero=stage)
    assert max_rel_diff(sharded["losses"], world1[1]["losses"]) < 1e-5
    assert len(set(sharded["param_sha256"])) == 1
    # one micro-batch: the same rank-order sums into the same shards as ZeRO-1 (parallel/zero.py), the same bits
    assert sharded["losses"] == zero1[world]["losses"]
    assert sharded["param_sha256"] == zero1[world]["param_sha256"]
    shard_bytes = [4 * (hi - lo) for lo, hi in shard_bounds(TINY_SIZE, world)]
    assert sharded["grad_bytes"] == shard_bytes
    assert sharded["param_bytes"] == (shard_bytes if stage == 3 else [4 * TINY_SIZE] * world)
    assert sharded["optimizer_state_bytes"] == [2 * b for b in shard_bytes]


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_adds_each_micro_batch_into_the_shard(corpus, world1, stage):
    sharded = run(corpus, 2, steps=STEPS, zero=stage, grad_accum=2)
    assert max_rel_diff(sharded["losses"], world1[2]["losses"]) < 1e-5
    assert len(set(sharded["param_sha256"])) == 1
    if stage == 3:  # ZeRO-2 and -3 add the same sums in the same order
        assert sharded["param_sha256"] == run(corpus, 2, steps=STEPS, zero=2, grad_accum=2)["param_sha256"]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_zero3_prefetch_depth_changes_what_is_held_not_the_bits(corpus, zero1, prefetch):
    sharded = run(corpus, 2, steps=3, zero=3, zero3_prefetch=prefetch)
    assert sharded["param_sha256"] == run(corpus, 2, steps=3, zero=1)["param_sha256"]


def test_zero3_with_bf16_and_evaluation(corpus):
    kw = {"dtype": "bf16", "eval_batches": 2, "eval_every": 2, "steps": 4}
    sharded, whole = run(corpus, 2, zero=3, **kw), run(corpus, 2, zero=1, **kw)
    assert sharded["losses"] == whole["losses"] and sharded["val_losses"] == whole["val_losses"]
    assert sharded["param_sha256"] == whole["param_sha256"]


class _Rank:
    """What the stages read of a communicator at construction: no collective runs there."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


def held_bytes(*objects) -> int:
    """Bytes of the arrays the objects keep as attributes (each buffer once, views counted by their base)."""
    seen, total = set(), 0
    for obj in objects:
        for value in vars(obj).values():
            if isinstance(value, np.ndarray):
                base = value if value.base is None else value.base
                if id(base) not in seen:
                    seen.add(id(base))
                    total += base.nbytes
    return total


def test_a_zero3_rank_holds_a_quarter_of_what_a_zero1_rank_does_at_world_4(corpus):
    from xtrain_dist.backend import numpy_ops
    from xtrain_dist.config import model_config
    from xtrain_dist.model import GPT2
    from xtrain_dist.parallel.zero import make_optimizer

    def held(stage):
        model = GPT2(model_config("tiny", corpus.vocab_size), numpy_ops, seed=7)
        cfg = TrainConfig(steps=1, batch=8, seq=32, model="tiny", world_size=4, zero=stage).resolved()
        return held_bytes(model, make_optimizer(model, cfg, _Rank(1, 4)))

    shard = 4 * (TINY_SIZE // 4)  # bytes of a float32 shard (TINY_SIZE is 4 x 2894 x ALIGN)
    schedule = 3 * 4  # AdamW's learning rate and bias corrections
    dropout_step = 4  # the step dropout's masks are drawn for (a uint32 the model keeps in memory)
    # ZeRO-1: whole parameters and gradients, the decay mask (a byte an element), m and v of the shard
    assert held(1) == 4 * TINY_SIZE * 2 + TINY_SIZE + 2 * shard + schedule + dropout_step
    # ZeRO-3: the shards of all four and of the mask
    assert held(3) == 4 * shard + shard // 4 + schedule + dropout_step


@pytest.mark.parametrize("world, options", [(2, {}), (4, {"grad_accum": 2})])
def test_zero3_resumes_bitwise_at_its_mesh_and_exactly_at_another_stage_and_world(corpus, tmp_path, world, options):
    options = {**options, "lr_decay_steps": 8}  # the schedule of the 8 steps, also in the run that stops at 4
    full = run(corpus, world, steps=8, zero=3, **options)
    run(corpus, world, steps=4, zero=3, save_dir=tmp_path / "ck", **options)
    assert {p.name for p in (tmp_path / "ck").glob("optimizer*")} == \
        {f"optimizer.rank{r}.safetensors" for r in range(world)}
    resumed = run(corpus, world, steps=8, zero=3, resume=tmp_path / "ck", **options)
    assert resumed["losses"] == full["losses"][4:] and resumed["param_sha256"] == full["param_sha256"]
    for other_world, stage in ((1, 0), (3, 2)):
        other = run(corpus, other_world, steps=8, zero=stage, resume=tmp_path / "ck", **options)
        assert max_rel_diff(other["losses"], full["losses"][4:]) < 1e-5


@pytest.mark.parametrize("options, line", [
    ({"zero": 3, "zero3_prefetch": -1}, "--zero3-prefetch must be 0 or more (pass steps gathered ahead), got -1"),
    ({"zero": 2, "tp": 2}, "--zero 2 and --tp do not work together yet: the tensor-parallel shards are not cut into "
                           "ZeRO's shards yet"),
    ({"zero": 3, "pp": 2}, "--zero 3 and --pp do not work together yet: the pipeline stages' tied wte is not sharded "
                           "yet"),
    ({"zero": 2, "grad_compress": "powersgd"}, "--zero 2 and --grad-compress powersgd do not work together yet: "
                                               "PowerSGD's factors need the whole gradient of a matrix on every rank"),
    ({"zero": 3, "grad_sync": "per-param"}, "--zero 3 and --grad-sync per-param do not work together yet: there is "
                                            "no whole gradient buffer to reduce after backward: each block is "
                                            "reduce-scattered as backward finishes it (--grad-sync bucketed)"),
    ({"zero": 2, "grad_sync": "flat"}, "--zero 2 and --grad-sync flat do not work together yet: there is no whole "
                                       "gradient buffer to reduce after backward: each block is reduce-scattered as "
                                       "backward finishes it (--grad-sync bucketed)"),
], ids=["prefetch", "tp", "pp", "powersgd", "per-param", "flat"])
def test_what_zero2_and_zero3_do_not_do_yet_is_one_line(options, line):
    from xtrain_dist.errors import XtrainError
    from xtrain_dist.parallel import zero

    cfg = TrainConfig(steps=1, batch=8, seq=32, world_size=2, **options)
    with pytest.raises(XtrainError) as info:
        zero.check_config(cfg)
    assert str(info.value) == line


def test_the_command_line_refuses_zero3_beside_tp_in_one_line():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "xtrain_dist.train_ddp", "2", "8", "32", "--world-size", "2",
                          "--zero", "3", "--tp", "2"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == ["train_ddp: error: --zero 3 and --tp do not work together yet: the "
                                       "tensor-parallel shards are not cut into ZeRO's shards yet"]


def test_zero3_scores_hellaswag_and_draws_samples_as_zero1_does(corpus, tmp_path):
    """13 examples over 3 ranks: 5, 4 and 4, so the ranks run different numbers of passes, and the ranks that
    run fewer must still take part in each gather; every rank draws rank 0's sample beside it."""
    from test_hellaswag import random_examples, write

    path = write(tmp_path / "hs.bin", random_examples(13, seed=0))
    kw = {"steps": 2, "hellaswag": str(path), "sample_every": 2, "sample_tokens": 4}
    sharded, whole = run(corpus, 3, zero=3, **kw), run(corpus, 3, zero=1, **kw)
    assert sharded["hellaswag"] == whole["hellaswag"] and sharded["samples"] == whole["samples"] != []
    assert sharded["param_sha256"] == whole["param_sha256"]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_memory_bound_counts_the_units_a_zero3_rank_gathers_and_fills(corpus, prefetch):
    """The pre-flight bound is the shards plus the gathered units and gradient buffers of the pass step that holds
    the most (parallel/zero.py's transient_bytes); the ranks held that, and at most one unit's reduce-scatter
    more (a step starts once at most one is still running)."""
    from xtrain_dist.config import model_config
    from xtrain_dist.layout import param_layout
    from xtrain_dist.parallel.zero import unit_sizes
    from xtrain_dist.train.memory import rank_memories

    cfg = TrainConfig(steps=2, batch=8, seq=32, model="tiny", seed=7, world_size=2, zero=3,
                      zero3_prefetch=prefetch).resolved()
    report = train(cfg, corpus, log=lambda line: None)
    bounds = rank_memories(model_config("tiny", corpus.vocab_size), cfg, 4)
    sizes = unit_sizes(param_layout(model_config("tiny", corpus.vocab_size))[0], [0, 1])
    for bound, peak, params, grads in zip(bounds, report["zero_peak_bytes"], report["param_bytes"],
                                          report["grad_bytes"], strict=True):
        shards = params + params // 4 + grads  # float32 parameters, their decay mask, float32 gradients
        held = shards + peak["gathered_params"] + peak["grad_buffers"]
        assert bound.parameters + bound.gradients <= held
        assert held <= bound.parameters + bound.gradients + 4 * sizes["mlp", 0]  # the largest unit of a block
    if prefetch == 0:  # the widest step: the embedding's forward, with wte, wpe and block 0's ln_1 (its unit)
        widest = sizes["wte"] + sizes["wpe"] + sizes["attn", 0]
        assert report["zero_peak_bytes"][0] == {"gathered_params": 4 * widest, "grad_buffers": 0}
        assert bounds[0].parameters == report["param_bytes"][0] * 5 // 4 + 4 * widest


def test_zero3_units_are_block_halves_and_wte_is_gathered_only_for_the_embedding_and_the_head():
    from xtrain_dist.parallel.zero import pass_steps, window

    order, needs, writes = pass_steps([0, 1])
    held = [window(order, needs, n, 1) for n in range(len(order))]
    assert [step for (_, step), units in zip(order, held, strict=True) if "wte" in units] == [
        "embed", ("mlp", 1), "head", "head"]  # the embedding; the last half prefetches the head's
    assert max(len(units - {"wte", "wpe", "ln_f"}) for units in held) == 3  # never more than three block halves
    # every gradient unit is written by one step, wte's by the embedding's backward only
    written = [key for keys in writes.values() for key in keys]
    assert sorted(map(str, written)) == sorted(map(str, set(written))) and writes["embed"] == ["wpe", "wte"]


@pytest.mark.long
def test_bench_zero_sets_what_a_rank_holds_beside_the_bound(tmp_path):
    """bin/bench_zero at world 2, ZeRO-1 and -3, of the tiny model: rank 0's arrays are the pre-flight bound's
    (ZeRO-1 exactly; ZeRO-3 at least, the reduce-scatters still in flight being left out of the bound, and within
    15% of it), and both follow world 1; xtrain-plan's memory is what the rank held within 10%."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bin" / "bench_zero"
    done = subprocess.run([sys.executable, str(script), "--model", "tiny", "--worlds", "2", "--stages", "1,3",
                           "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {r["stage"]: r for r in json.loads((tmp_path / "zero.json").read_text())["rows"]}
    assert rows[1]["held_bytes"] == rows[1]["bound_bytes"]
    assert rows[3]["bound_bytes"] <= rows[3]["held_bytes"] <= 1.15 * rows[3]["bound_bytes"]
    assert all(r["ranks_equal"] and r["loss_rel_diff"] < 1e-5 for r in rows.values())
    # PyTorch FSDP2 in the same run: the same losses (another implementation: float32 rounding apart) and, at
    # rest, about the same shards (it cuts each tensor's rows in two, padding them; we cut the flat buffer)
    fsdp = json.loads((tmp_path / "zero.json").read_text())["fsdp2"]
    if "skipped" not in fsdp:
        (theirs,) = fsdp["rows"]
        assert theirs["world"] == 2 and theirs["loss_rel_diff"] < 1e-5
        assert abs(theirs["state_bytes"] - rows[3]["at_rest_bytes"]) <= 0.05 * theirs["state_bytes"]
        assert "ZeRO-3 beside PyTorch FSDP2" in (tmp_path / "zero.md").read_text()
    # xtrain-plan's memory column (parameters, gradients, AdamW) is what the rank held, within 10%
    from xtrain_dist.config import model_config
    from xtrain_dist.planner.projection import Mesh, Run, Shape, device_memory

    for stage in (1, 3):
        m = device_memory(Shape.of(model_config("tiny", 4096)), Mesh(dp=2),
                          Run(batch=8, seq=64, precision="fp32", zero=stage))
        held = rows[stage]["held_bytes"]
        assert abs(m.parameters + m.gradients + m.optimizer - held) <= 0.1 * held


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_compression_rounds_each_block_as_zero1_rounds_each_bucket(corpus, stage):
    """Rounding is elementwise, before and after the rank-order sum: the same bits in blocks as in buckets."""
    kw = {"steps": 3, "grad_compress": "bf16"}
    sharded, whole = run(corpus, 2, zero=stage, **kw), run(corpus, 2, zero=1, **kw)
    assert sharded["param_sha256"] == whole["param_sha256"] != run(corpus, 2, zero=1, steps=3)["param_sha256"]
