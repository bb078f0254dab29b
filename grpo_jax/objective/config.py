"""The GRPO objective's settings: :class:`GRPOConfig`, the run config's ``grpo`` section.

One frozen, hashable config that the update (``grpo_jax.learner.update``) and the loss
(``grpo_jax.objective.losses.grpo_loss``, a static argument under jit) both take; each
default is stated once, here. It sits below the losses and checks the names they implement
against the registries (docs/objective.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from grpo_jax.core.checks import check_bool, check_choice, check_known_keys, check_range
from grpo_jax.core.errors import ConfigError
from grpo_jax.objective import advantages
from grpo_jax.objective.kl import KL_ESTIMATORS
from grpo_jax.objective.policy_terms import POLICY_LOSSES, SEQUENCE_POLICY_LOSSES

OLD_LOGPS = ("sampler", "recompute")
# Routing replay for mixtures of experts (docs/moe.md): "rollout" trains with the experts the
# sampler's routers chose.
ROUTER_REPLAY = ("none", "rollout")
# The reductions and behaviour corrections grpo_jax.objective.losses implements.
REDUCTIONS = ("grpo", "token_mean", "dr_grpo", "gspo")
BEHAVIOR_CORRECTIONS = ("none", "tis", "mis")
BEHAVIOR_LEVELS = ("token", "sequence")
# The clip range of a run config's ``grpo.epsilon`` when unset: both sides' default.
EPSILON = 0.2


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Hyperparameters of the GRPO objective (DeepSeekMath, Shao et al. 2024).

    Attributes:
      G: group size, completions sampled per prompt (>= 2: a group of one has
        no relative advantage).
      beta: weight of the KL penalty to the frozen reference policy. 0 skips
        the reference model entirely (no memory, no forward pass).
      epsilon_low: clip range below 1 for the ratio rho = pi_theta / pi_old;
        None switches clipping off on that side.
      epsilon_high: clip range above 1 (DAPO's "clip-higher" sets it above
        epsilon_low); None switches clipping off on that side.
      mu: gradient passes over each rollout batch against the fixed pi_old.
      kl_estimator: one of ``grpo_jax.objective.kl.KL_ESTIMATORS``.
      reduction: one of ``REDUCTIONS``: "grpo" (the per-sequence token mean, then
        the mean over rows), "token_mean" (DAPO), "dr_grpo" (a constant
        normaliser, Dr. GRPO) or "gspo" (the ratio and its clip per sequence).
      advantage_estimator: one of ``grpo_jax.objective.advantages.ESTIMATORS``.
      advantage_eps: eps in A = (r - mean) / (std + eps).
      temperature: sampling temperature; all three policies score tokens from
        logits / temperature.
      policy_loss: one of ``grpo_jax.objective.policy_terms.POLICY_LOSSES``
        (docs/objective.md); "gmpo" needs reduction "grpo", "gspo" needs "clip".
      dual_clip_c: dual-clip PPO's c (> 1) for A < 0; None switches it off.
      sapo_tau_pos, sapo_tau_neg: "sapo" gate temperatures for A > 0 / A < 0.
      cov_frac: "clip_cov"/"kl_cov" fraction of valid tokens picked by covariance.
      cov_lb, cov_ub: "clip_cov" covariance band.
      kl_cov_coef: "kl_cov" penalty weight k.
      passk_k: k of the "passk" advantage estimator (<= G).
      behavior_correction: "none" (default), "tis" or "mis": importance
        weights of pi_old against the distribution the sampler drew from
        (after top-k / top-p / min-p, at the sampler's precision), truncated
        at C ("tis") or masking tokens outside [1/C, C] ("mis"); see
        ``grpo_jax.objective.losses.behavior_weights`` and docs/objective.md.
        One of ``BEHAVIOR_CORRECTIONS``.
      behavior_level: "token" (default) or "sequence" weights.
      behavior_cap: C (> 1).
      old_logps: "sampler" (default): pi_old's log-probs are those the
        sampler recorded; "recompute": the update scores the batch with the
        sampling parameters once before its first pass (one more forward
        pass), so the first ratio is 1 even when sampler and trainer compute
        at different precision.
      gae_gamma, gae_lambda, whiten_advantages, value_loss_coef, value_clip,
        critic_warmup_steps: PPO with a learned critic (``advantage_estimator = "gae"``,
        docs/objective.md, section 14): GAE's discount and lambda, whether the advantages
        are whitened over the batch's tokens, the value loss's weight, its clip range
        around the old values, and the steps at the start whose policy term is off
        while the value head learns.
      router_replay: "none" (default) or "rollout": a mixture of experts trains with
        the experts the sampler's routers chose for each token, weighted by its own
        router's probabilities for them (docs/moe.md, "Routing replay in training").
    """

    G: int = 8
    beta: float = 0.0
    epsilon_low: float | None = EPSILON
    epsilon_high: float | None = EPSILON
    mu: int = 1
    kl_estimator: str = "k3"
    reduction: str = "grpo"
    advantage_estimator: str = "grpo"
    advantage_eps: float = 1e-4
    temperature: float = 1.0
    policy_loss: str = "clip"
    dual_clip_c: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_frac: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    passk_k: int = 1
    behavior_correction: str = "none"
    behavior_level: str = "token"
    behavior_cap: float = 2.0
    old_logps: str = "sampler"
    gae_gamma: float = 1.0
    gae_lambda: float = 1.0
    whiten_advantages: bool = True
    value_loss_coef: float = 0.5
    value_clip: float = 0.2
    critic_warmup_steps: int = 0
    router_replay: str = "none"

    def __post_init__(self):
        check_range("grpo.G", self.G, lo=2, integer=True)
        check_range("grpo.beta", self.beta, lo=0.0)
        for side in ("epsilon_low", "epsilon_high"):
            value = getattr(self, side)
            if value is not None:
                check_range(f"grpo.{side}", value, lo=0.0)
        check_range("grpo.mu", self.mu, lo=1, integer=True)
        check_choice("grpo.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("grpo.reduction", self.reduction, REDUCTIONS)
        check_choice("grpo.advantage_estimator", self.advantage_estimator, advantages.ESTIMATORS)
        check_range("grpo.advantage_eps", self.advantage_eps, lo=0.0)
        check_range("grpo.temperature", self.temperature, lo=0.0, lo_open=True)
        check_choice("grpo.policy_loss", self.policy_loss, POLICY_LOSSES)
        if self.reduction == "gspo" and self.policy_loss != "clip":
            raise ConfigError(
                f"grpo.policy_loss={self.policy_loss!r} does not combine with "
                "grpo.reduction='gspo'; allowed with 'gspo': ['clip']"
            )
        if self.policy_loss in SEQUENCE_POLICY_LOSSES and self.reduction != "grpo":
            raise ConfigError(
                f"grpo.policy_loss={self.policy_loss!r} needs grpo.reduction='grpo', "
                f"got {self.reduction!r}"
            )
        if self.dual_clip_c is not None:
            check_range("grpo.dual_clip_c", self.dual_clip_c, lo=1.0, lo_open=True)
        check_range("grpo.sapo_tau_pos", self.sapo_tau_pos, lo=0.0, lo_open=True)
        check_range("grpo.sapo_tau_neg", self.sapo_tau_neg, lo=0.0, lo_open=True)
        check_range("grpo.cov_frac", self.cov_frac, lo=0.0, hi=1.0)
        check_range("grpo.cov_lb", self.cov_lb)
        check_range("grpo.cov_ub", self.cov_ub, lo=self.cov_lb)
        check_range("grpo.kl_cov_coef", self.kl_cov_coef, lo=0.0)
        check_range("grpo.passk_k", self.passk_k, lo=1, hi=self.G, integer=True)
        check_choice("grpo.behavior_correction", self.behavior_correction, BEHAVIOR_CORRECTIONS)
        check_choice("grpo.behavior_level", self.behavior_level, BEHAVIOR_LEVELS)
        check_range("grpo.behavior_cap", self.behavior_cap, lo=1.0, lo_open=True)
        check_choice("grpo.old_logps", self.old_logps, OLD_LOGPS)
        check_choice("grpo.router_replay", self.router_replay, ROUTER_REPLAY)
        sequence_terms = self.reduction == "gspo" or self.policy_loss in SEQUENCE_POLICY_LOSSES
        self._check_critic(sequence_terms)
        if (
            self.behavior_correction != "none"
            and sequence_terms
            and self.behavior_level != "sequence"
        ):
            raise ConfigError(
                "grpo.behavior_correction with a sequence-level objective "
                f"(reduction={self.reduction!r}, policy_loss={self.policy_loss!r}) needs "
                f"grpo.behavior_level='sequence', got {self.behavior_level!r}"
            )

    def _check_critic(self, sequence_terms: bool) -> None:
        """The keys of PPO with a learned critic; "gae" needs a per-token policy term."""
        check_range("grpo.gae_gamma", self.gae_gamma, lo=0.0, hi=1.0)
        check_range("grpo.gae_lambda", self.gae_lambda, lo=0.0, hi=1.0)
        check_bool("grpo.whiten_advantages", self.whiten_advantages)
        check_range("grpo.value_loss_coef", self.value_loss_coef, lo=0.0, lo_open=True)
        check_range("grpo.value_clip", self.value_clip, lo=0.0, lo_open=True)
        check_range("grpo.critic_warmup_steps", self.critic_warmup_steps, lo=0, integer=True)
        if self.advantage_estimator == "gae" and sequence_terms:
            raise ConfigError(
                "grpo.advantage_estimator='gae' gives one advantage per token, which "
                f"grpo.reduction={self.reduction!r} with grpo.policy_loss="
                f"{self.policy_loss!r} cannot take (a sequence-level objective)"
            )

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> GRPOConfig:
        """Builds from the ``grpo`` section of a run config.

        ``epsilon`` sets both clip sides; ``epsilon_low``/``epsilon_high`` left
        at None there inherit it (a run config turns a side's clipping off with
        a huge value such as 1e9, which never binds since rho > 0).
        """
        cfg = dict(cfg)
        fields = {f.name for f in dataclasses.fields(cls)}
        check_known_keys("grpo", cfg, fields | {"epsilon"})
        eps = cfg.pop("epsilon", EPSILON)
        check_range("grpo.epsilon", eps, lo=0.0)
        for side in ("epsilon_low", "epsilon_high"):
            if cfg.get(side) is None:
                cfg[side] = eps
        return cls(**cfg)
