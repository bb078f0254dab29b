"""Partial rollouts: rows still unfinished when a step's groups are done carry over
(``sampling.partial_rollouts`` on an engine that carries rows, ``"paged"``).

With ``train.max_staleness`` = k >= 1 the engine run of step s holds the groups of steps
s .. s + k; it stops once step s's own groups are done, and the next run continues the rest
with its own parameters. Each token's version and log-probs are recorded beside it, and a
checkpoint holds the carried groups. With routing replay each row carries its routes, those
of the run that last fed it (the run that finishes a row feeds its whole prefix again).
docs/engine.md, "Partial rollouts", has the versions and their bound, the objective, exact
resume and the metrics.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from grpo_jax.core import sharding as sharding_lib
from grpo_jax.core.batch import jsonable
from grpo_jax.core.errors import ConfigError
from grpo_jax.rollout.rounds import Rollouts
from grpo_jax.sampling import paged
from grpo_jax.sampling.engines import get_engine

NO_VERSION = -1  # a token slot not drawn yet


@dataclasses.dataclass
class Group:
    """One prompt's G rows, as far as they have been drawn."""

    example: dict
    prompt: np.ndarray  # int32: its real tokens, as the encoder gives them
    rows: paged.Rows  # G rows
    versions_GxT: np.ndarray  # int32: the parameter version that drew each token

    def started(self) -> bool:
        return bool(self.rows.count_N.any())


def stack_rows(groups: list[Group]) -> paged.Rows:
    cat = lambda xs: None if xs[0] is None else np.concatenate(xs)
    return paged.Rows(*(cat(x) for x in zip(*(g.rows for g in groups))))


