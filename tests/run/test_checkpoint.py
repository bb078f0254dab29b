"""The Orbax checkpoint wrapper: save, keep-N, restore exactly, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers_resume import flip_bytes

from grpo_jax.run.checkpoints import Checkpointer


def _state(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (4, 3)), "b": {"x": jax.random.normal(k2, (3,))}}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)
    return params, opt_state


@pytest.mark.slow
def test_save_restore_roundtrip_and_keep(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", keep=2, async_save=True)
    assert ck.latest_step() is None
    for step in (1, 2, 3):
        params, opt_state = _state(step)
        ck.save(step, params=params, opt_state=opt_state, meta={"iter": {"pos": step}, "s": "x"})
    ck.wait()
    assert ck.all_steps() == [2, 3]
    ck.close()

    ck = Checkpointer(tmp_path / "ckpt", keep=2)
    like_p, like_o = _state(99)
    params, opt_state, meta = ck.restore(params_like=like_p, opt_state_like=like_o)
    want_p, want_o = _state(3)
    assert meta == {"iter": {"pos": 3}, "s": "x", "step": 3}
    for a, b in zip(
        jax.tree.leaves((params, opt_state)), jax.tree.leaves((want_p, want_o)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(opt_state) == jax.tree.structure(want_o)
    p2 = ck.restore_params(2, params_like=like_p)
    np.testing.assert_array_equal(np.asarray(p2["w"]), np.asarray(_state(2)[0]["w"]))
    assert ck.restore_meta(2)["iter"] == {"pos": 2}
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint for step 1 .*available steps: \[2, 3\]"
    ):
        ck.restore_params(1, params_like=like_p)
    ck.close()


def test_restore_empty_dir_errors(tmp_path):
    ck = Checkpointer(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="no checkpoint found in"):
        ck.restore_meta()
    ck.close()
    with pytest.raises(ValueError, match="checkpoint.keep = 0"):
        Checkpointer(tmp_path / "k", keep=0)


def _resume_check(saved_updates, now_updates, allow=True):
    from types import SimpleNamespace

    from helpers_config import smoke_config

    from grpo_jax.run.checkpoints import check_resume_config
    from grpo_jax.run.config import parse_config

    def config(updates):
        return smoke_config(**{"checkpoint.allow_changed_config": allow, **updates})

    saved = parse_config(config(saved_updates)).raw
    ck = SimpleNamespace(
        all_steps=lambda: [1], restore_meta=lambda step: {"config": saved}, directory="/w/ck"
    )
    return check_resume_config(parse_config(config(now_updates)), ck)


def test_allow_changed_config_still_refuses_a_change_of_the_saved_parameters_shapes():
    """A LoRA rank change used to warm-start again over warm_start/ and end in Orbax's
    shape error with a page of traceback; now it is one ConfigError before anything runs."""
    from grpo_jax.run.config import ConfigError

    lora = {"model.lora.rank": 2}
    assert _resume_check(lora, {**lora, "model.lora.alpha": 8.0}) == [
        "model.lora.alpha: 16.0 -> 8.0"
    ]
    for change in (
        {"model.lora.rank": 4},
        {"model.lora.targets": "q,v"},
        {"model.hidden_size": 64},
        {"model.scan_layers": True},
    ):
        key = next(iter(change))
        with pytest.raises(ConfigError) as e:
            _resume_check(lora, {**lora, **change})
        message = str(e.value)
        assert "\n" not in message and f"{key}: " in message, message
        assert "shapes" in message and "checkpoint.allow_changed_config" in message


def _big_state(seed):
    """Arrays large enough that Orbax writes them to data files of their own."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (64, 64)), "b": jax.random.normal(k2, (64,))}
    opt = optax.adam(1e-3)
    _, opt_state = opt.update(params, opt.init(params), params)  # moments of random values
    return params, opt_state


