"""The tokenizer of a GGUF file, built from its metadata with the ``tokenizers`` library.

A SentencePiece-BPE vocabulary (``tokenizer.ggml.model = "llama"``: Gemma, Llama 2) is
rebuilt as a byte-fallback BPE whose merges are ranked from the vocabulary (merges are not
stored), as a transformers ``PreTrainedTokenizerFast`` (no torch). docs/gguf.md, "The
tokenizer", has the rules and the test against transformers' own GGUF tokenizer.
"""

from __future__ import annotations

import os

from grpo_jax.models.gguf_format import GGUFFile
from grpo_jax.models.safetensors_io import CheckpointError

CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"


def _merges(tokens: list[str], rank: list[float]) -> list[tuple[str, str]]:
    """All (left, right) with left + right a token; best-ranked (highest) merged token first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, token in enumerate(tokens):
        for k in range(len(token) - 1, 0, -1):  # Longer left piece first.
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                found.append((-rank[i], len(found), left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def _sentencepiece_bpe(g, tokens: list[str], token_types: list[int]):
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    gemma = g.architecture.startswith("gemma")
    if gemma:
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank = [-float(i) for i in range(len(tokens))]
    else:
        rank = [float(s) for s in g.get("tokenizer.ggml.scores")]
    unk_id = g.get("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    model = BPE(
        vocab=vocab,
        merges=_merges(tokens, rank),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    steps = []
    if g.get("tokenizer.ggml.add_space_prefix", not gemma):
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(SPACE, 1, 0)] if len(steps) == 2 else [])
    )
    added = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, token_types)
        if ty == CONTROL
    ] + [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, token_types)
        if ty == USER_DEFINED and t.strip(" ")
    ]
    tok.add_tokens(added)
    return tok, tokens


def tokenizer_from_gguf(path_or_file: str | os.PathLike | object):
    """The ``PreTrainedTokenizerFast`` of a GGUF file (a path or a :class:`GGUFFile`)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    g = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
    kind = g.get("tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(f"{g.path}: no tokenizer in the metadata (tokenizer.ggml.model)")
    if kind != "llama":
        raise CheckpointError(
            f"{g.path}: tokenizer model {kind!r} is not supported (only SentencePiece BPE, "
            "'llama'); convert the original Hugging Face checkpoint's tokenizer instead"
        )
    tokens = list(g.get("tokenizer.ggml.tokens"))
    types = list(g.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    tok, tokens = _sentencepiece_bpe(g, tokens, types)

    def special(key):
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    ids = {t: tokens.index(t) for t in (bos, eos) if t is not None}
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=sorted(ids.items())
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=special("unknown"),
        pad_token=special("padding"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )
    template = g.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer of the GGUF file ``path`` (see :func:`tokenizer_from_gguf`)."""
    return tokenizer_from_gguf(path)
