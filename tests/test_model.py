"""The model: flat layout, deterministic init, Hugging Face names, and the whole gradient (float64 finite
differences; and Hugging Face's GPT2LMHeadModel itself as an independent oracle when torch is installed)."""

from itertools import pairwise

import numpy as np
import pytest
from finite_differences import assert_gradients_match_finite_differences
from padded_vocab import assert_padded_rows_stay_zero

from xtrain_dist.backend import numpy_ops
from xtrain_dist.config import GPTConfig, model_config
from xtrain_dist.layout import ALIGN, count_params, init_weights, param_layout
from xtrain_dist.model import GPT2

SMALL = GPTConfig(vocab_size=13, n_ctx=8, n_layer=2, n_head=2, n_embd=8)


def hf_names(n_layer):
    names = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
    for layer in range(n_layer):
        for suffix in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                       "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                       "mlp.c_proj.weight", "mlp.c_proj.bias"):
            names.add(f"transformer.h.{layer}.{suffix}")
    return names


def test_layout_is_aligned_disjoint_and_in_backward_order():
    cfg = model_config("tiny", 1000)
    specs, total = param_layout(cfg)
    assert {s.name for s in specs} == hf_names(cfg.n_layer)
    ends = 0
    for s in specs:
        assert s.offset % ALIGN == 0 and s.offset >= ends
        ends = s.offset + s.size
    assert total >= ends and total % ALIGN == 0
    order = [s.name for s in specs]
    # backward finishes ln_f, then the last block, ..., the first block, then wpe and wte
    assert order[:2] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert order.index("transformer.h.1.ln_1.bias") < order.index("transformer.h.0.mlp.c_proj.weight")
    assert order[-2:] == ["transformer.wpe.weight", "transformer.wte.weight"]
    C = cfg.n_embd
    shapes = {s.name: s.shape for s in specs}
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (C, 3 * C)  # Conv1D: (in, out)
    assert shapes["transformer.h.0.mlp.c_proj.weight"] == (4 * C, C)
    # wte's layout holds the padded vocabulary (1000 -> 1024 rows), its Hugging Face shape the 1000 tokens
    wte = next(s for s in specs if s.name == "transformer.wte.weight")
    assert cfg.padded_vocab_size == 1024 and wte.shape == (1024, C) and wte.hf_shape == (1000, C)
    assert {s.name: s.hf_shape for s in specs if s.name != wte.name} == {
        name: shape for name, shape in shapes.items() if name != wte.name}
    # weight decay on the matrices and both embeddings (nanoGPT's rule), never on biases or layernorm
    decayed = {s.name for s in specs if s.decay}
    assert decayed == {"transformer.wte.weight", "transformer.wpe.weight"} | {
        f"transformer.h.{layer}.{m}.weight" for layer in range(cfg.n_layer)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


def test_grad_ranges_cover_the_buffer_in_order():
    model = GPT2(model_config("tiny", 500), numpy_ops, seed=0)
    for ranges, count in ((model.grad_ready_ranges(), 3 * model.config.n_layer + 1),
                          (model.layer_grad_ranges(), model.config.n_layer + 1)):
        assert len(ranges) == count
        assert ranges[0][0] == 0 and ranges[-1][1] == model.size
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in pairwise(ranges))

    def covered(ranges):
        return [{".".join(s.name.split(".")[2:4]) if ".h." in s.name else s.name.split(".")[1] for s in model.layout
                 if lo <= s.offset < hi} for lo, hi in ranges]

    # each announcement is exactly what backward has finished by then: ln_f with the last block's MLP half, that
    # block's attention products (c_attn's weight gradient is in before its input's), its ln_1, then the block
    # before's three (a range that stopped short would hold finished gradients back from the overlap; one that
    # ran on would hand a bucket over before backward wrote it)
    assert covered(model.grad_ready_ranges()) == [{"ln_f", "1.mlp", "1.ln_2"}, {"1.attn"}, {"1.ln_1"},
                                                  {"0.mlp", "0.ln_2"}, {"0.attn"}, {"0.ln_1"}, {"wpe", "wte"}]
    # PowerSGD's buckets: a block at a time
    assert covered(model.layer_grad_ranges()) == [{"ln_f", "1.mlp", "1.ln_2", "1.attn", "1.ln_1"},
                                                  {"0.mlp", "0.ln_2", "0.attn", "0.ln_1"}, {"wpe", "wte"}]


