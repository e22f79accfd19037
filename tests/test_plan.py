"""The planner's arithmetic against cases worked by hand, its memory against the pre-flight check's, and its
command line's answers to bad input. No timings: the figures are the formulas', checked as numbers."""

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from xtrain_dist.config import PRESETS, TrainConfig, model_config
from xtrain_dist.layout import count_params, param_layout
from xtrain_dist.planner import cli
from xtrain_dist.planner.projection import (
    Hardware,
    Mesh,
    Run,
    Shape,
    device_memory,
    device_params,
    exposed_comm_s,
    flops_per_token,
    least,
    model_params,
    ring_all_reduce_s,
    scaling_table,
    step_time,
)
from xtrain_dist.profile import nanogpt_flops_per_token
from xtrain_dist.train.memory import rank_memories

ROOT = Path(__file__).resolve().parents[1]
# one layer, d_model 32, d_ff 64, 2 heads, vocab 100 (padded to 128), 4 positions: every tensor a multiple of
# layout.ALIGN (32 elements), so the sums below need no padding
SMALL = Shape(n_layer=1, n_head=2, d_model=32, d_ff=64, vocab_size=100, n_ctx=4)


def test_memory_of_a_small_shape_worked_by_hand():
    C, F, T, B = 32, 64, 4, 2
    block = (F * C + C) + (C * F + F) + 2 * C + (C * C + C) + (C * 3 * C + 3 * C) + 2 * C  # 8544 elements
    assert block == 4 * C * C + 2 * C * F + 9 * C + F == 8544
    params = block + 4 * C + 128 * C + 2 * C  # wpe, wte at 128 rows, ln_f
    assert device_params(SMALL, Mesh()) == params == 12832
    m = device_memory(SMALL, Mesh(), Run(batch=B, seq=T, precision="fp32"))
    assert (m.parameters, m.gradients, m.optimizer) == (4 * params + params, 4 * params, 8 * params)
    # kept per layer, in float32 elements: x_in, ln1, atty, x_mid, ln2 (B T C each), their four row statistics
    # (B T each), qkv (B T 3C), the probabilities (B heads T T) and the MLP's two (B T F)
    per_layer = 5 * B * T * C + 4 * B * T + B * T * 3 * C + B * 2 * T * T + 2 * B * T * F
    assert per_layer == 3168
    # ids (int32), x and ln_f (B T C), ln_f's statistics, and the logits' gradient (B T 128)
    final = B * T + 2 * B * T * C + 2 * B * T + B * T * 128
    assert m.activations == 4 * (per_layer + final) == 18912


def test_tensor_parallel_cuts_the_products_heads_and_vocabulary():
    C, F = 32, 64
    # per device: the products' weights halved, qkv's and fc's biases halved (qkv's 48 padded to 64)
    block = F * C // 2 + C + C * F // 2 + F // 2 + 2 * C + C * C // 2 + C + 3 * C * C // 2 + 64 + 2 * C
    assert block == 4384
    # the vocabulary padded to 128 rows (as the trainer pads it, whatever the tp), half of them here
    assert device_params(SMALL, Mesh(tp=2)) == block + 4 * C + 128 * C // 2 + 2 * C == 6624
    whole = device_memory(SMALL, Mesh(), Run(batch=2, seq=4, precision="fp32")).activations
    half = device_memory(SMALL, Mesh(tp=2), Run(batch=2, seq=4, precision="fp32")).activations
    B, T = 2, 4
    # qkv, atty, the probabilities and the MLP's two are halved, and the logits' gradient (128 wide)
    halved = B * T * 3 * C + B * T * C + B * 2 * T * T + 2 * B * T * F + B * T * 128
    assert whole - half == 4 * halved // 2
    # sequence parallelism cuts every other array too but the token ids: x_in, ln1, x_mid, ln2 and their
    # statistics in each layer; x, ln_f and its statistics after
    sequence = device_memory(SMALL, Mesh(tp=2), Run(batch=2, seq=4, precision="fp32", sequence_parallel=True))
    assert half - sequence.activations == 4 * (4 * B * T * C + 4 * B * T + 2 * B * T * C + 2 * B * T) // 2


