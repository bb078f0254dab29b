"""Test-session setup: 8 fake CPU devices for sharding tests, float32 everywhere.

The XLA flag must be set before jax is imported anywhere in the process, so it
lives here, the first module pytest imports.
"""

import os

# XLA's CPU backend without its LLVM optimisations: the suite's time is mostly XLA compiling
# small programs (dev/profile.sh), and at level 0 they compile faster (objective/test_losses.py and
# objective/test_advantages.py together: 53 s at the default level, 25 s at level 0, one measurement
# here) while computing the same values within the tests' tolerances. The README's training
# run in CI (tests/readme_commands.sh) keeps the default level. Subprocesses the tests start
# inherit it. XLA:CPU's older loop emitters (use_fusion_emitters=false) compile the suite's
# small programs in about half the time of the newer fusion emitters (a tiny model's
# value_and_grad: 0.83-1.00 s against 0.49-0.57 s, dev/profile.sh's figures in
# docs/testing.md) and compute the same values within the tests' tolerances.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + TEST_XLA_FLAGS
).strip()
# JAX's persistent compilation cache is off in the tests unless GRPO_JAX_TEST_XLA_CACHE=1 asks
# for it (then in ~/.cache/grpo_jax/tests-xla, or JAX_COMPILATION_CACHE_DIR, for programs that
# take 0.5 s or more to compile): a cold run gains little from it (the fast tier: 101 s with
# every program cached, 80 s with the 0.5 s floor, 83 s without; docs/testing.md), a warm
# rerun on one machine more. The tests of the cache itself turn it on for themselves.
if os.environ.get("GRPO_JAX_TEST_XLA_CACHE", "0") == "1":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/grpo_jax/tests-xla")
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # LRU, file-locked
else:
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # a user's own setting, off here too
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the tpu extra) loads only where a test compiles for a TPU topology
# (tests/aot/test_aot_tpu.py): quiet on a host without a TPU, and loadable by every worker
# of a run at once (its lockfile). JAX_PLATFORMS=cpu keeps every other test on the CPU.
from grpo_jax.aot.topology import quiet_libtpu  # noqa: E402 - imports no JAX

quiet_libtpu()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"


# Every XLA:CPU executable keeps a few memory mappings of its code, and a worker keeps every
# program it compiled: one that had run a few hundred files held over 50,000, and at the
# kernel's limit (vm.max_map_count, 65,530 by default) XLA:CPU crashed compiling or
# serializing the next program, which lost CI a worker (docs/testing.md). A third of the
# default limit leaves room for the largest file's programs (under 16,000 measured).
MAX_MAPPINGS = 20_000


def _mappings() -> int:
    """This process's memory mappings (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After a test file, JAX's compiled programs are dropped once the worker holds
    MAX_MAPPINGS mappings. Not after every file: recompiling what later files share cost the
    fast tier 17 s (95 s against 78 s)."""
    yield
    if _mappings() < MAX_MAPPINGS:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def outside():
    """A fresh path in the shared temporary directory, which every user may write to (the
    sandbox tests check that code run there cannot); removed afterwards."""
    import tempfile
    import uuid

    path = pathlib.Path(tempfile.gettempdir()) / f"grpo_outside_{uuid.uuid4().hex}"
    yield path
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


@pytest.fixture
def gsm8k_dir():
    """The real GSM8K JSONL files beside the checkout; the test skips where absent."""
    d = SHARED / "data" / "gsm8k"
    if not (d / "test.jsonl").exists():
        pytest.skip(f"GSM8K data not found at {d}")
    return d


# ---------------------------------------------------------------------------
# Shared toy models and tokenizer. Tests must treat these as read-only: the
# session-scoped ones are shared by every module that asks for them.

# A one-layer Qwen2-style transformer: D 32, 2 query heads of 16 sharing 1 KV
# head, SwiGLU width 64. Compiles in about a second on CPU.
TINY_MODEL_FIELDS = dict(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64
)


@pytest.fixture(scope="session")
def builtin_tokenizer():
    """The project's character tokenizer (vocabulary 100), built once per session."""
    from grpo_jax.models.builtin_tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_config():
    """``tiny_config(100, **TINY_MODEL_FIELDS)``; ``.replace(vocab_size=v)`` gives vocabulary v."""
    from grpo_jax.models import tiny_config

    return tiny_config(100, **TINY_MODEL_FIELDS)


@pytest.fixture(scope="session")
def one_device_mesh():
    """A mesh of the first device alone, with the single axis "data"."""
    import jax

    from grpo_jax.core import sharding

    return sharding.make_mesh({"data": -1}, jax.devices()[:1])


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_config, one_device_mesh):
    """(graphdef, params) of ``tiny_model_config`` with seed 0, created on ``one_device_mesh``."""
    from flax import nnx

    from grpo_jax.models import create_model

    return nnx.split(create_model(tiny_model_config, seed=0, mesh=one_device_mesh))
