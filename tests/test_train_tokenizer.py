"""The project's character tokenizer, saved and loaded in Hugging Face format."""

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
