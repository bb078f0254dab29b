"""Multi-process start-up: settings resolution, host helpers, and 2 processes x 2 devices.

The multi-process test runs this file as a script under
``launch/local_multiprocess.sh``: two processes with two fake CPU devices each
join over loopback, train a linear softmax policy for a few GRPO steps over a
global 4-device mesh, and must end with the parameters of the same run in one
process on four devices.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Sizes of the worker's problem: N rows (B=4 prompts x G=2), T tokens, D features, V vocab.
N, T, D, V, STEPS = 8, 6, 8, 11, 3
MESH_AXES = {"data": 2, "fsdp": 2}


def _problem():
    """The same global batch and initial parameters on every process (fixed seed)."""
    rng = np.random.default_rng(0)
    return {
        "h": rng.normal(size=(N, T, D)).astype(np.float32),
        "tokens": rng.integers(0, V, size=(N, T)).astype(np.int32),
        "mask": (rng.random((N, T)) < 0.8).astype(np.float32),
        "old_logps": (-2.5 + 0.1 * rng.normal(size=(N, T))).astype(np.float32),
        "advantages": rng.normal(size=(N,)).astype(np.float32),
    }, (0.3 * rng.normal(size=(D, V))).astype(np.float32)


def train_linear_policy(mesh):
    """STEPS AdamW steps of grpo_loss (beta > 0) on logits = h @ W; W sharded over fsdp.

    Returns (losses [STEPS], first gradient [D, V], final W [D, V]) as numpy,
    gathered from every process.
    """
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo_jax.core import distributed
    from grpo_jax.objective import losses
    from grpo_jax.objective.config import GRPOConfig

    batch_np, w0 = _problem()
    rows = distributed.host_rows(mesh, N)
    batch = distributed.global_batch({k: v[rows] for k, v in batch_np.items()}, mesh, N)
    w_sharding = NamedSharding(mesh, P("fsdp", None))
    w, w_ref = distributed.put((w0, w0), w_sharding)
    tx = optax.adamw(0.05)
    opt_state = jax.jit(tx.init)(w)

    def loss_fn(w, w_ref, batch):
        def logps(weights):
            logits = batch["h"] @ weights
            return losses.per_token_logps(logits, batch["tokens"])

        loss, _ = losses.grpo_loss(
            logps(w),
            batch["old_logps"],
            batch["advantages"],
            batch["mask"],
            GRPOConfig(beta=0.04),
            ref_logps_NxT=logps(w_ref),
        )
        return loss

    @jax.jit
    def step(w, opt_state, w_ref, batch):
        loss, grad = jax.value_and_grad(loss_fn)(w, w_ref, batch)
        updates, opt_state = tx.update(grad, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, loss, grad

    losses_, first_grad = [], None
    for _ in range(STEPS):
        w, opt_state, loss, grad = step(w, opt_state, w_ref, batch)
        losses_.append(float(loss))
        first_grad = distributed.fetch(grad) if first_grad is None else first_grad
    return np.asarray(losses_), first_grad, distributed.fetch(w)


def _check_host_rows(mesh) -> None:
    """Each host's rows in and out of global arrays, and the cross-host reductions."""
    import jax

    from grpo_jax.core import distributed

    me = jax.process_index()
    rows = distributed.host_rows(mesh, N)
    mine = np.arange(N * 3, dtype=np.float32).reshape(N, 3)[rows]  # this host's block only
    glob = distributed.global_batch(mine, mesh, N)
    assert glob.shape == (N, 3) and not glob.is_fully_addressable
    np.testing.assert_array_equal(distributed.local_rows(glob, rows), mine)
    np.testing.assert_array_equal(distributed.fetch(glob), np.arange(N * 3).reshape(N, 3))
    # A computation on the global array sees every host's rows.
    assert float(jax.jit(lambda x: x.sum())(glob)) == sum(range(N * 3))
    got = distributed.gather_rows(
        {"a": np.full(2, me), "b": np.array([[me, 10 + me]]), "c": np.array([me == 0, True])}
    )
    np.testing.assert_array_equal(got["a"], [0, 0, 1, 1])
    np.testing.assert_array_equal(got["b"], [[0, 10], [1, 11]])
    assert got["c"].dtype == np.bool_ and got["c"].tolist() == [True, True, False, True]
    assert distributed.max_over_hosts(7 + 5 * me) == 12


