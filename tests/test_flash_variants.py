"""The variants of kernels/flash_attention_mma.cu on the CPU (backend/cuda/flash_variants.py): the rule that
admits them, the launch geometry agreeing with the kernel file's own constants under each variant's -D
options, the tuning table's choice per shape, and the ptxas record (kernels/tuned/flash_variants_sm90.txt)
being of the current source with no spill. Their arithmetic is tests/test_cuda_flash_variants.py's (GPU
or simulator)."""

import shutil

import pytest
from bin_scripts import load_script

from xtrain_dist.backend.cuda import flash_variants as fv
from xtrain_dist.backend.cuda.compile import kernel_constant
from xtrain_dist.errors import XtrainError

ptxas = load_script("flash_variants_ptxas")


def test_the_rule_admits_todays_tiles_and_refuses_what_spills():
    assert fv.DEFAULT in fv.variants("forward", 64) and fv.DEFAULT in fv.variants("backward", 64)
    assert len(set(fv.VARIANTS)) == len(fv.VARIANTS) == 20
    # backward keeps K, V, dK and dV of its 16 rows in registers: tiles of 128 and heads of 128 spill there
    assert {(v.hs, v.tile) for v in fv.variants("backward")} == {(64, 32), (64, 64)}
    assert {(v.hs, v.tile) for v in fv.variants("forward")} == {(64, 32), (64, 64), (64, 128), (128, 32), (128, 64)}
    assert all(v.block_rows == 16 * v.warps and v.shared_bytes(p) <= fv.MAX_SHARED
               for v in fv.VARIANTS for p in v.passes)


@pytest.mark.parametrize("variant", [fv.DEFAULT, fv.Variant(128, 4, 32, 3), fv.Variant(64, 8, 128, 3)],
                         ids=lambda v: v.label)
def test_the_launch_geometry_is_the_kernel_files_under_the_variants_options(variant):
    """What the host launches with (threads, rows a block, dynamic shared memory) is what kernels/
    flash_attention_mma.cu computes from the same -D options."""
    def constant(name):
        return fv.launch_constant(variant, name)

    assert constant("MMA_THREADS") == 32 * variant.warps and constant("MMA_BLOCK_ROWS") == variant.block_rows
    assert (constant("MMA_TILE"), constant("MMA_STAGES"), constant("MMA_HS")) == (variant.tile, variant.stages,
                                                                                   variant.hs)
    assert constant("MMA_FORWARD_SHARED") == variant.shared_bytes("forward")
    assert constant("MMA_BACKWARD_SHARED") == variant.shared_bytes("backward")
    assert kernel_constant(fv.FILE, "MMA_BLOCK_ROWS") == fv.DEFAULT.block_rows  # no options: the defaults


SECTION = {"forward": {"8x12x1024x64": "w4-t128-s2", "4x16x2048x64": "w8-t64-s3", "8x12x1024x128": "w4-t32-s2"},
           "backward": {"8x12x1024x64": "w4-t32-s3"}}


@pytest.mark.parametrize(("pass_", "shape", "want"), [
    ("forward", (8, 12, 1024, 64), fv.Variant(64, 4, 128, 2)),    # the shape itself
    ("forward", (16, 12, 1024, 64), fv.Variant(64, 4, 128, 2)),   # same T, more heads
    ("forward", (1, 12, 1800, 64), fv.Variant(64, 8, 64, 3)),     # T nearer 2048 than 1024
    ("forward", (1, 1, 64, 128), fv.Variant(128, 4, 32, 2)),      # head size 128's own entry
    ("backward", (2, 2, 4096, 64), fv.Variant(64, 4, 32, 3)),     # the only backward entry
    ("backward", (8, 12, 1024, 128), fv.DEFAULT),                 # no entry at that head size: today's
])
def test_the_table_chooses_the_nearest_shape_of_the_same_head_size(pass_, shape, want):
    assert fv.choose(SECTION, pass_, *shape) == want
    assert fv.choose({}, pass_, *shape) == fv.DEFAULT


@pytest.mark.parametrize(("section", "line"), [
    ({"forward": {"8x12x1024x64": "w4-t128-s9"}}, "tuning table: attention forward 8x12x1024x64: 'w4-t128-s9' is "
     "not a forward variant of kernels/flash_attention_mma.cu at head size 64 (w4-t32-s2, "),
    ({"backward": {"8x12x1024x64": "w4-t128-s2"}}, "tuning table: attention backward 8x12x1024x64: 'w4-t128-s2' is "
     "not a backward variant of kernels/flash_attention_mma.cu at head size 64 (w4-t32-s2, w4-t32-s3, w4-t64-s2, "
     "w4-t64-s3, w8-t32-s2, w8-t32-s3, w8-t64-s2, w8-t64-s3)"),
    ({"forward": {"1024": "w4-t32-s2"}}, "tuning table: attention forward shape '1024' is not BxNHxTxHS"),
    ({"forward": ["w4-t32-s2"]}, "tuning table: attention 'forward' is not an object"),
])
def test_a_table_naming_no_variant_is_one_line(section, line):
    with pytest.raises(XtrainError) as err:
        fv.choose(section, "forward" if "forward" in section else "backward", 8, 12, 1024, 64)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_the_ptxas_record_is_of_this_source_and_no_variant_spills():
    """kernels/tuned/flash_variants_sm90.txt (bin/flash_variants_ptxas) lists every kernel of every variant's
    passes, compiled from the kernel source as it is now: rerun the script after changing the kernels."""
    sha, rows = ptxas.parse(ptxas.RECORD.read_text())
    assert sha == ptxas.source_sha256(), "kernels/flash_attention_mma.cu changed: run bin/flash_variants_ptxas"
    assert {(r["variant"], r["pass"], r["kernel"]) for r in rows} == {
        (v.label, p, k) for v in fv.VARIANTS for p in v.passes for k in ptxas.KERNELS_OF[p]}
    spilled = [r for r in rows if r["stack"] or r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled
    assert all(0 < r["registers"] <= 255 for r in rows)
    by_label = {v.label: v for v in fv.VARIANTS}
    for r in rows:
        shared = 0 if r["kernel"].endswith("_dot") else by_label[r["variant"]].shared_bytes(r["pass"])
        assert r["dynamic_smem"] == shared, r


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_ptxas_gives_the_recorded_registers():
    """One variant compiled again (today's tiles, a few seconds): the record's figures are ptxas's."""
    _, rows = ptxas.parse(ptxas.RECORD.read_text())
    report = ptxas.ptxas_report(shutil.which("nvcc"), fv.DEFAULT)
    for r in rows:
        if r["variant"] == fv.DEFAULT.label:
            assert (report[r["kernel"]]["registers"], report[r["kernel"]]["spill_stores"]) == (r["registers"], 0), r
