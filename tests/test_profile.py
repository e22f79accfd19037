"""The op profiler: transparent (a profiled step computes the same bits), complete (every op the model
and AdamW call is counted, the right number of times), and its flop counts are the model's."""

import numpy as np
import pytest
from bin_scripts import BENCH_GPU_HEADER, load_script

from xtrain_dist.backend import numpy_ops
from xtrain_dist.config import GPTConfig, TrainConfig, model_config
from xtrain_dist.model import GPT2
from xtrain_dist.optim import AdamW
from xtrain_dist.profile import (
    OpProfiler,
    compute_share,
    gpt2_num_params,
    llmc_flops_per_token,
    mfu,
    nanogpt_flops_per_token,
    op_bytes,
    peak_bandwidth_for,
    peak_for,
)


def one_step(backend, config, ids, targets, attention="standard"):
    model = GPT2(config, backend, seed=3, attention=attention)
    optimizer = AdamW(model, TrainConfig(steps=1, batch=ids.shape[0], seq=ids.shape[1]))
    losses = model.forward(ids, targets, dloss=1.0 / ids.size)
    model.backward()
    norm_squared = backend.global_norm_squared(model.grads)
    optimizer.step(1e-3, backend.clip_coefficient(norm_squared, 1.0))
    return losses, model


def test_a_profiled_step_is_the_same_step_and_every_op_is_counted(rng):
    config = model_config("tiny", 512)
    B, T, L, C = 2, 16, config.n_layer, config.n_embd
    ids = rng.integers(0, 512, (B, T)).astype(np.int32)
    targets = rng.integers(0, 512, (B, T)).astype(np.int32)
    plain_losses, plain = one_step(numpy_ops, config, ids, targets)
    profiler = OpProfiler(numpy_ops)
    losses, profiled = one_step(profiler, config, ids, targets)
    assert np.array_equal(losses, plain_losses) and np.array_equal(profiled.params, plain.params)

    report = profiler.report()
    calls = {t.name: t.calls for t in report["ops"]}
    assert calls == {  # c_attn's backward is two calls of matmul_backward (model.grad_ready_ranges)
        "encoder_forward": 1, "layernorm_forward": 1, "residual_layernorm_forward": 2 * L, "matmul_forward": 3 * L + 1,
        "matmul_gelu_forward": L, "attention_forward": L, "fused_classifier": 1,
        "matmul_backward": 4 * L + 1, "matmul_backward_gelu": L, "layernorm_backward": 2 * L + 1,
        "attention_backward": L, "encoder_backward": 1, "global_norm_squared": 1, "clip_coefficient": 1,
        "adamw_update": 1}
    # the matmuls' flops, counted independently: per token, 2 x (every block's weights + the classifier)
    block_weights = C * 3 * C + C * C + C * 4 * C + 4 * C * C
    flops = {t.name: t.flops for t in report["ops"]}
    assert flops["matmul_forward"] + flops["matmul_gelu_forward"] == 2 * B * T * (L * block_weights + C * 512)
    assert flops["matmul_gelu_forward"] == 2 * B * T * L * C * 4 * C
    assert flops["matmul_backward"] + flops["matmul_backward_gelu"] == \
        2 * (flops["matmul_forward"] + flops["matmul_gelu_forward"])
    assert flops["attention_forward"] == 4 * B * T * T * C * L
    assert flops["attention_backward"] == 8 * B * T * T * C * L  # dq, dk from the scores; datt, dv from y
    assert 0 < report["ops_s"] <= report["span_s"] and report["gaps_s"] == report["span_s"] - report["ops_s"]


def test_flash_attention_is_counted_like_the_attention_it_computes(rng):
    config = model_config("tiny", 512)
    B, T, L, C = 2, 16, config.n_layer, config.n_embd
    ids = rng.integers(0, 512, (B, T)).astype(np.int32)
    profiler = OpProfiler(numpy_ops)
    one_step(profiler, config, ids, ids, attention="flash")
    flops = {t.name: t.flops for t in profiler.report()["ops"]}
    assert flops["flash_attention_forward"] == 4 * B * T * T * C * L
    assert flops["flash_attention_backward"] == 2 * flops["flash_attention_forward"]


class TickBackend:
    """A backend whose clock is a counter advanced only by its ops: each call of `work` takes 3 ticks."""

    def __init__(self):
        self.now = 0.0

    def timestamp(self):
        return self.now

    @staticmethod
    def elapsed(start, end):
        return end - start

    def work(self):
        self.now += 3.0


