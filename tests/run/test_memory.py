"""Memory planning: hand-computed numbers, parity with the real model's shards, refusals."""

import dataclasses
import math
import types

import jax
import pytest
from flax import nnx
from helpers_config import run_config

from grpo_jax.run import memory

# V=10, D=4, L=1, H=2, K=1, Dh=2, F=6, tied embeddings. Parameters:
# embed 40; norms 2*4; q 4*2*2=16; k 8; v 8; o 16; gate/up/down 3*24; final norm 4.
HAND = types.SimpleNamespace(
    vocab_size=10,
    hidden_size=4,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    mlp_dim=6,
    tie_embeddings=True,
)
KW = dict(batch_rows=4, seq_len=5, prompt_len=3)  # S = 8
# A mixture of 8 experts of width 24, top 2, in every layer (docs/moe.md).
MOE_FIELDS = dict(num_experts=8, experts_per_token=2, moe_mlp_dim=24)


def test_param_count_by_hand():
    assert memory.param_count(HAND) == 40 + 8 + 16 + 8 + 8 + 16 + 72 + 4
    untied = types.SimpleNamespace(**{**vars(HAND), "tie_embeddings": False})
    assert memory.param_count(untied) == 172 + 40


def test_params_per_layout_by_hand():
    dp = memory.estimate(HAND, mesh_shape={"data": 2}, layout="dp", beta=0.0, **KW)
    assert dp.params == 172 * 4
    # fsdp=2 splits D: embed 20, q 8, k 4, v 4, o 8, mlp 36; norms (12) stay whole.
    fsdp = memory.estimate(HAND, mesh_shape={"fsdp": 2}, layout="fsdp", beta=0.0, **KW)
    assert fsdp.params == (20 + 8 + 4 + 4 + 8 + 36 + 12) * 4
    # fsdp=2, tensor=2: embed 40/4; q (2,1,2); K=1 is not split: k, v (2,1,2); o (1,2,2);
    # gate/up/down 2*3 each; norms 12.
    tp = memory.estimate(
        HAND, mesh_shape={"fsdp": 2, "tensor": 2}, layout="fsdp_tp", beta=0.0, **KW
    )
    assert tp.params == (10 + 4 + 4 + 4 + 4 + 18 + 12) * 4
    assert tp.grads == tp.params
    assert tp.optimizer == 2 * tp.params
    assert tp.reference == 0
    sgd = memory.estimate(
        HAND, mesh_shape={"fsdp": 2}, layout="fsdp", beta=0.1, optimizer="sgd", **KW
    )
    assert sgd.optimizer == 0
    assert sgd.reference == sgd.params


def test_kv_cache_activations_and_total_by_hand():
    est = memory.estimate(
        HAND, mesh_shape={"fsdp": 2, "tensor": 2}, layout="fsdp_tp", beta=0.04, **KW
    )
    # 2 (k, v) * L * (4 rows / 2 shards) * S=8 * K=1 (not split) * Dh=2 * 4 bytes.
    assert est.kv_cache == 2 * 1 * 2 * 8 * 1 * 2 * 4
    # Per layer and token: 4 * (6*4 + 2*1*2 + 2*1*2 + 4*6/2) + (4 + 4) * (2/2) * 8 = 240;
    # 2 rows * 8 tokens; logits 8 * 10/2 = 40 per scored token: the T = 5 completion tokens.
    assert est.activations == 2 * 8 * 240 + 2 * 5 * 40
    remat = memory.estimate(
        HAND,
        mesh_shape={"fsdp": 2, "tensor": 2},
        layout="fsdp_tp",
        beta=0.04,
        remat=True,
        **KW,
    )
    assert remat.activations == 2 * 8 * (1 * 4 * 4 + 240) + 2 * 5 * 40
    # Scoring one completion token at a time keeps one token's logits.
    chunked = memory.estimate(
        HAND, mesh_shape={"fsdp": 2, "tensor": 2}, layout="fsdp_tp", beta=0.04,
        logits_chunk=1, **KW,
    )  # fmt: skip
    assert chunked.activations == 2 * 8 * 240 + 2 * 1 * 40
    p = 56 * 4
    assert (est.params, est.optimizer, est.reference) == (p, 2 * p, p)
    assert est.training == p + 2 * p + p + p + 4240
    assert est.sampling == p + 2 * p + p + 256
    assert est.total == est.training == 5360
    assert est.biggest() == "activations"
    # A sampling batch bigger than the training batch moves the peak to sampling.
    big = memory.estimate(
        HAND,
        mesh_shape={"fsdp": 2, "tensor": 2},
        layout="fsdp_tp",
        beta=0.04,
        sample_rows=400,
        **KW,
    )
    assert big.kv_cache == 100 * 256
    assert big.total == big.sampling == 4 * p + 25600


