"""The evaluate command: greedy pass@1 and unbiased pass@k of a checkpoint (run/evaluation.py).

    python -m grpo_jax.evaluate --checkpoint=<workdir> [--config=configs/default.py]

``--checkpoint`` is a training workdir, its ``checkpoints/`` directory, one step of it, or a
Hugging Face model directory; the settings come from the run's own ``config.json`` or from
``--config``. A run's checkpoint of step s gives the figures of its ``eval/step_<s>.jsonl``,
problem by problem: the samples draw from the same key. README.md, "Evaluating a checkpoint",
and docs/evaluation.md have the rest.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from grpo_jax import cli

cli.quiet()  # before the imports of JAX, Orbax and transformers below

from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from grpo_jax import models  # noqa: E402
from grpo_jax.core import problems  # noqa: E402
from grpo_jax.run import record, runlocal  # noqa: E402
from grpo_jax.run.builders import (  # noqa: E402
    build_datasets,
    build_encoder,
    build_mesh,
    build_scorer,
    build_tokenizer,
    eval_examples,
    restore_policy,
    tokenizer_sampling,
)
from grpo_jax.run.checkpoints import Checkpointer  # noqa: E402
from grpo_jax.run.config import BUILTIN_TOKENIZER, ConfigError, parse_config  # noqa: E402
from grpo_jax.run.evaluation import eval_key, evaluate_problems  # noqa: E402

# ---------------------------------------------------------------------------
# Command line.


def _is_hf_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").exists() and (
        (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    )


def load_policy(run, checkpoint: str | pathlib.Path, mesh):
    """(graphdef, params, tokenizer) of a workdir / checkpoint dir / step dir / HF directory."""
    return load_policy_at(run, checkpoint, mesh)[:3]


def load_policy_at(run, checkpoint: str | pathlib.Path, mesh):
    """(graphdef, params, tokenizer, step) of a workdir (its latest step), a checkpoint dir
    (latest step), a step dir or a Hugging Face directory (step None)."""
    path = pathlib.Path(checkpoint)
    if _workdir_of(path) is None and _is_hf_dir(path):
        model = models.from_pretrained(str(path), mesh=mesh, layout=run.mesh.layout)
        if run.tokenizer == BUILTIN_TOKENIZER:
            tokenizer = models.load_tokenizer(path)  # Exports carry their tokenizer.
        else:
            tokenizer = build_tokenizer(run, path)
        return (*nnx.split(model), tokenizer, None)
    step = None
    if (path / "checkpoints").is_dir():
        workdir, ckdir = path, path / "checkpoints"
    elif path.name.isdigit() and path.parent.is_dir():
        step, ckdir, workdir = int(path.name), path.parent, path.parent.parent
    elif path.is_dir():
        workdir, ckdir = path.parent, path
    else:
        raise FileNotFoundError(
            f"--checkpoint={str(checkpoint)!r} is neither a training workdir, a checkpoint "
            "directory, a checkpoint step nor a Hugging Face model directory"
        )
    if step is None:  # the latest, named: the evaluation key follows it
        ck = Checkpointer(ckdir)
        try:
            step = ck.latest_step()
        finally:
            ck.close()
        if step is None:
            raise FileNotFoundError(f"--checkpoint={str(checkpoint)!r}: no checkpoint in {ckdir}")
    tokenizer = build_tokenizer(run, workdir)
    graphdef, params, _ = restore_policy(run, tokenizer, mesh, ckdir, step)  # LoRA: base + adapters
    return graphdef, params, tokenizer, step


def _set(value):
    """``value`` without the None-valued keys of its mappings, at every depth."""
    if isinstance(value, dict):
        return {k: _set(v) for k, v in value.items() if v is not None}
    return value


def _workdir_of(path: pathlib.Path) -> pathlib.Path | None:
    """The training workdir that ``path`` (workdir, checkpoints dir or step) belongs to."""
    for d in (path, path.parent, path.parent.parent):
        if (d / "checkpoints").is_dir() and (d / "config.json").is_file():
            return d
    return None


def run_config_for(checkpoint, config=None):
    """The ``RunConfig`` to evaluate ``checkpoint`` with: ``config``, or the run's own.

    A training workdir's ``config.json`` is the default; a given ``config``
    must agree with it on the model and tokenizer (else ConfigError naming them).
    """
    workdir = _workdir_of(pathlib.Path(checkpoint))
    saved = json.loads((workdir / "config.json").read_text()) if workdir is not None else None
    if config is None:
        if saved is None:
            raise ConfigError(
                f"--checkpoint={checkpoint} is not a training workdir (no config.json beside "
                "checkpoints/): give the run's --config"
            )
        return parse_config(saved)
    run = parse_config(config)
    if saved is not None:
        # A key set to None is the default an older run's config.json had no key for.
        differ = [k for k in ("model", "tokenizer") if _set(saved.get(k)) != _set(run.raw.get(k))]
        if differ:
            raise ConfigError(
                f"--config does not match the run in {workdir}: its {differ} differ from "
                f"{workdir / 'config.json'} ({ {k: saved.get(k) for k in differ} }); the "
                "checkpoint's parameters are that model's. Omit --config to evaluate with the "
                "run's own config"
            )
    return run


def evaluate_checkpoint(checkpoint, config=None, message=lambda text: None):
    """(problems, figures, record, file header) of ``checkpoint`` (``--checkpoint``) evaluated
    with ``config`` (None: the run's own), sampled from the run's evaluation key of its step
    (the header's ``step``; None for a Hugging Face directory, which draws from step 0's)."""
    t0 = time.perf_counter()
    run = runlocal.resolve(run_config_for(checkpoint, config))
    mesh = build_mesh(run)
    message(f"loading {checkpoint}")
    graphdef, params, tokenizer, step = load_policy_at(run, checkpoint, mesh)
    examples = eval_examples(run, build_datasets(run))
    message(
        f"{len(examples)} problems, loaded in {time.perf_counter() - t0:.0f}s; the first "
        "batch also compiles the sampler"
    )
    prob = evaluate_problems(
        graphdef,
        params,
        examples,
        encoder=build_encoder(run, tokenizer),
        scorer=build_scorer(run),
        sampling=tokenizer_sampling(run, tokenizer),
        cfg=run.eval,
        key=eval_key(run.seed, 0 if step is None else step),
        mesh=mesh,
        message=message,
    )
    k = run.eval.k if run.eval.num_samples else None
    rec = record.run_record(run, examples)
    rec["checkpoint"] = str(checkpoint)
    header = {
        "step": step,
        "k": k,
        "num_samples": run.eval.num_samples,
        "temperature": run.eval.temperature,
        "seeds": list(run.eval.seeds),
    }
    return prob, problems.figures(prob, k), rec, header


def main(argv):
    del argv
    cli.quiet()  # again: absl's app.run set its own log levels after the import
    FLAGS = flags.FLAGS

    def message(text):  # progress on stderr: stdout holds the results alone
        print(f"evaluate: {text}", file=sys.stderr, flush=True)

    try:
        prob, out, rec, header = evaluate_checkpoint(FLAGS.checkpoint, FLAGS.config, message)
    except cli.user_errors() as e:  # a damaged checkpoint too (IntegrityError)
        return cli.report_error(e, prefix="error")
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(json.dumps({**out, "record": rec}, indent=2) + "\n")
    if FLAGS.problems:
        problems.write(FLAGS.problems, prob, {**header, "figures": out, "record": rec})
    return 0


def _define_flags():
    config_flags.DEFINE_config_file(
        "config", None, "Run config file (default: the run's own config.json).", lock_config=True
    )
    flags.DEFINE_string("checkpoint", None, "Workdir, checkpoint (step) dir or HF model dir.")
    flags.DEFINE_string("output", "", "Optional path for the results and the run's record as JSON.")
    flags.DEFINE_string(
        "problems", "", "Optional path for the per-problem results (JSONL, grpo_jax.core.problems)."
    )
    flags.mark_flags_as_required(["checkpoint"])


if __name__ == "__main__":
    _define_flags()
    app.run(main, argv=sys.argv, flags_parser=cli.parse_flags)
