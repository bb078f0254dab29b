"""Converts a GGUF file (llama.cpp's format) into a Hugging Face checkpoint directory.

    python -m grpo_jax.convert_gguf gemma-3-270m-q4_k_m.gguf /models/gemma-3-270m \\
        [--dtype=bfloat16] [--no-tokenizer]

Supported: Gemma 3, Llama, Qwen2 and Qwen3 text models. The directory is what
``--config.model.path`` and transformers read; a conversion that fails changes nothing in it,
and a bad file or destination is one ``error:`` line and exit status 2 (docs/gguf.md).
"""

from __future__ import annotations

import argparse
import sys

from grpo_jax import cli
from grpo_jax.models.gguf import convert_gguf
from grpo_jax.models.safetensors_io import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_jax.convert_gguf", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out_dir", help="the Hugging Face checkpoint directory to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--no-tokenizer", action="store_true", help="write the weights and config only"
    )
    args = parser.parse_args(argv)
    try:
        out = convert_gguf(
            args.gguf, args.out_dir, dtype=args.dtype, tokenizer=not args.no_tokenizer
        )
    except (CheckpointError, OSError) as e:  # the input file or the destination
        return cli.report_error(e)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
