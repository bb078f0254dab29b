"""Bad input files and an offline machine: each gives a clear error naming what to fix.

Non-UTF-8 bytes in dataset files, truncated or corrupt safetensors files, and
GSM8K through TFDS where it is neither prepared nor downloadable.
"""

import json
import logging
import pathlib
import re
import struct
import time

import numpy as np
import pytest

from grpo_jax import data
from grpo_jax.data import MalformedRowError, gsm8k, read_jsonl
from grpo_jax.models.safetensors_io import (
    SINGLE_FILE,
    CheckpointError,
    SafetensorsCheckpoint,
    SafetensorsFile,
    write_checkpoint,
)
from grpo_jax.run.config import ConfigError

# ---------------------------------------------------------------------------
# Non-UTF-8 bytes in JSONL files.

GOOD = json.dumps({"prompt": "What is 2+2?", "answer": 4}).encode()
# Latin-1 "café" (0xe9) in the middle of an otherwise valid row.
LATIN1 = b'{"prompt": "caf\xe9 costs 3, tea 2: total?", "answer": 5}'


def _write_bytes(path, lines):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_read_jsonl_non_utf8_line_names_file_line_and_byte(tmp_path):
    p = _write_bytes(tmp_path / "rows.jsonl", [GOOD, b"", LATIN1, GOOD])
    with pytest.raises(
        MalformedRowError,
        match=r"rows\.jsonl:3: line is not valid UTF-8 \(byte 0xe9 at byte offset 15 of the line",
    ) as info:
        read_jsonl(p)
    assert info.value.lineno == 3


def test_read_jsonl_skips_and_counts_non_utf8_lines(tmp_path):
    p = _write_bytes(tmp_path / "rows.jsonl", [LATIN1, GOOD, b"\xff\xfe", GOOD])
    examples, skipped = read_jsonl(p, on_error="skip")
    assert skipped == [1, 3]
    assert [ex["answer"] for ex in examples] == ["4", "4"]


def test_read_jsonl_keeps_valid_multibyte_text_and_crlf(tmp_path):
    row = json.dumps({"prompt": "Ünïcödé ✓ 数学?", "answer": "7"}, ensure_ascii=False)
    p = tmp_path / "rows.jsonl"
    p.write_bytes(row.encode() + b"\r\n" + GOOD + b"\r\n")
    examples, skipped = read_jsonl(p)
    assert skipped == [] and examples[0]["prompt"] == "Ünïcödé ✓ 数学?"


def test_load_dataset_counts_non_utf8_rows_and_records_them(tmp_path, caplog):
    train = _write_bytes(tmp_path / "train.jsonl", [GOOD, LATIN1, GOOD])
    test = _write_bytes(tmp_path / "test.jsonl", [GOOD])
    cfg = {
        "source": "jsonl",
        "train_path": str(train),
        "test_path": str(test),
        "on_error": "skip",
    }
    stats = {}
    with caplog.at_level(logging.WARNING):
        splits = data.load_dataset(cfg, stats=stats)
    assert [len(splits["train"]), len(splits["test"])] == [2, 1]
    assert stats == {"skipped/train": 1, "skipped/test": 0}
    assert "skipped 1 malformed row(s)" in caplog.text
    assert data.last_load_stats() == {"skipped/train": 1, "skipped/test": 0}
    data.last_load_stats()["skipped/train"] = 99  # A copy: the record is not changed.
    assert data.last_load_stats()["skipped/train"] == 1

    data.load_dataset({"source": "synthetic", "n_train": 4, "n_test": 2})
    assert data.last_load_stats() == {"skipped/train": 0, "skipped/test": 0}


GSM8K_ROW = json.dumps({"question": "2 times 21?", "answer": "2 * 21 = 42\n#### 42"}).encode()
GSM8K_LATIN1 = b'{"question": "Jos\xe9 has 3 pens and buys 4. How many?", "answer": "#### 7"}'


def test_gsm8k_jsonl_reader_non_utf8_line(tmp_path):
    p = _write_bytes(tmp_path / "train.jsonl", [GSM8K_ROW, GSM8K_LATIN1])
    with pytest.raises(MalformedRowError, match=r"train\.jsonl:2: line is not valid UTF-8"):
        gsm8k.read_gsm8k_jsonl(p)
    examples, skipped = gsm8k.read_gsm8k_jsonl(p, on_error="skip")
    assert skipped == [2] and [ex["answer"] for ex in examples] == ["42"]


def test_gsm8k_preparation_rows_stop_at_non_utf8_line(tmp_path):
    """The rows the gsm8k_local builder prepares from: the first bad line stops it."""
    p = _write_bytes(tmp_path / "train.jsonl", [GSM8K_ROW, GSM8K_ROW, GSM8K_LATIN1])
    rows = gsm8k._iter_checked(p)
    assert next(rows)[0] == 1 and next(rows)[0] == 2
    with pytest.raises(
        MalformedRowError,
        match=r"train\.jsonl:3: line is not valid UTF-8 \(byte 0xe9 at byte offset 17",
    ):
        next(rows)