# HAND with two layers, the second a mixture of 4 experts of width 3, top 2. Parameters:
# embed 40; layer 0 (dense) norms 8, attention 48, MLP 72; layer 1 norms 8, attention 48,
# router 4*4, experts 3 * 4*4*3 = 144; final norm 4.
HAND_MOE = types.SimpleNamespace(
    **{**vars(HAND), "num_layers": 2},
    num_experts=4,
    experts_per_token=2,
    moe_mlp_dim=3,
    mlp_only_layers=(0,),
)


def test_a_mixture_of_experts_by_hand():
    assert memory.param_count(HAND_MOE) == 40 + (8 + 48 + 72) + (8 + 48 + 16 + 144) + 4 == 388
    mesh = {"fsdp": 2, "expert": 2}
    est = memory.estimate(HAND_MOE, mesh_shape=mesh, layout="fsdp", beta=0.0, **KW)
    # fsdp=2 splits D: embed 20, attention 24 a layer, MLP 36, router [D, E] 8; the experts
    # [E, D, F] / [E, F, D] split over expert and fsdp, 3 * 2*2*3 = 36; norms (20) whole.
    assert est.params == (20 + (24 + 36) + (24 + 8 + 36) + 20) * 4
    no_expert_axis = memory.estimate(
        HAND_MOE, mesh_shape={"fsdp": 2}, layout="fsdp", beta=0.0, **KW
    )
    assert no_expert_axis.params == est.params + 36 * 4  # the experts whole on each device
    assert est.optimizer == 2 * est.params and est.grads == est.params
    # Per token, 4 bytes each: a layer's norms and attention 4*(6*4 + 2*2*2 + 2*1*2) and
    # its scores (4 + 4) * H * S = 128: 272; the dense MLP 4 * 4*6 = 96; the sparse layer's
    # router (4 + 4) * E = 32 and K = 2 pairs of 2 rows of D and 6 of F: 4*2*(8 + 18) = 208.
    # 2 rows * S = 8 tokens on a device; logits 2 * 5 * 8 * 10.
    assert est.activations == 2 * 8 * (2 * 272 + 96 + 32 + 208) + 2 * 5 * 8 * 10
    remat = memory.estimate(
        HAND_MOE, mesh_shape=mesh, layout="fsdp", beta=0.0, remat=True, **KW
    )  # the layers' inputs, one layer recomputed: the sparse one, the larger
    assert remat.activations == 2 * 8 * (2 * 4 * 4 + 272 + 240) + 2 * 5 * 8 * 10
    assert "expert=2" in est.table() and "expert" not in no_expert_axis.table()


def test_half_precision_bytes():
    est = memory.estimate(
        HAND,
        mesh_shape={"data": 1},
        layout="dp",
        beta=0.0,
        param_bytes=2,
        compute_bytes=2,
        **KW,
    )
    assert est.params == 172 * 2
    assert est.kv_cache == 2 * 1 * 4 * 8 * 1 * 2 * 2


def test_table_lists_every_component():
    est = memory.estimate(HAND, mesh_shape={"fsdp": 2}, layout="fsdp", beta=0.04, **KW)
    table = est.table()
    for word in (
        "layout 'fsdp'",
        "fsdp=2",
        "parameters",
        "optimizer state",
        "KV cache",
        "activations",
        "reference parameters",
        "total (peak)",
        "172 parameters",
    ):
        assert word in table
    assert memory.format_bytes(1536) == "1.50 KiB"
    assert memory.format_bytes(3 * 2**30) == "3.00 GiB"
    assert memory.format_bytes(12) == "12 B"


