"""Dropout's masks: Philox-4x32-10 (the counter-based generator cuRAND and PyTorch use) in numpy, and what
each mask is keyed by. The numpy oracle of kernels/dropout.cu, which computes the same function line by line.

Why a counter-based generator. A mask bit is a pure function of a 128-bit counter and a 64-bit key, with no
state carried from one draw to the next. The key is the run's --seed; the counter names the element:

    counter = (e >> 2, sequence, step, layer * SITES + site)     key = (seed mod 2^32, seed >> 32)

and the element's bits are lane e & 3 of the four words Philox returns for that counter, where
- e is the element's index inside its sequence in the *full* tensor: t * C + c for the (B, T, C) residual
  stream and embeddings, (head * T + i) * T + j for attention's probabilities, with `head` the model's head
  index (a tensor-parallel rank holding heads h0 .. h0 + n - 1 passes group0 = h0);
- sequence is the sequence's index in the step's global batch (BATCH of them, all ranks together), which
  also says which micro-batch it is in, so --grad-accum moves no bit;
- step is the optimizer step (from 1), site which of GPT-2's dropouts it is (SITES below), layer the
  model's block index (a pipeline stage's blocks keep their global numbers).
So the bits depend on what the element is, never on which rank computes it or how the model is split: the
same mask at every --world-size, --tp, --pp and --grad-accum, on numpy and on CUDA, and a resumed run
draws the same masks with nothing saved (the step is in the counter).

Inverted dropout: an element is kept when its 32 bits are at least threshold = floor(p * 2^32) (kept
with probability 1 - p to within 2^-32) and multiplied by scale = 1 / (1 - p) rounded to float32; a
dropped one is 0. Backward is the same map applied to the gradient: the mask is drawn again from the same
counters, not stored (a stored attention mask would be B*NH*T*T bytes; drawing it again is ten rounds of
integer products per element).
"""

from dataclasses import dataclass

import numpy as np

from ..command import must_be
from ..errors import XtrainError

# Philox-4x32's round multipliers and Weyl key increments (Salmon et al., SC11; Random123's philox.h)
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10

# GPT-2's three places (Hugging Face's GPT2Model): the embeddings (wte + wpe), attention's probabilities
# after the softmax, and the two residual branches (after attn.c_proj and after mlp.c_proj)
EMBEDDINGS, ATTENTION_PROBS, ATTENTION_OUT, MLP_OUT = 0, 1, 2, 3
SITES = 4


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of counters (c0, c1, c2, c3) under keys (k0, k1), elementwise over numpy arrays (or
    scalars) of uint32 -> four uint32 arrays. Ten rounds; the key is bumped by the Weyl constants before
    every round but the first, as in Random123 (whose known answers tests/test_dropout.py checks)."""
    low = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) & low for x in (c0, c1, c2, c3)]  # 32-bit words, as the kernel's casts
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + np.uint64(PHILOX_W0)) & low, (k1 + np.uint64(PHILOX_W1)) & low
        p0 = np.uint64(PHILOX_M0) * c[0]  # a 64-bit product of two 32-bit words: (hi, lo) = mulhilo
        p1 = np.uint64(PHILOX_M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & low, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & low]
    return tuple(x.astype(np.uint32) for x in c)


@dataclass(frozen=True)
class DropoutSite:
    """What one dropout's mask is keyed by. `step` is a (1,) uint32 array on the backend holding the
    optimizer step, which the loop rewrites before each step: a kernel reads it from memory, so a captured
    CUDA graph replays with each step's number. The tensor it applies to is read as
    (B, groups, L): row b is global sequence seq0 + b * seq_stride, group g is global group group0 + g
    (a head of attention's probabilities; the (B, T, C) tensors are one group), so element l of group g has
    e = (group0 + g) * L + l."""
    p: float
    seed: int
    step: object
    layer: int
    site: int
    seq0: int
    seq_stride: int
    groups: int = 1
    group0: int = 0

    @property
    def threshold(self) -> int:
        """Keep an element when its 32 random bits are >= this: floor(p * 2^32)."""
        return int(np.floor(self.p * 2.0 ** 32))

    @property
    def scale(self) -> np.float32:
        """1 / (1 - p), rounded to float32 once: the factor every backend multiplies a kept element by."""
        return np.float32(1.0 / (1.0 - self.p))

    @property
    def key(self) -> tuple[int, int]:
        return self.seed & 0xFFFFFFFF, (self.seed >> 32) & 0xFFFFFFFF

    @property
    def layer_site(self) -> int:
        return self.layer * SITES + self.site


def check_dropout(p) -> float:
    """--dropout: a probability in [0, 1) (1 would drop everything and scale by infinity)."""
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
        raise XtrainError(must_be("--dropout", "a number >= 0 and < 1", p))
    return float(p)


def check_elements(site: DropoutSite, shape: tuple[int, ...]) -> int:
    """L, the elements per group of a tensor of `shape` read as (B, groups, L); every e must fit the
    counter's 32-bit word after the two lane bits are taken off."""
    B = shape[0]
    L = int(np.prod(shape)) // max(1, B * site.groups)
    if (site.group0 + site.groups) * L > 1 << 34:
        raise XtrainError(f"dropout: {(site.group0 + site.groups) * L} elements per sequence at one site "
                          "exceed the 2^34 Philox's counter numbers")
    return L


def keep_mask(shape: tuple[int, ...], site: DropoutSite, step: int) -> np.ndarray:
    """The mask of a tensor of `shape` at `site` in optimizer step `step` (the host's copy of site.step):
    True where the element is kept.

    Each counter's four words serve four elements, so Philox runs once per counter a group's elements span
    (a quarter of the elements, and one more where a group does not start on a multiple of 4), and each
    element takes its word from there: word k of counter q sits at 4 * (q - q0) + k of its group's row, which
    for e = 4q + k is e - 4 * q0."""
    B, G = shape[0], site.groups
    L = check_elements(site, shape)
    start = (np.uint64(site.group0) + np.arange(G, dtype=np.uint64)) * np.uint64(L)  # each group's first e
    q0 = start >> np.uint64(2)  # each group's first counter
    spanned = (L + 3) // 4 + 1  # the counters L elements span at most
    q = q0[:, None] + np.arange(spanned, dtype=np.uint64)[None, :]  # (G, spanned)
    seq = np.uint64(site.seq0) + np.arange(B, dtype=np.uint64) * np.uint64(site.seq_stride)
    words = np.broadcast_arrays(*philox4x32_10(q[None], seq[:, None, None], np.uint64(step),
                                               np.uint64(site.layer_site), *site.key))
    row = np.stack(words, axis=-1).reshape(B, G, spanned * 4)
    e = start[:, None] + np.arange(L, dtype=np.uint64)[None, :]  # (G, L)
    index = (e - (q0[:, None] << np.uint64(2))).astype(np.intp)
    bits = np.take_along_axis(row, np.broadcast_to(index, (B, G, L)), axis=-1)
    return (bits >= np.uint32(site.threshold)).reshape(shape)
