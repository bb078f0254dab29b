"""JSONL loading, dataset configs, prompt formatting and the resumable iterator."""

import json
import logging

import pytest

from grpo_jax import data
from grpo_jax.data import DataIterator, MalformedRowError, read_jsonl
from grpo_jax.run.config import ConfigError


def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"q": "What is 2+2?", "a": 4, "why": "<answer>4</answer>", "level": 1})


def test_read_jsonl_fields_and_extra_columns(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [GOOD, "", json.dumps({"q": "x?", "a": "y"})])
    examples, skipped = read_jsonl(p, prompt_field="q", answer_field="a", solution_field="why")
    assert skipped == []
    assert examples == [
        {"prompt": "What is 2+2?", "answer": "4", "solution": "<answer>4</answer>", "level": 1},
        {"prompt": "x?", "answer": "y"},
    ]


@pytest.mark.parametrize(
    "line,problem",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"a": 1}), "missing field 'q'"),
        (json.dumps({"q": "x"}), "missing field 'a'"),
        (json.dumps({"q": 3, "a": 1}), "field 'q' = 3 is not text"),
        (json.dumps({"q": "x", "a": [1]}), r"field 'a' = \[1\] is not text"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, line, problem):
    p = _jsonl(tmp_path / "rows.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(MalformedRowError, match=rf"rows\.jsonl:3: {problem}"):
        read_jsonl(p, prompt_field="q", answer_field="a")
    examples, skipped = read_jsonl(p, prompt_field="q", answer_field="a", on_error="skip")
    assert len(examples) == 2 and skipped == [3]


def test_read_jsonl_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file .*missing.jsonl does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="on_error='ignore' is not one of"):
        read_jsonl(tmp_path / "missing.jsonl", on_error="ignore")


def test_load_dataset_jsonl_skips_and_counts(tmp_path, caplog):
    train = _jsonl(tmp_path / "train.jsonl", [GOOD, "oops", GOOD, "{}"])
    test = _jsonl(tmp_path / "test.jsonl", [GOOD])
    cfg = {
        "source": "jsonl",
        "train_path": str(train),
        "test_path": str(test),
        "prompt_field": "q",
        "answer_field": "a",
        "on_error": "skip",
    }
    stats = {}
    with caplog.at_level(logging.WARNING):
        splits = data.load_dataset(cfg, stats=stats)
    assert [len(splits["train"]), len(splits["test"])] == [2, 1]
    assert stats == {"skipped/train": 2, "skipped/test": 0}
    assert "skipped 2 malformed row(s)" in caplog.text and "[2, 4]" in caplog.text
    with pytest.raises(MalformedRowError, match=r"train\.jsonl:2: invalid JSON"):
        data.load_dataset({**cfg, "on_error": "raise"})


def test_load_dataset_config_errors():
    with pytest.raises(
        ConfigError, match=r"'data.source' = 'hf' is not one of \['gsm8k', 'jsonl', 'synthetic'\]"
    ):
        data.load_dataset({"source": "hf"})
    with pytest.raises(ConfigError, match="data config has no 'source'"):
        data.load_dataset({})
    with pytest.raises(ConfigError, match=r"unknown config key data.n_trian;"):
        data.load_dataset({"source": "synthetic", "n_trian": 5})
    with pytest.raises(ConfigError, match=r"unknown config key data.max_digits;"):
        data.load_dataset({"source": "synthetic", "task": "countdown", "max_digits": 2})
    with pytest.raises(ConfigError, match="needs data.train_path and/or data.test_path"):
        data.load_dataset({"source": "jsonl"})
    with pytest.raises(ConfigError, match=r"'data.on_error' = 'drop'"):
        data.load_dataset({"source": "jsonl", "train_path": "x", "on_error": "drop"})
    with pytest.raises(ConfigError, match="must be a mapping"):
        data.load_dataset(["synthetic"])