def test_budget_refuses_with_layout_total_budget_and_hint():
    big = types.SimpleNamespace(**{**vars(HAND), "vocab_size": 50_000, "hidden_size": 1024})
    est = memory.estimate(big, mesh_shape={"data": 8}, layout="dp", beta=0.0, **KW)
    assert est.biggest() == "optimizer"
    memory.check_budget(est, est.total)  # exactly at the budget fits
    with pytest.raises(memory.MemoryBudgetError) as e:
        memory.check_budget(est, est.total - 1)
    msg = str(e.value)
    assert "layout 'dp'" in msg
    assert memory.format_bytes(est.total) in msg
    assert "over the budget of" in msg
    assert "biggest part is optimizer state" in msg
    assert "use layout fsdp" in msg

    fsdp = memory.estimate(big, mesh_shape={"fsdp": 8}, layout="fsdp", beta=0.0, **KW)
    assert fsdp.total < est.total
    with pytest.raises(memory.MemoryBudgetError, match="use more fsdp devices"):
        memory.check_budget(fsdp, 1024)

    act = memory.estimate(HAND, mesh_shape={"fsdp": 2}, layout="fsdp", beta=0.0, **KW)
    with pytest.raises(memory.MemoryBudgetError, match="biggest part is activations.*remat"):
        memory.check_budget(act, 100)
    with pytest.raises(ValueError, match="budget = 0 bytes must be positive"):
        memory.check_budget(act, 0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown sharding layout 'zero3'"):
        memory.estimate(HAND, mesh_shape={}, layout="zero3", beta=0.0, **KW)
    with pytest.raises(ValueError, match=r"unknown mesh axes \['pipe'\]"):
        memory.estimate(HAND, mesh_shape={"pipe": 2}, layout="dp", beta=0.0, **KW)
    with pytest.raises(ValueError, match=r"mesh_shape\['data'\] = -1 must be an integer >= 1"):
        memory.estimate(HAND, mesh_shape={"data": -1}, layout="dp", beta=0.0, **KW)
    with pytest.raises(ValueError, match="unknown optimizer 'adagrad'"):
        memory.estimate(HAND, mesh_shape={}, layout="dp", beta=0.0, optimizer="adagrad", **KW)
    with pytest.raises(ValueError, match="batch_rows = 0 must be an integer >= 1"):
        memory.estimate(
            HAND, mesh_shape={}, layout="dp", beta=0.0, batch_rows=0, seq_len=5, prompt_len=3
        )
    with pytest.raises(ValueError, match="beta = -1.0 must be >= 0"):
        memory.estimate(HAND, mesh_shape={}, layout="dp", beta=-1.0, **KW)
    with pytest.raises(TypeError, match=r"Namespace lacks \['mlp_dim'\]"):
        partial = types.SimpleNamespace(**{k: v for k, v in vars(HAND).items() if k != "mlp_dim"})
        memory.param_count(partial)


@pytest.mark.parametrize(
    "family,layout,axes,materialise",
    [
        ("qwen2", "dp", {"data": 8}, False),
        ("qwen2", "fsdp", {"fsdp": 8}, False),
        ("qwen2", "fsdp_tp", {"fsdp": 2, "tensor": 4}, True),
        ("gemma3", "fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}, False),
        ("llama", "fsdp", {"data": 2, "fsdp": 4}, False),
        ("qwen3_moe", "fsdp", {"expert": 4, "fsdp": 2}, True),
        ("qwen3_moe", "fsdp_tp", {"expert": 2, "fsdp": 2, "tensor": 2}, False),
    ],
)
def test_matches_the_real_models_shards(family, layout, axes, materialise):
    """Parameter count and one device's parameter and KV-cache bytes equal the model's.

    The model's own shardings (``param_shardings``, ``cache_shardings``) on
    its abstract state give each device's shard shape; one case also builds
    the sharded model and sums the bytes that really sit on the first device.
    """
    from grpo_jax.core.sharding import make_mesh
    from grpo_jax.models import Transformer, cache_shardings, param_shardings, tiny_config

    cfg = tiny_config(
        vocab_size=96,
        family=family,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        tie_embeddings=family == "gemma3",
        mlp_bias=family == "llama",
        **(MOE_FIELDS if family == "qwen3_moe" else {}),
    )
    mesh = make_mesh(axes)
    est = memory.estimate(
        cfg,
        mesh_shape=dict(mesh.shape),
        layout=layout,
        beta=0.0,
        batch_rows=8,
        seq_len=6,
        prompt_len=2,
    )
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), layout=layout))
    state = nnx.state(model, nnx.Param)
    shapes = jax.tree.leaves(state)
    shardings = jax.tree.leaves(param_shardings(state, mesh, layout))
    assert est.num_params == sum(x.size for x in shapes) == cfg.num_params

    def shard_bytes(x, sharding):
        return math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize

    assert est.params == sum(shard_bytes(x, s) for x, s in zip(shapes, shardings))
    cache = jax.eval_shape(lambda: model.init_cache(8, 8))
    cache_sh = cache_shardings(cache, mesh, layout)
    assert est.kv_cache == sum(
        shard_bytes(x, s) for x, s in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_sh))
    )
    if materialise:
        from grpo_jax.models import create_model

        real = jax.tree.leaves(nnx.state(create_model(cfg, mesh=mesh, layout=layout), nnx.Param))
        device = mesh.devices.flat[0]
        on_device = sum(
            s.data.nbytes for x in real for s in x.addressable_shards if s.device == device
        )
        assert est.params == on_device


