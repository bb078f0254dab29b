"""What README.md must tell a new user: the alarms, the evaluate command, the notebooks' needs."""

import dataclasses
import pathlib
import re

from grpo_jax.run.config import HealthConfig
from grpo_jax.run.health import ALARMS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_names_every_alarm_and_its_default_thresholds():
    for name in ALARMS:
        assert f"| `{name}` |" in README, name
    # Every threshold and window with its default, as the alarm table quotes them.
    switches = {"enabled", "stop_on_alarm", "resume_after_stop", "rearm_steps"}
    for f in dataclasses.fields(HealthConfig):
        if f.name not in switches:
            assert f"`{f.name}` {f.default}" in README, f.name
    for key in switches:
        assert f"health.{key}" in README, key


def test_readme_shows_the_evaluate_command_with_its_real_flags():
    lines = [line for line in README.splitlines() if "python -m grpo_jax.evaluate" in line]
    assert any("--checkpoint=" in line for line in lines), lines
    flags = {f for line in lines for f in re.findall(r"(--[a-z_]+)[=. ]", line)}
    assert flags <= {"--checkpoint", "--config", "--output"}, flags


def test_readme_says_what_the_notebooks_need_beyond_requirements_txt():
    runtime = (ROOT / "requirements.txt").read_text()
    tests = (ROOT / "requirements-test.txt").read_text()
    for package in ("matplotlib", "ipykernel", "nbclient"):
        assert package not in runtime and package in tests, package
        assert re.search(rf"notebooks[^\n]*(\n[^\n]+)*{package}", README), package
