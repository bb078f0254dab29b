"""The W&B writer (train.wandb): offline runs written and read back from their .wandb file."""

import json
import pathlib
import sys

import pytest

from grpo_jax.core.errors import ConfigError
from grpo_jax.run import wandb_writer, writers
from grpo_jax.run.config import TrainConfig


def read_wandb(run_dir: pathlib.Path) -> list:
    """The records of an offline run's ``run-<id>.wandb`` as wandb's protobuf ``Record``s.

    The file is ":W&B", two magic bytes and a version byte, then a LevelDB-style log: 32 KiB
    blocks of chunks, each a 7-byte header (checksum, little-endian length, kind: 1 whole,
    2 first, 3 middle, 4 last) and its bytes."""
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    # teardown() waits for wandb's service process to end, so the file is closed and whole
    # when it is read (a suite run once found no config in it, under load).
    wandb.teardown()
    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, buf, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    return [pb.Record.FromString(c) for c in out]


def _items(items) -> dict:
    """W&B's items (a key, or a nested key's parts, and a JSON value) as a nested dict."""
    out = {}
    for i in items:
        *parents, last = list(i.nested_key) or [i.key]
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = json.loads(i.value_json)
    return out


def history(records) -> list[dict]:
    kind = lambda r: r.WhichOneof("record_type")
    return [_items(r.history.item) for r in records if kind(r) == "history"]


def config(records) -> dict:
    """The run's config: its run record's, then every config record's updates."""
    out = {}
    for r in records:
        if r.WhichOneof("record_type") in ("run", "config"):
            updates = r.run.config.update if r.HasField("run") else r.config.update
            out.update(_items(updates))
    return out


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k))


def test_extra_writers_get_every_write(tmp_path):
    extra = _Recorder()
    w = writers.MetricsWriter(tmp_path, tensorboard=False, extra=[extra])
    w.write(1, {"rewards/mean": 0.5})
    w.write_samples(1, [{"prompt": "1+1=", "completion": "2"}], name="alarm_x_step", header="h")
    w.flush()
    w.close()
    assert [c[0] for c in extra.calls] == ["write", "write_samples", "flush", "close"]
    assert extra.calls[1][2] == {"name": "alarm_x_step", "header": "h"}
    # Processes other than 0 write nothing, and neither do their extra writers.
    other = _Recorder()
    writers.MetricsWriter(tmp_path, enabled=False, extra=[other]).write(1, {"x": 1.0})
    assert other.calls == []


def test_the_setting_is_checked_and_a_missing_package_is_one_line(tmp_path, monkeypatch):
    assert TrainConfig().wandb == "off"
    with pytest.raises(ConfigError, match=r"'train.wandb' = 'yes' is not one of"):
        TrainConfig(wandb="yes")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb: ImportError
    with pytest.raises(ConfigError, match=r"needs the wandb package.*pip install -e '.\[wandb\]'"):
        wandb_writer.WandbWriter(tmp_path, mode="offline", config={})


@pytest.mark.slow  # wandb starts its service process (2-3 s)
def test_offline_run_holds_config_record_metrics_samples_and_alarms(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_PROJECT", "grpo_jax_test")
    rec = {"config_sha256": "ab" * 32, "code": {"git_commit": "c0ffee"}}
    wb = wandb_writer.WandbWriter(
        tmp_path / "wd", mode="offline", config={"seed": 3, "grpo": {"G": 8}}, record=rec
    )
    w = writers.MetricsWriter(tmp_path / "wd", tensorboard=False, extra=[wb])
    w.write(1, {"rewards/mean": 0.25, "eval/pass_at_1": float("nan")})
    w.write(2, {"rewards/mean": 0.5, "alarms/reward_hacking": 1.0})
    w.write_samples(2, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    hacked = [{"prompt": "2+2=", "completion": "5", "reward": 1.0}]
    alarm = "health alarm reward_hacking: ..."
    w.write_samples(2, hacked, name="alarm_reward_hacking_step", header=alarm)
    run_dir = wb.run_dir
    w.close()
    assert run_dir.parent == tmp_path / "wd" / "wandb" and run_dir.name.startswith("offline-run-")
    records = read_wandb(run_dir)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[:2] == ["header", "run"] and kinds[-1] == "exit", kinds
    cfg = config(records)
    assert cfg["seed"] == 3 and cfg["grpo"] == {"G": 8} and cfg["record"] == rec
    rows = history(records)
    assert [(r["grpo/step"], r.get("rewards/mean")) for r in rows if "rewards/mean" in r] == [
        (1, 0.25),
        (2, 0.5),
    ]
    assert all("eval/pass_at_1" not in r for r in rows)  # NaN: not a number this step
    assert any(r.get("alarms/reward_hacking") == 1.0 for r in rows)
    tables = {k: v for r in rows for k, v in r.items() if isinstance(v, dict)}
    assert tables["samples/step"]["_type"] == "table-file"
    assert tables["alarms"]["nrows"] == 1
    # The tables' files: the sample and the alarm's row.
    media = run_dir / "files" / "media" / "table"
    (sample,) = media.glob("samples/step_*.table.json")
    assert json.loads(sample.read_text())["data"] == [["1+1=", "2", 1.0]]
    (alarms,) = media.glob("alarms_*.table.json")
    assert json.loads(alarms.read_text())["data"] == [[2, "reward_hacking", alarm]]
    # A second writer in the same workdir continues the same W&B run (a resumed run).
    again = wandb_writer.WandbWriter(tmp_path / "wd", mode="offline", config={})
    assert again.run.id == run_dir.name.rsplit("-", 1)[1]
    again.close()


@pytest.mark.slow  # trains the smoke config for two steps
def test_a_short_run_writes_an_offline_wandb_run(tmp_path):
    pytest.importorskip("wandb")
    from helpers_config import smoke_config

    from grpo_jax.run.train import train

    wd = tmp_path / "run"
    overrides = {"train.steps": 2, "warm_start.enabled": False, "train.wandb": "offline",
                 "train.samples_every": 1, "train.num_samples_logged": 2}  # fmt: skip
    train(smoke_config(**overrides), wd)
    summary = json.loads((wd / "summary.json").read_text())
    (run_dir,) = (wd / "wandb").glob("offline-run-*")
    records = read_wandb(run_dir)
    cfg = config(records)
    assert cfg["record"]["config_sha256"] == summary["record"]["config_sha256"]
    assert cfg["train"]["wandb"] == "offline"
    rows = history(records)
    logged = {r["grpo/step"] for r in rows if "rewards/mean" in r}
    assert logged == {1, 2}
    assert any("samples/step" in r for r in rows)
    after = [r["eval/pass_at_1"] for r in rows if "eval/pass_at_1" in r]
    assert after[-1] == pytest.approx(summary["after"]["pass_at_1"])