def test_gaps_between_ops_are_reported_as_waiting_for_the_host():
    backend = TickBackend()
    profiler = OpProfiler(backend)
    profiler.work()
    backend.now += 4.0  # the device idles: the host is late with the next launch
    profiler.work()
    report = profiler.report()
    assert (report["ops_s"], report["span_s"], report["gaps_s"]) == (6.0, 10.0, 4.0)
    rows = OpProfiler.rows(report)
    assert [(r["op"], r["calls"], r["ms"]) for r in rows] == [("work", 2, 6000.0),
                                                             ("(between ops: host work and launches)", None, 4000.0)]
    assert "| work | 2 | 6000.00 | 60.0% |" in OpProfiler.markdown(report)
    profiler.reset()
    assert profiler.report()["span_s"] == 0.0


def test_plumbing_and_attributes_pass_through_untimed():
    profiler = OpProfiler(numpy_ops)
    assert profiler.gelu_forward is profiler.gelu_forward  # one wrapper per op, made once
    assert profiler.xp is np and profiler.to_host is numpy_ops.to_host and profiler.timestamp is numpy_ops.timestamp
    profiler.to_host(profiler.from_host(np.ones(3, np.float32)))
    assert profiler.report()["ops"] == []
    profiler.gelu_forward(np.ones((2, 3), np.float32))
    assert [(t.name, t.calls) for t in profiler.report()["ops"]] == [("gelu_forward", 1)]


def test_bench_gpu_writes_the_profile_of_our_step(rng):
    """bin/bench_gpu's results file carries the per-op table (its GPU half runs only on a GPU)."""
    bench_gpu = load_script("bench_gpu")
    profiler = OpProfiler(numpy_ops)
    ids = rng.integers(0, 512, (2, 16)).astype(np.int32)
    one_step(profiler, model_config("tiny", 512), ids, ids)
    row = {"preset": "tiny", "batch": 2, "seq": 16, "precision": "fp32", "impl": "ours", "ms": 1.0, "ms_events": 1.0,
           "tokens_per_s": 32e3, "mfu": None, "first_loss": 6.2, "peak_mem_gib": 0.1,
           "profile": OpProfiler.rows(profiler.report())}
    text = bench_gpu.markdown(BENCH_GPU_HEADER, [row])
    assert "### Where our step's time goes: tiny, 2 x 16, fp32" in text
    assert "| matmul_backward | 9 |" in text and "| matmul_backward_gelu | 2 |" in text
    assert "| adamw_update | 1 |" in text
    # the split the targets read: products and attention, the other ops, the gaps, adding up to the step
    compute, other, between = compute_share(row["profile"])
    shares = {r["op"]: r["share"] for r in row["profile"]}
    assert compute == pytest.approx(sum(v for op, v in shares.items() if op.startswith(("matmul", "attention"))))
    assert other > 0 and compute + other + between == pytest.approx(sum(shares.values()))
    assert f"Products and attention: {100 * compute:.1f}% of the step; the other ops: {100 * other:.1f}%" in text
    # the memory column compares what each allocator holds from the driver, and says so
    assert "| loss (1st) | peak GiB held |" in text and "torch.cuda.max_memory_reserved for PyTorch" in text


def test_rows_rate_and_order_and_what_is_not_recorded():
    """TFLOP/s is flops / seconds / 1e12; ops come slowest first; calls from another thread (the bucketed
    sync's communication thread) and calls while switched off are not recorded."""
    import threading

    class Backend(TickBackend):
        def slow(self):
            self.now += 2.0

        def fast(self):
            self.now += 1.0

    backend = Backend()
    profiler = OpProfiler(backend)
    profiler.fast()
    profiler.slow()
    report = profiler.report()
    assert [t.name for t in report["ops"]] == ["slow", "fast"]
    report["ops"][0].flops = 5e12  # 5e12 flops in 2 s
    rows = OpProfiler.rows(report)
    assert rows[0]["tflops"] == 2.5 and rows[1]["tflops"] is None
    assert "| slow | 1 | 2000.00 | 66.7% | 2.5 |" in OpProfiler.markdown(report)
    profiler.reset()
    other = threading.Thread(target=profiler.fast)
    other.start()
    other.join()
    profiler.active = False
    profiler.slow()
    assert profiler.report()["ops"] == [] and backend.now == 6.0  # the calls ran, untimed
    profiler.active = True
    profiler.fast()
    assert [(t.name, t.calls) for t in profiler.report()["ops"]] == [("fast", 1)]


