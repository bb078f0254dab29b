"""The environment interface, the registry of environments by name, and error containment.

An environment is one object per episode (one row of a rollout): ``reset(example)`` gives the
first observation (text, chat messages, or None for the usual prompt), and ``step(text)``
takes the model's turn and returns ``(observation, reward, done, info)``. :func:`register`
names a class or factory; ``env.name`` selects it with options. An environment that raises,
returns something malformed or runs past its time budget ends its episode with reward NaN,
counted, and the run goes on. docs/multiturn.md, "Writing an environment".
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import math
import pathlib
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

Observation = str | list | None


@runtime_checkable
class Environment(Protocol):
    def reset(self, example: Mapping) -> Observation: ...

    def step(self, text: str) -> tuple[Observation, float, bool, dict]: ...


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register(name: str):
    """Decorator: registers an environment class (or factory) under ``name``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"environment name {name!r} must be an identifier")

    def deco(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def parse_spec(spec: str) -> tuple[str, dict]:
    """ "name(k=v, ...)" -> (name, {k: v}); the options must be Python literals."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"environment spec {spec!r} must be a non-empty string")
    text = spec.strip()
    name, _, rest = text.partition("(")
    name = name.strip()
    if not rest:
        return name, {}
    try:
        call = ast.parse(text, mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise ValueError
        return name, {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError):
        raise ValueError(
            f"environment spec {spec!r}: options must be keyword=literal, "
            "e.g. 'guess_number(high=9)'"
        ) from None


def get(name: str) -> Callable[..., Environment]:
    """The class or factory registered as ``name`` (without options)."""
    base, _ = parse_spec(name)
    if base not in _REGISTRY:
        raise KeyError(f"unknown environment {base!r}; registered: {available()}")
    return _REGISTRY[base]


def make(spec: str) -> Environment:
    """A fresh environment from "name" or "name(k=v, ...)"."""
    name, options = parse_spec(spec)
    factory = get(name)
    try:
        return factory(**options)
    except TypeError as e:
        raise ValueError(f"environment {spec!r}: bad options ({e})") from None


def load_user_module(item: str):
    """Imports a module (dotted name or ``.py`` path) whose import registers environments."""
    if item.endswith(".py") or "/" in item:
        path = pathlib.Path(item).expanduser().absolute()
        if not path.is_file():
            raise FileNotFoundError(f"environment module {item!r}: no such file")
        mod_name = "grpo_jax_user_env_" + path.stem
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(item)


# ---------------------------------------------------------------------------
# Containment.


class EnvTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raises EnvTimeout in this thread after ``seconds`` (main thread only; else no limit).

    A SIGALRM timer interrupts Python code; code stuck inside C that holds the
    interpreter lock is not interrupted (docs/multiturn.md).
    """
    usable = (
        seconds
        and seconds > 0
        and threading.current_thread() is threading.main_thread()
        and hasattr(signal, "setitimer")
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise EnvTimeout(f"ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _interrupts_seen(seen: list):
    """Records each SIGINT that arrives meanwhile in ``seen``, then handles it as before.

    Tells a real Ctrl-C apart from a KeyboardInterrupt that user code raises itself
    (main thread only, where Python delivers signals; elsewhere nothing to tell apart).
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return

    def on_interrupt(signum, frame):
        seen.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _contained(fn, timeout_s: float):
    """-> (fn(), None), or (None, "Type: message") if it raised or ran past ``timeout_s``.

    Every exception of user code is contained, ``SystemExit`` (``sys.exit``) and a
    ``KeyboardInterrupt`` it raises itself included: one episode must not end the run.
    A real SIGINT received meanwhile is not: it propagates.
    """
    interrupts: list = []
    try:
        with _interrupts_seen(interrupts), deadline(timeout_s):
            return fn(), None
    except BaseException as e:  # noqa: BLE001 - user code: any failure ends the episode
        if interrupts:
            raise
        return None, f"{type(e).__name__}: {e}"


@dataclasses.dataclass
class StepResult:
    observation: Observation
    reward: float
    done: bool
    info: dict
    error: str | None = None


def _check_observation(obs) -> Observation:
    if obs is None or isinstance(obs, str):
        return obs
    if isinstance(obs, list) and all(
        isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in obs
    ):
        return [dict(m) for m in obs]
    raise TypeError(
        f"an observation must be text, a list of chat messages or None, got {type(obs).__name__}"
    )


def safe_make(spec: str, timeout_s: float) -> tuple[Environment | None, str | None]:
    """``make(spec)`` with errors and the time budget contained -> (env, None) or (None, error)."""
    env, error = _contained(lambda: make(spec), timeout_s)
    return env, None if error is None else f"make: {error}"


def safe_reset(env: Environment, example: Mapping, timeout_s: float) -> StepResult:
    """``env.reset(example)`` with errors and the time budget contained."""

    def reset():
        return StepResult(_check_observation(env.reset(example)), 0.0, False, {})

    result, error = _contained(reset, timeout_s)
    return result or StepResult(None, math.nan, True, {}, f"reset: {error}")


def safe_step(env: Environment, text: str, timeout_s: float) -> StepResult:
    """``env.step(text)`` with errors, malformed returns and the time budget contained."""

    def step():
        out = env.step(text)
        if not isinstance(out, tuple) or len(out) != 4:
            raise TypeError("step must return (observation, reward, done, info)")
        obs, reward, done, info = out
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward {reward!r} is not finite")
        info = dict(info or {})
        return StepResult(_check_observation(obs), reward, bool(done) or obs is None, info)

    result, error = _contained(step, timeout_s)
    return result or StepResult(None, math.nan, True, {}, f"step: {error}")
