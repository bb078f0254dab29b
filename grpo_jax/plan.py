"""The plan command: a run's programs compiled for a named TPU topology, on any host.

    python -m grpo_jax.plan --config=configs/gsm8k.py:model=qwen2.5-0.5b --topology=v5e-16 \\
        [--config.mesh.fsdp=-1 --config.mesh.data=1 ...] [--json=plan.json]

From abstract parameters (no weight is read, nothing is downloaded) it compiles every program
the run would run and prints, per chip, XLA's memory beside the memory plan's, the FLOPs of a
whole step, its roofline time and MFU. A run that cannot fit is refused in one line before
anything compiles. Needs libtpu (``pip install 'grpo_jax[tpu]'``). Exit status: 0 every
program fits, 2 a user error or a program that does not fit. docs/pods.md has the rest.
"""

from __future__ import annotations

import os

# Before JAX starts a backend or libtpu loads: compile on this host's CPU for the named
# topology, and keep libtpu quiet about the TPU it does not find here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from grpo_jax import cli  # noqa: E402

cli.quiet()  # before the imports of JAX and transformers

from grpo_jax.aot import topology as topology_lib  # noqa: E402
from grpo_jax.core.errors import ConfigError  # noqa: E402

topology_lib.quiet_libtpu()
GiB = 2**30
PROGRAMS = (
    "update",
    "scoring",
    "prefill",
    "decode",
    "paged_prefill",
    "paged_decode",
    "reward_model",
    "judge",
)


@dataclasses.dataclass
class Options:
    """What the command line sets beside the run config."""

    topology: str
    model: str = ""
    model_config: str = ""
    programs: tuple[str, ...] = ()
    json: str = ""
    plan_only: bool = False
    suggest: bool = False
    force: bool = False


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _parse_programs(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in PROGRAMS]
    if unknown:
        raise ConfigError(f"--programs={text}: unknown {unknown}; known: {', '.join(PROGRAMS)}")
    return names


