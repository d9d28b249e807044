"""RL math as pure functions, one idea per module: masked reductions and loss aggregation (`reductions`), token
log-probs (`logprobs`), advantages and their registry (`advantages`, `estimators`), KL estimators and KL-shaped
rewards (`kl`), policy-gradient surrogates and their registry (`surrogates`), token selection
(`token_selection`), rollout correction (`rollout_correction`), the composed policy loss (`policy_loss`), the
critic's loss (`value_loss`), preference losses (`preference`), and the KL- and entropy-coefficient controllers.

Formulas and references: ``docs/algorithms.md``.
"""

from jaxrl_llm.rl.advantages import (
    AdvantageScale,
    discounted_returns,
    gae_advantages,
    group_normalized_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from jaxrl_llm.rl.entropy_control import (
    EntropyControllerKind,
    EntropyControllerState,
    adaptive_entropy_update,
    applied_entropy_coef,
    entropy_controller_update,
    fixed_entropy_update,
    init_entropy_controller,
)
from jaxrl_llm.rl.kl import KLEstimator, kl_penalty, kl_shaped_token_rewards, last_token_mask
from jaxrl_llm.rl.kl_control import (
    KLControllerKind,
    KLControllerState,
    adaptive_kl_update,
    fixed_kl_update,
    init_kl_controller,
    kl_controller_update,
)
from jaxrl_llm.rl.logprobs import (
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
    token_logprobs_chunked,
    token_logprobs_from_hidden,
)
from jaxrl_llm.rl.policy_loss import PolicyLossOptions, clipped_policy_loss, compose_policy_loss
from jaxrl_llm.rl.preference import PreferenceLossType, dpo_loss
from jaxrl_llm.rl.reductions import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate_loss,
    masked_count,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    masked_var,
    safe_divide,
)
from jaxrl_llm.rl.rollout_correction import (
    logprob_mismatch,
    rollout_correction_weights,
    truncated_importance_weights,
)
from jaxrl_llm.rl.surrogates import (
    POLICY_LOSSES,
    cispo_loss,
    clip_metrics,
    clipped_surrogate,
    gspo_loss,
    ppo_clip_loss,
    register_policy_loss,
    sapo_loss,
)
from jaxrl_llm.rl.token_selection import (
    clip_cov_token_mask,
    kl_cov_token_mask,
    token_covariance,
    top_entropy_token_mask,
)
from jaxrl_llm.rl.value_loss import clipped_value_loss, explained_variance

__all__ = [
    "AGGREGATION_MODES",
    "POLICY_LOSSES",
    "AdvantageScale",
    "AggregationMode",
    "EntropyControllerKind",
    "EntropyControllerState",
    "KLControllerKind",
    "KLControllerState",
    "KLEstimator",
    "PolicyLossOptions",
    "PreferenceLossType",
    "adaptive_entropy_update",
    "adaptive_kl_update",
    "aggregate_loss",
    "applied_entropy_coef",
    "cispo_loss",
    "clip_cov_token_mask",
    "clip_metrics",
    "clipped_policy_loss",
    "clipped_surrogate",
    "clipped_value_loss",
    "compose_policy_loss",
    "discounted_returns",
    "dpo_loss",
    "entropy_controller_update",
    "explained_variance",
    "fixed_entropy_update",
    "fixed_kl_update",
    "gae_advantages",
    "group_normalized_advantages",
    "gspo_loss",
    "init_entropy_controller",
    "init_kl_controller",
    "kl_controller_update",
    "kl_cov_token_mask",
    "kl_penalty",
    "kl_shaped_token_rewards",
    "last_token_mask",
    "logprob_mismatch",
    "masked_count",
    "masked_max",
    "masked_mean",
    "masked_min",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip_loss",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "rollout_correction_weights",
    "safe_divide",
    "sapo_loss",
    "token_covariance",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "token_logprobs_chunked",
    "token_logprobs_from_hidden",
    "top_entropy_token_mask",
    "truncated_importance_weights",
]
