"""The memory plan of each program: the terms the compiled programs showed it missed, the
optimizer's bytes against the state's own, and the settings it suggests for a topology."""

import math

import jax
import pytest

from grpo_jax.aot import architectures, budget
from grpo_jax.aot.topology import parse_topology
from grpo_jax.run import memory

GiB = 2**30


def _run(model="qwen2.5-0.5b", **over):
    """The gsm8k recipe, its layers scanned unless ``over`` says (an abstract scanned model
    is made in 0.1 s, an unrolled one in seconds)."""
    from configs import gsm8k
    from grpo_jax.run.config import parse_config

    c = gsm8k.get_config(f"model={model}")
    c.model.scan_layers = True
    for key, value in over.items():
        section, field = key.split(".")
        c[section][field] = value
    run = parse_config(c)
    return run, architectures.resolve(run)[0]


FSDP16 = {"data": 1, "fsdp": 16, "tensor": 1}


def test_the_scoring_pass_holds_the_whole_batchs_rows():
    """A reference pass scores all N rows at once: N / shards per chip, not a micro-batch's."""
    run, cfg = _run()
    sh = memory.run_shapes(run, cfg, FSDP16)
    assert (sh.n_s, sh.C) == (32 * 8 // 16, 64)
    logits = sh.n_s * sh.C * cfg.vocab_size * 4 * 3
    assert memory.scoring_bytes(run, cfg, sh) >= logits
    half, hcfg = _run(**{"train.logits_chunk": 32})
    assert memory.scoring_bytes(half, hcfg, memory.run_shapes(half, hcfg, FSDP16)) < logits
    # No reference, old log-probs as sampled, no pass measuring the update's movement.
    none, ncfg = _run(**{"grpo.beta": 0.0, "train.track_update": False})
    assert memory.scoring_bytes(none, ncfg, memory.run_shapes(none, ncfg, FSDP16)) == 0
    assert "scoring" not in budget.needs(none, ncfg, FSDP16)


def test_a_scanned_model_copies_its_stacked_cache():
    # A chunk of 8 tokens: the cache, not the logits, is the larger.
    run, cfg = _run(**{"train.logits_chunk": 8, "model.scan_layers": False})
    scan, scfg = _run(**{"train.logits_chunk": 8})
    one = memory.scoring_bytes(run, cfg, memory.run_shapes(run, cfg, FSDP16))
    two = memory.scoring_bytes(scan, scfg, memory.run_shapes(scan, scfg, FSDP16))
    sh = memory.run_shapes(run, cfg, FSDP16)
    cache = 2 * cfg.num_layers * sh.n_s * sh.S * cfg.num_kv_heads * cfg.head_dim * sh.c
    assert two - one == cache


def test_sharded_parameters_add_the_heads_gradient_and_gathered_weights():
    """Under fsdp the update holds the LM head's gradient whole (float32) inside the
    logits-chunk loop and gathered layers; the decode loop gathered weights."""
    run, cfg = _run()
    from grpo_jax.run import memory

    dp = {"data": 16, "fsdp": 1, "tensor": 1}
    sharded, whole = budget.needs(run, cfg, FSDP16), budget.needs(run, cfg, dp)
    s_est = memory.plan_run(run, cfg, FSDP16, budget_bytes=math.inf)
    w_est = memory.plan_run(run, cfg, dp, budget_bytes=math.inf)
    assert sharded["update"].own < whole["update"].own  # sharding still saves most
    head = cfg.vocab_size * cfg.hidden_size * (4 + 2 * 2)
    assert sharded["update"].own - (s_est.params + s_est.optimizer + s_est.reference) > head
    # Scanned layers: two layers and the LM head gathered in bfloat16, the stacked cache copied.
    gathered = sharded["decode"].own - whole["decode"].own + (w_est.params - s_est.params)
    assert (
        gathered
        == s_est.kv_cache
        + 2 * (cfg.num_params - cfg.vocab_size * cfg.hidden_size) // (cfg.num_layers) * 2
        + cfg.vocab_size * cfg.hidden_size * 2
    )


def test_the_plans_optimizer_bytes_are_the_states_per_device_bytes():
    """On 8 devices with fsdp 8: the moments laid out as the update's state is (abstract,
    optimizer.opt_state_shardings) against the plan's optimizer term."""
    from grpo_jax.aot.programs import Builder, per_device_bytes
    from grpo_jax.core.sharding import make_mesh
    from grpo_jax.learner import optimizer
    from grpo_jax.run import memory

    run, cfg = _run("gemma3-270m", **{"mesh.data": 1, "mesh.fsdp": 8})
    mesh = make_mesh({"data": 1, "fsdp": 8}, jax.devices()[:8])
    b = Builder(run, cfg, mesh)
    tx, _ = optimizer.make_optimizer(run.optim, 10)
    opt = b.opt_state(tx)
    moments = [x for x in jax.tree.leaves(opt) if x.ndim]
    est = memory.plan_run(run, cfg, dict(mesh.shape), budget_bytes=math.inf)
    assert per_device_bytes(moments) == est.optimizer
    assert per_device_bytes(b.params) == est.params


def test_suggest_finds_settings_that_fit_and_changes_little():
    run, cfg = _run()  # the recipe's default mesh: data parallel over every chip
    topo = parse_topology("v5e-16")
    assert not budget.fits(run, cfg, budget.mesh_shape(run, topo.chips), topo.chip.hbm_limit)[0]
    changed, r, c, mesh = budget.suggest(run, cfg, topo.chips, topo.chip.hbm_limit)
    assert changed == {"mesh.data": 1, "mesh.fsdp": 16}
    assert budget.fits(r, c, mesh, topo.chip.hbm_limit)[0]


def test_suggest_gives_up_on_a_run_nothing_fits():
    run, cfg = _run("qwen2.5-1.5b", **{"train.batch_size": 256})
    topo = parse_topology("v5e-1")
    assert budget.suggest(run, cfg, topo.chips, topo.chip.hbm_limit) is None


@pytest.mark.slow  # two runs' abstract models and plans: about 1.5 s
def test_a_critics_moments_and_head_are_what_the_plan_adds():
    """PPO (grpo.advantage_estimator = "gae"): the abstract state's value head and its moments
    against the plan's params and optimizer terms, as for the policy above."""
    from grpo_jax.aot.programs import Builder, per_device_bytes
    from grpo_jax.core.sharding import make_mesh
    from grpo_jax.learner import optimizer

    run, cfg = _run("gemma3-270m", **{"mesh.data": 1, "mesh.fsdp": 8})
    ppo, _ = _run(
        "gemma3-270m", **{"mesh.data": 1, "mesh.fsdp": 8}, **{"grpo.advantage_estimator": "gae"}
    )
    mesh = make_mesh({"data": 1, "fsdp": 8}, jax.devices()[:8])
    b = Builder(ppo, cfg, mesh)
    tx, _ = optimizer.make_optimizer(ppo.optim, 10)
    head = b.critic()
    moments = [x for x in jax.tree.leaves(b.opt_state(tx, head)) if x.ndim]
    grpo_est = memory.plan_run(run, cfg, dict(mesh.shape), budget_bytes=math.inf)
    est = memory.plan_run(ppo, cfg, dict(mesh.shape), budget_bytes=math.inf)
    head_bytes = per_device_bytes(jax.tree.leaves(head))
    assert head_bytes == 4 * (cfg.hidden_size + 1)
    assert est.params - grpo_est.params == head_bytes
    # The moments of a 0-d leaf (the bias) are dropped above like the optimizer's scalars.
    assert per_device_bytes(moments) + 2 * 4 == est.optimizer


def test_a_mixture_of_experts_flops_count_the_active_parameters():
    """The MFU's useful FLOPs (``budget.model_flops``) of Qwen3-30B-A3B: 2 per active
    parameter and decoded token (its LM head included, the embedding lookup not), a tenth of
    what its 30.5B parameters would give."""
    run, cfg = _run("qwen3-8b,pod", **{"model.path": "Qwen/Qwen3-30B-A3B"})
    assert cfg.num_experts == 128
    chips = 64
    N, T = run.train.batch_size * run.grpo.G, run.sampling.max_new_tokens
    flops = budget.model_flops(run, cfg, chips)
    embed = cfg.vocab_size * cfg.hidden_size
    assert flops["decode"] == 2 * (cfg.active_params - embed) * N * T / chips
    every_expert = budget.model_flops(run, cfg.replace(experts_per_token=128), chips)
    assert 0.09 < flops["update"] / every_expert["update"] < 0.13


def test_suggest_keeps_the_runs_expert_axis():
    """A mixture on expert 8: the chips it leaves go to fsdp, the experts stay split."""
    run, cfg = _run("qwen3-8b,pod", **{"model.path": "Qwen/Qwen3-30B-A3B", "mesh.expert": 8})
    topo = parse_topology("v5p-128")
    changed, r, c, mesh = budget.suggest(run, cfg, topo.chips, topo.chip.hbm_limit)
    assert mesh["expert"] == 8 and mesh["data"] * mesh["fsdp"] * mesh["tensor"] == 8
    assert "mesh.expert" not in changed and r.mesh.expert == 8
    assert budget.fits(r, c, mesh, topo.chip.hbm_limit)[0]
