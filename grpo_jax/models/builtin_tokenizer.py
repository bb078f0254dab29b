"""The project's own character-level tokenizer, in Hugging Face format.

One token per character over printable ASCII and newline, plus four special tokens, with
fixed ids; saved as a Hugging Face directory, so every consumer loads it with
``transformers.AutoTokenizer.from_pretrained(path)``. Any other character is ``<unk>``, and
:func:`warn_missing_characters` says which. docs/models.md, "The built-in tokenizer".
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n",)
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

# A minimal chat template: each message's content on its own line, no roles.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"

log = logging.getLogger(__name__)
_CHARSET = frozenset(CHARS)


def is_builtin(tokenizer) -> bool:
    """Whether ``tokenizer`` has this vocabulary (built here, or loaded from its saved files)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None or len(tokenizer) != VOCAB_SIZE:
        return False
    return get_vocab() == {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}


def warn_missing_characters(texts: Iterable[tuple[str, str]]) -> dict[str, str]:
    """One warning naming the characters of ``texts`` ((text, where it came from) pairs)
    that the tokenizer lacks and reads as ``<unk>``, each with the first place it was seen
    and how many texts hold it; returns {character: first place}, empty when none."""
    first: dict[str, str] = {}
    texts_with = collections.Counter()
    for text, where in texts:
        for ch in dict.fromkeys(text):  # in order of appearance: the same message every run
            if ch not in _CHARSET:
                first.setdefault(ch, where)
                texts_with[ch] += 1
    if first:
        common = [ch for ch, _ in texts_with.most_common()]
        shown = ", ".join(
            f"{ch!r} ({texts_with[ch]} text(s), first {first[ch]})" for ch in common[:8]
        )
        more = f" and {len(common) - 8} more" if len(common) > 8 else ""
        log.warning(
            "the built-in tokenizer has no token for %d character(s) of its input, which it "
            "reads as <unk>: %s%s",
            len(common),
            shown,
            more,
        )
    return first


def build_tokenizer():
    """The character tokenizer as a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character (newline included) is its own pre-token, so WordLevel
    # maps each to its id; anything outside the alphabet becomes <unk>.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(path: str | os.PathLike) -> pathlib.Path:
    """Writes the tokenizer as a Hugging Face directory at ``path`` and returns it."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(str(path))
    return path


def ensure_tokenizer(path: str | os.PathLike) -> pathlib.Path:
    """Saves the tokenizer at ``path`` unless a saved one is already there.

    The files are written into a fresh sibling folder that is then renamed to
    ``path`` in one step, so a process reading ``path`` (another host of the
    same run, which makes the same call) never sees it half written.
    """
    import shutil
    import tempfile

    path = pathlib.Path(path)
    if (path / "tokenizer.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    save_tokenizer(tmp)
    try:
        os.rename(tmp, path)  # replaces an empty folder; fails if another process won
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "tokenizer.json").exists():  # a folder left by something else
            save_tokenizer(path)
    return path
