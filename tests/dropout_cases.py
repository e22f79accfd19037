"""What tests/test_cuda_ops.py (fp32) and tests/test_cuda_bf16.py (bf16) check of kernels/dropout.cu: the
oracle's bits exactly."""

import numpy as np

from xtrain_dist.backend.dropout import ATTENTION_PROBS, MLP_OUT, DropoutSite

# (shape, site, groups, group0): a (B, T, C) residual branch and (B, NH, T, T) probabilities of heads 3..5;
# neither size a multiple of Philox's four words
DROPOUT_SHAPES = [((3, 5, 7), MLP_OUT, 1, 0), ((2, 3, 6, 6), ATTENTION_PROBS, 3, 3)]


def dropout_site(step, kind, seq0, stride, groups=1, group0=0, p=0.3):
    """A site of layer 1 under a seed past 32 bits (both key words in use)."""
    return DropoutSite(p, 2**33 + 5, step, 1, kind, seq0, stride, groups, group0)


def check_dropout_bitwise(backend, oracle, rng, shape, kind, groups, group0):
    """The same Philox bits and the same products: an activation (rounded to bf16 in bf16), a float32 buffer
    (wide) and in place, for sequences 5, 8, ... of the global batch."""
    x = (rng.standard_normal(shape)).astype(np.float32)
    step_host = np.array([int(rng.integers(1, 2**31))], dtype=np.uint32)
    host_site = dropout_site(step_host, kind, 5, 3, groups, group0)
    site = dropout_site(backend.from_host(step_host), kind, 5, 3, groups, group0)
    got = backend.to_host(backend.dropout(backend.from_host_act(x), site))
    want = oracle.dropout(oracle.from_host_act(x), host_site)
    assert np.array_equal(got, want)
    assert 0 < np.count_nonzero(want) < want.size
    wide = backend.to_host(backend.dropout(backend.from_host(x), site, wide=True))
    assert np.array_equal(wide, oracle.dropout(x, host_site, wide=True))
    buf = backend.from_host(x)
    backend._dropout_into(buf, buf, site, wide=True)
    assert np.array_equal(backend.to_host(buf), wide)
    # the step is read on the device: another value in the same array, another mask
    backend.upload(site.step, step_host + 1)
    assert not np.array_equal(backend.to_host(backend.dropout(backend.from_host(x), site, wide=True)), wide)