def test_init_is_deterministic_and_gpt2_like():
    cfg = model_config("tiny", 500)
    a, b, c = init_weights(cfg, 7), init_weights(cfg, 7), init_weights(cfg, 8)
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != c.tobytes()
    sd = GPT2(cfg, numpy_ops, seed=7).state_dict()
    assert np.all(sd["transformer.h.0.ln_1.weight"] == 1) and np.all(sd["transformer.h.0.attn.c_attn.bias"] == 0)
    assert sd["transformer.wte.weight"].std() == pytest.approx(0.02, rel=0.05)
    proj_std = 0.02 / np.sqrt(2 * cfg.n_layer)  # the two projections into the residual stream (GPT-2)
    for name in ("wpe.weight", "h.0.attn.c_attn.weight", "h.1.mlp.c_fc.weight", "h.0.attn.c_proj.weight",
                 "h.1.mlp.c_proj.weight"):
        want = proj_std if name.endswith("c_proj.weight") else 0.02
        assert sd[f"transformer.{name}"].std() == pytest.approx(want, rel=0.05), name
    # one random stream for the whole layout, not one per tensor: the tensors' draws are unrelated
    firsts = [v.reshape(-1)[:256] / v.std() for k, v in sd.items() if k.endswith("weight") and v.ndim == 2]
    for i, a in enumerate(firsts):
        for b in firsts[i + 1:]:
            assert abs(np.corrcoef(a, b)[0, 1]) < 0.3


def test_a_model_from_drawn_weights_is_the_model_of_their_seed():
    """GPT2(init=...) (bench_gpu draws a preset's weights once for all its rows): the same bits as the model
    that draws them from the seed, padded buffer included, and its own copy of them."""
    cfg = model_config("tiny", 500)
    drawn = GPT2(cfg, numpy_ops, seed=7)
    given = GPT2(cfg, numpy_ops, init=drawn.params, pad_to_multiple=7)
    own = GPT2(cfg, numpy_ops, seed=7, pad_to_multiple=7)
    assert given.params.tobytes() == own.params.tobytes() and given.size > drawn.size
    given.params[:] = 0
    assert drawn.params.tobytes() == init_weights(cfg, 7).tobytes()


def test_state_dict_round_trip_and_views_share_the_flat_buffer():
    model = GPT2(model_config("tiny", 300), numpy_ops, seed=3)
    sd = model.state_dict()
    sd["transformer.h.1.attn.c_proj.bias"][:] = 5.0
    assert np.all(model.p.h[1].attn_c_proj_bias == 0)  # host copies: the model changes only when loaded
    model.load_state_dict(sd)
    assert np.all(model.p.h[1].attn_c_proj_bias == 5.0)
    assert np.shares_memory(model.p.h[1].attn_c_proj_bias, model.params)
    assert np.shares_memory(model.g.wte, model.grads)


def randomised_model(seed=0, attention="standard", recompute=0):
    """A float64 model with every parameter random (biases, gains too), so no gradient term is hidden."""
    model = GPT2(SMALL, numpy_ops, seed=seed, dtype=np.float64, attention=attention, recompute=recompute)
    rng = np.random.default_rng(seed)
    used = np.zeros(model.size, dtype=bool)
    for s in model.layout:  # wte's padded rows are padding too: zero, and no gradient may reach them
        used[s.offset: s.offset + s.hf_size] = True
    model.params[used] = rng.standard_normal(used.sum()) * 0.3
    return model, used


