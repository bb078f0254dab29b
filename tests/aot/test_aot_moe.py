"""The plan command on a mixture of experts with an expert mesh axis (docs/moe.md, docs/pods.md):
a tiny MoE's programs compiled for v5e:2x2 (4 chips) as expert 2 x fsdp 2, its experts' bytes
per chip split over the expert axis by XLA's own count (libtpu; the slow tier), and the
meshes the command refuses in one line (no libtpu needed).
"""

import importlib.util
import io
import json
import math

import pytest

from grpo_jax import plan
from grpo_jax.aot import programs, topology

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu not installed"
)


def _config(**over):
    """The CPU default's `moe` variant made smaller to compile: 2 layers, all sparse (4
    experts, top 2), widths that fill the TPU's (8, 128) tiles of an expert weight's shard
    (so that XLA's bytes are the arrays' own, no padding), B 8 x G 4, on expert 2 x fsdp 2."""
    from configs import default

    c = default.get_config("moe")
    c.model.num_layers, c.model.hidden_size, c.model.moe_mlp_dim = 2, 256, 128
    c.train.batch_size, c.grpo.G = 8, 4
    c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, 2, 2
    for key, value in over.items():
        section, field = key.split(".")
        c[section][field] = value
    return c


def _plan(config, **opts):
    out, err = io.StringIO(), io.StringIO()
    status = plan.plan(config, plan.Options(**opts), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture
def nothing_compiles(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a program was built")

    monkeypatch.setattr(programs, "programs", refuse)
    monkeypatch.setattr(topology, "devices", refuse)


@pytest.mark.parametrize(
    "over, says",
    [
        (  # 2 x 4 x 1 x 2 = 16 devices on a 4-chip slice
            {"mesh.fsdp": 4},
            "config error: config section 'mesh' = {'data': 1, 'fsdp': 4, 'tensor': 1, "
            "'expert': 2} does not lay out the topology's 4 chips",
        ),
        (
            {"mesh.expert": 4, "mesh.fsdp": 1, "model.num_experts": 6},
            "config error: config key 'mesh.expert' = 4 must divide the model's "
            "num_experts = 6 (the built-in tiny model)",
        ),
        (
            {"model.num_experts": 0, "model.experts_per_token": 0},
            "config error: config key 'mesh.expert' = 2 needs a mixture-of-experts model; "
            "the built-in tiny model is dense (num_experts = 0): set mesh.expert = 1",
        ),
    ],
)
def test_meshes_the_experts_or_the_chips_do_not_take_are_one_line(over, says, nothing_compiles):
    status, out, err = _plan(_config(**over), topology="v5e-4")
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(says)


def test_the_plan_shows_the_expert_axis_and_the_active_parameters(nothing_compiles):
    status, out, err = _plan(_config(), topology="v5e-4", plan_only=True)
    assert status == 0 and err == ""
    header, _, model = out.splitlines()[:3]
    assert header.endswith("mesh {'data': 1, 'fsdp': 2, 'tensor': 1, 'expert': 2}")
    assert "parameters (" in model and "active: 2 of 4 experts per token in 2 layers)" in model


def test_a_qwen3_moe_tiny_checkpoint_is_planned_without_writing_it(nothing_compiles, tmp_path):
    """model.path "tiny:qwen3_moe": the sizes of the checkpoint a run would make, none made."""
    from configs import default

    c = default.get_config()
    c.model = {"path": "tiny:qwen3_moe"}
    c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, 2, 2
    status, out, err = _plan(c, topology="v5e-4", plan_only=True)
    assert status == 0 and err == ""
    assert "model: tiny:qwen3_moe (a tiny random qwen3_moe checkpoint)" in out
    assert "2 of 4 experts per token" in out


@pytest.mark.slow
@needs_libtpu
def test_a_tiny_moe_on_an_expert_axis_compiles_every_program(tmp_path):
    """expert 2 x fsdp 2 on v5e:2x2: the update, the scoring pass, the prefill and the decode
    loop compile for the TPU, each within the chip (exit status 0), on a mesh with the axis."""
    status, out, err = _plan(_config(), topology="v5e-4", json=str(tmp_path / "p.json"))
    assert status == 0, err
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 2}
    rows = {r["program"]: r for r in record["programs"]}
    assert set(rows) == {"update", "scoring", "prefill", "decode"}
    assert all(not r["error"] and r["xla_total"] > 0 for r in rows.values())
    # XLA's grouped matmuls are TPU kernels of their own: 3 per sparse layer and the kernel
    # of their groups' metadata. The FLOPs counted in them (hlo_costs) make each program do
    # at least the model's own FLOPs (the active parameters'); without them the prefill
    # counted half of those.
    assert rows["prefill"]["kernels"] == 2 * (3 + 1)
    assert all(r["flops"] >= r["model_flops"] > 0 for r in rows.values())


@pytest.mark.slow
@needs_libtpu
def test_the_paged_engines_programs_compile_on_an_expert_axis(tmp_path):
    """The paged engine's prefill chunk and decode step on expert 2 x fsdp 2, its Pallas
    decode kernel (under shard_map) beside the grouped matmuls' kernels."""
    over = {"sampling.engine": "paged", "model.attention": "splash"}
    names = ("paged_prefill", "paged_decode")
    status, _, err = _plan(
        _config(**over), topology="v5e-4", programs=names, json=str(tmp_path / "p.json")
    )
    assert status == 0, err
    rows = {r["program"]: r for r in json.loads((tmp_path / "p.json").read_text())["programs"]}
    assert set(rows) == set(names)
    assert not any(r["error"] for r in rows.values())
    assert rows["paged_decode"]["kernels"] == 2 * (3 + 1) + 2  # one attention kernel a layer


@pytest.mark.slow
@needs_libtpu
def test_xla_holds_1_over_expert_of_the_experts_weights_per_chip():
    """The prefill's arguments per chip (XLA's count) on expert 2 x fsdp 2 against the same
    program on tensor 2 x fsdp 2 under the fsdp layout (the tensor axis splits nothing there,
    so every other argument is the same): the difference is what the expert axis saves, half
    of the experts' bytes that fsdp alone leaves on a chip. Without the axis it would be 0."""
    from grpo_jax.aot import architectures, measure
    from grpo_jax.models.param_tensors import param_tensors
    from grpo_jax.run.config import parse_config

    run = parse_config(_config())
    cfg = architectures.resolve(run)[0]
    topology.quiet_libtpu()
    topo = topology.parse_topology("v5e-4")
    devices = topology.devices(topo)
    args = {}
    for name, axes in [
        ("expert", {"data": 1, "fsdp": 2, "tensor": 1, "expert": 2}),
        ("no expert", {"data": 1, "fsdp": 2, "tensor": 2}),
    ]:
        mesh = topology.make_mesh(topo, axes, devices)
        (program,) = programs.programs(run, cfg, mesh, ["prefill"])
        measured, _ = measure.compile_program(program)
        assert not measured.error, measured.error
        args[name] = measured.arguments
    experts = sum(
        math.prod(shape) * 4  # float32 parameters
        for path, shape, _, axes in param_tensors(cfg)
        if "experts" in axes
    )
    assert experts > 0.5 * cfg.num_params * 4  # most of the model: the check has teeth
    fsdp_only = experts / 2  # a chip's share under fsdp 2 alone
    assert args["no expert"] - args["expert"] == pytest.approx(fsdp_only / 2, rel=0.02)


@pytest.mark.slow
@needs_libtpu
def test_over_several_slices_the_expert_axis_stays_inside_each():
    """2 x v5e-4: data spans the slices, and each slice's 4 chips hold fsdp 2 x expert 2."""
    import numpy as np

    topology.quiet_libtpu()
    topo = topology.parse_topology("2xv5e-4")
    mesh = topology.make_mesh(
        topo, {"data": 2, "fsdp": 2, "tensor": 1, "expert": 2}, topology.devices(topo)
    )
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 1, "expert": 2}
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert [set(slices[i].ravel()) for i in range(2)] == [{0}, {1}]