def test_plan_reads_dtypes_and_checks_the_budget():
    from grpo_jax.models import tiny_config

    cfg = tiny_config(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=48, param_dtype="bfloat16", dtype="bfloat16",
                      remat=True)  # fmt: skip
    kw = dict(mesh_shape={"fsdp": 2}, layout="fsdp", beta=0.0, **KW)
    est = memory.plan(cfg, **kw)  # CPU reports no limit: nothing is checked
    same = memory.estimate(cfg, param_bytes=2, compute_bytes=2, remat=True, **kw)
    assert est == same
    assert est.params == 2 * memory.estimate(cfg, **kw).params // 4
    with pytest.raises(memory.MemoryBudgetError, match="layout 'fsdp'"):
        memory.plan(cfg, budget_bytes=1000, **kw)
    assert memory.device_memory_bytes() is None  # CPU devices report no limit


def test_plan_run_takes_rows_and_lengths_from_the_run():
    from grpo_jax.run import config

    plan = {
        "grpo.G": 4,
        "grpo.beta": 0.04,
        "train.batch_size": 8,
        "train.minibatch_size": 16,
        "optim.grad_accum": 2,
        "sampling.max_new_tokens": 5,
        "sampling.prompt_buckets": (2, 3),
        "eval.batch_size": 64,
        "mesh.layout": "fsdp_tp",
        "warm_start.enabled": False,
        "warm_start.batch_size": 100,
    }
    run = run_config(**plan)
    mesh = {"fsdp": 2, "tensor": 2}
    est = memory.plan_run(run, HAND, mesh)
    # 16 rows per update / 2 accumulation steps = 8; sampler: max(8 * 4, 64) = 64 rows.
    want = memory.estimate(HAND, mesh_shape=mesh, layout="fsdp_tp", beta=0.04, batch_rows=8,
                           sample_rows=64, seq_len=5, prompt_len=3)  # fmt: skip
    # The run's own terms beside the model's (tests/aot/test_aot_budget.py).
    assert est.update_buffers and est.scoring and est.gathered
    assert dataclasses.replace(est, update_buffers=0, scoring=0, gathered=0) == want
    run = run_config(**{**plan, "warm_start.enabled": True})  # its batch: the training rows
    assert memory.plan_run(run, HAND, mesh).activations == memory.estimate(
        HAND, mesh_shape=mesh, layout="fsdp_tp", beta=0.04, batch_rows=100, seq_len=5,
        prompt_len=3,
    ).activations  # fmt: skip
    with pytest.raises(config.ConfigError, match="layout 'fsdp_tp'.*over the budget"):
        memory.plan_run(run, HAND, mesh, budget_bytes=1024)


def test_with_an_environment_rows_are_as_long_as_the_transcript():
    """An episode's row holds env.max_tokens transcript slots, not sampling.max_new_tokens:
    the plan of an env run is the plan of a single-turn run with completions that long."""
    common = {"sampling.prompt_buckets": (4,), "warm_start.enabled": False, "grpo.beta": 0.04}
    env = run_config(**common, **{"env.name": "guess_number", "env.max_tokens": 24,
                                  "sampling.max_new_tokens": 8})  # fmt: skip
    plain = run_config(**common, **{"sampling.max_new_tokens": 24})
    assert env.completion_slots == (24, "env.max_tokens")
    assert plain.completion_slots == (24, "sampling.max_new_tokens")
    mesh = {"fsdp": 2}
    assert memory.plan_run(env, HAND, mesh) == memory.plan_run(plain, HAND, mesh)
    shorter = run_config(**common, **{"sampling.max_new_tokens": 8})
    assert (
        memory.plan_run(env, HAND, mesh).activations
        > memory.plan_run(shorter, HAND, mesh).activations
    )


