"""The package's layers (docs/architecture.md, "Layers"; the contract is pyproject.toml's).

lint-imports (tests/run.sh) checks that no module imports an upper layer. These tests pin
what that contract does not: the names moved down from ``grpo_jax.run.config`` are still
importable from it, the modules that keep JAX out (the reason their few imports inside
functions stay there) still import without it, and ``configs/common.py`` states the
library's typed defaults rather than copies of them.
"""

import dataclasses
import pathlib
import subprocess
import sys

import pytest
import tomllib

from configs import common
from grpo_jax import data
from grpo_jax.core import checks, errors
from grpo_jax.data import prompts
from grpo_jax.envs import section as envs_section
from grpo_jax.learner import optimizer
from grpo_jax.models import config as models_config
from grpo_jax.objective import config as objective
from grpo_jax.rewards import section as rewards_section
from grpo_jax.run import config
from grpo_jax.sampling import static as sampling

MOVED = {
    errors: ["ConfigError"],
    checks: ["check_bool", "check_choice", "check_known_keys", "check_range", "to_dict"],
    models_config: ["ATTENTION", "LORA_PROJECTIONS", "MODEL_KEYS", "LoRAConfig", "ModelSection"],
    sampling: ["SamplingSection"],
    data: ["DataSection"],
    prompts: ["PromptConfig"],
    rewards_section: ["RewardsSection", "load_reward_modules", "parse_rewards"],
    envs_section: ["EnvSection"],
    objective: ["OLD_LOGPS", "GRPOConfig"],
    optimizer: ["SCHEDULES", "OptimConfig"],
}


@pytest.mark.parametrize("module", MOVED, ids=lambda m: m.__name__)
def test_the_names_moved_down_are_still_importable_from_config(module):
    for name in MOVED[module]:
        assert getattr(config, name) is getattr(module, name), name


def test_the_light_modules_import_without_jax():
    """cli (imported by the commands before quiet()), distributed (before multi-process
    start-up), errors and checks: the modules whose late imports keep JAX out."""
    mods = (
        "grpo_jax.cli, grpo_jax.core.distributed, grpo_jax.core.errors, grpo_jax.core.checks, "
        "grpo_jax.sweep"
    )
    code = f"import sys, {mods}; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


SECTIONS = {
    "prompt": config.PromptConfig,
    "grpo": config.GRPOConfig,
    "optim": config.OptimConfig,
    "train": config.TrainConfig,
    "eval": config.EvalConfig,
    "checkpoint": config.CheckpointConfig,
    "mesh": config.MeshConfig,
    "warm_start": config.WarmStartConfig,
    "health": config.HealthConfig,
    "env": config.EnvSection,
}


def test_the_base_config_is_the_typed_defaults(builtin_tokenizer):
    c = common.base()
    c.data = {"source": "synthetic"}
    c.rewards = "exact_match:1.0"
    c.sampling.max_new_tokens = 8
    run = config.parse_config(c)
    for name, cls in SECTIONS.items():
        assert getattr(run, name) == cls(), name
    assert run.model == config.ModelSection()
    assert run.sampling == config.SamplingSection(max_new_tokens=8)
    assert (run.seed, run.tokenizer, run.rewards.modules) == (0, config.BUILTIN_TOKENIZER, ())
    # Every field of these sections is a key of the base (settable on the command line).
    for name, cls in SECTIONS.items():
        assert set(c[name]) >= {f.name for f in dataclasses.fields(cls)}, name


# -- The layer picture of docs/architecture.md, drawn from pyproject.toml's contract ----------

ROOT = pathlib.Path(__file__).resolve().parents[1]
WIDTH = 96  # the picture's lines wrap before this column
NAME_COLUMN = 24  # the top-level layers' notes start here


def _layer_notes(pyproject: str) -> list[str]:
    """The comment above each layer of the top-level "layers" contract, in order."""
    block = pyproject.split('id = "layers"', 1)[1].split("layers = [", 1)[1].split("]", 1)[0]
    notes, comment = [], []
    for line in block.splitlines():
        line = line.strip()
        if line.startswith("#"):
            comment.append(line.lstrip("# ").rstrip("."))
        elif line.startswith('"'):
            notes.append(" ".join(comment))
            comment = []
    return notes


def _wrapped(head: str, tokens: list[str], indent: int) -> list[str]:
    """``head`` padded to ``indent``, then ``tokens``, wrapped before WIDTH at that indent."""
    lines, line = [], head.ljust(indent)
    for token in tokens:
        if len(line) + len(token) > WIDTH and len(line) > indent:
            lines.append(line.rstrip())
            line = " " * indent
        line += token + " "
    return lines + [line.rstrip()]


def layer_picture() -> str:
    """The picture docs/architecture.md's "Layers" shows: the folders top to bottom with what
    each layer holds, then each folder's modules top to bottom (``>`` between layers, ``|``
    between modules of a layer, which may not import each other)."""
    text = (ROOT / "pyproject.toml").read_text()
    contracts = tomllib.loads(text)["tool"]["importlinter"]["contracts"]
    layers = {c["id"]: c["layers"] for c in contracts if c["type"] == "layers"}
    top = layers.pop("layers")
    lines = []
    for names, note in zip(top, _layer_notes(text), strict=True):
        note = note[:1].lower() + note[1:]
        if len(names) >= NAME_COLUMN:
            lines.append(names)
            names = ""
        lines += _wrapped(names, note.split(" "), NAME_COLUMN)
    lines += ["", "inside each folder, top to bottom:"]
    folders = [name.strip() for names in top for name in names.split("|")]
    for folder in [f for f in folders if f in layers] + sorted(set(layers) - set(folders)):
        tokens = " > ".join(layers[folder]).split(" ")
        lines += _wrapped(f"{folder}/", tokens, 16)
    return "\n".join(lines) + "\n"


def _doc_picture() -> str:
    layers = (ROOT / "docs" / "architecture.md").read_text().split("\n## Layers\n", 1)[1]
    return layers.split("```\n", 2)[1]


def test_the_layer_picture_is_the_import_contract():
    """docs/architecture.md's picture is pyproject.toml's contract, drawn by layer_picture():
    a layer or module added, moved or renamed there fails here until the picture follows."""
    want = layer_picture()
    assert _doc_picture() == want, (
        "docs/architecture.md's layer picture differs from pyproject.toml's contract; its code "
        f"block under '## Layers' should read:\n{want}"
    )