def _worker(out_dir: str) -> None:
    from grpo_jax.core import distributed

    assert distributed.maybe_initialize(), "expected a multi-process run from the environment"
    import jax

    from grpo_jax.core.sharding import make_mesh

    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    mesh = make_mesh(MESH_AXES)
    assert distributed.host_rows(mesh, N) == slice(
        4 * jax.process_index(), 4 * (1 + jax.process_index())
    )
    _check_host_rows(mesh)
    losses_, grad, w = train_linear_policy(mesh)
    if distributed.is_primary():
        np.savez(pathlib.Path(out_dir) / "result.npz", losses=losses_, grad=grad, w=w)
    # Every process also reports its own view, to check that they agree.
    np.savez(pathlib.Path(out_dir) / f"w_{jax.process_index()}.npz", w=w)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1])
    sys.exit(0)


# ---------------------------------------------------------------------------
# Tests (run by pytest in the 8-fake-device test process).

import jax  # noqa: E402
import pytest  # noqa: E402

from grpo_jax.core import distributed  # noqa: E402
from grpo_jax.core.distributed import DistributedError, Plan, plan  # noqa: E402

SLURM = {
    "SLURM_JOB_ID": "12",
    "SLURM_STEP_NODELIST": "node[001-004]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


def test_plan_single_process_is_none():
    assert plan(environ={}) is None
    assert plan(num_processes=1, environ={}) is None
    assert plan(environ={"GRPO_JAX_NUM_PROCESSES": "1"}) is None
    assert plan(environ={**SLURM, "SLURM_NTASKS": "1"}) is None


def test_plan_from_arguments_wins():
    p = plan("10.0.0.1:1234", 4, 2, local_device_ids=[0, 1], environ=SLURM)
    assert p == Plan("arguments", "10.0.0.1:1234", 4, 2, (0, 1))
    # Explicitly one process: no start-up, even inside a SLURM job.
    assert plan(num_processes=1, environ=SLURM) is None


def test_plan_from_environment():
    env = {
        "GRPO_JAX_COORDINATOR": "127.0.0.1:5000",
        "GRPO_JAX_NUM_PROCESSES": "2",
        "GRPO_JAX_PROCESS_ID": "1",
    }
    assert plan(environ=env) == Plan("environment", "127.0.0.1:5000", 2, 1)
    assert plan(environ={**env, **SLURM}).source == "environment"


def test_plan_detects_slurm_and_leaves_the_rest_to_jax():
    assert plan(environ=SLURM) == Plan("slurm")
    assert plan(local_device_ids=[3], environ=SLURM) == Plan("slurm", local_device_ids=(3,))
    partial = {k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}
    assert plan(environ=partial) is None  # not a complete SLURM step: one process


@pytest.mark.parametrize(
    "args,env,message",
    [
        (("127.0.0.1:1", None, None), {}, "coordinator_address is set but num_processes is not"),
        ((None, None, 0), {}, "process_id is set but num_processes is not"),
        ((None, 2, 0), {}, "num_processes = 2 needs coordinator_address too"),
        (("h:1", 2, None), {}, "num_processes = 2 needs process_id too"),
        (("h:1", 2, 2), {}, r"process_id = 2 must be in \[0, num_processes = 2\)"),
        (("h:1", 0, 0), {}, "num_processes = 0 must be at least 1"),
        (("localhost", 2, 0), {}, "coordinator_address = 'localhost' must be host:port"),
        (
            (None, None, None),
            {"GRPO_JAX_NUM_PROCESSES": "two"},
            "GRPO_JAX_NUM_PROCESSES = 'two' is not an integer",
        ),
        (
            (None, None, None),
            {"GRPO_JAX_NUM_PROCESSES": "2", "GRPO_JAX_PROCESS_ID": "0"},
            "GRPO_JAX_NUM_PROCESSES = 2 needs GRPO_JAX_COORDINATOR too",
        ),
        (
            (None, None, None),
            {"GRPO_JAX_COORDINATOR": "h:1"},
            "GRPO_JAX_COORDINATOR is set but GRPO_JAX_NUM_PROCESSES is not",
        ),
    ],
)
def test_plan_errors_name_the_setting(args, env, message):
    with pytest.raises(DistributedError, match=message):
        plan(*args, environ=env)


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("GRPO_JAX_", "SLURM_")):
            monkeypatch.delenv(key)