def test_load_dataset_synthetic_from_config_dict():
    import ml_collections

    cfg = ml_collections.ConfigDict(
        {
            "source": "synthetic",
            "task": "arithmetic",
            "n_train": 20,
            "n_test": 5,
            "seed": 3,
            "max_digits": 3,
            "reverse_digits": True,
        }
    )
    splits = data.load_dataset(cfg)
    assert [len(splits["train"]), len(splits["test"])] == [20, 5]
    assert splits["train"] == data.make_split(
        "arithmetic", "train", 20, 3, max_digits=3, reverse_digits=True
    )


# ------------------------------------------------------------------ prompts


def _chat_tokenizer(template=True):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
        unk_token="[UNK]",
    )
    if template:
        tok.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
    return tok


def test_format_prompt_plain():
    ex = {"prompt": "What is 2+2?", "answer": "4"}
    text = data.format_prompt(ex)
    assert text.startswith("What is 2+2?\n") and "<think>" in text and "<answer>" in text
    assert data.format_prompt(ex, template=data.PLAIN_TEMPLATE) == "What is 2+2?"
    assert data.format_prompt("12+3=", template="{prompt}") == "12+3="
    assert data.format_prompt(ex, template="Q: {prompt}\nA:", system="Be brief.") == (
        "Be brief.\n\nQ: What is 2+2?\nA:"
    )
    with pytest.raises(ValueError, match=r"uses field 'question', which the example does not"):
        data.format_prompt(ex, template="{question}")
    with pytest.raises(ValueError, match=r"is not a valid format string .* \{\{ and \}\}"):
        data.format_prompt(ex, template="{prompt} {")


def test_format_prompt_chat():
    ex = {"prompt": "What is 2+2?", "answer": "4"}
    tok = _chat_tokenizer()
    got = data.format_prompt(ex, tokenizer=tok, chat=True, system="You are exact.")
    assert got == (
        "<|system|>You are exact.\n<|user|>What is 2+2?\n"
        + data.FORMAT_INSTRUCTION
        + "\n<|assistant|>"
    )
    assert data.format_prompt(ex, template="{prompt}", tokenizer=tok, chat=True) == (
        "<|user|>What is 2+2?\n<|assistant|>"
    )
    with pytest.raises(ValueError, match="chat=True needs a tokenizer"):
        data.format_prompt(ex, chat=True)
    with pytest.raises(ValueError, match="has no chat template; use chat=False"):
        data.format_prompt(ex, tokenizer=_chat_tokenizer(template=False), chat=True)


# ----------------------------------------------------------------- iterator

EXAMPLES = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]


def _ids(batch):
    return [int(ex["answer"]) for ex in batch]


def test_iterator_epochs_cover_shard_and_reshuffle():
    it = DataIterator(EXAMPLES, 3, seed=0)
    assert it.batches_per_epoch == 3
    epoch0 = [_ids(it.next()) for _ in range(3)]
    epoch1 = [_ids(it.next()) for _ in range(3)]
    flat0, flat1 = sum(epoch0, []), sum(epoch1, [])
    assert len(set(flat0)) == 9 and len(set(flat1)) == 9  # one dropped per epoch
    assert flat0 != flat1  # reshuffled
    assert it.state_dict()["epoch"] == 1
    # Same seed, same stream; another seed, another.
    again = DataIterator(EXAMPLES, 3, seed=0)
    assert [_ids(again.next()) for _ in range(6)] == epoch0 + epoch1
    other = DataIterator(EXAMPLES, 3, seed=1)
    assert [_ids(other.next()) for _ in range(3)] != epoch0


