"""Test-session setup: 8 fake CPU devices for sharding tests, float32 everywhere.

The XLA flag must be set before jax is imported anywhere in the process, so it
lives here, the first module pytest imports.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture
def gsm8k_dir():
    """The real GSM8K JSONL files beside the checkout; the test skips where absent."""
    d = SHARED / "data" / "gsm8k"
    if not (d / "test.jsonl").exists():
        pytest.skip(f"GSM8K data not found at {d}")
    return d
