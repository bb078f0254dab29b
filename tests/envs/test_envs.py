"""The environment interface: registry, options, user modules, examples, error containment."""

import math
import os
import signal
import sys
import time

import pytest

from grpo_jax import envs


def test_registry_and_options():
    assert {"guess_number", "tool_use"} <= set(envs.available())
    env = envs.make("guess_number(high=4, max_turns=2)")
    assert (env.high, env.max_turns) == (4, 2)
    with pytest.raises(KeyError, match="registered"):
        envs.get("nope")
    with pytest.raises(ValueError, match="keyword=literal"):
        envs.make("guess_number(1)")
    with pytest.raises(ValueError, match="bad options"):
        envs.make("guess_number(colour='red')")


def test_guess_number_feedback_and_graded_reward():
    env = envs.make("guess_number(high=9, max_turns=4)")
    assert env.reset({"answer": "17"}) == "guess 0-9:"  # 17 mod 10 -> hidden 7
    assert env.step("5") == ("H", 0.0, False, {"success": False})
    assert env.step("x") == ("?", 0.0, False, {"success": False})
    assert env.step("9") == ("L", 0.0, False, {"success": False})
    obs, reward, done, info = env.step("7")
    # Found on turn 4 of 4: 1 - 3/4.
    assert (obs, reward, done, info["success"]) == (None, 0.25, True, True)
    env.reset({"target": 3})
    assert env.step("3")[1] == 1.0
    env.reset({"target": 3})
    for _ in range(3):
        env.step("0")
    assert env.step("0") == (None, 0.0, True, {"success": False, "turns": 4})


def test_tool_use_runs_tools_then_scores_the_answer():
    env = envs.make("tool_use(reward='exact_match(tag=None)', tools=('calculator',), max_turns=3)")
    assert env.reset({"prompt": "17*23=", "answer": "391"}) is None
    obs, reward, done, _ = env.step("<calculator>17*23</calculator>")
    assert obs == '<tool_result name="calculator">391</tool_result>' and not done
    obs, reward, done, info = env.step("391")
    assert (obs, reward, done, info["success"]) == (None, 1.0, True, True)


