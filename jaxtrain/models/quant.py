"""Quantized training of the layers' weight matmuls (`model.quant`), through qwix's quantized dot_general.

- fp8: e4m3 operands in the forward pass and e5m2 gradients in the backward, each scaled per tensor by its
  current absmax: the recipe H100s run natively (torchtitan's "tensorwise" Float8).
- int8: symmetric int8 forward and backward, scaled per channel (each activation row, each weight output column),
  as MaxText's int8 through qwix.

Current scaling, not delayed: a delayed scale needs an amax history in the train state, and quantization here
is a compute choice. Weights and checkpoints stay in the param dtype, so a run may switch it on or off across
resumes. The embedding, the output head, attention's own einsums and the MoE experts stay unquantized.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from qwix._src.core import dot_general_qt  # the QT op qwix's QtProvider runs (MaxText imports it the same way)

from jaxtrain.models.config import QUANT_MODES


@functools.cache
def qt_config(mode: str) -> dot_general_qt.DotGeneralQtConfig:
    """qwix's settings for `mode` (fp8 or int8), forward and backward."""
    if mode == "fp8":
        per_tensor = {f"{side}_disable_channelwise_axes": True
                      for side in ("lhs", "rhs", "dlhs_grad", "drhs_grad")}
        return dot_general_qt.DotGeneralQtConfig(
            lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn,
            dlhs_grad_qtype=jnp.float8_e5m2, drhs_grad_qtype=jnp.float8_e5m2, **per_tensor)
    if mode == "int8":
        return dot_general_qt.DotGeneralQtConfig(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8,
                                                 dlhs_grad_qtype=jnp.int8, drhs_grad_qtype=jnp.int8)
    raise ValueError(f"model.quant: unknown mode {mode!r}; choose one of {list(QUANT_MODES)}")


def dot_general(x, w, dimension_numbers, mode: str):
    """jax.lax.dot_general(x, w, dimension_numbers) with both operands, and both gradients, quantized by `mode`;
    the result in x's dtype."""
    return dot_general_qt.dot_general_qt(x, w, dimension_numbers, qt_config(mode)).astype(x.dtype)
