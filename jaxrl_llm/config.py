"""Typed configuration of a whole run: dataclasses, YAML presets and dotted command-line overrides.

`load_run_config(yaml_path, overrides)` merges, in order, the dataclass defaults, the YAML file and
`section.field=value` overrides with OmegaConf (which type-checks every value and names the full key on
error), then `validate` checks the relations between numbers (which must divide which) up front, so a bad
config fails before anything is compiled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

ALGORITHMS = ("sft", "grpo", "rloo", "reinforce_pp", "ppo", "rm")
ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field(s) at fault."""


@dataclass
class ModelSection:
    path: str = "models/arith-base"  # HF directory or hub id; for --algo sft: where the new model is written
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    param_dtype: str = "float32"
    remat: bool = False
    # Memory of one float32 logits block [rows, chunk, V] when the train step and the reference pass compute
    # log-probs and entropy from the final hidden states (MiB); 0 = all completion positions in one block.
    logprob_block_mib: float = 256.0
    # Full-sequence attention takes at most this many queries at a time (float32 scores [B, H, chunk, S], not
    # [B, H, T, S]); 0 = all queries at once.
    attention_query_chunk: int = 128
    # --algo sft only: architecture of a model trained from scratch (HF config.json keys, with model_type),
    # and its tokenizer: a directory, or "arithmetic" for the default task's character tokenizer.
    init: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""


@dataclass
class DataSection:
    train: str = "data/arithmetic/train.jsonl"  # JSONL path, or hf:NAME[:CONFIG] for a hub dataset
    eval: str = "data/arithmetic/test.jsonl"
    split: str = "train"  # hub datasets only
    eval_split: str = "test"
    prompt_field: str = "prompt"  # text, or a list of chat messages [{"role", "content"}]
    answer_field: str = "answer"  # passed to reward functions as a keyword (all fields are)
    chosen_field: str = "chosen"  # --algo rm: preference pairs
    rejected_field: str = "rejected"
    # Optional templates applied to each record: "{question}" style, filled from the record's fields.
    prompt_template: str = ""
    answer_template: str = ""
    chat_template: bool = False  # render the prompt with the tokenizer's chat template
    system_prompt: str = ""
    max_prompt_tokens: int = 64  # longer prompts are dropped (with a count), never cut
    shuffle: bool = True


@dataclass
class SamplingSection:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # Compile buckets: prompt widths and completion lengths are rounded up to these multiples, so calls with
    # lengths in one bucket reuse one compiled sampler / train step. Smaller = less padding, more compiles.
    prompt_bucket: int = 16
    new_tokens_bucket: int = 16


@dataclass
class GRPOSection:
    prompts_per_step: int = 16  # P
    group_size: int = 8  # G: samples per prompt
    mu: int = 1  # optimisation passes over each rollout
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole rollout (P * G)
    grad_accum: int = 1  # micro-batches per optimizer step (divides minibatch_size)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip_c: float = 0.0  # 0 = off; else > 1
    ratio_level: str = "token"  # token | sequence (GSPO)
    beta: float = 0.0  # KL coefficient to the reference model; 0 skips the reference pass
    kl_estimator: str = "k3"
    loss_aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum(-norm)
    scale_rewards: str = "group"  # group | batch | none (Dr.GRPO)
    entropy_coef: float = 0.0
    # Advantage estimator: "" = the algorithm's own (grpo, rloo, reinforce_pp); or reinforce_pp_baseline.
    estimator: str = ""
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill the batch
    max_refill_rounds: int = 3


