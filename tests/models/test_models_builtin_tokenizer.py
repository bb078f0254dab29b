"""The project's character tokenizer, saved and loaded in Hugging Face format."""

import pathlib

from transformers import AutoTokenizer

from grpo_jax.models import builtin_tokenizer as bt


def test_roundtrip_through_autotokenizer(tmp_path):
    path = bt.save_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == bt.VOCAB_SIZE == 100
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("12+3=\n").input_ids
    assert ids == [
        1,
        4 + ord("1") - 32,
        4 + ord("2") - 32,
        4 + ord("+") - 32,
        4 + ord("3") - 32,
        4 + ord("=") - 32,
        99,
    ]
    assert tok("ab", add_special_tokens=False).input_ids == [69, 70]
    text = "What is 123 + 45? <answer>861</answer>\n"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    assert tok.decode([69, 70, bt.EOS_ID], skip_special_tokens=True) == "ab"
    assert tok("é", add_special_tokens=False).input_ids == [bt.UNK_ID]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "hi\n"


def test_ensure_keeps_existing(tmp_path):
    p = bt.ensure_tokenizer(tmp_path / "t")
    mtime = (p / "tokenizer.json").stat().st_mtime_ns
    bt.ensure_tokenizer(p)
    assert (p / "tokenizer.json").stat().st_mtime_ns == mtime


def test_the_tokenizer_folder_appears_whole(tmp_path, monkeypatch):
    """Every host of a run saves the built-in tokenizer into the same workdir and then loads
    it: the files are written elsewhere and the folder appears in one rename, so a reader
    never sees it half written (a host once read an empty tokenizer_config.json)."""
    written = []
    real = bt.save_tokenizer

    def recording(path):
        written.append(pathlib.Path(path))
        assert not (tmp_path / "w" / "tokenizer").exists()  # nothing visible while writing
        return real(path)

    monkeypatch.setattr(bt, "save_tokenizer", recording)
    target = tmp_path / "w" / "tokenizer"
    assert bt.ensure_tokenizer(target) == target
    assert written and written[0] != target and written[0].parent == target.parent
    AutoTokenizer.from_pretrained(str(target))
    assert [p.name for p in target.parent.iterdir()] == ["tokenizer"]  # no leftovers
    bt.ensure_tokenizer(target)  # a second host finds it whole and writes nothing
    assert len(written) == 1


def test_characters_it_lacks_are_named_once_with_where_they_came_from(tmp_path, caplog):
    import logging

    tok = AutoTokenizer.from_pretrained(str(bt.save_tokenizer(tmp_path / "tok")))
    assert bt.is_builtin(tok) and bt.is_builtin(bt.build_tokenizer())
    texts = [("12+3=15", "a:1"), ("café ✓", "a:2"), ("né\t", "a:3"), ("ok", "a:4")]
    with caplog.at_level(logging.WARNING, logger="grpo_jax.models.builtin_tokenizer"):
        assert bt.warn_missing_characters(texts) == {"é": "a:2", "✓": "a:2", "\t": "a:3"}
    assert [r.getMessage() for r in caplog.records] == [
        "the built-in tokenizer has no token for 3 character(s) of its input, which it reads as "
        "<unk>: 'é' (2 text(s), first a:2), '✓' (1 text(s), first a:2), '\\t' (1 text(s), "
        "first a:3)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_jax.models.builtin_tokenizer"):
        assert bt.warn_missing_characters([("12+3=15\n", "a:1")]) == {}
    assert not caplog.records