def test_a_stated_budget_in_the_run_config_refuses_the_run_at_start_up(tmp_path):
    """--config.mesh.memory_budget_gb stops an oversized layout before anything trains."""
    from configs.default import get_config
    from grpo_jax.run import config, train

    c = get_config("smoke")
    c.mesh.memory_budget_gb = 1e-6  # about 1 KiB: nothing fits
    with pytest.raises(config.ConfigError, match=r"layout 'fsdp'.*over the budget of"):
        train.train(c, str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_plan_sampler_is_a_whole_copy_of_the_parameters_and_the_kv_cache_of_its_rows():
    """``plan_sampler``: mesh.sampler_devices = 4 of 8 (grpo_jax.rollout.staleness's split mesh)."""
    from configs.default import get_config
    from grpo_jax.run import builders, config

    c = get_config("smoke")  # B = 4, G = 4, prompt buckets up to 32, 6 new tokens
    c.mesh.num_devices, c.mesh.sampler_devices, c.train.max_staleness = 8, 4, 1
    c.mesh.data, c.mesh.fsdp = 1, -1  # the learner: fsdp 4 on devices 4-7
    c.grpo.beta = 0.04  # the learner holds a reference, the sampler does not
    c.eval.batch_size = 64  # evaluation runs on the learner mesh: more rows there
    run = config.parse_config(c)
    sampler_mesh = dict(builders.build_sampler_mesh(run).shape)
    learner_mesh = dict(builders.build_mesh(run).shape)
    assert sampler_mesh == {"data": 4, "fsdp": 1, "tensor": 1}
    assert learner_mesh == {"data": 1, "fsdp": 4, "tensor": 1}

    est = memory.plan_sampler(run, HAND, sampler_mesh)
    # The whole model on each sampler device, float32: 172 parameters (test_param_count_by_hand).
    assert est.params == 172 * 4 == memory.param_count(HAND) * 4
    assert (est.grads, est.optimizer, est.reference, est.activations) == (0, 0, 0, 0)
    # KV cache of the step's B * G = 16 rows over 4 sampler devices, S = 32 + 6 slots:
    # 2 (k, v) * L=1 * 4 rows * 38 * K=1 * Dh=2 * 4 bytes.
    assert est.kv_cache == 2 * 1 * 4 * 38 * 1 * 2 * 4 == 2432
    assert est.total == est.sampling == 688 + 2432
    memory.plan_sampler(run, HAND, sampler_mesh, budget_bytes=688 + 2432)  # fits exactly
    with pytest.raises(memory.MemoryBudgetError, match="over the budget"):
        memory.plan_sampler(run, HAND, sampler_mesh, budget_bytes=688 + 2431)

    # The learner's own plan: fsdp 4 splits D = 4 (embed 10, q 4, k 2, v 2, o 4, MLP 18; the
    # norms, 12, stay whole), with its gradients, Adam moments and reference, and the KV
    # cache of max(16, 64) = 64 evaluation rows over 4 shards.
    learner = memory.plan_run(run, HAND, learner_mesh)
    p = (10 + 4 + 2 + 2 + 4 + 18 + 12) * 4
    assert (learner.params, learner.grads, learner.optimizer, learner.reference) == (
        p, p, 2 * p, p,
    )  # fmt: skip
    assert learner.kv_cache == 2 * 1 * 16 * 38 * 1 * 2 * 4
    assert learner.activations > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "qwen3_moe"])
