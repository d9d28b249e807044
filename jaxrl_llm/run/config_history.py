"""A resumed run's config against the one it started with: the changed keys, which of them alter the math or
the shapes (`unsafe_changes`), and a config written by an earlier version read under today's names and defaults
(`current_config`), so an old run still resumes."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.config import RunConfig, to_dict

# Config keys a resume may change freely: cadence, memory knobs and reporting; the math stays the same.
SAFE_TO_CHANGE = ("out_dir", "steps", "log_every", "sample_every", "eval_every", "eval_size", "eval_batch_size",
                  "checkpoint_every", "keep_checkpoints", "export", "export_dir", "tensorboard", "progress_bar",
                  "on_divergence", "divergence.", "distributed.", "mesh.", "model.remat", "model.scan_unroll",
                  "model.logprob_block_mib", "model.attention_query_chunk", "sft.eval_batch_size", "data.eval",
                  "data.eval_split", "eval_reward", "final_checkpoint", "diagnostics.", "logging.", "report",
                  "monitor.")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            if isinstance(v, dict) and v and k != "init" and k != "kwargs":
                out.update(_flatten(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out
    return {prefix.rstrip("."): tree}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """`(key, old value, new value)` for each dotted key whose value differs."""
    a, b = _flatten(old), _flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def unsafe_changes(changes: list[tuple[str, Any, Any]], new: RunConfig) -> list[tuple[str, Any, Any]]:
    """The changes that alter the math or the shapes of a resumed run (see `SAFE_TO_CHANGE`)."""
    def safe(key: str) -> bool:
        if key == "steps":  # the decay of a cosine / linear schedule spans all steps
            return new.optim.schedule == "constant"
        return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)

    return [c for c in changes if not safe(c[0])]


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)


def current_config(old: dict[str, Any]) -> dict[str, Any]:
    """A config read from a run's `configs/` as today's version writes it: renamed keys under their current names,
    fields added since at their defaults."""
    return _with_defaults(_current_names(old))


def _with_defaults(old: dict[str, Any]) -> dict[str, Any]:
    """A config written by an earlier version, with the fields added since at their defaults: a key the old run
    did not have ran at its default value then (a new option, off), so it is no change."""
    def merge(defaults: Any, given: Any) -> Any:
        if isinstance(defaults, dict) and isinstance(given, dict) and defaults:
            return {**defaults, **{k: merge(defaults.get(k), v) for k, v in given.items()}}
        return given

    return merge(to_dict(RunConfig()), old)


def _current_names(old: dict[str, Any]) -> dict[str, Any]:
    """A config written by an earlier version, with its renamed keys under their current names (`grpo:` is
    `rl:`, `ratio_level: token|sequence` is `policy_loss: ppo_clip|gspo`, the loss's flat `rl` keys are `rl.loss`'s,
    SAPO's `sapo_tau_*` are `rl.policy_loss_kwargs`), so such a run still resumes."""
    if "grpo" in old and "rl" not in old:
        rl = dict(old.pop("grpo") or {})
        if "ratio_level" in rl:
            rl["policy_loss"] = {"token": "ppo_clip", "sequence": "gspo"}.get(rl.pop("ratio_level"), "ppo_clip")
        old = {**old, "rl": rl}
    rl = dict(old.get("rl") or {})
    moved = {k: rl.pop(k) for k in LOSS_KEYS if k in rl}  # flat rl keys of before the rl.loss section
    if "loss_aggregation" in rl:
        moved["aggregation"] = rl.pop("loss_aggregation")
    taus = {k[len("sapo_"):]: rl.pop(k) for k in ("sapo_tau_pos", "sapo_tau_neg") if k in rl}
    if rl.get("policy_loss") == "sapo" and taus:
        rl["policy_loss_kwargs"] = {**taus, **(rl.get("policy_loss_kwargs") or {})}
    if moved or taus:
        old = {**old, "rl": {**rl, "loss": {**moved, **(rl.get("loss") or {})}}}
    return old


LOSS_KEYS = ("epsilon_low", "epsilon_high", "dual_clip_c", "kl_estimator", "top_entropy_quantile", "clip_cov_ratio",
             "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef", "rollout_correction",
             "rollout_correction_cap")
