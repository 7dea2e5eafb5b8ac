"""Assertions shared by the tensor-parallel tests (test_tensor_parallel.py, test_tp_smp_nn.py)."""

RTOL = 1e-5


def assert_close(name, a, b, rtol=RTOL, atol=0.0):
    """max|a - b| <= rtol * max|b| + atol. ``atol`` only for gradients that are zero in exact
    arithmetic (e.g. attention key biases: softmax ignores a shift), where fp32 noise is ~1e-9."""
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff, scale = float((a - b).abs().max()), float(b.abs().max())
    assert diff <= rtol * scale + atol, f"{name}: max difference {diff:.2e} > {rtol:.0e} x {scale:.2e} + {atol:.0e}"


def hf_quiet():
    import transformers

    transformers.logging.set_verbosity_error()