class Carry:
    """The groups of the next k + 1 steps, in prompt order (module doc).

    ``top_up(draw)`` reads the data iterator up to k + 1 steps' groups;
    ``sample(params, key, version)`` then runs the engine once and returns the
    step's B groups, finished; the rest stay here for the next step.
    """

    def __init__(self, r: Rollouts, k: int):
        self.r, self.k = r, k
        self.groups: list[Group] = []

    @property
    def width(self) -> int:
        return (self.k + 1) * self.r.batch_size

    def _new_groups(self, examples: list[dict]) -> list[Group]:
        s, g = self.r.sampling, self.r.grpo.G
        t = s.max_new_tokens
        _, tokens_BxP, mask_BxP = self.r.encoder.encode(examples, max_new_tokens=t)
        return [
            Group(
                example=ex,
                prompt=row[m].astype(np.int32),
                rows=paged.fresh_rows(g, t, s.pad_id),
                versions_GxT=np.full((g, t), NO_VERSION, np.int32),
            )
            for ex, row, m in zip(examples, tokens_BxP, mask_BxP, strict=True)
        ]

    def top_up(self, draw) -> list[Group]:
        """Reads batches of B examples with ``draw()`` until k + 1 steps' groups are here
        -> the next step's groups."""
        while len(self.groups) < self.width:
            self.groups += self._new_groups(list(draw()))
        return self.groups[: self.r.batch_size]

    def sample(self, params, key: jax.Array, version: int) -> tuple[list[Group], object]:
        """-> (the step's B groups, finished; the engine's statistics), sampled by
        ``params`` (parameter version ``version``); call :meth:`top_up` first."""
        if len(self.groups) < self.width:
            raise RuntimeError(f"{len(self.groups)} groups carried; top_up to {self.width} first")
        graphdef, params = self.r.sampler_policy(params)
        b, g = self.r.batch_size, self.r.grpo.G
        self._give_routes(nnx.merge(graphdef, params).config)
        before = stack_rows(self.groups)
        # The run's config named an engine that carries rows (grpo_jax.run.config checks it).
        rows, stats = get_engine(self.r.sampling.engine).generate_rows(
            graphdef,
            params,
            [x.prompt for x in self.groups],
            before,
            key,
            self.r.sampling,
            num_samples=g,
            due=b,
            mesh=self.r.mesh,
        )
        t = rows.tokens_NxT.shape[1]
        drawn_NxT = (np.arange(t)[None] >= before.count_N[:, None]) & (
            np.arange(t)[None] < rows.count_N[:, None]
        )
        for i, grp in enumerate(self.groups):
            sl = slice(i * g, (i + 1) * g)
            grp.rows = paged.Rows(*(None if x is None else x[sl] for x in rows))
            grp.versions_GxT = np.where(drawn_NxT[sl], version, grp.versions_GxT)
        done, self.groups = self.groups[:b], self.groups[b:]
        return done, stats

    def _give_routes(self, model_cfg) -> None:
        """With routing replay, a routes array for each group without one yet: [G, W + T, R,
        K], W the largest prompt bucket (the widest prompt the batches pad to)."""
        s = self.r.sampling
        if not paged.records_routes(model_cfg, s):
            return
        w, g = max(s.prompt_buckets), self.r.grpo.G
        for grp in self.groups:
            if grp.rows.routes_NxSxRxK is None:
                routes = paged.fresh_routes(model_cfg, g, w, s.max_new_tokens)
                grp.rows = grp.rows._replace(routes_NxSxRxK=routes)

    def metrics(self, done: list[Group], version: int) -> dict[str, float]:
        """The ``partial/*`` metrics of a step's groups (sampled by ``version`` and earlier)."""
        v_NxT = np.concatenate([x.versions_GxT for x in done])
        drawn = v_NxT != NO_VERSION
        stale_NxT = np.where(drawn, version - v_NxT, 0)
        t = self.r.sampling.max_new_tokens
        carried = [x for x in self.groups if x.started()]
        inflight = sum(int((~x.rows.finished(t) & (x.rows.count_N > 0)).sum()) for x in carried)
        return {
            "partial/stale_token_frac": float((stale_NxT > 0).sum() / max(drawn.sum(), 1)),
            "partial/token_staleness_mean": float(stale_NxT.sum() / max(drawn.sum(), 1)),
            "partial/token_staleness_max": float(stale_NxT.max(initial=0)),
            "partial/carried_rows": float((stale_NxT > 0).any(axis=1).sum()),
            "partial/inflight_rows": float(inflight),
            "partial/inflight_groups": float(len(carried)),
        }

    # -- checkpoints: the groups carried (grpo_jax.run.state.Stateful) ----------------

    def state_dict(self) -> dict:
        """The groups' examples and prompts, and their arrays' shapes (JSON)."""
        if not self.groups:
            return {"partial": {"groups": []}}
        groups = [
            {"example": jsonable(x.example), "prompt": x.prompt.tolist()} for x in self.groups
        ]
        shapes = {k: [list(v.shape), str(v.dtype)] for k, v in self._arrays().items()}
        return {"partial": {"groups": groups, "shapes": shapes}}

    def state_arrays(self) -> dict:
        """Their rows' tokens, log-probs, versions and counts, and with routing replay their
        routes (no keys or values)."""
        return {"partial": self._arrays()} if self.groups else {}

    def _arrays(self) -> dict[str, np.ndarray]:
        rows = stack_rows(self.groups)
        g = self.r.grpo.G
        arrays = {
            name: np.asarray(x).reshape(len(self.groups), g, *np.shape(x)[1:])
            for name, x in rows._asdict().items()
            if x is not None  # routes: with routing replay only
        }
        arrays["versions_NxT"] = np.stack([x.versions_GxT for x in self.groups])
        return arrays

    def arrays_like(self, state):
        """What to read a checkpoint's carried rows into (None: it carries none)."""
        if not isinstance(state, dict):
            raise ConfigError(
                "the checkpoint holds batches sampled ahead by the train.max_staleness "
                "pipeline, not partial rollouts: resume it with sampling.partial_rollouts = False"
            )
        info = state.get("partial")
        if not info or not info["groups"]:
            return None
        g, t = self.r.grpo.G, self.r.sampling.max_new_tokens
        saved_gt = info["shapes"]["tokens_NxT"][0][1:]
        if saved_gt != [g, t]:
            raise ConfigError(
                f"the checkpoint carries rows of {saved_gt} (grpo.G, sampling.max_new_tokens); "
                f"this run has [{g}, {t}]: resume with the settings it was saved with"
            )
        replicated = sharding_lib.replicated(self.r.mesh)
        return {
            "partial": {
                name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=replicated)
                for name, (shape, dtype) in info["shapes"].items()
            }
        }

    def load_state_dict(self, state, arrays=None) -> None:
        """The groups carried when the checkpoint was saved (``arrays``: as
        :meth:`arrays_like` asked, read back)."""
        info = state.get("partial") if isinstance(state, dict) else None
        self.groups = []
        if not info or not info["groups"] or arrays is None:
            return
        arrays = {k: np.asarray(v) for k, v in arrays["partial"].items()}
        self.groups = [
            Group(
                example=meta["example"],
                prompt=np.asarray(meta["prompt"], np.int32),
                rows=paged.Rows(
                    *(arrays[name][i] if name in arrays else None for name in paged.Rows._fields)
                ),
                versions_GxT=arrays["versions_NxT"][i],
            )
            for i, meta in enumerate(info["groups"])
        ]
