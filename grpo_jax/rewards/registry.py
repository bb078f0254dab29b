"""Reward functions by name: the registry that configs select from.

A reward function is ``fn(prompts, completions, **fields) -> list[float]``, one float per
completion, NaN where it cannot score. ``@register("name")`` registers one;
``@register("name", factory=True)`` a function that builds one from keyword options
(``"overlong(max_len=256, buffer=64)"``). :func:`load_user_module` imports a user's module
of rewards (the run config's ``reward_modules``). docs/rewards.md, "A reward function and
the registry".
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import pathlib
import sys
import threading
from collections.abc import Callable

from grpo_jax.core.errors import ConfigError

RewardFn = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class _Entry:
    obj: Callable
    factory: bool
    module: str | None = None  # __name__ of the module whose code called register()
    file: str | None = None  # and its __file__, when it has one


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a registered reward comes from: what a worker process imports to find it.

    Attributes:
      name: the registry name (``spec`` without its options).
      options: the options of ``spec`` (keyword arguments of a factory).
      module, file: ``__name__`` and ``__file__`` of the module that called
        :func:`register` (``file`` is None for a module without one).
      identity: ``(module, qualname)`` of the registered function or factory,
        which a worker compares with its own registry entry after the import.
      builtin: registered by grpo_jax.rewards itself.
    """

    name: str
    options: dict
    module: str | None
    file: str | None
    identity: tuple[str | None, str | None]
    builtin: bool


_REGISTRY: dict[str, _Entry] = {}
_BUILT: dict[str, RewardFn] = {}  # "name(options)" -> reward function built once
_LOCK = threading.Lock()
_USER_MODULES: dict[str, object] = {}


def register(name: str, *, factory: bool = False, override: bool = False):
    """Decorator registering a reward function (or a factory of them) as ``name``.

    Registering a different function under a taken name raises ValueError
    unless ``override=True`` (re-registering the same object is a no-op, so a
    module may be imported twice).
    """
    if not isinstance(name, str) or not name or "(" in name or ")" in name:
        raise ValueError(f"reward name {name!r} must be a non-empty string without parentheses")
    caller = sys._getframe(1).f_globals  # the registering module, for worker processes
    module, file = caller.get("__name__"), caller.get("__file__")

    def deco(obj: Callable) -> Callable:
        if not callable(obj):
            raise TypeError(f"reward {name!r}: {obj!r} is not callable")
        with _LOCK:
            old = _REGISTRY.get(name)
            if old is not None and old.obj is not obj and not override:
                raise ValueError(
                    f"reward name {name!r} is already registered (to {old.obj!r}); "
                    "pass override=True to replace it"
                )
            _REGISTRY[name] = _Entry(obj, factory, module, file)
            for key in [k for k in _BUILT if k == name or k.startswith(name + "(")]:
                del _BUILT[key]
        return obj

    return deco


def identity(obj) -> tuple[str | None, str | None]:
    """``(module, qualname)`` of a function, class or callable instance."""
    qualname = getattr(obj, "__qualname__", None) or getattr(type(obj), "__qualname__", None)
    return getattr(obj, "__module__", None), qualname


def origin(spec: str) -> Origin:
    """Where the reward ``spec`` was registered (ConfigError for unknown names)."""
    name, options = _parse_spec(spec) if isinstance(spec, str) else (spec, {})
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"unknown reward {name!r}; available rewards: {available()}")
    builtin = entry.module is not None and entry.module.startswith("grpo_jax.rewards.")
    return Origin(name, options, entry.module, entry.file, identity(entry.obj), builtin)


def available() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def _parse_spec(spec: str) -> tuple[str, dict]:
    """``"name"`` or ``"name(key=literal, ...)"`` -> (name, options)."""
    if "(" not in spec:
        return spec.strip(), {}
    try:
        call = ast.parse(spec.strip(), mode="eval").body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            raise ValueError("expected name(key=value, ...)")
        options = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        if None in options:
            raise ValueError("**kwargs is not allowed")
    except (SyntaxError, ValueError) as e:
        raise ConfigError(
            f"reward {spec!r} is not of the form name or name(key=literal, ...): {e}"
        ) from None
    return call.func.id, options


def get(spec: str) -> RewardFn:
    """The reward function registered as ``spec`` (``"name"`` or ``"name(k=v, ...)"``).

    Raises ConfigError listing the available names when the name is unknown,
    and when options are given to a reward that is not a factory or that the
    factory rejects.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"reward name must be a string, got {spec!r}")
    with _LOCK:
        if spec in _BUILT:
            return _BUILT[spec]
    name, options = _parse_spec(spec)
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"unknown reward {name!r}; available rewards: {available()}")
    if not entry.factory:
        if options:
            raise ConfigError(f"reward {name!r} takes no options, got {options}")
        return entry.obj
    try:
        fn = entry.obj(**options)
    except ConfigError as e:  # the factory named the problem itself
        raise ConfigError(f"reward {spec!r}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"reward {spec!r}: bad options {options}: {e}") from None
    with _LOCK:
        return _BUILT.setdefault(spec, fn)


def load_user_module(module_or_path: str):
    """Imports the user module whose import registers rewards; returns the module.

    ``module_or_path`` is a dotted module name importable from ``sys.path``
    (``my_pkg.rewards``) or the path of a ``.py`` file. A missing module or
    file raises ConfigError naming it; errors raised by the module itself
    propagate unchanged so that their traceback points into the user's code.
    """
    if not isinstance(module_or_path, str) or not module_or_path.strip():
        raise ConfigError(
            f"reward module must be a module name or .py path, got {module_or_path!r}"
        )
    target = module_or_path.strip()
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = pathlib.Path(target).expanduser().resolve()
        key = str(path)
        if key in _USER_MODULES:
            return _USER_MODULES[key]
        if not path.is_file():
            raise ConfigError(f"reward module file {target!r} does not exist (resolved to {path})")
        mod_name = f"grpo_jax_user_rewards.{path.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
        _USER_MODULES[key] = module
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise ConfigError(
                f"reward module {target!r} was not found on sys.path ({e}); "
                "give a dotted module name or the path of a .py file"
            ) from None
        raise