def test_user_module_by_path(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(
        "from grpo_jax import envs\n"
        "@envs.register('echo_once_test')\n"
        "class Echo:\n"
        "    def reset(self, example):\n"
        "        return 'say it'\n"
        "    def step(self, text):\n"
        "        return None, float(len(text)), True, {}\n"
    )
    envs.load_user_module(str(path))
    env = envs.make("echo_once_test")
    assert isinstance(env, envs.Environment)
    assert envs.safe_step(env, "abc", 1.0).reward == 3.0
    with pytest.raises(FileNotFoundError):
        envs.load_user_module(str(tmp_path / "missing.py"))


class _Bad:
    def __init__(self, mode):
        self.mode = mode

    def reset(self, example):
        if self.mode == "reset":
            raise RuntimeError("broken reset")
        if self.mode == "exit":
            sys.exit(0)
        return "go"

    def step(self, text):
        if self.mode == "raise":
            raise RuntimeError("broken step")
        if self.mode == "exit":
            sys.exit(0)
        if self.mode == "interrupt":
            raise KeyboardInterrupt
        if self.mode == "sigint":  # a real Ctrl-C while the environment runs
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        if self.mode == "hang":
            while True:
                pass
        if self.mode == "shape":
            return "obs", 1.0
        if self.mode == "inf":
            return None, math.inf, True, {}
        if self.mode == "obs":
            return 42, 0.0, False, {}
        return "fine", 0.5, False, {}


@pytest.mark.parametrize("mode", ["raise", "hang", "shape", "inf", "obs", "exit", "interrupt"])
def test_step_errors_and_timeouts_end_the_episode_with_nan(mode):
    t0 = time.monotonic()
    r = envs.safe_step(_Bad(mode), "text", 0.3)
    assert r.done and math.isnan(r.reward) and r.error.startswith("step:")
    assert time.monotonic() - t0 < 3
    # sys.exit and a KeyboardInterrupt raised by the environment itself: its episode ends.
    want = {"exit": "step: SystemExit: 0", "interrupt": "step: KeyboardInterrupt: "}
    assert r.error == want.get(mode, r.error)


def test_a_real_interrupt_while_an_environment_runs_still_stops_the_run():
    # Python's own SIGINT handler, as an interactive run has it (a pytest-xdist worker
    # ignores SIGINT, and an ignored signal interrupts nothing).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            envs.safe_step(_Bad("sigint"), "text", 10.0)
        assert time.monotonic() - t0 < 3
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_reset_error_and_good_step():
    r = envs.safe_reset(_Bad("reset"), {}, 1.0)
    assert r.done and math.isnan(r.reward) and "broken reset" in r.error
    r = envs.safe_reset(_Bad("exit"), {}, 1.0)
    assert r.done and math.isnan(r.reward) and r.error == "reset: SystemExit: 0"
    r = envs.safe_step(_Bad("ok"), "t", 1.0)
    assert (r.observation, r.reward, r.done, r.error) == ("fine", 0.5, False, None)


_RESETS = iter(range(10**6))


@envs.register("reset_all_test")
class _ResetProbe:
    """reset: raises for answer "bad", a per-instance prompt for "differ", else "go <answer>"."""

    def __init__(self):
        self.k = next(_RESETS)

    def reset(self, example):
        answer = example["answer"]
        if answer == "bad" or (answer == "flaky" and self.k % 2):
            raise RuntimeError(f"broken reset {answer}")
        if answer == "hang":
            time.sleep(30)
        return f"go {self.k}" if answer == "differ" else f"go {answer}"

    def step(self, text):
        return None, 1.0, True, {}


def test_reset_all_contains_failing_resets():
    from grpo_jax.rollout import episodes as multiturn

    examples = [{"answer": a} for a in ("1", "bad", "flaky", "hang")]
    t0 = time.monotonic()
    environments, first, messages = multiturn.reset_all("reset_all_test", examples, 2, 0.3)
    assert time.monotonic() - t0 < 10
    assert len(environments) == 8 and first[:2] == ["go 1", None]
    broken = [e is None for e in environments]
    # Both episodes of "bad" and "hang"; one of the two of "flaky", whose prompt is the
    # good one's.
    assert broken[:4] == [False, False, True, True] and broken[6:] == [True, True]
    assert sum(broken[4:6]) == 1 and first[2] == "go flaky" and first[3] is None
    assert len(messages) == 5 and messages[0] == "example 1: reset: RuntimeError: broken reset bad"
    assert messages[-1] == "example 3: reset: EnvTimeout: ran past 0.3 s"
    # A broken environment's episode ends at its first turn with NaN, counted.
    r = envs.safe_step(environments[2], "x", 1.0)
    assert r.done and math.isnan(r.reward) and r.error is not None


def test_reset_all_contains_different_first_observations_in_a_group():
    from grpo_jax.rollout import episodes as multiturn

    examples = [{"answer": "differ"}, {"answer": "1"}]
    environments, first, messages = multiturn.reset_all("reset_all_test", examples, 2, 1.0)
    # The group's episodes end at once (reward NaN, counted); the next group plays.
    assert [e is None for e in environments] == [True, True, False, False]
    assert first == [None, "go 1"]
    assert messages == 2 * [
        "example 0: reset: the 2 episodes' first observations differ; they must share one prompt"
    ]
    # One episode per example: nothing to compare.
    _, first, _ = multiturn.reset_all("reset_all_test", [{"answer": "differ"}], 1, 1.0)
    assert first[0].startswith("go ")


_MADE = iter(range(10**6))


@envs.register("made_once_test")
class _MadeOnce:
    """The constructor works once (the config's check) and raises or exits from then on."""

    def __init__(self):
        k = next(_MADE)
        if k == 1:
            sys.exit(3)
        if k > 1:
            raise RuntimeError("only one instance")

    def reset(self, example):
        return None

    def step(self, text):
        return None, 1.0, True, {}


def test_reset_all_contains_a_failing_constructor():
    from grpo_jax.rollout import episodes as multiturn

    envs.make("made_once_test")
    environments, first, messages = multiturn.reset_all("made_once_test", [{"answer": "1"}], 2, 1.0)
    assert environments == [None, None] and first == [None]
    assert messages == [
        "example 0: make: SystemExit: 3",
        "example 0: make: RuntimeError: only one instance",
    ]
