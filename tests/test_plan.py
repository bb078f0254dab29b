"""The plan command's refusals: each one line and exit status 2, before anything compiles
and without libtpu; --plan_only prints the plan. Compiling for a TPU is the slow tier's
(tests/aot/test_aot_tpu.py, with libtpu)."""

import io
import subprocess
import sys

import pytest

from grpo_jax import plan
from grpo_jax.aot import programs, topology


def _config(model="qwen2.5-0.5b", **over):
    """The gsm8k recipe, its layers scanned (the abstract model is made in 0.1 s, not 3)."""
    from configs import gsm8k

    c = gsm8k.get_config(f"model={model}")
    c.model.scan_layers = True
    for key, value in over.items():
        section, field = key.split(".")
        c[section][field] = value
    return c


@pytest.fixture
def nothing_compiles(monkeypatch):
    """A refusal must come before any program is built, compiled or libtpu asked for."""

    def refuse(*a, **k):
        raise AssertionError("a program was built")

    monkeypatch.setattr(programs, "programs", refuse)
    monkeypatch.setattr(topology, "devices", refuse)


def _plan(config, **opts):
    out, err = io.StringIO(), io.StringIO()
    status = plan.plan(config, plan.Options(**opts), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_a_run_that_does_not_fit_is_refused_in_one_line(nothing_compiles):
    """The recipe as it is (data parallel: every chip holds the whole training state)."""
    status, _, err = _plan(_config(), topology="v5e-16")
    assert status == 2
    (line,) = err.splitlines()
    assert line.startswith("config error: program update needs ")
    assert "GiB per chip by the memory plan, over the 15.75 GiB a v5e chip gives" in line


def test_an_unknown_topology_is_one_line(nothing_compiles):
    status, out, err = _plan(_config(), topology="v5e-12")
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("config error: --topology=v5e-12: no v5e slice of that size")


def test_without_libtpu_one_line_says_how_to_install_it(nothing_compiles, monkeypatch):
    monkeypatch.setattr(topology, "libtpu_problem", lambda: "libtpu is not installed: pip ...")
    over = {"mesh.data": 1, "mesh.fsdp": 16}
    status, out, err = _plan(_config(**over), topology="v5e-16")
    assert status == 2 and err == "config error: libtpu is not installed: pip ...\n"
    assert "v5e:4x4" in out  # the plan's header came first


def test_plan_only_prints_each_programs_plan(nothing_compiles):
    over = {"mesh.data": 1, "mesh.fsdp": 16}
    status, out, err = _plan(_config(**over), topology="v5e-16", plan_only=True)
    assert status == 0 and err == ""
    rows = {line.split()[0]: line.split() for line in out.splitlines()[4:]}
    assert set(rows) == {"update", "scoring", "prefill", "decode"}
    assert all(r[-1] == "yes" for r in rows.values())


def test_suggest_prints_the_settings_it_plans(nothing_compiles):
    status, out, _ = _plan(_config(), topology="v5e-16", suggest=True, plan_only=True)
    assert status == 0
    assert out.splitlines()[0] == ("suggested settings: --config.mesh.data=1 --config.mesh.fsdp=16")


def test_a_mesh_that_does_not_lay_out_the_topology_is_one_line(nothing_compiles):
    status, _, err = _plan(_config(**{"mesh.data": 3}), topology="v5e-16")
    assert status == 2 and "does not lay out the topology's 16 chips" in err
    assert len(err.splitlines()) == 1


@pytest.mark.slow
def test_the_command_line(tmp_path):
    """The module as users run it: absl's flags, the refusal, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_jax.plan", "--config=configs/gsm8k.py:model=qwen3-32b,pod",
         "--topology=v5e-4"],
        capture_output=True, text=True, timeout=300, cwd=plan.__file__.rsplit("/grpo_jax/", 1)[0],
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("config error: program update needs ")


@pytest.mark.parametrize(
    "arg, topo, over",
    [
        ("qwen2.5-0.5b,pod", "v5e-16", {}),
        ("qwen3-8b,pod", "v5p-64", {}),
        ("qwen3-8b,pod", "v6e-32", {}),
        ("qwen3-32b,pod", "v5p-128", {}),
        ("gemma3-27b,pod", "v6e-256", {"train.batch_size": 256, "train.minibatch_size": 512}),
    ],
)
def test_the_pod_recipes_fit_their_slices_by_the_plan(arg, topo, over, nothing_compiles):
    """docs/pods.md's table: each recipe's plan fits its slice (the compiled figures there)."""
    from configs import gsm8k

    c = gsm8k.get_config(f"model={arg}")
    for key, value in over.items():
        section, field = key.split(".")
        c[section][field] = value
    status, out, err = _plan(c, topology=topo, plan_only=True)
    assert status == 0 and err == ""
    assert "NO" not in out
