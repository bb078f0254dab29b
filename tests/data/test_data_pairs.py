"""Reading preference pairs: JSONL files and prepared TFDS datasets, and every error naming
what is wrong (grpo_jax/data/pairs.py)."""

import json
import logging
import subprocess
import sys
import textwrap

import helpers_tfds
import pytest

from grpo_jax.core.errors import ConfigError, MalformedRowError
from grpo_jax.data.pairs import load_pairs


def test_malformed_rows_name_file_and_line(tmp_path):
    good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    cases = {
        "not valid JSON": "{oops",
        "expected a JSON object": "[1, 2]",
        "needs string fields .*; missing or not a string: \\['rejected'\\]": json.dumps(
            {"prompt": "p", "chosen": "a", "rejected": 3}
        ),
    }
    for i, (problem, line) in enumerate(cases.items()):
        path = tmp_path / f"pairs{i}.jsonl"
        path.write_text(f"{good}\n\n{line}\n")
        with pytest.raises(MalformedRowError, match=f"pairs{i}.jsonl:3: {problem}"):
            load_pairs(path)
    ok = tmp_path / "ok.jsonl"
    ok.write_text(good + "\n")
    assert load_pairs(ok) == [("p", "a", "b")]
    with pytest.raises(FileNotFoundError, match="nope.jsonl not found"):
        load_pairs(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no preference pairs"):
        load_pairs(tmp_path / "empty.jsonl")


def test_jsonl_fields_may_be_named_otherwise(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"q": "1+1=", "good": "2", "bad": "3", "other": 1}) + "\n")
    assert load_pairs(path, fields=("q", "good", "bad")) == [("1+1=", "2", "3")]
    with pytest.raises(MalformedRowError, match="missing or not a string: \\['prompt'"):
        load_pairs(path)
    for fields in (("q", "good"), ("q", "", "bad")):
        with pytest.raises(ConfigError, match="must name three features"):
            load_pairs(path, fields=fields)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    return helpers_tfds.prepare(tmp_path_factory.mktemp("tfds"))


def _want(rows):
    return sorted((r["question"], r["response_j"], r["response_k"]) for r in rows)


def test_a_prepared_tfds_dataset_reads_as_pairs(tfds_dir):
    every = helpers_tfds.rows(helpers_tfds.TRAIN + helpers_tfds.TEST)
    kw = dict(data_dir=tfds_dir, fields=helpers_tfds.FIELDS)
    train = load_pairs("tfds:tiny_prefs", **kw)
    assert sorted(train) == _want(every[: helpers_tfds.TRAIN])  # TFDS stores them shuffled
    test = load_pairs("tfds:tiny_prefs:1.0.0", split="test", **kw)
    assert sorted(test) == _want(every[helpers_tfds.TRAIN :])
    assert len(load_pairs("tfds:tiny_prefs", split="train[:5]", **kw)) == 5  # TFDS slicing


def test_tfds_errors_name_the_problem(tfds_dir, tmp_path):
    kw = dict(data_dir=tfds_dir, fields=helpers_tfds.FIELDS)
    with pytest.raises(ConfigError, match=r"has no feature \['prompt', 'chosen', 'rejected'\]"):
        load_pairs("tfds:tiny_prefs", data_dir=tfds_dir)  # the default field names
    with pytest.raises(ConfigError, match="question.*response_j.*score"):
        load_pairs("tfds:tiny_prefs", data_dir=tfds_dir)  # ... and lists those it has
    with pytest.raises(MalformedRowError, match=r"tfds:tiny_prefs\[train\]:\d+: .*'score' is"):
        load_pairs("tfds:tiny_prefs", data_dir=tfds_dir, fields=("question", "score", "response_k"))
    with pytest.raises(ConfigError, match="split 'validation'.*train.*test"):
        load_pairs("tfds:tiny_prefs", split="validation", **kw)
    with pytest.raises(ConfigError, match="tfds:no_such_prefs is neither prepared"):
        load_pairs("tfds:no_such_prefs", **kw)
    with pytest.raises(ConfigError, match="names no dataset"):
        load_pairs("tfds:", **kw)
    # A dataset TFDS knows, not prepared here: no download, a pointer to preparing it.
    with pytest.raises(ConfigError, match="tfds:imdb_reviews is not prepared in .*never"):
        load_pairs("tfds:imdb_reviews", data_dir=tmp_path, fields=helpers_tfds.FIELDS)


def test_a_prepared_folder_reads_without_the_code_that_built_it(tfds_dir):
    """What a copied data_dir gives a machine that never had the builder: the pairs."""
    code = textwrap.dedent(f"""
        from grpo_jax.data.pairs import load_pairs
        pairs = load_pairs("tfds:tiny_prefs", data_dir={str(tfds_dir)!r},
                           fields=("question", "response_j", "response_k"))
        print(len(pairs), sorted(pairs)[0])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first = _want(helpers_tfds.rows(helpers_tfds.TRAIN))[0]
    assert done.stdout.strip().splitlines()[-1] == f"{helpers_tfds.TRAIN} {first}"


def _write(path, rows):
    path.write_text(
        "".join(json.dumps(dict(zip(("prompt", "chosen", "rejected"), r))) + "\n" for r in rows)
    )
    return path


def test_a_directory_is_not_reported_as_missing(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"file {tmp_path} is a directory; give a JSONL"):
        load_pairs(tmp_path)


def test_each_pair_keeps_its_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n\n' * 2)
    assert [(p.path, p.lineno) for p in load_pairs(path)] == [(str(path), 1), (str(path), 3)]


def test_pairs_whose_chosen_is_their_rejected_are_kept_with_one_warning(tmp_path, caplog):
    rows = [("1+1=", "2", "3"), ("1+2=", "3", "3"), ("2+2=", "4", "5"), ("2+3=", "5", "5")]
    path = _write(tmp_path / "pairs.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="grpo_jax.data.pairs"):
        assert load_pairs(path) == rows
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 of 4 pairs have the same chosen and rejected text (line(s) 2, 4); they are "
        "kept, add nothing to the loss and count as wrong in the pairwise accuracy"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_jax.data.pairs"):
        load_pairs(_write(tmp_path / "distinct.jsonl", rows[:1]))
    assert not caplog.records


def test_a_pair_longer_than_the_limit_names_its_line(tmp_path, builtin_tokenizer):
    from grpo_jax.data.pairs import check_lengths

    path = _write(tmp_path / "pairs.jsonl", [("1+1=", "2", "3"), ("1+2=", "3", "4" * 60)])
    pairs = load_pairs(path)
    check_lengths(pairs, builtin_tokenizer, 65, "tokens")  # <bos> + 4 + 60 characters
    with pytest.raises(
        MalformedRowError, match=r"pairs.jsonl:2: prompt \+ rejected is 65 tokens \(64 char"
    ):
        check_lengths(pairs, builtin_tokenizer, 64, "tokens of the largest bucket")
    # Five million characters: refused from the text's head, without tokenizing them all.
    huge = _write(
        tmp_path / "huge.jsonl", [("1+1=", "2", "3")] * 3 + [("1+1=", "x" * 5_000_000, "3")]
    )
    with pytest.raises(
        MalformedRowError,
        match=r"huge.jsonl:4: prompt \+ chosen is over [0-9,]+ tokens \(5,000,004 characters\), "
        "more than the 1024 tokens of --buckets",
    ):
        check_lengths(load_pairs(huge), builtin_tokenizer, 1024, "tokens of --buckets")