def test_pipeline_stages_hold_their_layers_and_micro_batches_in_flight():
    shape = Shape(n_layer=8, n_head=2, d_model=32, d_ff=64, vocab_size=100, n_ctx=4)
    one = device_memory(Shape(1, 2, 32, 64, 100, 4), Mesh(), Run(batch=8, seq=4, precision="fp32", grad_accum=4))
    two = device_memory(Shape(2, 2, 32, 64, 100, 4), Mesh(), Run(batch=8, seq=4, precision="fp32", grad_accum=4))
    per_layer = two.activations - one.activations
    staged = device_memory(shape, Mesh(pp=4), Run(batch=8, seq=4, precision="fp32", grad_accum=4))
    # stage 0 of 4: 2 layers, 4 micro-batches of 2 sequences in flight (1F1B), and the ids (int32)
    assert staged.activations == 4 * 2 * per_layer + 4 * 2 * 4
    assert device_params(shape, Mesh(pp=4)) == 2 * 8544 + 4 * 32 + 128 * 32


@pytest.mark.parametrize("preset", ["tiny", "mini", "gpt2-124m"])
def test_parameters_and_flops_agree_with_the_model_and_the_profiler(preset):
    config = model_config(preset, 50257)
    shape = Shape.of(config)
    assert device_params(shape, Mesh()) == param_layout(config)[1]
    assert model_params(shape) == count_params(config)
    assert flops_per_token(shape, 1024) == nanogpt_flops_per_token(config, 1024)


@pytest.mark.parametrize("preset,dp,batch,zero,precision,attention,recompute,accum", [
    ("tiny", 1, 4, 0, "fp32", "standard", 0, 1),
    ("tiny", 3, 7, 1, "bf16", "flash", 1, 1),
    ("mini", 2, 9, 1, "fp32", "standard", 2, 2),
    ("gpt2-124m", 8, 64, 1, "bf16", "flash", 0, 4),
    ("gpt2-124m", 5, 16, 0, "fp32", "standard", 0, 1),
])
def test_memory_is_the_preflight_checks(preset, dp, batch, zero, precision, attention, recompute, accum):
    config = model_config(preset, 4095)
    seq = PRESETS[preset][3]
    cfg = TrainConfig(steps=1, batch=batch, seq=seq, model=preset, world_size=dp, zero=zero,
                      dtype="bf16" if precision == "bf16" else "fp32", attention=attention, recompute=recompute,
                      grad_accum=accum)
    preflight = rank_memories(config, cfg, 2 if precision == "bf16" else 4)[0]
    planned = device_memory(Shape.of(config), Mesh(dp=dp), Run(batch=batch, seq=seq, precision=precision, zero=zero,
                                                                attention=attention, recompute=recompute,
                                                                grad_accum=accum))
    assert planned == preflight


@pytest.mark.parametrize("preset, tp", [("mini", 2), ("gpt2-774m", 5)])
def test_tensor_parallel_memory_is_the_preflight_checks(preset, tp):
    """The vocabulary-parallel wte and logits: ceil(Vp / tp) rows and columns a device, also where tp does not divide
    Vp (50304 over the 774M model's tp 5: 10061 rows, the last device's one row past Vp padding)."""
    config = model_config(preset, 50257)
    cfg = TrainConfig(steps=1, batch=2, seq=64, model=preset, world_size=tp, tp=tp, attention="standard")
    planned = device_memory(Shape.of(config), Mesh(tp=tp), Run(batch=2, seq=64, precision="fp32"))
    assert planned == rank_memories(config, cfg, 4)[0]


