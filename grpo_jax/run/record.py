"""A record of what ran: config, code, library versions, devices, seeds and data.

:func:`run_record` is written into ``summary.json`` (``"record"``) and into the header of
every evaluation file (``grpo_jax.core.problems``), so a figure carries what produced it.
Its fields: docs/evaluation.md, "The record of what ran".
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import pathlib
import platform
import subprocess
from collections.abc import Mapping, Sequence

import jax

from grpo_jax.core import problems

LIBRARIES = ("numpy", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers")


def config_text(raw: Mapping) -> str:
    """The config as canonical JSON: sorted keys, no spaces beyond the separators."""
    return json.dumps(raw, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(raw: Mapping) -> str:
    return hashlib.sha256(config_text(raw).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """The git commit of the checkout the package is imported from, or its installed version.

    Read once per process (at the first record, the run's start): a commit made while a
    run goes on is not the code it runs.
    """
    root = pathlib.Path(__file__).resolve().parents[2]  # grpo_jax/run/record.py -> checkout
    try:
        git = lambda *a: subprocess.run(
            ["git", "-C", str(root), *a], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        if (root / ".git").exists():
            return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "-s"))}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"package_version": _version("grpo_jax")}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {"python": platform.python_version(), **{n: _version(n) for n in LIBRARIES}}


def devices(num_devices: int = 0) -> dict:
    """The platform and kind of the devices, how many the run uses (``mesh.num_devices``,
    0: all), how many are visible and the number of processes."""
    d = jax.devices()
    return {
        "platform": d[0].platform,
        "device_kind": d[0].device_kind,
        "device_count": num_devices or jax.device_count(),
        "visible_device_count": jax.device_count(),
        "process_count": jax.process_count(),
    }


def data_fingerprint(raw: Mapping, examples: Sequence[Mapping]) -> dict:
    """The data section and sha256 of the evaluated problems' ids, in order."""
    ids = "\n".join(problems.problem_id(e) for e in examples)
    return {
        "section": raw.get("data"),
        "eval_problems": len(examples),
        "eval_sha256": hashlib.sha256(ids.encode()).hexdigest(),
    }


def run_record(run, eval_examples: Sequence[Mapping]) -> dict:
    """The record of ``run`` (a ``RunConfig``) evaluated on ``eval_examples`` (module doc)."""
    raw = run.raw
    data = raw.get("data") or {}
    return {
        "config_sha256": config_hash(raw),
        "config": config_text(raw),
        "code": code_version(),
        "versions": versions(),
        "devices": devices(run.mesh.num_devices),
        "seeds": {
            "seed": run.seed,
            "data_seed": data.get("seed") if isinstance(data, Mapping) else None,
            "eval_seeds": list(run.eval.seeds),
        },
        "data": data_fingerprint(raw, eval_examples),
    }
