"""Mesh construction and logical-axis rules."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from grpo_jax.core import sharding


def test_mesh_fills_the_rest():
    mesh = sharding.make_mesh({"data": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert sharding.batch_shards(mesh) == 4
    one = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    assert one.size == 1


@pytest.mark.parametrize(
    "axes, message",
    [
        ({"data": 3}, r"needs 3 devices, but 8 are available"),
        ({"data": -1, "fsdp": -1}, "at most one mesh axis may be -1"),
        ({"model": 2}, r"unknown mesh axes \['model'\]"),
        ({"data": -1, "fsdp": 3}, "does not divide the 8 devices"),
    ],
)
def test_mesh_errors(axes, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(axes)


def test_logical_rules():
    assert sharding.logical_to_spec(("vocab", "embed"), "dp") == P(None, None)
    assert sharding.logical_to_spec(("vocab", "embed"), "fsdp") == P(None, "fsdp")
    assert sharding.logical_to_spec(("embed", "mlp"), "fsdp_tp") == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("batch", "length", "embed"), "fsdp") == P(
        ("data", "fsdp"), None, None
    )  # fsdp already shards the batch, so the activation's embed stays whole.


def test_group_layout_check():
    mesh = sharding.make_mesh({"data": 8})
    sharding.check_group_layout(64, 8, mesh)
    with pytest.raises(ValueError, match="multiple of 8"):
        sharding.check_group_layout(32, 8, mesh)
