"""Worker process of :mod:`grpo_jax.rewards.isolation`: runs user reward functions on request.

Started as a script (``python _reward_worker.py <parent pid>``) by the parent's worker pool,
never forked from it; it speaks length-prefixed pickled messages on its stdin and on a
duplicate of its original stdout (the reward code's prints go to stderr). The messages
and their replies: docs/rewards.md, "The worker's protocol". It exits at the end of its
input, and with its parent (``PR_SET_PDEATHSIG`` on Linux, else a thread that watches it).
"""

import importlib
import importlib.util
import os
import pickle
import signal
import struct
import sys
import threading
import time

# The script's own folder (grpo_jax/rewards) must not shadow installed packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

_HEADER = struct.Struct("<Q")


# grpo_jax.rewards.registry, imported by main() once the parent has sent its sys.path.
registry = None


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 -- not Linux: the watcher thread below covers it
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _read(f):
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(header)
    data = f.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def _write(f, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _load(name: str, file: str | None) -> None:
    """Imports the module that registered a reward, as the parent did.

    Files loaded by ``load_user_module(path)`` are loaded the same way (same
    module name, same registry entries); other modules by name from the
    parent's ``sys.path``, else from their file under the same name.
    """
    if name.startswith("grpo_jax_user_rewards.") and file:
        registry.load_user_module(file)
        return
    if name in sys.modules:
        return
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is not None or not file:
        importlib.import_module(name)
        return
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {name!r} from {file!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _sendable_exception(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 -- replaced by a plain exception with the same text
        return RuntimeError(repr(e))


def _sendable_values(out):
    try:
        pickle.dumps(out)
        return ("ok", out)
    except Exception:  # noqa: BLE001
        pass
    if not isinstance(out, list):
        return ("malformed", type(out).__name__)
    values = []
    for x in out:  # an element that cannot travel becomes its repr: malformed, counted
        try:
            pickle.dumps(x)
            values.append(x)
        except Exception:  # noqa: BLE001
            values.append(repr(x))
    return ("ok", values)


def _call(spec, ident, prompts, completions, fields):
    name = spec.split("(", 1)[0].strip()
    entry = registry._REGISTRY.get(name)
    if entry is None:
        return ("unavailable", f"importing its module did not register {name!r}")
    if registry.identity(entry.obj) != tuple(ident):
        got = registry.identity(entry.obj)
        return ("unavailable", f"{name!r} is {got} after the import, not {tuple(ident)}")
    try:
        fn = registry.get(spec)
    except Exception as e:  # noqa: BLE001
        return ("unavailable", _describe(e))
    try:
        out = fn(prompts, completions, **fields)
        if not isinstance(out, (list, str, bytes)):
            try:
                out = list(out)
            except TypeError:
                pass
    except BaseException as e:  # noqa: BLE001 -- reported, counted by the parent
        return ("raised", _sendable_exception(e))
    return _sendable_values(out)


def main() -> None:
    parent_pid = int(sys.argv[1])
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # the reward code's prints must not corrupt the protocol
    _die_with_parent(parent_pid)

    init = _read(requests)
    if init is None:
        return
    sys.path[:] = init["sys_path"]
    global registry
    # Inside a function on purpose: grpo_jax is importable only from the parent's sys.path,
    # just set. Importing the registry imports grpo_jax.rewards first (the built-in rewards).
    from grpo_jax.rewards import registry

    failed = {}
    for i, (name, file) in enumerate(init["modules"]):
        try:
            _load(name, file)
        except BaseException as e:  # noqa: BLE001
            failed[i] = _describe(e)
    _write(replies, ("ready", failed))

    while True:
        message = _read(requests)
        if message is None:
            return
        if message[0] == "load":
            try:
                _load(message[1], message[2])
                reply = ("loaded", None)
            except BaseException as e:  # noqa: BLE001
                reply = ("loaded", _describe(e))
        elif message[0] == "call":
            reply = _call(*message[1:])
        else:
            reply = ("unavailable", f"unknown request {message[0]!r}")
        _write(replies, reply)


if __name__ == "__main__":
    main()