def test_single_process_helpers(clean_env):
    assert distributed.maybe_initialize() is False
    assert distributed.is_primary()
    from grpo_jax.core.sharding import make_mesh

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert distributed.host_rows(mesh, 8) == slice(0, 8)
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    g = distributed.global_batch({"x": x}, mesh, 8)["x"]
    assert g.shape == (8, 2) and g.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_array_equal(np.asarray(g), x)
    np.testing.assert_array_equal(distributed.local_rows(g, slice(0, 8)), x)
    assert distributed.gather_rows({"a": np.array([1, 2])})["a"].tolist() == [1, 2]
    assert distributed.max_over_hosts(5) == 5


def test_put_and_fetch_in_one_process():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo_jax.core.sharding import make_mesh

    mesh = make_mesh({"data": 2, "fsdp": 4})
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    key = jax.random.key(3)
    placed = distributed.put({"x": x, "key": key}, NamedSharding(mesh, P()))
    assert placed["x"].sharding == NamedSharding(mesh, P())
    assert jax.random.key_impl(placed["key"]) == jax.random.key_impl(key)
    rows = distributed.put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    assert rows.sharding.spec == P(("data", "fsdp"))
    out = distributed.fetch({"rows": rows, "n": 3})
    assert isinstance(out["rows"], np.ndarray)
    np.testing.assert_array_equal(out["rows"], x)
    assert out["n"] == 3


def test_initialize_after_jax_started_is_a_clear_error(clean_env):
    jax.devices()  # the backend is up in the test process
    with pytest.raises(RuntimeError, match="maybe_initialize\\(\\) must run before any other JAX"):
        distributed.maybe_initialize("127.0.0.1:1", 2, 0)


@pytest.mark.slow
def test_flags_are_defined_on_request_only():
    """Importing the module defines no flags (library users may have their own)."""
    code = (
        "from absl import flags; from grpo_jax.core import distributed; "
        "from grpo_jax import sampling; "
        "from grpo_jax.learner import update; "
        "assert 'process_id' not in flags.FLAGS; distributed.define_flags(); "
        "distributed.define_flags(); "
        "flags.FLAGS(['x', '--coordinator_address=h:1', '--num_processes=2', '--process_id=1']); "
        "print(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes, flags.FLAGS.process_id)"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["h:1", "2", "1"]


@pytest.mark.slow
def test_two_processes_match_one_process_on_four_devices(tmp_path):
    """2 processes x 2 CPU devices over loopback == 1 process x 4 devices, to float32 rounding."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_JAX_", "SLURM_"))}
    # This process's XLA flags less its device count, which the launcher sets per process.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags), PYTHONPATH=str(ROOT))
    cmd = [
        "bash",
        str(ROOT / "launch" / "local_multiprocess.sh"),
        "--timeout",
        "240",
        "--log-dir",
        str(tmp_path / "logs"),
        "--devices-per-process",
        "2",
        "2",
        "--",
        sys.executable,
        __file__,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted((tmp_path / "logs").glob("*.log"))
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{logs}"
    multi = np.load(tmp_path / "result.npz")
    w1 = np.load(tmp_path / "w_1.npz")["w"]
    np.testing.assert_array_equal(multi["w"], w1)  # both hosts hold the same parameters

    from grpo_jax.core.sharding import make_mesh

    mesh = make_mesh(MESH_AXES, devices=jax.devices()[:4])
    losses_, grad, w = train_linear_policy(mesh)
    np.testing.assert_allclose(multi["losses"], losses_, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(multi["grad"], grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(multi["w"], w, rtol=1e-5, atol=1e-6)
    # The problem is not degenerate: the parameters moved and the loss changed.
    _, w0 = _problem()
    assert np.abs(w - w0).max() > 0.05
    assert np.abs(np.diff(losses_)).max() > 1e-4