def test_iterator_no_shuffle_and_keep_remainder():
    it = DataIterator(EXAMPLES, 4, seed=0, shuffle=False, drop_remainder=False)
    got = [_ids(it.next()) for _ in range(4)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


def test_iterator_save_restore_gives_same_following_batches():
    it = DataIterator(EXAMPLES, 3, seed=7, drop_remainder=False)
    for _ in range(5):
        it.next()
    state = json.loads(json.dumps(it.state_dict()))  # survives a JSON checkpoint
    expected = [_ids(it.next()) for _ in range(7)]
    fresh = DataIterator(EXAMPLES, 3, seed=7, drop_remainder=False)
    fresh.load_state_dict(state)
    assert [_ids(fresh.next()) for _ in range(7)] == expected


def test_iterator_hosts_read_their_blocks_of_the_one_host_stream():
    examples = [{"prompt": f"p{i}", "answer": str(i)} for i in range(23)]
    one = DataIterator(examples, 8, seed=5)
    hosts = [DataIterator(examples, 8, seed=5, process_index=h, process_count=4) for h in range(4)]
    assert one.batches_per_epoch == 2 and hosts[0].host_batch_size == 2
    for _ in range(5):  # across epoch boundaries
        want = _ids(one.next())
        parts = [_ids(h.next()) for h in hosts]
        assert sum(parts, []) == want
        assert all(len(p) == 2 for p in parts)
    # Uneven blocks through ``rows`` (a mesh can give hosts different shares).
    a = DataIterator(examples, 8, seed=5, rows=slice(0, 6))
    b = DataIterator(examples, 8, seed=5, rows=slice(6, 8))
    assert _ids(a.next()) + _ids(b.next()) == _ids(DataIterator(examples, 8, seed=5).next())
    # Every host holds the same state; a 4-host state resumes one host, same stream.
    assert len({json.dumps(h.state_dict()) for h in hosts}) == 1
    resumed = DataIterator(examples, 8, seed=5)
    resumed.load_state_dict(hosts[2].state_dict())
    assert _ids(resumed.next()) == _ids(one.next())


def test_iterator_reads_only_this_hosts_rows():
    class Recording(list):
        read = []

        def __getitem__(self, i):
            self.read.append(i)
            return super().__getitem__(i)

    data = Recording({"prompt": f"p{i}", "answer": str(i)} for i in range(12))
    it = DataIterator(data, 4, seed=0, process_index=1, process_count=2)
    got = [_ids(it.next()) for _ in range(3)]
    assert sorted(data.read) == sorted(sum(got, [])) and len(data.read) == 6


def test_iterator_errors():
    with pytest.raises(ValueError, match="10 examples are fewer than batch_size=12"):
        DataIterator(EXAMPLES, 12, seed=0)
    with pytest.raises(ValueError, match="batch_size=3 does not split into 2 equal blocks"):
        DataIterator(EXAMPLES, 3, seed=0, process_count=2)
    with pytest.raises(ValueError, match="drop_remainder=False needs one host"):
        DataIterator(EXAMPLES, 4, seed=0, process_count=2, drop_remainder=False)
    with pytest.raises(ValueError, match=r"rows=slice\(3, 9, None\) must be a block"):
        DataIterator(EXAMPLES, 4, seed=0, rows=slice(3, 9))
    with pytest.raises(ValueError, match="not both"):
        DataIterator(EXAMPLES, 4, seed=0, rows=slice(0, 2), process_count=2)
    with pytest.raises(ValueError, match=r"process_index=2 must be in \[0, process_count=2\)"):
        DataIterator(EXAMPLES, 2, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
        DataIterator(EXAMPLES, 0, seed=0)
    it = DataIterator(EXAMPLES, 2, seed=0)
    with pytest.raises(ValueError, match="saved with seed=1, but this iterator has seed=0"):
        it.load_state_dict({**it.state_dict(), "seed": 1})
    with pytest.raises(ValueError, match="saved with num_examples=11"):
        it.load_state_dict({**it.state_dict(), "num_examples": 11})
    with pytest.raises(ValueError, match="iterator state has no 'position'"):
        it.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=r"position=99 is not in \[0, 10\]"):
        it.load_state_dict({"epoch": 0, "position": 99})
