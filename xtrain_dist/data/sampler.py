"""The batches each data-parallel rank trains on: `BatchSampler` cuts random windows from a stream; every rank
draws the whole global batch from the same seeded RNG and keeps its own share, so the ranks agree on the
batch without talking to each other."""

import numpy as np

from ..errors import XtrainError
from .token_files import TokenFiles, take_windows


class BatchSampler:
    """Draws global batches from one seeded RNG that every rank constructs identically; keeps this
    rank's share.

    Each `next()` draws `batch` start offsets, offsets = rng.integers(0, len(tokens) - seq, size=batch)
    (each uniform in [0, len(tokens) - seq - 1]); sequence i is tokens[o_i : o_i + seq] with targets
    tokens[o_i + 1 : o_i + seq + 1]. Rank r keeps the sequences with i % world == r. Every rank draws
    all the offsets, so the RNGs stay in lockstep and the ranks' shares together are exactly the
    batch that world 1 would train on. For the same reason the state is the same on every rank, and
    a state saved at one world size resumes the same stream of global batches at another.

    overfit (--overfit-batch, llm.c's -a): every `next()` is the first global batch again, drawn from a
    fresh RNG of the same seed, so the saved state never moves and a resume draws that batch too.
    """

    def __init__(self, tokens: np.ndarray | TokenFiles, batch: int, seq: int, seed: int, rank: int = 0,
                 world: int = 1, overfit: bool = False):
        if not isinstance(tokens, TokenFiles):
            tokens = np.asarray(tokens)
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise TypeError(f"tokens must be a 1-D array of integer ids, not {tokens.dtype} {tokens.shape}")
        if batch < 1 or seq < 1:
            raise XtrainError(f"BATCH and SEQ must be at least 1, got BATCH={batch}, SEQ={seq}")
        if seed < 0:
            raise XtrainError(f"the seed must be a non-negative integer, got {seed}")
        if world < 1 or not 0 <= rank < world:
            raise XtrainError(f"rank {rank} is not one of the {world} ranks of this world")
        if len(tokens) < seq + 1:
            raise XtrainError(
                f"a stream of {len(tokens)} tokens is too short for SEQ={seq}: at least {seq + 1} are needed"
            )
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
        self.rank, self.world, self.overfit = rank, world, overfit
        self.n_local = len(range(rank, batch, world))
        self._rng = self._first_rng()
        self._batches_drawn = 0

    def _first_rng(self) -> np.random.Generator:
        # [seed, 1] rather than seed: the model's init draws from PCG64(seed), and the data order
        # must not be a replay of the initial weights' random stream.
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 1])))

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (inputs, targets) of the next global batch: int32 arrays of shape (n_local, seq)."""
        rng = self._first_rng() if self.overfit else self._rng
        offsets = rng.integers(0, len(self.tokens) - self.seq, size=self.batch)
        self._batches_drawn += 1
        windows = take_windows(self.tokens, offsets[self.rank :: self.world], self.seq + 1)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])

    def _stream(self) -> dict:
        """What fixes the stream of global batches; a state only fits a sampler with the same."""
        return {"seed": self.seed, "batch": self.batch, "seq": self.seq, "n_tokens": len(self.tokens)}

    def state(self) -> dict:
        """A JSON-serialisable snapshot; `load_state` of it makes `next()` continue exactly from here."""
        bits = self._rng.bit_generator.state
        return {
            **self._stream(),
            "batches_drawn": self._batches_drawn,
            # PCG64's state and increment are 128-bit: as strings they survive JSON readers that
            # hold numbers in doubles.
            "pcg64": {
                "state": str(bits["state"]["state"]),
                "inc": str(bits["state"]["inc"]),
                "has_uint32": bits["has_uint32"],
                "uinteger": bits["uinteger"],
            },
        }

    def load_state(self, state: dict) -> None:
        """Continue the stream `state` (state()'s snapshot) left off. Every field is checked first: a state
        edited by hand, or of another sampler, is one XtrainError naming the field, never numpy's
        OverflowError from a word that does not fit PCG64's 128 bits."""
        saved = {name: state.get(name) for name in self._stream()}
        if saved != self._stream():
            raise XtrainError(f"sampler state was saved for {saved}, but this sampler draws {self._stream()}")
        drawn = state.get("batches_drawn")
        if not isinstance(drawn, int) or isinstance(drawn, bool) or drawn < 0:
            raise XtrainError(f"sampler.batches_drawn is {drawn!r}, expected an integer >= 0")
        pcg64 = state.get("pcg64")
        if not isinstance(pcg64, dict):
            raise XtrainError(f"sampler.pcg64 is {pcg64!r}, expected an object with state, inc, has_uint32 and "
                              "uinteger")
        words = {}
        for name, limit, bound in (("state", 2**128, "2**128"), ("inc", 2**128, "2**128"), ("has_uint32", 2, "2"),
                                   ("uinteger", 2**32, "2**32")):
            value = pcg64.get(name)
            # the 128-bit words are saved as strings (JSON readers hold numbers in doubles), the others as numbers
            if isinstance(value, str) and value.isascii() and value.isdigit():
                words[name] = int(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                words[name] = value
            if not 0 <= words.get(name, -1) < limit:
                raise XtrainError(f"sampler.pcg64.{name} is {value!r}, expected an integer in [0, {bound})")
        self._rng.bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": words["state"], "inc": words["inc"]},
            "has_uint32": words["has_uint32"],
            "uinteger": words["uinteger"],
        }
        self._batches_drawn = drawn
