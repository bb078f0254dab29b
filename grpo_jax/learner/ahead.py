"""The first step: the update compiled while the sampler compiles and runs."""

from __future__ import annotations

import jax


def _signature(args):
    leaves, treedef = jax.tree.flatten(args)
    return treedef, [(x.shape, x.dtype, x.sharding) for x in leaves]


class CompiledAhead:
    """A jitted function compiled for one argument signature in a background thread.

    The first step of a run compiles the sampler, samples, then compiles the
    update. ``CompiledAhead(update, state, batch_spec(...), key, ref)`` starts
    the update's tracing and compilation at once, so they overlap the
    sampler's (XLA compiles with the interpreter lock released, on another
    core where there is one) and its sampling. Calling it with arguments of
    that signature (shapes, dtypes, shardings) runs the compiled executable;
    any other call, or a failed compilation, goes to the jitted function
    itself, which then compiles (or raises) as usual.

    It is a context manager: leaving it waits for the compilation and its
    thread, so no tracing of a run's update goes on after the run has ended
    (a run that stops before its first update would otherwise leave a thread
    tracing while the caller starts the next run, or changes what it traces).
    """

    def __init__(self, jitted, *args):
        import concurrent.futures

        self._jitted = jitted
        self._signature = _signature(args)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-update")
        self._future = self._pool.submit(lambda: jitted.lower(*args).compile())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Waits for the compilation (its error, if any, is the jitted call's to raise)."""
        self._pool.shutdown(wait=True)

    def __call__(self, *args):
        if _signature(args) == self._signature:
            try:
                compiled = self._future.result()
            except Exception:  # noqa: BLE001 - the jitted call below raises it with context
                compiled = None
            if compiled is not None:
                return compiled(*args)
        return self._jitted(*args)