def test_op_bytes_is_what_an_op_cannot_avoid_moving():
    """Each array given read once (or written once, an output passed in), each returned written once, each
    updated in place read and written; scalars and None are no traffic."""
    x, out = np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)
    assert op_bytes("gelu_forward", (x,), out) == 2 * 128
    mean = rstd = np.zeros(4, np.float32)
    w = np.zeros(8, np.float32)
    assert op_bytes("layernorm_forward", (x, w, w), (out, mean, rstd)) == 128 + 32 + 32 + 128 + 16 + 16
    # dweight and dbias accumulate (read and written), dinp is only written
    assert op_bytes("layernorm_backward", (out, w, w, x, x, w, mean, rstd), None) == \
        128 + 2 * 32 + 2 * 32 + 128 + 128 + 32 + 16 + 16
    dweight, weight = np.zeros((8, 16), np.float32), np.zeros((8, 16), np.float32)
    dout = np.zeros((4, 16), np.float32)
    assert op_bytes("matmul_backward", (dweight, None, dout, x, weight), x) == 2 * 512 + 256 + 128 + 512 + 128
    p, g, m, v = (np.zeros(10, np.float32) for _ in range(4))
    mask = np.zeros(10, np.uint8)
    args = (p, g, m, v, mask, 3, 1e-3, 0.9, 0.95, 1e-8, 0.1, np.float32(1.0))
    assert op_bytes("adamw_update", args, None) == 2 * 40 + 40 + 2 * 40 + 2 * 40 + 10


def test_a_profiled_step_has_each_ops_bandwidth(rng):
    """On the numpy backend too: AdamW's row moves params, m and v twice, the gradients, the decay mask and
    the clip factor once; GB/s is that over the op's time; the table shows it."""
    config = model_config("tiny", 64)
    ids = rng.integers(0, 64, (2, 8))
    profiler = OpProfiler(numpy_ops)
    _, model = one_step(profiler, config, ids, np.roll(ids, -1, axis=1))
    report = profiler.report()
    [adamw] = [t for t in report["ops"] if t.name == "adamw_update"]
    assert adamw.bytes == 7 * model.params.nbytes + model.decay_mask.nbytes + 4  # + the clip factor, a 0-d array
    row = next(r for r in OpProfiler.rows(report) if r["op"] == "adamw_update")
    assert row["gbps"] == pytest.approx(adamw.bytes / adamw.seconds / 1e9)
    assert f"| {row['gbps']:.4g} |" in OpProfiler.markdown(report)
    assert all(t.bytes > 0 for t in report["ops"]), [t.name for t in report["ops"] if not t.bytes]


def test_peak_bandwidth_for_the_parts():
    assert peak_bandwidth_for("NVIDIA H100 80GB HBM3") == 3350 and peak_bandwidth_for("NVIDIA H200") == 4800
    assert peak_bandwidth_for("NVIDIA H100 PCIe") == 2000 and peak_bandwidth_for("NVIDIA A100-SXM4-80GB") == 2039
    assert peak_bandwidth_for("NVIDIA GeForce RTX 4090") is None


# ------------------------------------------------------------------------------- MFU
def test_nanogpt_flops_per_token_is_nanogpts_count():
    """nanoGPT's estimate_mfu for GPT-2 124M at T = 1024: 6 N (N = 124,439,808 parameters less wpe's
    1024 x 768) plus 12 L C T for attention; the parameter count is the published one, and the Hugging Face
    export's (whatever rows the layout pads)."""
    mcfg = model_config("gpt2-124m", 50257)
    assert gpt2_num_params(mcfg, 50257) == 124_439_808
    assert nanogpt_flops_per_token(mcfg, 1024) == 6 * (124_439_808 - 786_432) + 12 * 12 * 768 * 1024
    assert nanogpt_flops_per_token(mcfg, 1024) == 855_166_464


