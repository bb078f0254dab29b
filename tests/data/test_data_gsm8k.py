"""GSM8K through tensorflow-datasets, offline: local JSONL and a pre-filled TFDS cache."""

import json

import pytest
from helpers_tfds import _prefill_tfds_download_cache, _write

from grpo_jax import data
from grpo_jax.data import gsm8k


def _key(ex):
    return (ex["prompt"], ex["answer"], ex["solution"])


def test_to_example_normalises_and_converts():
    ex = gsm8k.to_example(" Q? ", "Cost 2 * 540 = <<2*540=1080>>1080.\n#### 1,080")
    assert ex == {
        "prompt": "Q?",
        "answer": "1080",
        "solution": "<think>\nCost 2 * 540 = 1080.\n</think>\n<answer>1080</answer>",
    }
    with pytest.raises(ValueError, match="no '####' final-answer marker"):
        gsm8k.to_example("Q", "just text")
    with pytest.raises(ValueError, match=r"no number after '####' \(got 'many'\)"):
        gsm8k.to_example("Q", "x\n#### many")


def test_tfds_local_route_reads_what_was_written(tmp_path, monkeypatch):
    src = _write(tmp_path / "jsonl")
    data_dir = tmp_path / "tfds"
    train = gsm8k.load("train", data_dir=data_dir, jsonl_dir=src)
    direct, skipped = gsm8k.read_gsm8k_jsonl(src / "train.jsonl")
    assert skipped == [] and len(train) == 4
    assert sorted(map(_key, train)) == sorted(map(_key, direct))
    assert sorted(ex["answer"] for ex in train) == ["-3", "1080", "4.5", "7"]
    assert all("<<" not in ex["solution"] for ex in train)
    assert (data_dir / "gsm8k_local" / "1.0.0").is_dir()

    # Prepared once: a second load must not prepare again.
    cls = gsm8k.local_builder_class()

    def no_prepare(*a, **k):
        raise AssertionError("prepared twice")

    monkeypatch.setattr(cls, "download_and_prepare", no_prepare)
    test = gsm8k.load("test", data_dir=data_dir, jsonl_dir=src)
    assert sorted(ex["answer"] for ex in test) == ["42", "9"]
    assert len(gsm8k.load("test[:1]", data_dir=data_dir, jsonl_dir=src)) == 1
    with pytest.raises(ValueError, match=r"split 'validation' not found .* \['test', 'train'\]"):
        gsm8k.load("validation", data_dir=data_dir, jsonl_dir=src)

    # Changed source files are refused rather than served stale.
    (src / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ValueError, match="was prepared from other GSM8K files"):
        gsm8k.load("test", data_dir=data_dir, jsonl_dir=src)


def test_tfds_local_route_names_file_and_line_of_bad_row(tmp_path):
    src = _write(tmp_path / "jsonl")
    with (src / "train.jsonl").open("a") as f:
        f.write(json.dumps({"question": "no marker", "answer": "42"}) + "\n")
    with pytest.raises(Exception, match=r"train\.jsonl:5: answer has no '####'"):
        gsm8k.load("train", data_dir=tmp_path / "tfds", jsonl_dir=src)


def test_missing_jsonl_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no \\*.jsonl files"):
        gsm8k.load("train", data_dir=tmp_path, jsonl_dir=tmp_path / "nowhere")


def test_tfds_gsm8k_builder_path_without_network(tmp_path):
    """TFDS's own gsm8k builder prepared from a filled download cache, read by load()."""
    src = _write(tmp_path / "jsonl")
    data_dir = tmp_path / "tfds"
    _prefill_tfds_download_cache(src, data_dir / "downloads")
    test = gsm8k.load("test", data_dir=data_dir)
    assert (data_dir / "gsm8k" / "1.0.0").is_dir()
    direct, _ = gsm8k.read_gsm8k_jsonl(src / "test.jsonl")
    assert sorted(map(_key, test)) == sorted(map(_key, direct))


def test_real_gsm8k_test_split_through_tfds(gsm8k_dir, tmp_path):
    src = tmp_path / "jsonl"
    src.mkdir()
    (src / "test.jsonl").symlink_to(gsm8k_dir / "test.jsonl")
    splits = data.load_dataset(
        {
            "source": "gsm8k",
            "jsonl_dir": str(src),
            "data_dir": str(tmp_path / "tfds"),
            "splits": "test",
        }
    )
    direct, _ = gsm8k.read_gsm8k_jsonl(gsm8k_dir / "test.jsonl")
    assert list(splits) == ["test"] and len(splits["test"]) == 1319
    assert sorted(map(_key, splits["test"])) == sorted(map(_key, direct))
