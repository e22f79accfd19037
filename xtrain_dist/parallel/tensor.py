"""--tp N: Megatron tensor parallelism on the ranks of a data-parallel x tensor-parallel mesh.

The model does the splitting (model.py: each block's four matrices cut over the tensor-parallel group, the
all-reduces after the row-parallel products and before the column-parallel ones in backward); the mesh
(comm/mesh.py) lays the world out as dp x tp with tp fastest, so ranks 0 .. tp-1 are one model; and the
data-parallel gradient sync runs inside each data-parallel group (the ranks holding the same shard). This
module checks the option before any rank starts, and says what a tensor-parallel run cannot do yet.

--tp-classifier: vocab (the default) cuts wte and the tied classifier over the group by the vocabulary, Megatron's
vocabulary-parallel embedding and cross-entropy; replicated keeps them whole on every rank (model.py's notes).

--sequence-parallel: Megatron's sequence parallelism (Korthikanti et al. 2022) on top: what tensor parallelism leaves
whole on every rank (the residual stream, the layernorms, dropout on the residual) is cut over the group by tokens,
each rank holding a contiguous 1/tp of a micro-batch's B x T tokens (model.py's notes). SEQ divisible by tp makes
every micro-batch's tokens divide, whatever its rows.
"""

from ..command import must_be, one_of
from ..config import GPTConfig
from ..errors import XtrainError
from ..layout import check_tp


def refuse_what_does_not_work_yet(split: str, refused: tuple, cfg) -> None:
    """One line for the first of `refused` (a NOT_YET list's entries) that cfg asks for beside `split` ("--tp 2")."""
    for option, asks, why in refused:
        if asks(cfg):
            raise XtrainError(f"{split} and {option} do not work together yet: {why}")


TP_CLASSIFIERS = ("vocab", "replicated")

# what a run with --tp above 1 refuses, and why: (option, whether the configuration asks for it, why not). (The
# overlapped sync runs beside --tp and --pp on a GPU too: its buckets settle before each of their collectives,
# parallel/ddp.py; PowerSGD runs on the data-parallel group, each rank compressing its own shards, parallel/powersgd.py)
NOT_YET: tuple = ()  # none now: --tp-classifier vocab, the last, has the cuda backend's kernels (classifier.cu)


def check_config(cfg, config: GPTConfig) -> None:
    """--tp divides the world and the model's heads, and asks for nothing NOT_YET lists: one line if not."""
    if isinstance(cfg.tp, bool) or not isinstance(cfg.tp, int) or cfg.tp < 1:
        raise XtrainError(must_be("--tp", "a positive integer", cfg.tp))
    if cfg.tp_classifier not in TP_CLASSIFIERS:
        raise XtrainError(must_be("--tp-classifier", one_of(TP_CLASSIFIERS), cfg.tp_classifier))
    if cfg.world_size % cfg.tp:
        raise XtrainError(must_be("--tp", f"a divisor of the world size ({cfg.world_size})", cfg.tp))
    check_tp(config, cfg.tp)
    if cfg.tp > 1 and cfg.sequence_parallel and cfg.seq % cfg.tp:
        raise XtrainError(f"--sequence-parallel cuts each micro-batch's tokens over the {cfg.tp} tensor-parallel "
                          f"ranks: SEQ must be divisible by --tp {cfg.tp}, got {cfg.seq}")
    if cfg.tp > 1:
        refuse_what_does_not_work_yet(f"--tp {cfg.tp}", NOT_YET, cfg)