@pytest.mark.parametrize("zero, dp, precision", [(2, 4, "fp32"), (3, 4, "fp32"), (3, 2, "bf16")])
def test_zero2_and_zero3_memory_is_the_preflight_checks(zero, dp, precision):
    """The planner sizes the units (block halves, wte, wpe, ln_f) from the shape, the pre-flight check from the
    layout, and both walk the pass steps for the one that holds the most (parallel/zero.py's transient_bytes).
    GPT-2's tensors are whole multiples of 32 elements, so the two agree to the byte."""
    config = model_config("gpt2-124m", 50257)
    cfg = TrainConfig(steps=1, batch=8, seq=1024, model="gpt2-124m", world_size=dp, zero=zero,
                      dtype="bf16" if precision == "bf16" else "fp32")
    preflight = rank_memories(config, cfg, 2 if precision == "bf16" else 4)[0]
    planned = device_memory(Shape.of(config), Mesh(dp=dp), Run(batch=8, seq=1024, precision=precision, zero=zero))
    assert planned == preflight
    whole = device_memory(Shape.of(config), Mesh(dp=dp), Run(batch=8, seq=1024, precision=precision, zero=1))
    assert planned.gradients < whole.gradients and (zero == 2 or planned.parameters < whole.parameters)


def test_zero3_memory_of_the_small_model_is_the_closed_form_count():
    """At dp 4 in float32 a ZeRO-3 rank holds a quarter of the 17 bytes per parameter (float32 parameters, their
    decay-mask byte, float32 gradients, m and v) and, at its fullest pass step (a block's MLP backward:
    its MLP half gathered and its gradient filling, the attention half below prefetched), 4 bytes for each of
    two MLP halves and one attention half. bin/bench_zero measured 63.47 MiB against this 61.21 (docs/ddp.md)."""
    C, F, V, T, L = 384, 4 * 384, 4096, 256, 6  # --model small with the shipped 4096-token vocabulary
    mlp = F * C + C + C * F + F + 2 * C   # c_proj, c_fc, ln_2: each a multiple of 32 elements, so unpadded
    attn = C * C + C + C * 3 * C + 3 * C + 2 * C
    n = L * (mlp + attn) + 2 * C + T * C + V * C
    m = device_memory(Shape.of(model_config("small", V)), Mesh(dp=4), Run(batch=8, seq=64, precision="fp32", zero=3))
    assert m.parameters + m.gradients + m.optimizer == 17 * n // 4 + 4 * (2 * mlp + attn)
    assert round((m.parameters + m.gradients + m.optimizer) / (1 << 20), 2) == 61.21
    assert (m.parameters + m.gradients + m.optimizer) / (17 * n) < 0.31  # ZeRO-0 holds 17 n


def test_ring_all_reduce_and_the_overlap_model():
    assert ring_all_reduce_s(1e9, 4, 100.0) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9)  # 15 ms
    assert ring_all_reduce_s(1e9, 1, 100.0) == 0.0
    assert exposed_comm_s(10.0, 1.0, 6.0, 1.0) == 4.0     # backward hides 6 of 10
    assert exposed_comm_s(10.0, 1.0, 20.0, 1.0) == 1.0    # all of it but the last bucket
    assert exposed_comm_s(10.0, 1.0, 6.0, 0.5) == 7.0     # half of backward can carry buckets
    assert exposed_comm_s(0.0, 0.0, 6.0, 1.0) == 0.0