@dataclass
class PPOSection:
    """--algo ppo only; the loop's knobs (prompts_per_step, group_size, mu, minibatch_size, epsilons,
    entropy_coef) stay in `grpo`. The KL to the reference is in the per-token reward, not in the loss."""

    gamma: float = 1.0  # discount over completion tokens
    lam: float = 0.95  # GAE lambda
    value_clip: float = 0.2  # clip range of V around the rollout's values; 0 = no value clipping
    critic_learning_rate: float = 5.0e-4  # the critic's own AdamW (same schedule / warmup as optim)
    critic_warmup_steps: int = 0  # first steps train only the critic (the policy is not updated)
    critic_init: str = "policy"  # "policy" (a copy of its decoder) or a model directory (e.g. a reward model)
    kl_coef_init: float = 0.01  # beta of r_t = -beta * KL_t + [t = last] * score
    kl_estimator: str = "k1"
    kl_target: float = 0.0  # adaptive controller target (mean KL per token); 0 = fixed coefficient
    kl_horizon: float = 10000.0  # adaptive controller horizon, in samples
    whiten_advantages: bool = True


@dataclass
class RewardSpec:
    name: str = "math_answer"  # a built-in name or "module:function"
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimSection:
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear (decay to end_lr_ratio * lr after warmup)
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    max_grad_norm: float = 1.0


@dataclass
class SFTSection:
    batch_size: int = 64
    eval_batch_size: int = 256


@dataclass
class MeshSection:
    """Device mesh (see `jaxrl_llm.sharding`): data * fsdp * tensor = all devices; one axis may be -1."""

    data: int = -1  # data parallel: params replicated, batch split
    fsdp: int = 1  # batch split, params and optimizer state sharded
    tensor: int = 1  # attention heads and MLP columns split


@dataclass
class DistributedSection:
    """Multi-host: `jax.distributed.initialize` before anything touches the devices. Empty fields are taken
    from the environment (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or what JAX detects
    on SLURM, Open MPI and TPU pods); `enabled=false` and no such variables: one process."""

    enabled: bool = False
    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1
    local_device_ids: list[int] = field(default_factory=list)  # default: all local devices


