"""torch autocast on the CPU with CUDA's float32 list: the reference for `--precision`.

`torch.autocast("cpu", dtype=torch.float16)` runs softmax, log-softmax, layer norm, exp, log, pow
and sums in float16 (the CPU autocast lists are not the CUDA ones), while CUDA autocast — what
`ntl-patch step --precision` follows, since CUDA and ROCm are where half precision pays — runs
them in float32. `cuda_float32_list()` registers, for the AutocastCPU dispatch key, the CUDA
autocast kernels of those ops (torch 2.7 aten/src/ATen/autocast_mode.cpp: the `fp32`,
`fp32_set_opt_dtype` and `fp32_append_dtype` lists): half inputs are cast to float32 and the op
runs below autocast. The lower-precision lists are the same on both devices (matmul, linear,
addmm, bmm, baddbmm, conv), and torch.amp.GradScaler("cpu") is the CUDA scaler's algorithm.
"""

from __future__ import annotations

import contextlib

import torch
from torch._C import DispatchKey, DispatchKeySet

# CUDA autocast's float32 ops that the models and losses here reach (overload names)
CUDA_FLOAT32_OPS = (
    "softmax.int", "log_softmax.int", "_softmax", "_log_softmax",
    "layer_norm", "native_layer_norm", "group_norm",
    "exp", "log", "log1p", "expm1", "reciprocal", "rsqrt", "softplus",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "sum", "sum.dim_IntList", "cumsum", "prod", "logsumexp",
    "nll_loss", "nll_loss_nd", "cross_entropy_loss", "mse_loss", "l1_loss", "huber_loss",
    "smooth_l1_loss", "norm.Scalar", "norm.ScalarOpt_dim", "linalg_vector_norm",
    "acos", "asin", "cosh", "sinh", "tan",
)
_HALF = (torch.float16, torch.bfloat16)


def _widen(x):
    if isinstance(x, torch.Tensor) and x.dtype in _HALF:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_widen(v) for v in x)
    return x


def _kernel(op):
    def run(*args, **kwargs):
        args, kwargs = _widen(args), {k: _widen(v) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.AutocastCPU)):
            return op(*args, **kwargs)
    return run


@contextlib.contextmanager
def cuda_float32_list():
    """Within: CPU autocast keeps CUDA autocast's float32 ops in float32."""
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for name in CUDA_FLOAT32_OPS:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            lib.impl(name, _kernel(op), "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()