def plan(config, opts: Options, out=None, err=None) -> int:
    """The command on a parsed ``config`` (a ConfigDict); returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        return _plan(config, opts, out, err)
    except ConfigError as e:
        return cli.report_error(e, stream=err)


def _plan(config, opts: Options, out, err) -> int:
    # Here and in the two functions below, inside the function on purpose: these modules
    # import JAX, which loads libtpu; --help and the one-line refusals need neither.
    from grpo_jax.aot import architectures, budget
    from grpo_jax.run.config import check_batch_layout, parse_config

    topo = topology_lib.parse_topology(opts.topology)
    chip = topo.chip
    run = parse_config(config)
    cfg, source = architectures.resolve(run, model=opts.model, model_config=opts.model_config)
    budget.check_expert_axis(run, cfg, source)
    mesh_shape = budget.mesh_shape(run, topo.chips)
    if opts.suggest:
        found = budget.suggest(run, cfg, topo.chips, chip.hbm_limit, topo.slices)
        if found is None:
            raise ConfigError(
                f"no mesh, grad_accum, logits_chunk, attention, remat or scan_layers setting "
                f"fits the run on {topo.name} by the memory plan: a smaller batch "
                "(train.batch_size, sampling.max_new_tokens) or a larger topology"
            )
        overrides, run, cfg, mesh_shape = found
        flags = " ".join(f"--config.{k}={v}" for k, v in overrides.items()) or "(none)"
        print(f"suggested settings: {flags}", file=out, flush=True)
    check_batch_layout(run, mesh_shape["data"] * mesh_shape["fsdp"])
    needs = budget.needs(run, cfg, mesh_shape)
    wanted = opts.programs or tuple(needs)
    print(topo.describe() + f"; mesh {mesh_shape}", file=out)
    print(
        f"chip {chip.name}: {chip.peak_flops / 1e12:.0f} TFLOP/s bf16, HBM {_gib(chip.hbm_bytes)} "
        f"GiB at {chip.hbm_bandwidth / 1e9:.0f} GB/s (the compiler allows {_gib(chip.hbm_limit)} "
        f"GiB), ICI {chip.ici_bandwidth / 1e9:.0f} GB/s; {chip.source}",
        file=out,
    )
    print(f"model: {source}, {_params_line(cfg)}, {_run_line(run, cfg)}", file=out)
    worst = max((needs[p] for p in wanted if p in needs), key=lambda n: n.total, default=None)
    if worst is not None and worst.total > chip.hbm_limit and not (opts.force or opts.plan_only):
        raise ConfigError(
            f"program {worst.program} needs {_gib(worst.total)} GiB per chip by the memory "
            f"plan, over the {_gib(chip.hbm_limit)} GiB a {chip.name} chip gives a program "
            f"(mesh {mesh_shape}): nothing was compiled; --suggest finds settings that fit, "
            "--force compiles anyway"
        )
    if opts.plan_only:
        _print_plan_only(needs, wanted, chip, out)
        return 0
    problem = topology_lib.libtpu_problem()
    if problem:
        raise ConfigError(problem)
    return _compile_all(run, cfg, topo, mesh_shape, needs, wanted, opts, out, err)


def _params_line(cfg) -> str:
    """The parameters; a mixture of experts' also those a token computes with (the FLOPs'
    count, ``budget.model_flops``)."""
    line = f"{cfg.num_params:,} parameters"
    if cfg.num_experts:
        line += (
            f" ({cfg.active_params:,} active: {cfg.experts_per_token} of {cfg.num_experts} "
            f"experts per token in {len(cfg.sparse_layers)} layers)"
        )
    return line


def _run_line(run, cfg) -> str:
    line = (
        f"B {run.train.batch_size}, G {run.grpo.G}, P {max(run.sampling.prompt_buckets)}, "
        f"T {run.completion_slots[0]}, minibatch {run.train.minibatch_size or 'all'}, "
        f"grad_accum {run.optim.grad_accum}, logits_chunk {run.train.logits_chunk}, "
        f"{cfg.dtype} over {cfg.param_dtype}, remat {cfg.remat}, scan_layers {cfg.scan_layers}, "
        f"attention {cfg.attention}, engine {getattr(run.sampling, 'engine', 'static')}"
    )
    if run.model.lora.enabled:  # the programs carry the adapters; only they train
        line += f", LoRA rank {run.model.lora.rank} on {'/'.join(run.model.lora.projections)}"
    return line


def _print_plan_only(needs, wanted, chip, out) -> None:
    print(f"{'program':<14}{'plan GiB':>10}{'+ resident':>12}{'fits':>6}", file=out)
    for name in wanted:
        if name in needs:
            n = needs[name]
            fits = "yes" if n.total <= chip.hbm_limit else "NO"
            print(f"{name:<14}{_gib(n.own):>10}{_gib(n.resident):>12}{fits:>6}", file=out)


HEADER = (
    f"{'program':<14}{'compile s':>10}{'args':>7}{'out':>7}{'temps':>7}{'code':>6}"
    f"{'XLA':>7}{'+res':>6}{'plan':>7}{'plan/XLA':>9}{'TFLOP/step':>11}{'roof s':>8}"
    f"{'bound':>8}{'MFU':>6}{'kernels':>8}"
)


def _compile_all(run, cfg, topo, mesh_shape, needs, wanted, opts, out, err) -> int:
    from grpo_jax.aot import budget, measure, programs

    devices = topology_lib.devices(topo)
    mesh = topology_lib.make_mesh(topo, mesh_shape, devices)
    model_flops = budget.model_flops(run, cfg, topo.chips)
    print("per chip: GiB (args, out, temps, code, XLA's total, + resident beside it, the plan's "
          "own), FLOPs of one whole run of the program", file=out)  # fmt: skip
    print(HEADER, file=out, flush=True)
    rows, over = [], []
    for program in programs.programs(run, cfg, mesh, wanted):
        m, _ = measure.compile_program(program)
        need = needs.get(program.name)
        row = _row(m, need, run, cfg, mesh_shape, topo.chip, model_flops)
        rows.append(row)
        print(_format(row), file=out, flush=True)
        if m.error:
            over.append(f"program {m.program}: {m.error}")
        elif row["xla_total"] + row["resident"] > topo.chip.hbm_limit:
            over.append(
                f"program {m.program} needs {_gib(row['xla_total'] + row['resident'])} GiB per "
                f"chip (XLA, with what stays resident beside it), over the "
                f"{_gib(topo.chip.hbm_limit)} GiB a {topo.chip.name} chip gives a program"
            )
    step = _step(rows, topo.chip)
    if step:
        print(
            f"step (update + sampling): {step['tflop']:.1f} TFLOP per chip, roofline "
            f"{step['roofline_s']:.3g} s, MFU {step['mfu']:.0%} at most",
            file=out,
        )
    if opts.json:
        record = dict(
            topology=dataclasses.asdict(topo), mesh=mesh_shape, model=dataclasses.asdict(cfg),
            run=_run_line(run, cfg), programs=rows, step=step,
        )  # fmt: skip
        with open(opts.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    if over:
        return cli.report_error(over[0], stream=err)
    return 0


def _row(m, need, run, cfg, mesh_shape, chip, model_flops) -> dict:
    from grpo_jax.aot import budget

    row = dataclasses.asdict(m)
    row["xla_total"] = m.total
    row["plan"] = need.own if need else None
    row["resident"] = need.resident if need else 0
    if m.error:
        return row
    if m.program in ("reward_model", "judge"):  # one pass: its weights and activations once
        traffic = need.own if need else 0.0
    else:
        traffic = budget.hbm_traffic(m.program, run, cfg, mesh_shape)
    row.update(budget.roofline(m.flops, m.collective_bytes, traffic, chip))
    row["hbm_traffic"] = traffic
    useful = model_flops.get(m.program, 0.0)
    row["model_flops"] = useful
    row["mfu"] = useful / (row["roofline_s"] * chip.peak_flops) if row["roofline_s"] else 0.0
    return row


def _format(row) -> str:
    if row["error"]:
        return f"{row['program']:<14}{row['compile_s']:>10.0f}  {row['error']}"
    g = lambda k: _gib(row[k])
    plan = _gib(row["plan"]) if row["plan"] else "-"
    ratio = f"{row['plan'] / row['xla_total']:.2f}" if row["plan"] else "-"
    return (
        f"{row['program']:<14}{row['compile_s']:>10.0f}{g('arguments'):>7}{g('outputs'):>7}"
        f"{g('temporaries'):>7}{g('code'):>6}{g('xla_total'):>7}{g('resident'):>6}{plan:>7}"
        f"{ratio:>9}{row['flops'] / 1e12:>11.3g}{row['roofline_s']:>8.3g}{row['bound']:>8}"
        f"{row['mfu']:>6.0%}{row['kernels']:>8}"
    )


def _step(rows, chip) -> dict | None:
    """One GRPO step: the update and the sampler (prefill + decode loop)."""
    by = {r["program"]: r for r in rows if not r["error"]}
    parts = [by[p] for p in ("update", "prefill", "decode") if p in by]
    if "update" not in by or len(parts) < 3:
        return None
    t = sum(r["roofline_s"] for r in parts)
    useful = sum(r["model_flops"] for r in parts)
    return dict(
        tflop=sum(r["flops"] for r in parts) / 1e12,
        roofline_s=t,
        mfu=useful / (t * chip.peak_flops),
        model_tflop=useful / 1e12,
    )


def main(argv) -> int:
    from absl import flags

    F = flags.FLAGS
    if len(argv) > 1:
        return cli.report_error(f"unexpected arguments: {argv[1:]}")
    try:
        opts = Options(
            topology=F.topology,
            model=F.model,
            model_config=F.model_config,
            programs=_parse_programs(F.programs),
            json=F.json,
            plan_only=F.plan_only,
            suggest=F.suggest,
            force=F.force,
        )
    except ConfigError as e:
        return cli.report_error(e)
    if F.verbose:
        return _plan(F.config, opts, sys.stdout, sys.stderr)
    return plan(F.config, opts)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py).")
    flags.DEFINE_string("topology", None, f"TPU slice: {topology_lib.EXAMPLES}.")
    flags.DEFINE_string("model", "", "A built-in model's name (grpo_jax.aot.architectures).")
    flags.DEFINE_string("model_config", "", "A Hugging Face config.json giving the model's sizes.")
    flags.DEFINE_string("programs", "", f"Only these programs ({', '.join(PROGRAMS)}).")
    flags.DEFINE_string("json", "", "Write the table as JSON to this file.")
    flags.DEFINE_bool("plan_only", False, "Print the memory plan; compile nothing.")
    flags.DEFINE_bool("suggest", False, "Find settings that fit the topology, compile those.")
    flags.DEFINE_bool("force", False, "Compile a run the plan says does not fit.")
    flags.DEFINE_bool("verbose", False, "Show the traceback of a user error.")
    flags.mark_flags_as_required(["config", "topology"])
    app.run(main, argv=sys.argv, flags_parser=cli.parse_flags)