def test_a_data_parallel_step_worked_by_hand():
    config = model_config("tiny", 4095)
    shape = Shape.of(config)
    size = param_layout(config)[1]
    run = Run(batch=4, seq=128, precision="fp32")
    hw = Hardware(peak_flops=1e12, mfu=0.5, bus_gbps=1.0, inter_node_gbps=1.0, tp_bus_gbps=1.0,
                  latency_s=1e-4, bucket_bytes=1 << 20)
    t = step_time(shape, Mesh(dp=2), run, hw)
    compute = 2 * 128 * flops_per_token(shape, 128) / 0.5e12  # 2 sequences on each rank
    assert t.compute_s == pytest.approx(compute)
    grad_bytes = 4 * size
    ring = 2 * 1 / 2 * grad_bytes / 1e9
    buckets = -(-grad_bytes // (1 << 20))
    assert t.dp_comm_s == pytest.approx(ring + buckets * 1e-4)
    last = ring * (1 << 20) / grad_bytes + 1e-4
    assert t.dp_exposed_s == pytest.approx(max(last, ring + buckets * 1e-4 - compute * 2 / 3))
    assert t.step_s == pytest.approx(compute + t.dp_exposed_s)
    assert t.tokens_per_s == pytest.approx(4 * 128 / t.step_s)
    zero = step_time(shape, Mesh(dp=2), Run(batch=4, seq=128, precision="fp32", zero=1), hw)
    gather = ring / 2 + 1e-4  # the float32 parameters, half a ring, after the step
    scatter = ring / 2  # the gradients' reduce-scatter: the other half, overlapped like the all-reduce
    last_scatter = scatter * (1 << 20) / grad_bytes + 1e-4
    assert zero.dp_exposed_s == pytest.approx(max(last_scatter, scatter + buckets * 1e-4 - compute * 2 / 3) + gather)


def test_the_scaling_table_starts_at_one_and_keeps_each_ranks_batch():
    shape = Shape.of(model_config("gpt2-124m", 50257))
    hw = Hardware(peak_flops=989.4e12, mfu=0.4, bus_gbps=360.0, inter_node_gbps=45.0, tp_bus_gbps=360.0)
    rows = scaling_table(shape, Mesh(dp=8), Run(batch=64, seq=1024), hw, 1024)
    assert [r["gpus"] for r in rows] == [2 ** k for k in range(11)]
    assert rows[0]["efficiency"] == pytest.approx(1.0, abs=1e-12) and rows[0]["exposed_s"] == 0.0
    assert [r["batch"] for r in rows] == [8 * r["gpus"] for r in rows]
    assert all(a["efficiency"] >= b["efficiency"] for a, b in itertools.pairwise(rows))
    # past one node the ring runs at the slower bandwidth
    assert rows[4]["dp_comm_s"] == pytest.approx(rows[3]["dp_comm_s"] * (2 * 15 / 16) / (2 * 7 / 8) * 360 / 45)
    split = scaling_table(shape, Mesh(dp=2, tp=2, pp=2), Run(batch=16, seq=1024, grad_accum=2), hw, 64)
    assert [r["gpus"] for r in split] == [4, 8, 16, 32, 64] and split[0]["dp"] == 1


def test_the_126_layer_model_needs_sharding():
    shape = Shape(n_layer=126, n_head=128, d_model=16384, d_ff=53248, vocab_size=128256, n_ctx=8192)
    # GPT-2 shaped (two MLP matrices, every head its own keys and values): 357.4B parameters
    C, F = 16384, 53248
    assert model_params(shape) == 126 * (4 * C * C + 2 * C * F + 9 * C + F) + (128256 + 8192) * C + 2 * C
    run = Run(batch=64, seq=8192, attention="flash", recompute=2, grad_accum=8)
    whole = device_memory(shape, Mesh(dp=8), run)
    assert whole.persistent > 80 * 2 ** 40 / 1024 * 50  # terabytes of state on one device: far past any GPU
    # tp 8 x pp 16 with ZeRO-1: the state fits, but the first stage keeps 8 micro-batches of its 8 layers'
    # activations, whole between the tp devices where sequence parallelism does not cut them
    mesh = Mesh(dp=8, tp=8, pp=16)
    split = Run(batch=64, seq=8192, zero=1, attention="flash", recompute=2, grad_accum=8)
    assert least(device_memory(shape, mesh, split)) > 79.2 * 2 ** 30
    sequence_parallel = device_memory(shape, mesh, replace(split, sequence_parallel=True))
    assert least(sequence_parallel) < 79.2 * 2 ** 30


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,message", [
    (["--gpus", 8, "--dp", 3, "--bus-gbps", 1], "the mesh --dp 3 x --tp 1 x --pp 1 = 3 devices, not --gpus 8"),
    (["--gpus", 12, "--tp", 8, "--bus-gbps", 1], "--gpus (12) must be divisible by --tp x --pp (8 x 1)"),
    (["--tp", 8, "--heads", 12, "--layers", 2, "--d-model", 96, "--bus-gbps", 1],
     "--heads (12) must be divisible by --tp (8): tensor parallelism gives each device whole heads"),
    (["--gpus", 8], "the bus bandwidth is needed: give --bus-gbps (nccl-tests' all_reduce busbw, GB/s) or "
                    "--from-bench-collectives FILE"),
    (["--model", "tiny", "--layers", 2, "--bus-gbps", 1],
     "--model and --layers both given: name a preset or give a shape, not both"),
    (["--layers", 2, "--bus-gbps", 1], "a custom shape needs --d-model, --heads as well"),
    (["--model", "tiny", "--seq", 256, "--bus-gbps", 1], "--seq (256) must be at most the model's context (128)"),
    (["--model", "huge", "--bus-gbps", 1], "--model must be one of tiny, mini, small, gpt2-124m, gpt2-350m, "
                                           "gpt2-774m, got 'huge'"),
    (["--pp", 13, "--bus-gbps", 1], "--pp (13) must be at most the number of layers (12)"),
    (["--gpus", 4, "--batch", 2, "--bus-gbps", 1],
     "--batch (2) must be at least --dp (4): every data-parallel rank needs a sequence"),
    (["--mfu", 1.5, "--bus-gbps", 1], "--mfu must be a number from 1e-06 to 1, got '1.5'"),
    (["--overlap", -1, "--bus-gbps", 1], "--overlap must be a number from 0 to 1, got '-1'"),
    (["--tp", 16, "--heads", 16, "--layers", 2, "--d-model", 64, "--bus-gbps", 1],
     "--tp (16) must be at most --node-gpus (8): its all-reduces run every layer and need a node's links"),
    (["--layers", 2, "--d-model", 64, "--heads", 4, "--from-bench-gpu", "x.json", "--bus-gbps", 1],
     "--from-bench-gpu needs --model: bench_gpu measures presets, not a custom shape"),
    (["--bus-gbps", 1, "--from-bench-collectives", "x.json"],
     "--bus-gbps and --from-bench-collectives both given: use one"),
    (["--bus-gbps", 1, "--json", "/"], "--json '/' is a folder, not a file"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    code, out, err = run_cli(argv, capsys)
    assert (code, out, err) == (2, "", f"python -m xtrain_dist.plan: error: {message}\n")


def test_the_command_prints_the_plan_and_writes_it(tmp_path, capsys):
    code, out, err = run_cli(["--model", "gpt2-124m", "--gpus", 8, "--batch", 64, "--bus-gbps", 360, "--max-gpus",
                              16, "--json", tmp_path / "plan.json"], capsys)
    assert code == 0 and err == ""
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [r["gpus"] for r in plan["scaling"]] == [1, 2, 4, 8, 16]
    assert plan["memory"]["total"] == least(device_memory(Shape.of(model_config("gpt2-124m", 50257)), Mesh(dp=8),
                                                          Run(batch=64, seq=1024)))
    assert "| 8 | 8 x 1 x 1 | 64 |" in out and "fits in 79.2 GiB" in out


def test_measured_figures_come_from_results_files(tmp_path, capsys):
    gpu = ROOT / "bench/results/2026-11-26-h100/bench/run1/bench_gpu-2026-11-26T134732-nvidia-h100-80gb-hbm3.json"
    mfu, row = cli.bench_gpu_mfu(gpu, "gpt2-124m", "bf16")
    assert row["impl"] == "ours flash lt" and mfu == pytest.approx(0.18366, abs=1e-5)
    bus, latency, row = cli.bench_collectives_bus(ROOT / "bench/cpu/2026-11-22/collectives.json", 2)
    assert (row["world"], row["bytes"]) == (2, 1 << 30) and bus == pytest.approx(7.06, abs=0.01)
    assert latency == pytest.approx(126e-6, abs=1e-6)
    # the measured step of that row, predicted from its own MFU: the same shape, so the same milliseconds
    code, _, _ = run_cli(["--model", "gpt2-124m", "--batch", 8, "--precision", "bf16", "--from-bench-gpu", gpu,
                              "--bus-gbps", 1, "--max-gpus", 1, "--json", tmp_path / "p.json"], capsys)
    assert code == 0
    assert json.loads((tmp_path / "p.json").read_text())["step"]["step_s"] * 1e3 == pytest.approx(row_ms(gpu), 1e-3)
    code, _, err = run_cli(["--model", "small", "--from-bench-gpu", gpu, "--bus-gbps", 1], capsys)
    assert err.endswith(f"--from-bench-gpu '{gpu}' has no row of ours for --model small at --precision bf16\n")


def row_ms(path: Path) -> float:
    rows = json.loads(path.read_text())["rows"]
    return max((r for r in rows if r["impl"].startswith("ours")), key=lambda r: r["mfu"])["ms"]


def test_bench_plan_predicts_a_gpu_row_from_another_shapes_mfu():
    from tests.bin_scripts import load_script
    rows = load_script("bench_plan").gpu_rows()
    by_key = {(r["preset"], r["batch"], r["seq"], r["precision"], r["impl"], r["file"]): r for r in rows}
    doubled = next(r for k, r in by_key.items() if k[:5] == ("gpt2-124m", 16, 1024, "bf16", "ours flash lt"))
    source = next(r for k, r in by_key.items() if k[:5] == ("gpt2-124m", 8, 1024, "bf16", "ours flash lt"))
    # FLOPs grow with the batch, so at 8 x 1024's MFU twice the batch takes twice the step the MFU implies
    flops = 16 * 1024 * flops_per_token(Shape.of(model_config("gpt2-124m", 50257)), 1024)
    assert doubled["from_shape"] == "8x1024" and doubled["from_mfu"] == source["measured_mfu"]
    assert doubled["predicted_ms"] == pytest.approx(flops / (989.4e12 * source["measured_mfu"]) * 1e3)
    assert doubled["predicted_bytes"] == least(device_memory(Shape.of(model_config("gpt2-124m", 50257)), Mesh(),
                                                             Run(batch=16, seq=1024, attention="flash")))


def test_tensor_and_pipeline_communication_worked_by_hand():
    shape = Shape(n_layer=4, n_head=2, d_model=32, d_ff=64, vocab_size=100, n_ctx=16)
    run = Run(batch=8, seq=16, precision="bf16", grad_accum=4)
    hw = Hardware(peak_flops=1e12, mfu=1.0, bus_gbps=10.0, inter_node_gbps=1.0, tp_bus_gbps=10.0, node_gpus=2,
                  latency_s=1e-5)
    t = step_time(shape, Mesh(tp=2, pp=2), run, hw)
    message = 2 * 16 * 32 * 2  # a micro-batch of 2 sequences' activations, in bf16
    # 2 layers a stage, 4 micro-batches, 4 all-reduces each over the 2 tp devices: 2 (2 - 1) / 2 of the message
    assert t.tp_comm_s == pytest.approx(4 * 2 * 4 * (message / 10e9 + 1e-5))
    # tp x pp = 4 devices is more than the 2 of a node: the stages send between nodes, twice a micro-batch
    assert t.pp_comm_s == pytest.approx(2 * 4 * message / 1e9)
    assert t.bubble_s == pytest.approx(t.compute_s * (2 - 1) / 4)
    assert t.compute_s == pytest.approx(8 * 16 * flops_per_token(shape, 16) / 4 / 1e12)
    assert t.step_s == pytest.approx(t.compute_s + t.bubble_s + t.tp_comm_s + t.pp_comm_s)
