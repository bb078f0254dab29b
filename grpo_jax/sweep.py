r"""Run a config file's sweep: one ``grpo_jax.main`` command per point, printed or run.

    python -m grpo_jax.sweep --config=configs/gsm8k.py:model=qwen2.5-0.5b \
        --workdir_root=/runs/sweep [--run] [-- --config.model.path=/models/Qwen2.5-0.5B-Instruct]

A config file with sweeps defines ``sweep(arg=None) -> list[dict]``, each dict a set of
overrides by dotted key; each point runs in ``<root>/<name>``, where <name> joins the last
part of each key with its value (``learning_rate=1e-06,beta=0.04``). Every key is checked
against the config before anything runs (README.md, "Sweeps"; docs/recipes.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import shlex
import subprocess
import sys
from collections.abc import Sequence

from grpo_jax.cli import override_keys, report_error, unknown_key


class SweepError(ValueError):
    """A config file without a sweep, or a sweep point that names an unknown key."""


def load_config_module(path: str):
    """The module of config file ``path``; SweepError, one line, when it cannot be loaded."""
    file = pathlib.Path(path)
    if file.is_dir():
        raise SweepError(f"config file {path!r} is a directory, not a config file (configs/*.py)")
    if not file.is_file():
        raise SweepError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_sweep_config_{file.stem}", file)
    if spec is None:
        raise SweepError(f"config file {path!r} is not a Python file (configs/*.py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise SweepError(f"config file {e.filename}:{e.lineno}: {e.msg}") from e
    return module


def _format(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_format(v) for v in value)
    return str(value)


def point_name(overrides: dict) -> str:
    """``{"optim.learning_rate": 1e-06, "grpo.beta": 0.0}`` -> "learning_rate=1e-06,beta=0.0"."""
    return ",".join(f"{k.rsplit('.', 1)[-1]}={_format(v)}" for k, v in overrides.items())


def _check_key(config, key: str, config_spec: str) -> None:

    why = unknown_key(config, key)
    if why:
        raise SweepError(f"sweep of {config_spec} overrides {key!r}, but {why}")


def commands(
    config_spec: str,
    workdir_root: str,
    extra: Sequence[str] = (),
    python: str = sys.executable,
) -> list[list[str]]:
    """The ``grpo_jax.main`` command line of every point of ``config_spec``'s sweep."""
    path, _, arg = config_spec.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "sweep"):
        raise SweepError(f"config file {path} defines no sweep(arg) function")
    points = module.sweep(arg or None)
    if not points:
        raise SweepError(f"sweep of {config_spec} has no points")
    config = module.get_config(arg or None)
    names = [point_name(p) for p in points]
    if len(set(names)) != len(names):
        raise SweepError(f"sweep of {config_spec} repeats a point: {names}")

    swept = {k for p in points for k in p}
    clash = sorted(swept & set(override_keys(extra)))
    if clash:
        raise SweepError(
            f"the arguments after -- override {', '.join(clash)}, which the sweep of "
            f"{config_spec} sets per point; drop them there (or change the sweep)"
        )
    out = []
    for overrides, name in zip(points, names, strict=True):
        for key in overrides:
            _check_key(config, key, config_spec)
        out.append(
            [python, "-m", "grpo_jax.main", f"--config={config_spec}"]
            + [f"--workdir={pathlib.Path(workdir_root) / name}"]
            + [f"--config.{k}={_format(v)}" for k, v in overrides.items()]
            + list(extra)
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m grpo_jax.sweep", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="config file and argument, file.py:arg")
    p.add_argument("--workdir_root", required=True, help="each point runs in <root>/<name>")
    p.add_argument("--run", action="store_true", help="run the points in turn (else print)")
    args = p.parse_args(argv)
    try:
        cmds = commands(args.config, args.workdir_root, extra)
    except (SweepError, ValueError) as e:
        return report_error(e, prefix="sweep error")
    failed = []
    for cmd in cmds:
        print(shlex.join(cmd), flush=True)
        if args.run and subprocess.run(cmd).returncode != 0:
            failed.append(cmd)
    if failed:
        print(f"{len(failed)} of {len(cmds)} sweep runs failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