@pytest.mark.parametrize("attention, recompute", [("standard", 0), ("flash", 0), ("standard", 2)])
def test_whole_model_gradient_matches_finite_differences(attention, recompute):
    model, used = randomised_model(attention=attention, recompute=recompute)
    rng = np.random.default_rng(1)
    B, T = 3, SMALL.n_ctx
    ids = rng.integers(0, SMALL.vocab_size, (B, T)).astype(np.int32)
    targets = rng.integers(0, SMALL.vocab_size, (B, T)).astype(np.int32)
    dloss = 1.0 / (B * T)
    model.zero_grad()
    model.forward(ids, targets, dloss)
    model.backward()
    assert np.all(model.grads[~used] == 0)  # padding never gets a gradient

    def loss():
        return float(model.forward(ids, targets).sum() * dloss)

    assert_gradients_match_finite_differences(model, loss, rng)


def test_backward_announces_every_range_once_in_order():
    """... and only once it is final: what backward adds to grads[a:b] after announcing it would be missed by
    a bucket that gradient sync reduces at once (a race on thread ranks, not a deterministic failure)."""
    model, _ = randomised_model()
    ids = np.arange(4, dtype=np.int32).reshape(1, 4)
    seen, snapshots = [], []

    def ready(a, b):
        seen.append((a, b))
        snapshots.append(model.grads[a:b].copy())

    model.zero_grad()
    model.forward(ids, ids, 1.0)
    model.backward(on_grads_ready=ready)
    assert seen == model.grad_ready_ranges()
    for (a, b), early in zip(seen, snapshots, strict=True):
        assert np.array_equal(early, model.grads[a:b]), (a, b)


def test_forward_matches_hugging_face_gpt2():
    """Our loss, logits and every gradient against transformers.GPT2LMHeadModel holding the same weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = SMALL
    model = GPT2(cfg, numpy_ops, seed=5, dtype=np.float64)
    rng = np.random.default_rng(2)
    model.load_state_dict({name: rng.standard_normal(w.shape) * 0.3 for name, w in model.state_dict().items()})
    hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.n_ctx, n_embd=cfg.n_embd,
                                     n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                                     tie_word_embeddings=True)
    hf = transformers.GPT2LMHeadModel(hf_cfg).double().eval()
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()},
                                             strict=False)
    assert unexpected == [] and all(k == "lm_head.weight" or k.endswith(".attn.bias") for k in missing)

    ids = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx)).astype(np.int32)
    logits = model.forward(ids)
    hf_logits = hf(torch.from_numpy(ids.astype(np.int64))).logits
    np.testing.assert_allclose(logits, hf_logits.detach().numpy(), rtol=1e-9, atol=1e-9)

    n = ids.size
    model.zero_grad()
    losses = model.forward(ids, targets, 1.0 / n)
    model.backward()
    hf_loss = torch.nn.functional.cross_entropy(hf_logits.reshape(n, -1), torch.from_numpy(targets).long().reshape(-1))
    hf_loss.backward()
    assert losses.mean() == pytest.approx(hf_loss.item(), rel=1e-10)
    hf_grads = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    grads = {s.name: model.grads[s.offset: s.offset + s.hf_size].reshape(s.hf_shape) for s in model.layout}
    for name, g in grads.items():
        np.testing.assert_allclose(g, hf_grads[name], rtol=1e-7, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("sdpa", [False, True])
def test_the_torch_peer_is_our_model(sdpa):
    """xtrain_dist.torch_gpt2 (the peer bin/bench_cpu and bin/bench_gpu race, and whose losses they
    report next to ours) computes our loss and every gradient for the same weights. Random weights of
    std 0.3: at the init's 0.02 a GELU approximation, a layernorm eps, the attention scale or a leaky
    mask moved the benchmarks' loss comparison by less than its tolerance."""
    torch = pytest.importorskip("torch")
    from xtrain_dist.bench import torch_gpt2

    cfg = SMALL
    model = GPT2(cfg, numpy_ops, seed=5, dtype=np.float64)
    rng = np.random.default_rng(4)
    model.load_state_dict({name: (rng.standard_normal(w.shape) * 0.3).astype(np.float32)  # the peer's are float32
                           for name, w in model.state_dict().items()})
    peer = torch_gpt2.build(cfg, model.state_dict(), sdpa=sdpa).double()
    assert sorted(peer.state_dict()) == sorted(model.state_dict())  # tied: no separate classifier weight
    ids = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx)).astype(np.int32)
    model.zero_grad()
    losses = model.forward(ids, targets, 1.0 / ids.size)
    model.backward()
    loss = peer(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(targets.astype(np.int64)))
    loss.backward()
    assert loss.item() == pytest.approx(losses.mean(), rel=1e-12)
    peer_grads = {k: p.grad.numpy() for k, p in peer.named_parameters()}
    for s in model.layout:
        np.testing.assert_allclose(peer_grads[s.name], model.grads[s.offset: s.offset + s.hf_size].reshape(s.hf_shape),
                                   rtol=1e-9, atol=1e-12, err_msg=s.name)


