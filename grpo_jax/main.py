"""Entry point: flags, config file, workdir -> ``grpo_jax.run.train.train``.

    python -m grpo_jax.main --config=configs/default.py --workdir=/tmp/grpo_tiny

Override config values on the command line (``--config.grpo.beta=0.04``). Running the same
command again resumes from the workdir's latest checkpoint; SIGTERM saves one and exits 0.
Exit status: 0 done (or preempted), 2 a user error (one line on stderr), 3 stopped by
non-finite updates, 4 stopped by a health alarm (``health.stop_on_alarm``; a rerun refuses,
also with 4, until ``--config.health.resume_after_stop=True``).
"""

from __future__ import annotations

import time

_T0 = time.time()  # Before the heavy imports: the wall time counts them.


from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from grpo_jax import cli  # noqa: E402
from grpo_jax.core import distributed  # noqa: E402
from grpo_jax.core.errors import AlarmStop, NonFiniteError  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and summary.json.")
flags.DEFINE_bool("verbose", False, "Show the full traceback of a user error (bad config, input).")
flags.mark_flags_as_required(["config", "workdir"])
distributed.define_flags()  # --coordinator_address, --num_processes, --process_id


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.quiet()
    # Multi-host runs (TPU pod, SLURM, the flags, GRPO_JAX_* variables) join here, before
    # anything asks JAX for devices; a single process goes on unchanged.
    try:
        distributed.maybe_initialize_from_flags()
    except distributed.DistributedError as e:
        return cli.report_error(e, prefix="multi-process settings error")
    import jax

    if jax.process_index() == 0:  # the imports and the setup below take seconds, say so
        print(f"setting up the run in {FLAGS.workdir}", flush=True)
    from grpo_jax.run.train import train

    try:
        summary = train(FLAGS.config, FLAGS.workdir, start_time=_T0)
    except cli.user_errors() as e:
        if FLAGS.verbose:
            raise
        return cli.report_error(e)
    except NonFiniteError as e:
        return cli.report_error(e, status=cli.NON_FINITE)
    except AlarmStop as e:
        return cli.report_error(e, prefix="stopped", status=cli.ALARM_STOP)
    return 0 if summary else 1


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
