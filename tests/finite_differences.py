"""The float64 oracle of a model's backward: central finite differences of a scalar loss at a few probed
elements of every parameter tensor (two per tensor, drawn from `rng`), against what backward put in grads."""

import pytest


def assert_gradients_match_finite_differences(model, loss, rng, eps: float = 1e-6) -> None:
    """model.grads holds backward's gradient of loss() (a float64 model); loss() recomputes it from
    model.params as they stand."""
    probe = [s.offset + rng.integers(0, s.hf_size) for s in model.layout for _ in range(2)]
    for i in probe:
        keep = model.params[i]
        model.params[i] = keep + eps
        up = loss()
        model.params[i] = keep - eps
        down = loss()
        model.params[i] = keep
        assert model.grads[i] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9), i
