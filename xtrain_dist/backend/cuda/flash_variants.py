"""The compile-time variants of kernels/flash_attention_mma.cu, which one runs at a shape, and their launches.

A variant is a choice of the kernel file's knobs (its `#define XTRAIN_MMA_*` defaults, overridden by -D
options when NVRTC compiles it): warps a block (4 or 8, of 16 rows each: 64 or 128 queries a block in
forward and dq, keys in dkdv), the rows of a streamed tile (32, 64 or 128: keys in forward and dq, queries
in dkdv), cp.async stages (2: double buffering, or 3) and the head size (64 or 128). Each variant is a
file compiled apart (compile.Kernels with its defines, cached per variant), so a run compiles only the
variants it launches.

Not every combination is worth compiling: VARIANTS holds those the rule in `Variant.passes` admits, per
pass (a variant may serve forward and not backward), and nothing else names a variant by hand. The rule
counts the fragment registers a thread keeps live (ptxas's counts, bin/flash_variants_ptxas, confirm that
none of the admitted ones spills: kernels/tuned/flash_variants_sm90.txt) and the shared memory a block
asks for against what one Hopper block may have.

Which variant runs: bin/bench_attention --sweep times them all on a GPU and writes its choice per shape
into kernels/tuned/<gpu>.json, section "attention":

    {"forward":  {"8x12x1024x64": "w8-t128-s2", ...},
     "backward": {"8x12x1024x64": "w4-t64-s3", ...}}

The backend reads it on its first flash call (tuned.load_section). At a shape the table does not name, the
entry of the same head size with the nearest T (then the nearest B x NH) is taken; without a table,
DEFAULT: the tiles the kernel file was written with (8 warps, tiles of 64, two stages).
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import numpy as np

from ...errors import XtrainError
from . import tuned
from .compile import Kernels, kernel_constant
from .device import cupy, device_name

FILE = "flash_attention_mma"
PASSES = ("forward", "backward")
SECTION = "attention"

WARPS = (4, 8)
TILES = (32, 64, 128)
STAGES = (2, 3)
HEAD_SIZES = (64, 128)

# The rule. Fragment registers a thread keeps live through a step of the inner loop (32-bit registers;
# bin/flash_variants_ptxas: with addresses and indices the kernels use 40-100 more, 255 at most):
#   forward:  Q's A fragments hs/4, O's accumulators hs/2, S's tile/2, P's A fragments tile/4
#   backward: dkdv, the larger of its two kernels: K and V hs/2, dK and dV hs, S^T and dP^T tile, P^T tile/4
# At or under these bounds no variant spills on sm_90; above them the first ones over do (backward at tile
# 128 or head size 128, forward at head size 128 with tiles of 128).
FORWARD_FRAGMENT_REGISTERS = 160
BACKWARD_FRAGMENT_REGISTERS = 176
# What one block may have (Hopper: 227 KB, the dynamic part opted into above 48 KB)
MAX_SHARED = 227 * 1024
STATIC_SHARED = 48 * 1024


@dataclass(frozen=True, order=True)
class Variant:
    hs: int
    warps: int
    tile: int
    stages: int

    @property
    def name(self) -> str:
        """The table's name of it: the head size comes with the shape."""
        return f"w{self.warps}-t{self.tile}-s{self.stages}"

    @property
    def label(self) -> str:
        return f"{self.name}-h{self.hs}"

    @property
    def defines(self) -> tuple[str, ...]:
        """The NVRTC options of this variant; none for the file's own defaults, which so compile (and are
        cached) exactly as every other kernel file is."""
        if self == DEFAULT:
            return ()
        return (f"-DXTRAIN_MMA_WARPS={self.warps}", f"-DXTRAIN_MMA_TILE={self.tile}",
                f"-DXTRAIN_MMA_STAGES={self.stages}", f"-DXTRAIN_MMA_HS={self.hs}")

    @property
    def block_rows(self) -> int:
        return 16 * self.warps

    def shared_bytes(self, pass_: str) -> int:
        """The dynamic shared memory a launch of this pass gives (the kernel file's MMA_*_SHARED)."""
        rows = (1 if pass_ == "forward" else 2) * self.block_rows + 2 * self.stages * self.tile
        return 2 * (self.hs + 8) * rows

    def fragment_registers(self, pass_: str) -> int:
        if pass_ == "forward":
            return self.hs // 4 + self.hs // 2 + self.tile // 2 + self.tile // 4
        return self.hs // 2 + self.hs + self.tile + self.tile // 4

    @property
    def passes(self) -> tuple[str, ...]:
        """The passes this variant is compiled and swept for: the rule."""
        bound = {"forward": FORWARD_FRAGMENT_REGISTERS, "backward": BACKWARD_FRAGMENT_REGISTERS}
        return tuple(p for p in PASSES
                     if self.fragment_registers(p) <= bound[p] and self.shared_bytes(p) <= MAX_SHARED)


VARIANTS: tuple[Variant, ...] = tuple(
    v for v in (Variant(hs, w, t, s) for hs, w, t, s in itertools.product(HEAD_SIZES, WARPS, TILES, STAGES))
    if v.passes)
DEFAULT = Variant(64, 8, 64, 2)


def variants(pass_: str, hs: int | None = None) -> list[Variant]:
    return [v for v in VARIANTS if pass_ in v.passes and hs in (None, v.hs)]


