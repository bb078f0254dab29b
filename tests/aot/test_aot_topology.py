"""TPU slice names as users say them, the chips' figures, libtpu's absence and environment."""

import importlib.util

import pytest

from grpo_jax.aot import topology
from grpo_jax.core.errors import ConfigError


@pytest.mark.parametrize(
    "name, topology_name, chip_config, chips, kind",
    [
        ("v4-8", "v4:2x2x1", "megacore", 4, "TPU v4"),  # v4-N counts TensorCores
        ("v5e-1", "v5e:1x1", "default", 1, "TPU v5 lite"),
        ("v5e-16", "v5e:4x4", "default", 16, "TPU v5 lite"),
        ("v5litepod-16", "v5e:4x4", "default", 16, "TPU v5 lite"),
        ("v5p-64", "v5:2x4x4", "megacore", 32, "TPU v5"),
        ("v5p-128", "v5:4x4x4", "megacore", 64, "TPU v5"),
        ("v6e-32", "v6e:4x8", "default", 32, "TPU v6 lite"),
        ("V6E-256", "v6e:16x16", "default", 256, "TPU v6 lite"),
        ("v5e:4x8", "v5e:4x8", "default", 32, "TPU v5 lite"),
        ("v5p:4x4x8", "v5:4x4x8", "megacore", 128, "TPU v5"),
    ],
)
def test_user_names_map_to_topologies(name, topology_name, chip_config, chips, kind):
    t = topology.parse_topology(name)
    assert (t.topology_name, t.chip_config, t.chips, t.chip.device_kind) == (
        topology_name,
        chip_config,
        chips,
        kind,
    )
    assert t.slices == 1


def test_several_slices():
    t = topology.parse_topology("2xv5e-16")
    assert (t.topology_name, t.slices, t.chips, t.wrap) == ("v5e:4x4", 2, 32, (False,) * 3)
    assert topology.parse_topology("2 x v5p-128").wrap == (True, True, True)  # a full cube
    assert topology.parse_topology("v6e-256").wrap == (True, True, False)


@pytest.mark.parametrize(
    "name, says",
    [
        ("v7-8", "unknown TPU kind 'v7'"),
        ("v5e-12", "no v5e slice of that size; known: v5e-1, v5e-4"),
        ("v5p-7", "no v5p slice of that size"),
        ("tpu", "is not a TPU slice name"),
        ("v5e:4x4x4", "a v5e shape has 2 dimensions"),
        ("0xv5e-16", "at least 1"),
    ],
)
def test_unknown_topologies_are_one_line(name, says):
    with pytest.raises(ConfigError, match=None) as e:
        topology.parse_topology(name)
    assert says in str(e.value)
    assert f"--topology={name}" in str(e.value) and "\n" not in str(e.value)


def test_every_chip_names_its_source_and_the_compilers_limit_is_below_the_hbm():
    for chip in topology.CHIPS.values():
        assert chip.source.startswith("https://cloud.google.com/tpu/docs/")
        assert 0.9 * chip.hbm_bytes < chip.hbm_limit <= 1.01 * chip.hbm_bytes


def test_without_libtpu_one_line_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    problem = topology.libtpu_problem()
    assert "pip install 'grpo_jax[tpu]'" in problem and "\n" not in problem


def test_libtpus_environment_keeps_what_the_user_set(monkeypatch):
    for key in topology.LIBTPU_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    topology.quiet_libtpu()
    import os

    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8"
    assert os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"


def test_the_module_imports_no_jax():
    """tests/conftest.py and the plan command import it before JAX may load."""
    import subprocess
    import sys

    code = "import sys, grpo_jax.aot.topology; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
