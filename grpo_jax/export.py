"""Export a trained policy as a Hugging Face model directory.

    python -m grpo_jax.export --workdir=/tmp/grpo_tiny --out=/tmp/grpo_tiny_hf [--step=200]
    python -m grpo_jax.export --workdir=/tmp/grpo_tiny --out=/tmp/grpo_tiny_sft --warm_start

Writes a checkpoint of a training workdir (the latest by default) as config.json,
generation_config.json, model.safetensors and the tokenizer's files; a LoRA run's adapters
merged (``--format=merged``, the default) or as PEFT adapters (``--format=peft``). ``out`` is
a new or empty directory or an earlier export (docs/recipes.md, "After training";
docs/lora.md, "Export").
"""

from __future__ import annotations

import json
import pathlib
import sys

from grpo_jax import cli

cli.quiet()  # before the imports of JAX, Flax and the model code below

from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import models  # noqa: E402
from grpo_jax.core.errors import CheckpointError, ConfigError  # noqa: E402
from grpo_jax.models import lora  # noqa: E402
from grpo_jax.run import runlocal  # noqa: E402
from grpo_jax.run.builders import (  # noqa: E402
    build_mesh,
    build_tokenizer,
    restore_policy,
    restore_warm_start,
)
from grpo_jax.run.config import parse_config  # noqa: E402


class ExportError(ValueError):
    """The export's source or destination is not usable."""


def _holds_a_run(path: pathlib.Path) -> bool:
    """A training workdir: its config.json beside its checkpoints or its metrics."""
    return (path / "config.json").is_file() and any(
        (path / n).exists() for n in ("checkpoints", "metrics.jsonl")
    )


def check_destination(workdir, out) -> None:
    """Refuses an ``out`` inside a training workdir (``workdir`` or another) or holding a run."""
    workdir, out = pathlib.Path(workdir).resolve(), pathlib.Path(out).resolve()
    for parent in (out, *out.parents):
        if parent == workdir or _holds_a_run(parent):
            raise ExportError(
                f"--out={out} is inside the training workdir {parent}; an export there would "
                "replace the run's config.json. Choose a directory outside any workdir"
            )
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ExportError(
            f"--out={out} holds files that are not an earlier export (no {MARKER}); an export "
            "would overwrite them. Choose a new or empty directory"
        )


MARKER = "export.json"  # what an export wrote, and from where


FORMATS = ("merged", "peft")


def export_hf(
    workdir,
    out,
    *,
    step: int | None = None,
    dtype=None,
    format: str = "merged",
    warm_start: bool = False,
) -> pathlib.Path:
    """Writes checkpoint ``step`` (latest when None) of ``workdir`` as a HF directory ``out``.

    ``format`` "peft" (LoRA runs only) writes the adapters as PEFT loads them.
    ``warm_start``: the warm-started policy GRPO began from (``<workdir>/warm_start``, a
    LoRA run's base) instead of a checkpoint, e.g. to start a reward model from it.
    """
    if format not in FORMATS:
        raise ExportError(f"--format={format!r} is not one of {list(FORMATS)}")
    if warm_start and (step is not None or format != "merged"):
        raise ExportError("--warm_start exports the warm start alone: no --step, no --format=peft")

    workdir = pathlib.Path(workdir)
    config_path = workdir / "config.json"
    if not config_path.exists():
        raise ExportError(f"{config_path} not found: is {workdir} a training workdir?")
    check_destination(workdir, out)
    run = runlocal.resolve(parse_config(json.loads(config_path.read_text())))
    tokenizer = build_tokenizer(run, workdir)
    mesh = build_mesh(run)
    out = pathlib.Path(out)
    if warm_start:
        if not run.warm_start.enabled:
            raise ExportError(f"--warm_start: the run in {workdir} has no warm start")
        graphdef, params = restore_warm_start(run, tokenizer, mesh, workdir)
        models.save_pretrained(nnx.merge(graphdef, params), out, dtype=dtype, tokenizer=tokenizer)
        return _mark(out, workdir, "warm_start", format)
    graphdef, params, lora_run = restore_policy(run, tokenizer, mesh, workdir / "checkpoints", step)
    if lora_run is None and format == "peft":
        raise ExportError(f"--format=peft: the run in {workdir} has no LoRA adapters (model.lora)")
    if format == "peft":
        lora.check_peft(params)  # before the base is written beside the adapters
        base_model = lora_run.base_path
        if run.warm_start.enabled or not base_model or base_model.endswith(".gguf"):
            # The adapters need the base they were trained on, which is on no disk as
            # a Hugging Face checkpoint: write it beside them.
            base = nnx.merge(lora_run.base_graphdef, lora.split(params)[0])
            base_model = models.save_pretrained(base, out / "base", tokenizer=tokenizer)
        model_cfg = nnx.merge(graphdef, params).config
        lora.save_peft(
            params, model_cfg, lora_run.cfg, out, base_model=str(pathlib.Path(base_model).resolve())
        )
    else:
        if lora_run is not None:  # W + s A B: a plain model of the base's architecture
            graphdef, params = lora_run.base_graphdef, lora.merged(params, lora_run.cfg.scale)
        models.save_pretrained(nnx.merge(graphdef, params), out, dtype=dtype, tokenizer=tokenizer)
    return _mark(out, workdir, step, format)


def _mark(out: pathlib.Path, workdir: pathlib.Path, step, format: str) -> pathlib.Path:
    """Writes the marker that says what was exported, and from where."""
    source = {"workdir": str(workdir.resolve()), "step": step, "format": format}
    (out / MARKER).write_text(json.dumps(source, indent=2) + "\n")
    return out


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    try:
        path = export_hf(
            FLAGS.workdir,
            FLAGS.out,
            step=FLAGS.step,
            format=FLAGS.format,
            warm_start=FLAGS.warm_start,
        )
    except (ExportError, ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        return cli.report_error(e, prefix="error")
    print(f"exported to {path}")
    return 0


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "Training workdir (config.json + checkpoints/).")
    flags.DEFINE_string("out", None, "Output Hugging Face model directory.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_enum(
        "format", "merged", ["merged", "peft"], "LoRA runs: merged weights or PEFT adapters."
    )
    flags.DEFINE_bool(
        "warm_start", False, "Export the warm-started policy (<workdir>/warm_start) instead."
    )
    flags.mark_flags_as_required(["workdir", "out"])
    app.run(main, argv=sys.argv, flags_parser=cli.parse_flags)