def test_array_digests_are_the_same_on_any_layout_and_change_with_any_element():
    """Each shard is summed on its device with its offset in the array (no collective: many
    small ones in flight deadlocked XLA's CPU all-reduce), the sums added on the host."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from grpo_jax.core import integrity

    x = jax.random.normal(jax.random.key(0), (16, 12))
    tree = {"x": x, "b": jnp.arange(10, dtype=jnp.bfloat16), "n": jnp.int32(7)}
    one = integrity.tree_digests(tree)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    for spec in (P("a", "b"), P(None, "a"), P("b"), P()):
        placed = dict(tree, x=jax.device_put(x, NamedSharding(mesh, spec)))
        assert integrity.tree_digests(placed) == one, spec
    for i, j in ((0, 0), (7, 5), (15, 11)):
        flipped = x.at[i, j].set(-x[i, j])
        assert integrity.tree_digests(dict(tree, x=flipped))["['x']"] != one["['x']"]


@pytest.mark.slow
def test_flipped_bytes_in_a_step_are_an_integrity_error_naming_the_array(tmp_path):
    from grpo_jax.core.errors import IntegrityError

    ck = Checkpointer(tmp_path / "ckpt", async_save=False)
    for step in (1, 2, 3):
        params, opt_state = _big_state(step)
        ck.save(step, params=params, opt_state=opt_state, meta={"pos": step})
    ck.close()
    flip_bytes(tmp_path / "ckpt" / "2", "params")
    flip_bytes(tmp_path / "ckpt" / "3", "opt_state")
    meta_file = tmp_path / "ckpt" / "1" / "meta" / "metadata"
    meta_file.write_text(meta_file.read_text().replace('"pos": 1', '"pos": 7'))

    said = []
    ck = Checkpointer(tmp_path / "ckpt", say=said.append)
    like_p, like_o = _big_state(99)
    try:
        with pytest.raises(IntegrityError, match=r"step 2 in .*: params\['w'\] differs from the "):
            ck.restore(2, params_like=like_p, opt_state_like=like_o)
        with pytest.raises(IntegrityError, match=r"step 3 .*: opt_state\S* differs from the "):
            ck.restore(3, params_like=like_p, opt_state_like=like_o)
        with pytest.raises(IntegrityError, match=r"step 2 .*: params\['w'\] differs"):
            ck.restore_params(2, params_like=like_p)  # evaluation and export verify too
        with pytest.raises(IntegrityError, match=r"step 1 .*: its meta \(counters, data position"):
            ck.restore_meta(1)
    finally:
        ck.close()
    assert said == []  # every step had checksums


@pytest.mark.slow
def test_a_step_saved_without_checksums_restores_with_one_line_saying_so(tmp_path):
    """Checkpoints of earlier versions (no checksums in their meta) still restore."""
    import json

    ck = Checkpointer(tmp_path / "ckpt", async_save=False)
    params, opt_state = _big_state(1)
    ck.save(1, params=params, opt_state=opt_state, meta={"pos": 1})
    ck.close()
    meta_file = tmp_path / "ckpt" / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["integrity"]
    meta_file.write_text(json.dumps(meta))
    said = []
    ck = Checkpointer(tmp_path / "ckpt", say=said.append)
    try:
        back, _, meta = ck.restore(params_like=params, opt_state_like=opt_state)
        assert ck.restore_meta(1) == meta == {"pos": 1, "step": 1}
    finally:
        ck.close()
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(params["w"]))
    assert said == [
        f"checkpoint step 1 in {tmp_path / 'ckpt'} was saved without checksums (by an earlier "
        "version of grpo_jax): restored unverified"
    ]


def test_a_setting_the_checkpoints_version_lacked_counts_as_its_default():
    """A checkpoint written before the teacher section existed: resuming with the teacher at
    its default is the same run; setting one is a change, named like any other."""
    from types import SimpleNamespace

    from helpers_config import smoke_config

    from grpo_jax.run.checkpoints import check_resume_config
    from grpo_jax.run.config import ConfigError, parse_config

    saved = dict(parse_config(smoke_config()).raw)
    del saved["teacher"]  # as a version without the section saved it
    ck = SimpleNamespace(
        all_steps=lambda: [1], restore_meta=lambda step: {"config": saved}, directory="/w/ck"
    )
    assert check_resume_config(parse_config(smoke_config()), ck) is None
    with pytest.raises(ConfigError, match="teacher.path: '' -> '/ckpt/teacher'"):
        check_resume_config(parse_config(smoke_config(**{"teacher.path": "/ckpt/teacher"})), ck)
