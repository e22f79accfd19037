"""Every compile-time variant of kernels/flash_attention_mma.cu (backend/cuda/flash_variants.py) against
the numpy oracle, on a GPU, or on the CPU simulator (tests/test_cudasim.py runs this module there); and
the tuning table choosing which variant the backend launches.

Each variant runs at two small shapes chosen for its tiling, not for size: T = 17 (one ragged key tile,
a single block, the diagonal inside a tile) and T = max(block rows, stages x tile) + 17 (more key tiles
than pipeline stages, so every buffer is refilled while others are in flight, a second query block and a
ragged last tile). Forward against numpy_ops.flash_attention_forward with the variant's key tile (its
online softmax rounds each tile's P, so the tile is part of the function); backward from the oracle's out
and lse, against flash_attention_backward; tolerances of tests/bf16_cases.py, as test_cuda_bf16.py's
flash tests. One backend and one compiled file per variant serve both shapes.
"""

import json

import numpy as np
import pytest

pytest.importorskip("cupy")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_device_memory")]  # conftest: skip without a GPU

from bf16_cases import assert_bf16_close  # noqa: E402

from xtrain_dist.backend.cuda import flash_variants, tuned  # noqa: E402
from xtrain_dist.backend.cuda.device import device_name  # noqa: E402
from xtrain_dist.backend.cuda.ops import CudaBackend  # noqa: E402
from xtrain_dist.backend.numpy_ops import NumpyBackend  # noqa: E402

REF = NumpyBackend("bf16")
VARIANTS = flash_variants.VARIANTS


@pytest.fixture(scope="module")
def be():
    import cupy

    if getattr(cupy, "cudasim", False):  # the simulator compiles with g++: all variants at once, on every core
        import fake_cupy

        from xtrain_dist.backend.cuda.compile import kernel_source, nvrtc_options

        fake_cupy.prebuild([(kernel_source(flash_variants.FILE), nvrtc_options("bf16") + v.defines) for v in VARIANTS])
    return CudaBackend(0, dtype="bf16")


def shapes(variant) -> list[tuple[int, int, int]]:
    """(B, NH, T) the variant is held to the oracle at."""
    return [(2, 1, 17), (1, 2, max(variant.block_rows, variant.stages * variant.tile) + 17)]


def inputs(rng, B, NH, T, hs):
    C = NH * hs
    qkv = REF.from_host_act(rng.standard_normal((B, T, 3 * C)).astype(np.float32))
    dout = REF.from_host_act(rng.standard_normal((B, T, C)).astype(np.float32))
    return qkv, dout


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.label for v in VARIANTS])
def test_every_variant_matches_the_oracle(be, rng, variant):
    import cupy

    for B, NH, T in shapes(variant):
        qkv, dout = inputs(rng, B, NH, T, variant.hs)
        out_ref, lse_ref = REF.flash_attention_forward(qkv, NH, tile=variant.tile)
        d_qkv = be.from_host_act(qkv)
        where = f"{variant.label} at {B}x{NH}x{T}"
        if "forward" in variant.passes:
            out = cupy.empty((B, T, NH * variant.hs), dtype=be.act_dtype)
            lse = cupy.empty((B, NH, T), dtype=cupy.float32)
            assert flash_variants.forward(be, out, lse, d_qkv, B, T, NH, variant) == variant
            assert_bf16_close(be.to_host(out), out_ref, "act2", f"{where} forward out")
            assert_bf16_close(be.to_host(lse), lse_ref, "lse", f"{where} forward lse")
        if "backward" in variant.passes:
            dqkv = cupy.empty(qkv.shape, dtype=be.act_dtype)
            D = cupy.empty((B, NH, T), dtype=cupy.float32)
            flash_variants.backward(be, dqkv, D, be.from_host_act(dout), d_qkv, be.from_host_act(out_ref),
                                    be.from_host(lse_ref), B, T, NH, variant)
            want = REF.flash_attention_backward(dout, qkv, out_ref, lse_ref, NH)
            assert_bf16_close(be.to_host(dqkv), want, "act2", f"{where} backward dqkv")


def test_the_tuning_table_picks_the_variant_the_backend_launches(be, rng, tmp_path, monkeypatch):
    """A table naming other variants than the default for a shape makes the backend's flash attention
    (what --attention flash calls) compile and launch those, with the variant's own results; without a
    table, the default tiles."""
    import cupy

    B, NH, T = 1, 1, 128
    qkv, dout = inputs(rng, B, NH, T, 64)
    # keys ever larger along the sequence: each query's largest score is its last key's, so every row past
    # the first tile of 32 raises its running max in a later tile and rounds P where tiles of 64 do not
    qkv[:, :, 64:128] *= np.linspace(0.5, 2.0, T, dtype=np.float32)[None, :, None]
    qkv = REF.from_host_act(qkv)
    d_qkv, d_dout = be.from_host_act(qkv), be.from_host_act(dout)
    monkeypatch.setattr(tuned, "TUNED_DIR", tmp_path)
    flash_variants.forget_tables()
    try:
        assert flash_variants.chosen(be, "forward", B, NH, T, 64) == flash_variants.DEFAULT
        picked = {"forward": flash_variants.Variant(64, 4, 32, 3), "backward": flash_variants.Variant(64, 4, 32, 2)}
        name = device_name(be.device)
        tuned.write_section(name, "attention", {p: {"8x12x1024x64": v.name} for p, v in picked.items()},
                            {"command": "test"})
        flash_variants.forget_tables()
        out, lse = be.flash_attention_forward(d_qkv, NH)
        dqkv = be.flash_attention_backward(d_dout, d_qkv, out, lse, NH)
        assert set(picked.values()) <= flash_variants.compiled()
        # the same bits as those variants launched by name, and not the default's (tiles of 64 round P
        # elsewhere than tiles of 32)
        alone_out = cupy.empty_like(out)
        alone_lse = cupy.empty_like(lse)
        flash_variants.forward(be, alone_out, alone_lse, d_qkv, B, T, NH, picked["forward"])
        assert np.array_equal(be.to_host(alone_out), be.to_host(out))
        default_out = cupy.empty_like(out)
        flash_variants.forward(be, default_out, cupy.empty_like(lse), d_qkv, B, T, NH, flash_variants.DEFAULT)
        assert not np.array_equal(be.to_host(default_out), be.to_host(out))
        alone = cupy.empty_like(dqkv)
        flash_variants.backward(be, alone, cupy.empty_like(lse), d_dout, d_qkv, out, lse, B, T, NH,
                                picked["backward"])
        assert np.array_equal(be.to_host(alone), be.to_host(dqkv))
        assert json.loads(tuned.table_path(name).read_text())["measured"]["attention"] == {"command": "test"}
    finally:
        flash_variants.forget_tables()