def by_name(name: str, hs: int, pass_: str) -> Variant | None:
    return next((v for v in variants(pass_, hs) if v.name == name), None)


# ---------------------------------------------------------------------------- the table

def shape_key(B: int, NH: int, T: int, hs: int) -> str:
    return f"{B}x{NH}x{T}x{hs}"


def choose(section: dict, pass_: str, B: int, NH: int, T: int, hs: int, where: str = "tuning table") -> Variant:
    """The variant a table's section (tuned.load_section(gpu, "attention")) names for this pass and shape:
    the exact shape, else the same head size's nearest T (by ratio), then nearest B x NH; none: DEFAULT."""
    entries = section.get(pass_, {})
    if not isinstance(entries, dict):
        raise XtrainError(f"{where}: attention {pass_!r} is not an object")
    candidates = []
    for key, name in entries.items():
        try:
            b, nh, t, h = (int(x) for x in key.split("x"))
        except ValueError:
            raise XtrainError(f"{where}: attention {pass_} shape {key!r} is not BxNHxTxHS") from None
        variant = by_name(name, h, pass_) if isinstance(name, str) else None
        if variant is None:
            raise XtrainError(f"{where}: attention {pass_} {key}: {name!r} is not a {pass_} variant of "
                              f"kernels/{FILE}.cu at head size {h} ({', '.join(v.name for v in variants(pass_, h))})")
        if h == hs:
            candidates.append((abs(math.log(t / T)), abs(math.log(b * nh / (B * NH))), key, variant))
    if not candidates:
        return DEFAULT
    return min(candidates)[3]


_tables: dict[str, dict] = {}
_tables_lock = threading.Lock()


def table_for(device: int) -> dict:
    """This device's "attention" section, read once per GPU model and process ({} without a table)."""
    name = device_name(device)
    with _tables_lock:
        if name not in _tables:
            _tables[name] = tuned.load_section(name, SECTION)
        return _tables[name]


def forget_tables() -> None:
    """Read the tables again at the next call (after a sweep has written one, or in tests)."""
    with _tables_lock:
        _tables.clear()


# ---------------------------------------------------------------------------- compiling and launching

_kernels: dict[tuple[str, Variant], Kernels] = {}
_kernels_lock = threading.Lock()


def kernels(dtype: str, variant: Variant) -> Kernels:
    with _kernels_lock:
        if (dtype, variant) not in _kernels:
            _kernels[(dtype, variant)] = Kernels(dtype, variant.defines)
        return _kernels[(dtype, variant)]


def compiled() -> set[Variant]:
    """The variants whose kernels this process has asked for (what ran, for tests and benchmarks)."""
    with _kernels_lock:
        return {variant for _, variant in _kernels}


def launch_constant(variant: Variant, name: str) -> int:
    """A launch constant of kernels/flash_attention_mma.cu as this variant compiles it."""
    return kernel_constant(FILE, name, variant.defines)


def _launch(be, kernel, grid, block: int, shared: int, *args) -> None:
    be._check_stream()
    if 0 in grid:
        return
    if shared > STATIC_SHARED and getattr(kernel, "max_dynamic_shared_size_bytes", 0) < shared:
        kernel.max_dynamic_shared_size_bytes = shared  # CUDA's opt-in beyond 48 KB, once per kernel
    kernel(tuple(grid), (block,), args, shared_mem=shared, stream=cupy.cuda.get_current_stream())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chosen(be, pass_: str, B: int, NH: int, T: int, hs: int) -> Variant:
    return choose(table_for(be.device), pass_, B, NH, T, hs)


def forward(be, out, lse, qkv, B: int, T: int, NH: int, variant: Variant | None = None) -> Variant:
    """flash_mma_forward of `variant` (None: the table's choice at this shape) into out and lse."""
    hs = qkv.shape[-1] // 3 // NH
    variant = variant or chosen(be, "forward", B, NH, T, hs)
    k = kernels(be.dtype, variant)
    _launch(be, k.flash_mma_forward, (_cdiv(T, variant.block_rows), NH, B), 32 * variant.warps,
            variant.shared_bytes("forward"), out, lse, qkv, np.int32(T), np.int32(NH))
    return variant


def backward(be, dqkv, D, dout, qkv, out, lse, B: int, T: int, NH: int, variant: Variant | None = None) -> Variant:
    """D = rowsum(dout * out), then dK and dV, then dQ, by `variant`'s kernels (None: the table's choice)."""
    hs = qkv.shape[-1] // 3 // NH
    variant = variant or chosen(be, "backward", B, NH, T, hs)
    k = kernels(be.dtype, variant)
    threads = 32 * variant.warps
    _launch(be, k.flash_mma_backward_dot, (_cdiv(B * NH * T, threads // 8),), threads, 0,
            D, dout, out, np.int32(B), np.int32(T), np.int32(NH))
    grid = (_cdiv(T, variant.block_rows), NH, B)
    args = (dqkv, dout, qkv, lse, D, np.int32(T), np.int32(NH))
    shared = variant.shared_bytes("backward")
    _launch(be, k.flash_mma_backward_dkdv, grid, threads, shared, *args)
    _launch(be, k.flash_mma_backward_dq, grid, threads, shared, *args)
    return variant
