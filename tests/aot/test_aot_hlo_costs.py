"""FLOPs and collective bytes of one whole run of a compiled program, against hand counts:
loops times their trips (XLA's cost_analysis counts a loop body once)."""

import jax
import jax.numpy as jnp
import pytest

from grpo_jax.aot import hlo_costs

MATMUL = 2 * 16 * 32 * 32  # one [16, 32] x [32, 32]


def _scan(x, w):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0].sum()


def test_a_scan_counts_each_step():
    x, w = jnp.ones((16, 32)), jnp.ones((7, 32, 32))
    compiled = jax.jit(_scan).lower(x, w).compile()
    costs = hlo_costs.analyse(compiled.as_text())
    assert costs.flops == 7 * MATMUL
    assert costs.loops == [(7, True)]
    assert compiled.cost_analysis()["flops"] < 2 * MATMUL  # what this corrects
    grads = hlo_costs.analyse(jax.jit(jax.grad(_scan, 1)).lower(x, w).compile().as_text())
    assert grads.flops == 3 * 7 * MATMUL  # forward, and two matmuls per step backward


def test_a_loop_that_stops_on_data_counts_its_bound():
    """The sampler's decode loop: a counter below T, and every row not yet done."""

    def decode(x):
        def cond(s):
            return (s[0] < 10) & (s[1].sum() < 1e30)

        return jax.lax.while_loop(cond, lambda s: (s[0] + 1, s[1] @ jnp.ones((32, 32))), (0, x))

    costs = hlo_costs.analyse(jax.jit(decode).lower(jnp.ones((16, 32))).compile().as_text())
    assert costs.flops == 10 * MATMUL
    assert costs.loops == [(10, False)]  # the bound: it may stop earlier


# The TPU compiler's forms, written as it prints them (tests/aot/test_aot_tpu.py compiles
# real ones): a windowed einsum whose counter steps by 2, a conditional, a batched matmul as
# a convolution that selects one input per tap, an asynchronous all-gather in the loop.
TPU_LIKE = """\
HloModule m

%body (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %p = (s32[], bf16[8,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,64] get-tuple-element(%p), index=1
  %w = bf16[64,64] constant({...})
  %d = bf16[8,64] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = (bf16[2,64], bf16[8,64]) all-gather-start(%x), dimensions={0}
  %agd = bf16[8,64] all-gather-done(%ag)
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  ROOT %t = (s32[], bf16[8,64]) tuple(%next, %d)
}

%cond (p.1: (s32[], bf16[8,64])) -> pred[] {
  %p.1 = (s32[], bf16[8,64]) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%small (a: bf16[8,64]) -> bf16[8,64] {
  %a = bf16[8,64] parameter(0)
  %w2 = bf16[64,64] constant({...})
  ROOT %d2 = bf16[8,64] dot(%a, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%big (b: bf16[8,64]) -> bf16[8,64] {
  %b = bf16[8,64] parameter(0)
  %w3 = bf16[64,64] constant({...})
  %d3 = bf16[8,64] dot(%b, %w3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d4 = bf16[8,64] dot(%d3, %w3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x0: bf16[8,64], k: s32[], lhs: f32[16,1536,512,2], rhs: f32[16,2,512,512]) \
-> f32[16,1536,512,2] {
  %x0 = bf16[8,64] parameter(0)
  %k = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,64]) tuple(%zero, %x0)
  %loop = (s32[], bf16[8,64]) while(%init), condition=%cond, body=%body
  %y = bf16[8,64] get-tuple-element(%loop), index=1
  %c = bf16[8,64] conditional(%k, %y, %y), branch_computations={%small, %big}
  %lhs = f32[16,1536,512,2] parameter(2)
  %rhs = f32[16,2,512,512] parameter(3)
  ROOT %conv = f32[16,1536,512,2] convolution(%lhs, %rhs), \
window={size=16x2 stride=15x1 pad=0_0x1_1 lhs_dilate=16x1 rhs_reversal=0x1}, \
dim_labels=0bf1_o01i->0bf1
}
"""


def test_the_tpu_compilers_forms():
    costs = hlo_costs.analyse(TPU_LIKE)
    step = 2 * 8 * 64 * 64
    # The loop runs 6 times (12 / 2), the larger branch has two matmuls. The convolution
    # (a batched matmul of 1536 x 512 by 512 x 512 per tap on a real input): along its first
    # window dimension each of the 16 outputs meets one real input among the 16 taps
    # (lhs_dilate 16, stride 15), along the second (window 2, padding 1 over 2 inputs) the
    # first output meets 1 and the second 2: 16 x 3 taps, not the 16 x 2 x 2 of the window.
    conv = 2 * 1536 * 512 * 512 * 16 * 3
    assert costs.loops == [(6, True)]
    assert costs.flops == pytest.approx(6 * step + 2 * step + conv)
    assert costs.collective_bytes == 6 * 8 * 64 * 2  # the gathered [8, 64], not the operand


# A mixture of experts' grouped matmul (``jax.lax.ragged_dot``) as the TPU compiler writes
# it: its own kernel, after the kernel that computes the groups' metadata; in a loop of 3.
RAGGED = """\
HloModule m

%body (p: (s32[], f32[512,64])) -> (s32[], f32[512,64]) {
  %p = (s32[], f32[512,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[512,64] get-tuple-element(%p), index=1
  %sizes = s32[4] constant({128, 128, 128, 128})
  %ragged-dot-metadata = (s32[5], s32[19], s32[19], s32[1]) custom-call(%sizes), \
custom_call_target="tpu_custom_call"
  %m0 = s32[5] get-tuple-element(%ragged-dot-metadata), index=0
  %m3 = s32[1] get-tuple-element(%ragged-dot-metadata), index=3
  %w = f32[4,64,192] constant({...})
  %ragged-dot-none.2 = f32[512,192] custom-call(%m3, %m0, /*index=2*/%x, %w), \
custom_call_target="tpu_custom_call", frontend_attributes={ragged_dot_tiling="128,64,192"}
  %wd = f32[4,192,64] constant({...})
  %down = f32[512,64] custom-call(%m3, %m0, %ragged-dot-none.2, %wd), \
custom_call_target="tpu_custom_call", frontend_attributes={ragged_dot_tiling="128,192,64"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[512,64]) tuple(%next, %down)
}

%cond (p.1: (s32[], f32[512,64])) -> pred[] {
  %p.1 = (s32[], f32[512,64]) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x0: f32[512,64]) -> (s32[], f32[512,64]) {
  %x0 = f32[512,64] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[512,64]) tuple(%zero, %x0)
  ROOT %loop = (s32[], f32[512,64]) while(%init), condition=%cond, body=%body
}
"""


def test_a_grouped_matmuls_kernel_counts_each_row_times_its_groups_weights():
    """Each of the 512 rows goes through one group's [64, 192] and back through [192, 64]:
    2 x 512 x 64 x 192 FLOPs each way, 3 times; the metadata kernel none. (Before, the
    kernels counted nothing: a mixture's experts were missing from its FLOPs.)"""
    costs = hlo_costs.analyse(RAGGED)
    assert costs.flops == 3 * 2 * (2 * 512 * 64 * 192)
    assert costs.kernels == 3