def test_llmc_flops_per_token_counts_the_padded_vocabulary_and_half_the_attention_square():
    """llm.c's gpt2_estimate_mfu: 6 N with N its num_parameters (wte at 50304 rows, wpe included:
    124,475,904 for GPT-2 124M) plus 6 L C T."""
    mcfg = model_config("gpt2-124m", 50257)
    assert gpt2_num_params(mcfg, 50304) == 124_475_904
    assert llmc_flops_per_token(mcfg, 1024) == 6 * 124_475_904 + 6 * 12 * 768 * 1024 == 803_478_528
    # a small config by hand: V = 1000 pads to 1024; C = 8, L = 2, n_ctx = 16, T = 4
    small = GPTConfig(vocab_size=1000, n_ctx=16, n_layer=2, n_head=2, n_embd=8)
    per_layer = 12 * 64 + 13 * 8  # 872
    assert gpt2_num_params(small, 1000) == 8000 + 128 + 2 * per_layer + 16 == 9888
    assert nanogpt_flops_per_token(small, 4) == 6 * (9888 - 128) + 12 * 2 * 8 * 4 == 59_328
    assert llmc_flops_per_token(small, 4) == 6 * (1024 * 8 + 128 + 2 * per_layer + 16) + 6 * 2 * 8 * 4 == 60_864
    # V already a multiple of 128: llm.c pads nothing
    assert llmc_flops_per_token(GPTConfig(vocab_size=1024, n_ctx=16, n_layer=2, n_head=2, n_embd=8), 4) == 60_864


def test_the_parameter_count_is_the_exported_models():
    """gpt2_num_params counts from the shape; the model's state_dict (the Hugging Face export, V rows) holds
    as many numbers, for a vocabulary that is not a multiple of 128 too."""
    mcfg = model_config("tiny", 1000)
    exported = GPT2(mcfg, numpy_ops, seed=1).state_dict()
    assert sum(v.size for v in exported.values()) == gpt2_num_params(mcfg, 1000)


def test_mfu_is_the_share_of_the_peak_a_step_reaches():
    assert mfu(2e12, 500.0, 1e13) == pytest.approx(0.4)  # 2 TFLOP in half a second, of 10 TFLOP/s
    # GPT-2 124M, 8 x 1024 tokens in 100 ms against an H100 SXM's bf16 peak: about 7%
    assert mfu(855_166_464 * 8 * 1024, 100.0, 989.4e12) == pytest.approx(0.070806, abs=1e-6)


def test_peak_for_names_the_parts_nvidia_smi_reports():
    sxm = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4}
    assert peak_for("NVIDIA H100 80GB HBM3") == sxm  # what an H100 SXM calls itself
    assert peak_for("NVIDIA H100 SXM5 80GB") == sxm
    assert peak_for("NVIDIA H200") == sxm
    assert peak_for("NVIDIA H100 PCIe") == {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0}
    assert peak_for("NVIDIA A100-SXM4-80GB") == peak_for("NVIDIA A100 80GB PCIe") == \
        {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}
    assert peak_for("NVIDIA GeForce RTX 4090") is None  # unknown: MFU n/a, not a wrong number


def test_the_jobs_peak_counts_each_gpu_once_at_the_runs_precision(monkeypatch):
    """MFU's denominator: virtual ranks sharing a GPU count it once; every process holds as many GPUs."""
    from dataclasses import replace

    from xtrain_dist.backend.cuda import device
    from xtrain_dist.comm.launch_env import Launch
    from xtrain_dist.train.job import job_peak_flops

    monkeypatch.setattr(device, "device_name", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "Some GPU"].__getitem__)
    cfg = TrainConfig(steps=1, batch=4, seq=8, backend="cuda")
    single, two_processes = Launch("single"), Launch("torchrun", num_processes=2)
    assert job_peak_flops(cfg, [0, 0, 0], single) == pytest.approx(66.9e12)  # three virtual ranks on one GPU, fp32
    assert job_peak_flops(replace(cfg, tf32=True), [0], single) == pytest.approx(494.7e12)
    assert job_peak_flops(replace(cfg, dtype="bf16"), [0, 1], two_processes) == pytest.approx((989.4 + 756.0) * 2e12)
    assert job_peak_flops(cfg, [0, 2], single) is None  # one GPU of unknown peak: no MFU, not a wrong one
    assert job_peak_flops(replace(cfg, backend="numpy"), [None], single) is None


def test_a_cpu_run_gives_no_mfu():
    from xtrain_dist.data.corpus import DEFAULT_CORPUS, DEFAULT_TOKENIZER, Corpus
    from xtrain_dist.train.job import train

    lines = []
    cfg = TrainConfig(steps=2, batch=4, seq=16, eval_batches=0).resolved()
    report = train(cfg, Corpus.load(DEFAULT_TOKENIZER, DEFAULT_CORPUS), log=lines.append)
    assert report["mfu"] is None and not [line for line in lines if "MFU" in line]