@pytest.mark.slow
def test_activations_match_what_jax_saves_for_the_backward_pass(family):
    """The activation term against the tensors JAX keeps for the gradient.

    ``saved_residuals`` lists them (reshapes are views in XLA and counted once;
    parameters are not activations). Without remat the estimate must cover
    them with at most 30% to spare; with remat JAX keeps each layer's input and
    the logits, and the estimate is that plus the one layer recomputed at a
    time. (XLA:CPU's own memory analysis does not reflect remat, so the
    saved set is the backend-independent measure.)
    """
    import jax.numpy as jnp
    from jax._src.ad_checkpoint import saved_residuals

    from grpo_jax.models import Transformer, tiny_config
    from grpo_jax.objective import losses

    n, S, V = 4, 48, 256
    found, est = {}, {}
    for remat in (False, True):
        cfg = tiny_config(vocab_size=V, family=family, hidden_size=64, num_layers=3,
                          num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=160,
                          remat=remat, **(MOE_FIELDS if family == "qwen3_moe" else {}))  # fmt: skip
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        tokens = jnp.zeros((n, S), jnp.int32)

        def loss(p, graphdef=graphdef, tokens=tokens):
            return losses.per_token_logps(nnx.merge(graphdef, p)(tokens), tokens).sum()

        found[remat] = sum(
            math.prod(aval.shape) * aval.dtype.itemsize
            for aval, why in saved_residuals(loss, params)
            if not any(w in why for w in ("argument", "output of reshape", "literal"))
        )
        est[remat] = memory.estimate(cfg, mesh_shape={"data": 1}, layout="dp", beta=0.0,
                                     batch_rows=n, seq_len=S, prompt_len=0,
                                     remat=remat).activations  # fmt: skip
    assert found[False] <= est[False] <= 1.3 * found[False]
    one_layer = (est[False] - 8 * V * n * S) / 3
    assert found[True] == pytest.approx(est[True] - one_layer, rel=0.1)
    assert found[True] < found[False] / 2


@pytest.mark.slow
def test_the_documented_qwen_memory_tables_are_what_the_script_prints():
    """README.md and docs/lora.md quote benchmarks/memory_plans.py's tables row for row."""
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import memory_plans
    finally:
        sys.path.remove(str(root / "benchmarks"))
    readme = (root / "README.md").read_text()
    lora_doc = (root / "docs" / "lora.md").read_text()
    for placement in memory_plans.PLACEMENTS:
        rows = memory_plans.table(placement)[2:]
        assert len(rows) == 6
        assert "\n".join(rows) in lora_doc, placement
    assert "\n".join(memory_plans.table("16 fsdp devices, 128 rows")[2:]) in readme


def test_the_sampling_copy_is_counted_while_sampling_with_its_kv_cache_in_its_dtype():
    """sampling.param_dtype = "bfloat16" on the float32 HAND model (172 parameters)."""

    def run_with(param_dtype):
        return run_config(
            **{
                "grpo.G": 4,
                "grpo.beta": 0.0,
                "train.batch_size": 2,
                "train.minibatch_size": 0,
                "optim.grad_accum": 1,
                "sampling.max_new_tokens": 5,
                "sampling.prompt_buckets": (3,),
                "sampling.param_dtype": param_dtype,
                "eval.batch_size": 2,
                "mesh.layout": "dp",
                "warm_start.enabled": False,
            }
        )

    mesh = {"data": 1}
    plain, est = (
        memory.plan_run(run_with(""), HAND, mesh),
        memory.plan_run(run_with("bfloat16"), HAND, mesh),
    )
    assert (plain.sampler_copy, est.sampler_copy) == (0, 172 * 2)
    # KV cache, S = 3 + 5 = 8 slots, L = 1, K = 1, Dh = 2: the 8 rollout rows in bfloat16
    # (2 * 8 * 8 * 2 * 2 = 512) outweigh the 2 evaluation rows, which use the float32
    # parameters (2 * 2 * 8 * 2 * 4 = 256); without the copy, 8 rows in float32.
    assert (plain.kv_cache, est.kv_cache) == (2 * 8 * 8 * 2 * 4, 512)
    assert est.sampling == plain.sampling - 1024 + 512 + 344
    assert est.training == plain.training  # the copy is dropped after the round
    assert "sampling copy" in est.table()
    memory.plan_run(run_with("bfloat16"), HAND, mesh, budget_bytes=est.total)  # fits exactly
    with pytest.raises(memory.MemoryBudgetError):
        memory.plan_run(run_with("bfloat16"), HAND, mesh, budget_bytes=est.total - 1)
    # A model already in bfloat16 is sampled as it is: no copy.
    bf16 = types.SimpleNamespace(**vars(HAND), dtype="bfloat16", param_dtype="bfloat16")
    assert memory.plan_run(run_with("bfloat16"), bf16, mesh).sampler_copy == 0
    # A sampler mesh of its own holds the copy alone, and the rollouts' cache.
    split = memory.plan_sampler(run_with("bfloat16"), HAND, mesh)
    assert (split.params, split.sampler_copy, split.kv_cache) == (344, 0, 512)


