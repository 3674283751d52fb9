"""The roofline on hand-written HLO in XLA:GPU's form: bytes of fused kernels, FLOPs of cuDNN's attention."""

import numpy as np
import pytest

from jaxtrain.observe import hlo
from jaxtrain.tools.plan import roofline

# A layer scan's two in-place kernels: one writes a layer's [1, 256, 64] gradient into the stacked [48, 256, 64]
# buffer, which XLA:GPU reaches through a bitcast of the parameter; one reads a layer's slice of a stacked
# weight through a bitcast. Neither moves the whole stack.
HLO = """
HloModule m

%write (p0: f32[48,256,64], p1: f32[256,64], p2: s32[]) -> f32[48,256,64] {
  %p0 = f32[48,256,64]{2,1,0} parameter(0)
  %b0 = f32[48,16384]{1,0} bitcast(f32[48,256,64]{2,1,0} %p0)
  %b1 = f32[48,256,64]{2,1,0} bitcast(f32[48,16384]{1,0} %b0)
  %p1 = f32[256,64]{1,0} parameter(1)
  %u = f32[1,256,64]{2,1,0} bitcast(f32[256,64]{1,0} %p1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[48,256,64]{2,1,0} dynamic-update-slice(f32[48,256,64]{2,1,0} %b1, f32[1,256,64]{2,1,0} %u, s32[] %p2, s32[] %z, s32[] %z)
}

%read (q0: bf16[48,256,64], q1: s32[]) -> bf16[256,64] {
  %q0 = bf16[48,256,64]{2,1,0} parameter(0)
  %c = bf16[48,256,64]{2,1,0} bitcast(bf16[48,256,64]{2,1,0} %q0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %s = bf16[1,256,64]{2,1,0} dynamic-slice(bf16[48,256,64]{2,1,0} %c, s32[] %q1, s32[] %z, s32[] %z), dynamic_slice_sizes={1,256,64}
  ROOT %r = bf16[256,64]{1,0} bitcast(bf16[1,256,64]{2,1,0} %s)
}

%whole (r0: f32[48,256,64]) -> f32[48,256,64] {
  %r0 = f32[48,256,64]{2,1,0} parameter(0)
  %r1 = f32[48,16384]{1,0} bitcast(f32[48,256,64]{2,1,0} %r0)
  %n = f32[48,16384]{1,0} negate(f32[48,16384]{1,0} %r1)
  ROOT %r2 = f32[48,256,64]{2,1,0} bitcast(f32[48,16384]{1,0} %n)
}

ENTRY %main (a: f32[48,256,64], g: f32[256,64], i: s32[], w: bf16[48,256,64]) -> (f32[48,256,64], bf16[256,64], f32[48,256,64]) {
  %a = f32[48,256,64]{2,1,0} parameter(0)
  %g = f32[256,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %w = bf16[48,256,64]{2,1,0} parameter(3)
  %f1 = f32[48,256,64]{2,1,0} fusion(f32[48,256,64]{2,1,0} %a, f32[256,64]{1,0} %g, s32[] %i), kind=kLoop, calls=%write
  %f2 = bf16[256,64]{1,0} fusion(bf16[48,256,64]{2,1,0} %w, s32[] %i), kind=kLoop, calls=%read
  %f3 = f32[48,256,64]{2,1,0} fusion(f32[48,256,64]{2,1,0} %a), kind=kLoop, calls=%whole
  ROOT %t = (f32[48,256,64]{2,1,0}, bf16[256,64]{1,0}, f32[48,256,64]{2,1,0}) tuple(%f1, %f2, %f3)
}
"""


def test_a_fusion_that_updates_or_slices_a_stacked_buffer_through_a_bitcast_moves_one_layer():
    layer = 256 * 64
    kernels = {k["name"]: k for k in roofline.roofline(HLO, 1e15, 1e12, top=10)["top"]}
    # the update (read) and the layer written, plus the index: not the 48-layer buffer read and written
    assert kernels["f1"]["bytes"] == 4 * layer + 4 * layer + 4
    assert kernels["f2"]["bytes"] == 2 * layer + 4 + 2 * layer  # the slice read, the index, the output
    assert kernels["f3"]["bytes"] == 2 * 4 * 48 * layer  # an elementwise op reads and writes all of it


def _attention(target: str, mask: str, window: int) -> str:
    config = ('{"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": '
              f'["2", "8", "64", "64"], "layout": {{"minor_to_major": ["3", "2", "1", "0"]}}}}, "mask_type": "{mask}", '
              f'"sliding_window_length": {window}}}}}')
    return f"""
HloModule m

ENTRY %main (q: bf16[2,64,8,32], k: bf16[2,64,2,32], v: bf16[2,64,2,16]) -> bf16[2,8,64,16] {{
  %q = bf16[2,64,8,32]{{3,2,1,0}} parameter(0)
  %k = bf16[2,64,2,32]{{3,2,1,0}} parameter(1)
  %v = bf16[2,64,2,16]{{3,2,1,0}} parameter(2)
  %a = (bf16[2,8,64,16]{{3,1,2,0}}, f32[2,8,64]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmha{target}", backend_config={config}
  ROOT %o = bf16[2,8,64,16]{{3,1,2,0}} get-tuple-element(%a), index=0
}}
"""


@pytest.mark.parametrize("target, mask, window", [("Softmax", "CAUSAL", 0), ("SoftmaxBackward", "CAUSAL", 0),
                                                  ("Softmax", "NO_MASK", 0), ("SoftmaxBackward", "CAUSAL", 16)])
def test_cudnn_attention_counts_two_flops_per_multiply_add_of_each_unmasked_pair(target, mask, window):
    q, k = np.arange(64)[:, None], np.arange(64)[None, :]
    visible = np.ones((64, 64), bool) if mask == "NO_MASK" else k <= q
    visible &= (q - k < window) if window else True
    # forward: q.k (32) and p.v (16); backward: q.k again, dp = do.v, dv = p.do, dq = ds.k, dk = ds.q
    per_pair = 3 * 32 + 2 * 16 if target.endswith("Backward") else 32 + 16
    expected = 2 * 2 * 8 * visible.sum() * per_pair
    module = hlo.parse_hlo(_attention(target, mask, window))
    assert hlo.dot_flops(module) == expected
    assert roofline.roofline(module, 1e15, 1e12)["matmul_flops"] == expected