def test_presets_are_openai_gpt2_sizes_and_shapes_are_checked():
    """The gpt2-* presets have the parameter counts of OpenAI's GPT-2 (Hugging Face's gpt2, gpt2-medium,
    gpt2-large, tied classifier) at its vocabulary of 50257; a bad shape is one clear error."""
    from xtrain_dist.config import TrainConfig
    from xtrain_dist.errors import XtrainError

    for preset, count in (("gpt2-124m", 124_439_808), ("gpt2-350m", 354_823_168), ("gpt2-774m", 774_030_080)):
        cfg = model_config(preset, 50257)
        assert (count_params(cfg), cfg.n_ctx) == (count, 1024), preset
        # the layout pads wte to 50304 rows: 47 x C more elements, zero, that are not parameters
        assert param_layout(cfg)[1] == count + 47 * cfg.n_embd, preset
    with pytest.raises(XtrainError, match=r"^n_embd \(10\) must be divisible by n_head \(4\)$"):
        GPTConfig(vocab_size=8, n_head=4, n_embd=10)
    for name, bad in (("n_layer", 0), ("vocab_size", True), ("n_ctx", 2.0)):
        with pytest.raises(XtrainError, match=rf"^{name} must be a positive integer, got {bad!r}$"):
            GPTConfig(**{"vocab_size": 8, "n_head": 2, "n_embd": 8, name: bad})
    cfg = TrainConfig(steps=200, batch=1, seq=1, lr=3e-3).resolved()
    assert (cfg.min_lr, cfg.warmup_steps, cfg.lr_decay_steps) == (pytest.approx(3e-4), 10, 200)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_padded_vocabulary_rows_stay_bitwise_zero_through_training(dtype):
    """V = 1000 pads wte to 1024 rows: after AdamW steps with weight decay the padded rows, their gradient and
    AdamW's m and v there (and the bf16 copy's) are all +0.0, bit for bit; the Hugging Face tensors hold the
    1000 rows alone. tests/test_cuda_ops.py and test_cuda_bf16.py hold the CUDA backend to the same."""
    model = GPT2(model_config("tiny", 1000), numpy_ops.NumpyBackend(dtype), seed=1)
    assert_padded_rows_stay_zero(model, steps=4)
    assert model.state_dict()["transformer.wte.weight"].shape == (1000, model.config.n_embd)


def test_padded_logit_columns_are_no_token():
    """forward without targets gives the V real logits (a view of the Vp-wide product), and its losses are
    those of the V columns alone even where a padded column would dominate the softmax."""
    cfg = GPTConfig(vocab_size=100, n_ctx=8, n_layer=1, n_head=2, n_embd=8)
    model = GPT2(cfg, numpy_ops, seed=2)
    ids = np.arange(8, dtype=np.int32).reshape(1, 8)
    logits = model.forward(ids)
    assert logits.shape == (1, 8, 100) and cfg.padded_vocab_size == 128
    want = numpy_ops.crossentropy_forward(np.ascontiguousarray(logits), ids)
    np.testing.assert_array_equal(model.forward(ids, ids), want)
    # a padded row that is not zero (only a broken update could make one) would win every softmax if read
    wte = next(s for s in model.layout if s.name == "transformer.wte.weight")
    model.params[wte.offset + wte.hf_size: wte.offset + wte.size] = 1e3
    np.testing.assert_array_equal(model.forward(ids, ids), want)
    assert model.forward(ids).shape == (1, 8, 100)
