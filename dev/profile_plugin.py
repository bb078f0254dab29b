"""A pytest plugin that records where the suite's time goes (dev/profile.sh runs it).

For every test it writes one JSON line to ``$GRPO_JAX_PROFILE_OUT`` (one file per
xdist worker): its wall time by phase, the number of XLA compilations and their
seconds (JAX's monitoring events: tracing, lowering, backend compilation), and the
seconds spent waiting for subprocesses it started. ``dev/profile_report.py``
sums the lines by file and by kind.

Not loaded by default: ``PYTHONPATH=tests pytest -p profile_plugin``.
"""

import json
import os
import subprocess
import threading
import time

import pytest

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_current: dict = {}
_out = None


def _on_duration(event, duration, **_):
    key = _EVENTS.get(event)
    if key is None or not _current:
        return
    _current[key] = _current.get(key, 0.0) + duration
    if key == "compile_s":
        _current["compiles"] = _current.get("compiles", 0) + 1


_waiting = threading.local()  # inside a timed wait: communicate() calls wait() itself


def _wrap_subprocess():
    """Times the waits on child processes (subprocess.run and Popen.wait/communicate),
    the outermost call only."""
    for name in ("wait", "communicate"):
        original = getattr(subprocess.Popen, name)

        def timed(self, *a, _original=original, **k):
            if getattr(_waiting, "active", False):
                return _original(self, *a, **k)
            _waiting.active, t = True, time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                _waiting.active = False
                if _current:
                    _current["subprocess_s"] = (
                        _current.get("subprocess_s", 0.0) + time.perf_counter() - t
                    )

        setattr(subprocess.Popen, name, timed)


def pytest_configure(config):
    global _out
    path = os.environ.get("GRPO_JAX_PROFILE_OUT", "profile.jsonl")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        path = f"{path}.{worker}"
    _out = open(path, "a")  # noqa: SIM115 - open for the whole session
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _wrap_subprocess()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.clear()
    _current.update(nodeid=item.nodeid, slow=item.get_closest_marker("slow") is not None)
    t = time.perf_counter()
    yield
    _current["wall_s"] = time.perf_counter() - t
    _out.write(json.dumps(_current) + "\n")
    _out.flush()
    _current.clear()
