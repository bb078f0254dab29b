"""LoRA's programs in the plan command (docs/pods.md): the update it compiles for a LoRA run is
the run's own (the adapters alone train, the base is the reference), on CPU devices; and
the TPU compiler's figures for it against the plan's (libtpu; the slow tier).
"""

import importlib.util

import jax
import pytest

from grpo_jax.aot import architectures, programs
from grpo_jax.core import sharding
from grpo_jax.models import lora
from grpo_jax.run import builders, setup
from grpo_jax.run.config import parse_config


def _run(rank=8, beta=0.04, **over):
    """The CPU default on fsdp 4, with adapters of rank ``rank`` (0: none), beta > 0 so
    that a full run would hold a reference copy."""
    from configs import default

    c = default.get_config()
    c.mesh.data, c.mesh.fsdp = 1, 4
    c.model.lora.rank, c.grpo.beta = rank, beta
    for key, value in over.items():
        section, field = key.split(".")
        c[section][field] = value
    return parse_config(c)


def _hlo(lowered) -> str:
    """The lowered text without source locations (the two callers' lines differ)."""
    return "\n".join(
        line.split(" loc(")[0] for line in lowered.as_text().splitlines() if "#loc" not in line
    )


@pytest.mark.slow
def test_the_plans_lora_update_is_the_runs(tmp_path):
    """The plan's update for a LoRA run lowers to the program the run's own trainer lowers
    (``run.setup.build_trainer``) on the same mesh: the optimizer's moments cover the
    adapters alone and no reference copy goes in. Before the plan knew LoRA it compiled the
    full fine-tuning update for such a run."""
    run = _run()
    cfg = architectures.resolve(run)[0]
    mesh = sharding.make_mesh({"data": 1, "fsdp": 4}, jax.devices()[:4])
    (planned,) = programs.programs(run, cfg, mesh, ["update"])
    tokenizer = builders.build_tokenizer(run, tmp_path)
    graphdef, params, lora_run = builders.build_policy(run, tokenizer, mesh)
    policy = setup.Policy(graphdef=graphdef, tokenizer=tokenizer, lora=lora_run)
    trainer, state = setup.build_trainer(run, policy, params, mesh)
    b = programs.Builder(run, cfg, mesh)
    spec = (
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state),
        b.batch(),
        b.key(),
        None,
    )
    with jax.set_mesh(mesh):
        own = trainer.update.lower(*spec)
    assert planned.args[3] is None  # the base in the parameters is the reference
    moments = [x.size for x in jax.tree.leaves(planned.args[0].opt_state) if x.ndim]
    adapters = sum(x.size for x in jax.tree.leaves(lora.trainable(state.params)))
    assert sum(moments) == 2 * adapters  # Adam's two moments of each adapter, no more
    assert _hlo(planned.lower()) == _hlo(own)


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu not installed"
)


@pytest.mark.slow
@needs_libtpu
def test_a_lora_update_on_v5e_holds_the_adapters_moments_not_the_bases():
    """The TPU compiler's argument bytes per chip for the LoRA update lie between the plan's
    LoRA state (parameters, the adapters' moments, the batch; the TPU pads small arrays to
    whole tiles) and what a full fine-tuning update of the same run holds by the plan (all
    moments and a reference copy): the old plan, which compiled that full update for a LoRA
    run, was above it. Its total is within the plan's."""
    from grpo_jax.aot import budget, measure, topology
    from grpo_jax.run import memory

    topology.quiet_libtpu()
    topo = topology.parse_topology("v5e-4")
    mesh = topology.make_mesh(topo, {"data": 1, "fsdp": 4, "tensor": 1}, topology.devices(topo))
    run, full = _run(), _run(rank=0)
    cfg = architectures.resolve(run)[0]
    (program,) = programs.programs(run, cfg, mesh, ["update"])
    measured, _ = measure.compile_program(program)
    assert not measured.error, measured.error
    shape = dict(mesh.shape)
    batch = memory.batch_bytes(memory.run_shapes(run, cfg, shape))
    lo = memory.plan_run(run, cfg, shape, budget_bytes=float("inf"))
    hi = memory.plan_run(full, cfg, shape, budget_bytes=float("inf"))
    assert lo.params + lo.optimizer + lo.reference + batch <= measured.arguments
    assert measured.arguments < hi.params + hi.optimizer + hi.reference + batch
    assert measured.total <= budget.needs(run, cfg, shape)["update"].own


def test_a_lora_updates_useful_flops_leave_out_the_bases_weight_gradient():
    """The MFU's useful FLOPs: with LoRA the frozen base's matmuls run forward and back to
    the activations only, 4 FLOPs per parameter and token where full training takes 6."""
    from grpo_jax.aot import budget

    over = {"grpo.old_logps": "sampler", "train.track_update": False}
    run, full = _run(beta=0.0, **over), _run(rank=0, beta=0.0, **over)  # no scoring pass
    cfg = architectures.resolve(run)[0]
    lora_f, full_f = budget.model_flops(run, cfg, 4), budget.model_flops(full, cfg, 4)
    assert lora_f["update"] == pytest.approx(4 / 6 * full_f["update"])
