"""The per-device memory plans of Qwen2.5-1.5B- and 7B-sized runs, full fine-tuning and LoRA.

    .venv/bin/python benchmarks/memory_plans.py

Prints the two tables of README.md ("LoRA") and docs/lora.md ("Memory"):
``grpo_jax.run.memory_model.estimate`` for each model, training mode and placement, in
GiB. No model is built: the shapes are those of the public Qwen2.5 configs
(hidden size, layers, heads, KV heads, head width, MLP width, vocabulary, tied
embeddings), the workload 256 prompt + 512 completion tokens, remat, beta 0.04,
float32 compute, LoRA rank 16 on all seven projections.
tests/run/test_memory.py checks that the tables in the docs are what this prints.
"""

from __future__ import annotations

import sys

from grpo_jax.models import family_config
from grpo_jax.run import memory

MODELS = {
    "Qwen2.5-1.5B": dict(
        vocab_size=151936,
        hidden_size=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        mlp_dim=8960,
        tie_embeddings=True,
    ),
    "Qwen2.5-7B": dict(
        vocab_size=152064,
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        mlp_dim=18944,
        tie_embeddings=False,
    ),
}
MODES = (  # (label, LoRA rank, bytes per stored base parameter)
    ("full, float32", 0, 4),
    ("LoRA r=16, float32 base", 16, 4),
    ("LoRA r=16, bfloat16 base", 16, 2),
)
PLACEMENTS = {  # name: (mesh, rows trained and sampled at once)
    "16 fsdp devices, 128 rows": ({"fsdp": 16}, 128),
    "one device, 8 rows": ({}, 8),
}
HEADER = (
    "| model | training | trainable | params | grads | optimizer | reference | KV cache "
    "| activations | total |"
)


def table(placement: str) -> list[str]:
    """The markdown table of one placement, header included."""
    mesh, rows = PLACEMENTS[placement]
    gib = lambda b: f"{b / 2**30:.2f}"
    out = [HEADER, "|---" * 10 + "|"]
    for name, shape in MODELS.items():
        cfg = family_config("qwen2", **shape)
        for label, rank, param_bytes in MODES:
            est = memory.estimate(
                cfg,
                mesh_shape=mesh,
                layout="fsdp",
                batch_rows=rows,
                seq_len=512,
                prompt_len=256,
                beta=0.04,
                remat=True,
                param_bytes=param_bytes,
                lora_rank=rank,
            )
            trainable = est.num_params if est.trainable_params is None else est.trainable_params
            parts = (est.params, est.grads, est.optimizer, est.reference, est.kv_cache)
            cells = [name, label, f"{trainable / 1e6:.1f}M", *map(gib, parts)]
            cells += [gib(est.activations), gib(est.total)]
            out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> None:
    for placement in PLACEMENTS:
        print(f"Per device, {placement} (GiB):\n")
        print("\n".join(table(placement)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