def test_gsm8k_local_route_non_utf8_line_names_file_and_line(tmp_path):
    src = tmp_path / "jsonl"
    src.mkdir()
    _write_bytes(src / "train.jsonl", [GSM8K_ROW, GSM8K_LATIN1])
    with pytest.raises(Exception, match=r"train\.jsonl:2: line is not valid UTF-8"):
        gsm8k.load("train", data_dir=tmp_path / "tfds", jsonl_dir=src)


# ---------------------------------------------------------------------------
# Truncated or corrupt safetensors files.

Q = "model.layers.0.self_attn.q_proj.weight"


def _tiny_checkpoint(directory):
    """Two float32 tensors: [4] (16 bytes) then [32, 32] (4096 bytes)."""
    arrays = {
        "model.norm.weight": np.ones(4, np.float32),
        Q: np.arange(32 * 32, dtype=np.float32).reshape(32, 32),
    }
    (file,) = write_checkpoint(
        directory, [(n, a.shape, a.dtype) for n, a in arrays.items()], arrays.__getitem__
    )
    return file, arrays


def _data_start(file):
    (n,) = struct.unpack("<Q", file.read_bytes()[:8])
    return 8 + n


def test_intact_tiny_checkpoint_reads_back(tmp_path):
    file, arrays = _tiny_checkpoint(tmp_path)
    ckpt = SafetensorsCheckpoint(tmp_path)
    for name, a in arrays.items():
        np.testing.assert_array_equal(ckpt[name], a)


def test_truncated_body_names_file_tensor_and_bytes(tmp_path):
    file, _ = _tiny_checkpoint(tmp_path)
    start = _data_start(file)
    file.write_bytes(file.read_bytes()[: start + 3000])
    with pytest.raises(
        CheckpointError,
        match=rf"model\.safetensors: tensor '{Q}' needs bytes 16\.\.4112 but the file has only "
        r"3000 bytes after its header \(truncated or corrupt file\)",
    ):
        SafetensorsFile(file)


def test_file_truncated_after_opening_is_caught_on_read(tmp_path):
    file, _ = _tiny_checkpoint(tmp_path)
    f = SafetensorsFile(file)
    file.write_bytes(file.read_bytes()[: _data_start(file) + 3000])
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{Q}' needs bytes"):
        f[Q]


def _rewrite_header(file, edit):
    raw = file.read_bytes()
    start = _data_start(file)
    header = json.loads(raw[8:start])
    edit(header)
    blob = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[start:])


def test_header_offsets_that_disagree_with_shape(tmp_path):
    file, _ = _tiny_checkpoint(tmp_path)
    _rewrite_header(file, lambda h: h[Q].update(shape=[32, 16]))
    with pytest.raises(
        CheckpointError,
        match=rf"model\.safetensors: tensor '{Q}' has data_offsets \[16, 4112\] \(4096 bytes\), "
        r"but dtype F32 and shape \[32, 16\] need 2048 bytes",
    ):
        SafetensorsFile(file)
    _rewrite_header(file, lambda h: h[Q].update(shape=[32, 32], data_offsets=[4112, 16]))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q}' has bad data_offsets \[4112, 16\]"):
        SafetensorsFile(file)
    _rewrite_header(file, lambda h: h[Q].pop("data_offsets"))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q}' has no data_offsets"):
        SafetensorsFile(file)


def test_header_length_beyond_the_file(tmp_path):
    file = tmp_path / SINGLE_FILE
    file.write_bytes(struct.pack("<Q", 5000) + b'{"a": 1}')
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: not a safetensors file \(its header length 5000 exceeds "
        r"the 8 bytes after the length field; truncated or corrupt file\)",
    ):
        SafetensorsFile(file)