@dataclass
class RunConfig:
    algo: str = "grpo"
    seed: int = 0
    steps: int = 100
    out_dir: str = "runs/default"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    sft: SFTSection = field(default_factory=SFTSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    optim: OptimSection = field(default_factory=OptimSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    log_every: int = 1
    sample_every: int = 10  # write sample completions with rewards every N steps
    # Held-out accuracy = share of greedy answers this reward scores exactly 1: a built-in name or
    # module:function; "" = the first of `rewards` (set it when that one is not a 0/1 check, e.g. a reward model).
    eval_reward: str = ""
    eval_every: int = 0  # held-out greedy evaluation every N steps (0: only before and after)
    eval_size: int = 256  # held-out prompts per evaluation (0: all)
    eval_batch_size: int = 256
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    export: bool = True  # write the final policy as a Hugging Face directory
    export_dir: str = ""  # default: out_dir/hf
    tensorboard: bool = True
    progress_bar: bool = True


def load_run_config(path: str | Path | None, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """Defaults < YAML file < `fields` < dotted `overrides` ("grpo.beta=0.04"), type-checked, validated."""
    try:
        merged = OmegaConf.structured(RunConfig)
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} does not exist")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        if fields:
            merged = OmegaConf.merge(merged, OmegaConf.create(fields))
        if overrides:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid configuration{f' in {path}' if path else ''}: {e}") from e
    validate(config)
    return config


def _choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")


def validate(c: RunConfig) -> None:
    """Check relations between fields, naming each number involved."""
    _choice(c.algo, "algo", ALGORITHMS)
    _choice(c.model.dtype, "model.dtype", ("float32", "bfloat16"))
    _choice(c.model.param_dtype, "model.param_dtype", ("float32", "bfloat16"))
    g = c.grpo
    _choice(g.kl_estimator, "grpo.kl_estimator", ("k1", "k2", "k3"))
    _choice(g.ratio_level, "grpo.ratio_level", ("token", "sequence"))
    _choice(
        g.loss_aggregation,
        "grpo.loss_aggregation",
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    )
    _choice(g.scale_rewards, "grpo.scale_rewards", ("group", "batch", "none"))
    _choice(c.optim.schedule, "optim.schedule", ("constant", "cosine", "linear"))
    if c.model.attention_query_chunk < 0:
        raise ConfigError(f"model.attention_query_chunk={c.model.attention_query_chunk} must be >= 0 (0 = off)")
    if c.model.logprob_block_mib < 0:
        raise ConfigError(f"model.logprob_block_mib={c.model.logprob_block_mib}: the MiB of one log-prob block "
                          "must be >= 0 (0 = all completion positions in one block)")
    if c.optim.learning_rate <= 0:
        raise ConfigError(f"optim.learning_rate={c.optim.learning_rate} must be > 0")
    if c.sampling.prompt_bucket < 1 or c.sampling.new_tokens_bucket < 1:
        raise ConfigError(f"sampling.prompt_bucket={c.sampling.prompt_bucket} and sampling.new_tokens_bucket="
                          f"{c.sampling.new_tokens_bucket} must be >= 1")
    sizes = (c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh.data/fsdp/tensor = {sizes}: each is a positive size, and at most one is -1")
    if g.estimator:
        _choice(g.estimator, "grpo.estimator", ESTIMATORS)
    if g.group_size < 2 and c.algo in ("grpo", "rloo") and g.estimator != "reinforce_pp":
        raise ConfigError(f"grpo.group_size={g.group_size}: a group-relative advantage needs at least 2 samples")
    rollout = g.prompts_per_step * g.group_size
    minibatch = g.minibatch_size or rollout
    if rollout % minibatch:
        raise ConfigError(
            f"grpo.minibatch_size={minibatch} must divide the rollout size "
            f"grpo.prompts_per_step * grpo.group_size = {g.prompts_per_step} * {g.group_size} = {rollout}"
        )
    if minibatch % g.grad_accum:
        raise ConfigError(f"grpo.grad_accum={g.grad_accum} must divide grpo.minibatch_size={minibatch}")
    if g.mu < 1:
        raise ConfigError(f"grpo.mu={g.mu} must be >= 1")
    if g.epsilon_low < 0 or g.epsilon_high < 0:
        raise ConfigError("grpo.epsilon_low and grpo.epsilon_high must be >= 0")
    if g.dual_clip_c and g.dual_clip_c <= 1:
        raise ConfigError(f"grpo.dual_clip_c={g.dual_clip_c} must be > 1 (or 0 to disable)")
    if c.sampling.temperature <= 0:
        raise ConfigError(f"sampling.temperature={c.sampling.temperature} must be > 0")
    if c.sampling.max_new_tokens < 1:
        raise ConfigError("sampling.max_new_tokens must be >= 1")
    if not c.rewards:
        raise ConfigError("rewards: at least one reward function is required")
    if c.steps < 0:
        raise ConfigError(f"steps={c.steps} must be >= 0")
    if c.algo == "ppo":
        _validate_ppo(c.ppo)


def _validate_ppo(p: PPOSection) -> None:
    _choice(p.kl_estimator, "ppo.kl_estimator", ("k1", "k2", "k3"))
    if not 0 <= p.gamma <= 1 or not 0 <= p.lam <= 1:
        raise ConfigError(f"ppo.gamma={p.gamma} and ppo.lam={p.lam} must be in [0, 1]")
    if p.value_clip < 0 or p.kl_coef_init < 0 or p.kl_target < 0 or p.critic_warmup_steps < 0:
        raise ConfigError("ppo.value_clip, ppo.kl_coef_init, ppo.kl_target and ppo.critic_warmup_steps must be >= 0")
    if p.kl_target > 0 and (p.kl_horizon <= 0 or p.kl_coef_init <= 0):
        raise ConfigError("the adaptive KL controller (ppo.kl_target > 0) needs ppo.kl_horizon > 0 and "
                          "ppo.kl_coef_init > 0")
    if p.critic_learning_rate <= 0:
        raise ConfigError(f"ppo.critic_learning_rate={p.critic_learning_rate} must be > 0")


def advantage_estimator(c: RunConfig) -> str:
    """The estimator a run uses: `grpo.estimator` if set, else the one named by `algo`."""
    return c.grpo.estimator or (c.algo if c.algo in ESTIMATORS else "grpo")


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