def test_a_critic_adds_its_head_moments_and_targets():
    # PPO's value head on HAND (D = 4): 5 float32 numbers as parameters, as gradients and
    # twice as Adam's moments; its targets are 4 float32 per token of the batch's rows on a
    # device: N = 8 * 4 = 32 rows over fsdp 2 -> 16, T = 5: 16 * 5 * 16 = 1280 bytes. The
    # old values are scored once per step over the whole batch, a scoring pass like pi_old's
    # recomputed log-probs.
    plan = {"grpo.G": 4, "train.batch_size": 8, "sampling.max_new_tokens": 5}
    plan.update({"sampling.prompt_buckets": (3,), "warm_start.enabled": False})
    plan["train.track_update"] = False  # no other scoring pass
    mesh = {"fsdp": 2}
    grpo = memory.plan_run(run_config(**plan), HAND, mesh)
    ppo = memory.plan_run(run_config(**plan, **{"grpo.advantage_estimator": "gae"}), HAND, mesh)
    assert (ppo.params - grpo.params, ppo.grads - grpo.grads) == (20, 20)
    assert ppo.optimizer - grpo.optimizer == 40
    assert ppo.update_buffers - grpo.update_buffers == 1280
    recompute = memory.plan_run(run_config(**plan, **{"grpo.old_logps": "recompute"}), HAND, mesh)
    assert grpo.scoring == 0 and ppo.scoring == recompute.scoring > 0
    assert (ppo.activations, ppo.kv_cache) == (grpo.activations, grpo.kv_cache)


def test_routing_replay_counts_the_recorded_routes():
    # HAND's one layer made a mixture of 8 experts, top 2 (R = 1 sparse layer, K = 2). The
    # routes are [N, P + T, R, K] in int8: N = 8 * 4 = 32 rows over fsdp 2 -> 16, P + T =
    # 3 + 5 = 8: 16 * 8 * 1 * 2 = 256 bytes, held while sampling and while updating. Past
    # 127 experts they are int16. The own-routing pass of the moe/* metrics is a scoring pass.
    moe = types.SimpleNamespace(**{**vars(HAND), **MOE_FIELDS})
    plan = {"grpo.G": 4, "train.batch_size": 8, "sampling.max_new_tokens": 5}
    plan.update({"sampling.prompt_buckets": (3,), "warm_start.enabled": False})
    plan["train.track_update"] = False  # no other scoring pass
    mesh = {"fsdp": 2}
    off = memory.plan_run(run_config(**plan), moe, mesh)
    on = memory.plan_run(run_config(**plan, **{"grpo.router_replay": "rollout"}), moe, mesh)
    assert (off.routes, on.routes) == (0, 256)
    assert off.scoring == 0 < on.scoring
    assert on.sampling - off.sampling == 256
    assert on.training == dataclasses.replace(on, routes=0).training + 256
    assert "recorded routes" in on.table() and "recorded routes" not in off.table()
    wide = types.SimpleNamespace(**{**vars(moe), "num_experts": 128})
    run = run_config(**plan, **{"grpo.router_replay": "rollout"})
    assert memory.plan_run(run, wide, mesh).routes == 512
    assert memory.plan_run(run, HAND, mesh).routes == 0  # a dense model records none
    # The paged engine writes them on the host and returns the same [N, P + T, R, K] array:
    # the same bytes on the device, none in its pool or its programs' buffers.
    engine = {"sampling.engine": "paged", "sampling.page_size": 4}
    paged = run_config(**plan, **engine, **{"grpo.router_replay": "rollout"})
    paged_off = run_config(**plan, **engine)
    on_p, off_p = memory.plan_run(paged, moe, mesh), memory.plan_run(paged_off, moe, mesh)
    assert (off_p.routes, on_p.routes) == (0, 256)
    assert on_p.kv_cache == off_p.kv_cache and on_p.sampling - off_p.sampling == 256