def test_header_that_is_not_json_or_not_an_object(tmp_path):
    file = tmp_path / SINGLE_FILE
    file.write_bytes(struct.pack("<Q", 6) + b"{oops}")
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: not a safetensors file \(header is not JSON"
    ):
        SafetensorsFile(file)
    file.write_bytes(struct.pack("<Q", 2) + b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a safetensors file"):
        SafetensorsFile(file)
    file.write_bytes(struct.pack("<Q", 6) + b"[1, 2]")
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: not a safetensors file \(header is a list, not a JSON object",
    ):
        SafetensorsFile(file)
    file.write_bytes(struct.pack("<Q", 8) + b'{"w": 3}')
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'w' has header 3"):
        SafetensorsFile(file)


def test_truncated_checkpoint_through_from_pretrained(tmp_path):
    from grpo_jax.models import create_model, from_pretrained, save_pretrained, tiny_config

    cfg = tiny_config(64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    directory = tmp_path / "ckpt"
    save_pretrained(create_model(cfg.replace(mlp_dim=64)), directory)
    file = directory / SINGLE_FILE
    size = file.stat().st_size
    file.write_bytes(file.read_bytes()[: size - 1000])
    with pytest.raises(
        CheckpointError,
        match=r"ckpt/model\.safetensors: tensor '[\w.]+' needs bytes \d+\.\.\d+ but the file has "
        r"only \d+ bytes after its header \(truncated or corrupt file\)",
    ):
        from_pretrained(directory)


# ---------------------------------------------------------------------------
# GSM8K through TFDS with no network.


def test_gsm8k_unprepared_without_network_fails_fast(tmp_path, monkeypatch):
    probes = []

    def no_network(*a, **k):
        probes.append(a)
        return False

    monkeypatch.setattr(gsm8k, "network_reachable", no_network)
    data_dir = tmp_path / "tfds"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        gsm8k.load("train", data_dir=data_dir)
    assert time.monotonic() - t0 < 10  # Importing TFDS is most of it.
    assert probes
    msg = str(info.value)
    assert msg.startswith(
        f"GSM8K is not prepared in {data_dir} and it cannot be downloaded here (no network): "
        "put GSM8K's train.jsonl/test.jsonl in a folder and set data.jsonl_dir=<folder> "
        "(docs/data.md)"
    )
    # Nothing half-downloaded is left behind.
    assert not (data_dir / "gsm8k").exists()

    with pytest.raises(ConfigError, match="cannot be downloaded here"):
        data.load_dataset({"source": "gsm8k", "data_dir": str(data_dir), "splits": "test"})


def test_gsm8k_docs_references_exist():
    root = pathlib.Path(gsm8k.__file__).resolve().parents[2]
    assert (root / "docs" / "data.md").is_file()
    text = pathlib.Path(gsm8k.__file__).read_text()
    for ref in set(re.findall(r"docs/[\w./-]+\.md", text)):
        assert (root / ref).is_file(), ref


def test_gsm8k_download_cache_counts_as_available(tmp_path, monkeypatch):
    """A filled TFDS download cache needs no network, so no probe is made."""
    from helpers_tfds import _prefill_tfds_download_cache, _write

    data_dir = tmp_path / "tfds"
    assert not gsm8k.download_cached(data_dir)
    _prefill_tfds_download_cache(_write(tmp_path / "jsonl"), data_dir / "downloads")
    assert gsm8k.download_cached(data_dir)


def test_network_probe_is_bounded_and_false_on_failure(monkeypatch):
    import socket

    def refuse(*a, **k):
        raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    t0 = time.monotonic()
    assert gsm8k.network_reachable(timeout=0.5) is False
    assert time.monotonic() - t0 < 2

    def hang(*a, **k):
        time.sleep(5)

    monkeypatch.setattr(socket, "create_connection", hang)
    t0 = time.monotonic()
    assert gsm8k.network_reachable(timeout=0.3) is False
    assert time.monotonic() - t0 < 2


@pytest.mark.slow
def test_skipped_rows_reach_the_run_summary(tmp_path):
    """A run on a JSONL file with a malformed row skips it and says so in summary.json."""
    import io

    from configs.default import get_config
    from grpo_jax.run.train import train

    rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(40)]
    (tmp_path / "train.jsonl").write_bytes(
        ("\n".join(rows) + "\n").encode() + b'{"prompt": "bad \xff", "answer": "1"}\n'
    )
    (tmp_path / "test.jsonl").write_text("\n".join(rows[:8]) + "\n")
    c = get_config("smoke")
    c.data = {
        "source": "jsonl",
        "train_path": str(tmp_path / "train.jsonl"),
        "test_path": str(tmp_path / "test.jsonl"),
        "on_error": "skip",
    }
    c.warm_start.enabled = False
    c.train.steps = 1
    c.eval.num_problems = 8
    c.eval.batch_size = 8
    c.eval.num_samples = 0
    c.eval.every = 0
    out = io.StringIO()
    summary = train(c, tmp_path / "w", stream=out)
    assert summary["data"] == {"skipped/train": 1, "skipped/test": 0}
    assert "malformed data rows skipped" in out.getvalue()


def test_more_devices_than_there_are_stops_in_one_line_before_the_workdir_is_touched(tmp_path):
    """mesh.num_devices over the devices there are: one ConfigError that says how a CPU gets
    more, raised before the checkpointer or the workdir's lock exist (an Orbax checkpointer
    opened first printed a page of traceback at exit)."""
    import jax

    from configs.default import get_config
    from grpo_jax.run.config import parse_config
    from grpo_jax.run.setup import setup

    c = get_config("smoke")
    c.mesh.num_devices = jax.device_count() + 8
    with pytest.raises(ConfigError) as e:
        setup(parse_config(c), tmp_path / "run")
    n = c.mesh.num_devices
    assert str(e.value) == (
        f"config key 'mesh.num_devices' = {n}, but only {jax.device_count()} devices are "
        f"available (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} gives {n})"
    )
    assert not (tmp_path / "run").exists()
