"""The TPU compiler's own pass over a run's programs, on this CPU host (libtpu; skipped
without it): a tiny model's update and paged decode step compiled for v5e:2x2 (4 chips),
their memory against the plan's, the Pallas kernels compiled by Mosaic, and libtpu beside
the CPU tests (two processes, no noise, the CPU devices unchanged).

CI installs libtpu (tests/run.sh: the tpu extra), so these run there.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed"),
]


def _run(**over):
    from configs import default
    from grpo_jax.run.config import parse_config

    c = default.get_config()
    c.mesh.data, c.mesh.fsdp = 1, 4
    for key, value in over.items():
        section, field = key.split(".")
        c[section][field] = value
    return parse_config(c)


@pytest.fixture(scope="module")
def v5e_4():
    from grpo_jax.aot import topology

    topology.quiet_libtpu()
    topo = topology.parse_topology("v5e-4")
    devices = topology.devices(topo)
    return topo, topology.make_mesh(topo, {"data": 1, "fsdp": 4, "tensor": 1}, devices)


def _compiled(run, mesh, name):
    from grpo_jax.aot import architectures, budget, measure, programs

    cfg = architectures.resolve(run)[0]
    (program,) = programs.programs(run, cfg, mesh, [name])
    measured, compiled = measure.compile_program(program)
    assert not measured.error, measured.error
    return measured, compiled, budget.needs(run, cfg, dict(mesh.shape))[name]


# Two micro-batches and a chunked loss: the update's loops (the accumulation's scan, the
# logits chunks) are there for the whole-step FLOPs to count.
UPDATE = {"train.minibatch_size": 128, "train.logits_chunk": 3}


@pytest.fixture(scope="module")
def update(v5e_4):
    """The tiny update compiled once for the module (about a minute here)."""
    return _compiled(_run(**UPDATE), v5e_4[1], "update")


def test_the_update_fits_the_plans_bounds(update, v5e_4):
    """Between the plan's bounds: its arguments at least the parameters, optimizer state,
    reference and batch the plan counts (the TPU pads small arrays to whole tiles), its
    total at most the plan's (a code allowance included)."""
    from grpo_jax.aot import architectures
    from grpo_jax.run import memory

    measured, _, need = update
    run = _run(**UPDATE)
    cfg = architectures.resolve(run)[0]
    mesh_shape = dict(v5e_4[1].shape)
    est = memory.plan_run(run, cfg, mesh_shape, budget_bytes=float("inf"))
    args = est.params + est.optimizer + est.reference
    args += memory.batch_bytes(memory.run_shapes(run, cfg, mesh_shape))
    assert args <= measured.arguments and measured.total <= need.own
    # XLA counts each loop body once (and elementwise ops the walk leaves out: without a
    # loop its count is the larger); the walk counts the bodies times their trips.
    assert measured.loops and all(n == 2 and exact for n, exact in measured.loops)
    assert measured.flops > 1.4 * measured.xla_flops_once


def test_the_update_reduces_no_activations(update):
    """Rows stay split over the batch axes: what the chips all-reduce is the gradients
    (each a parameter's shape: the TPU compiler writes their reduce-scatter as an
    all-reduce) and the metrics' scalars. The update jitted without the mesh set
    all-reduced activations and logits chunks of every row (f32[256,8,32], f32[256,3,100])."""
    from grpo_jax.aot import architectures, hlo_costs
    from grpo_jax.models.param_tensors import param_tensors

    _, compiled, _ = update
    params = {tuple(shape) for _, shape, _, _ in param_tensors(architectures.resolve(_run())[0])}
    reduced = [
        tuple(dims)
        for line in compiled.as_text().splitlines()
        if re.search(r" all-reduce(?:-start)?\(", line)
        for _, dims in hlo_costs.shapes_in(line.split(" all-reduce")[0].split("=", 1)[1])
    ]
    assert reduced
    assert not {d for d in reduced if d and d not in params}


def test_the_paged_decode_step_runs_its_kernel_within_the_plan(v5e_4):
    """The paged engine's decode step with splash attention: Mosaic's kernel, one per layer,
    on the 4-chip mesh (under shard_map), within the plan."""
    run = _run(**{"sampling.engine": "paged", "model.attention": "splash"})
    measured, _, need = _compiled(run, v5e_4[1], "paged_decode")
    assert measured.kernels == 4  # the tiny model's 4 layers
    assert measured.total <= need.own


def test_splash_prefill_runs_its_kernel(v5e_4):
    run = _run(**{"model.attention": "splash"})
    measured, _, need = _compiled(run, v5e_4[1], "prefill")
    assert measured.kernels == 4
    assert measured.total <= need.own


def test_libtpu_beside_the_cpu_tests():
    """Two processes load libtpu at once (its lockfile), print none of its warnings, and
    JAX_PLATFORMS=cpu still gives the 8 CPU devices the tests run on."""
    code = (
        "import jax; from grpo_jax.aot import topology as t; t.quiet_libtpu(); "
        "d = t.devices(t.parse_topology('v5e-4')); "
        "print(len(jax.devices()), jax.devices()[0].platform, len(d), d[0].device_kind)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_ACCELERATOR_TYPE",)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.split() == ["8", "cpu", "4", "TPU", "v5", "lite"]
        assert "TPU_ACCELERATOR_TYPE" not in err and "TPU_WORKER_HOSTNAMES" not in err
