"""Typed configuration of a whole run: dataclasses, YAML presets and dotted command-line overrides.

`load_run_config(yaml_path, overrides)` merges, in order, the dataclass defaults, the YAML file and
`section.field=value` overrides with OmegaConf (which type-checks every value and names the full key on
error), then `validate` checks the relations between numbers (which must divide which) up front, so a bad
config fails before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl_llm.errors import ConfigError, one_line

# Keys of earlier versions and what replaced them: a config that still uses one gets a one-line error.
RENAMED = {
    "grpo": "rl (the RL loop's section, for GRPO, RLOO, REINFORCE++ and PPO alike)",
    "rl.ratio_level": "rl.policy_loss (token -> ppo_clip, sequence -> gspo)",
}


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
class RLSection:
    """The RL loop (GRPO family and PPO): rollout sizes, the update's epochs and minibatches, the policy loss
    and the advantage estimator (both picked by name from their registries)."""

    prompts_per_step: int = 16  # P
    group_size: int = 8  # G: samples per prompt
    mu: int = 1  # optimisation passes over each rollout
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole rollout (P * G)
    grad_accum: int = 1  # micro-batches per optimizer step (divides minibatch_size)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip_c: float = 0.0  # 0 = off; else > 1
    policy_loss: str = "ppo_clip"  # rl.losses.POLICY_LOSSES: ppo_clip (token ratio) | gspo (sequence ratio)
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
    entropy_coef) are in `rl`. The KL to the reference is in the per-token reward, not in the loss."""

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
    timeout_s: float = 0.0  # > 0: a call that takes longer stops the run with an error naming the function


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
class DivergenceSection:
    """Collapse checks on each RL step's metrics (`jaxrl_llm.divergence`); a condition that holds for
    `patience` steps in a row is a divergence, handled by the run's `on_divergence`."""

    patience: int = 5  # consecutive steps a condition must hold (0 = checks off)
    entropy_floor: float = 0.01  # nats/token: below it the policy is deterministic (collapsed to one answer)
    entropy_ceiling: float = 0.95  # fraction of log V: above it the policy is ~uniform noise
    kl_max: float = 10.0  # mean KL to the reference per token (nats); above it the policy ran away
    reward_stuck: bool = True  # every completion of the step scored the same, and the same as the last step


@dataclass
class RunConfig:
    algo: str = "grpo"
    seed: int = 0
    steps: int = 100
    out_dir: str = "runs/default"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    rl: RLSection = field(default_factory=RLSection)
    sft: SFTSection = field(default_factory=SFTSection)
    ppo: PPOSection = field(default_factory=PPOSection)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    optim: OptimSection = field(default_factory=OptimSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    divergence: DivergenceSection = field(default_factory=DivergenceSection)
    on_divergence: str = "stop"  # stop: end the run, keep the last good checkpoint, no export | warn: log only
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
    """Defaults < YAML file < `fields` < dotted `overrides` ("rl.beta=0.04"), type-checked, validated.

    Every error names the key and where its value came from: the YAML file or the command line."""
    overrides = list(overrides or [])
    merged = OmegaConf.structured(RunConfig)
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist (--config takes a YAML preset, e.g. configs/)")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # YAML syntax: the parser's message has the line and column
            raise ConfigError(f"{path} is not valid YAML: {one_line(str(e))}") from e
        _check_renamed(OmegaConf.to_container(loaded), f"in {path}")
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as e:
            raise ConfigError(_omegaconf_message(e, f"in {path}")) from e
        except Exception as e:  # YAML syntax: the parser's message has the line and column
            raise ConfigError(f"{path} is not valid YAML: {one_line(str(e))}") from e
    if fields:
        merged = OmegaConf.merge(merged, OmegaConf.create(fields))
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"command-line override {item!r} must be key=value, e.g. rl.beta=0.04 or steps=10")
        _check_renamed(key.strip(), f"on the command line ({item!r})")
        if not _.strip():  # `data.eval=` means the empty string (YAML would read null)
            item = f"{key}=''"
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise ConfigError(_omegaconf_message(e, f"on the command line ({item!r})")) from e
    try:
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e, f"in {path}" if path else "")) from e
    try:
        validate(config)
    except ConfigError as e:
        raise ConfigError(f"{e} ({config_source(str(e), path, overrides)})") from e
    return config


def _check_renamed(tree: Any, where: str) -> None:
    """`ConfigError` naming the new key when `tree` (a YAML mapping, or one dotted key) uses a renamed one."""
    if isinstance(tree, str):
        keys = [tree]
    else:
        tree = tree if isinstance(tree, dict) else {}
        keys = [str(k) for k in tree] + [f"{k}.{sub}" for k, v in tree.items() if isinstance(v, dict) for sub in v]
    for key in keys:
        for old, new in RENAMED.items():
            if key == old or key.startswith(old + "."):
                raise ConfigError(f"config key {key} {where} was renamed to {new}")


def _omegaconf_message(e: OmegaConfBaseException, where: str) -> str:
    key = getattr(e, "full_key", None)
    msg = (str(getattr(e, "msg", None) or e).strip().splitlines() or [type(e).__name__])[0]
    return f"config key {key} {where}: {msg}".replace("  ", " ") if key else f"invalid configuration {where}: {msg}"


def config_source(message: str, path: str | Path | None, overrides: list[str]) -> str:
    """Where the `key=value` settings a message names were set: the command line, the YAML file or defaults."""
    keys = [k for k in re.findall(r"([a-z_][a-z0-9_.]*)=", message) if "." in k or hasattr(RunConfig, k)]
    given = {o.split("=", 1)[0].strip() for o in overrides}
    if any(k in given for k in keys):
        return "set on the command line"
    if keys and path is not None:
        tree: Any = OmegaConf.to_container(OmegaConf.load(path))
        for key in keys:
            node = tree
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                return f"set in {path}"
    return "the default" if keys else f"from {path or 'the defaults'}"


def _choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")


# Bounds of every numeric field, checked before anything loads: (key, low, high, low_inclusive).
_AT_LEAST = 0.0, float("inf"), True
_POSITIVE = 0.0, float("inf"), False
_AT_LEAST_1 = 1.0, float("inf"), True
_FRACTION = 0.0, 1.0, True
NUMERIC_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "seed": _AT_LEAST, "steps": _AT_LEAST, "log_every": _AT_LEAST_1, "sample_every": _AT_LEAST,
    "eval_every": _AT_LEAST, "eval_size": _AT_LEAST, "eval_batch_size": _AT_LEAST_1,
    "checkpoint_every": _AT_LEAST, "keep_checkpoints": _AT_LEAST_1,
    "model.logprob_block_mib": _AT_LEAST, "model.attention_query_chunk": _AT_LEAST,
    "data.max_prompt_tokens": _AT_LEAST_1,
    "sampling.max_new_tokens": _AT_LEAST_1, "sampling.temperature": _POSITIVE, "sampling.top_k": _AT_LEAST,
    "sampling.top_p": (0.0, 1.0, False), "sampling.min_p": _FRACTION, "sampling.prompt_bucket": _AT_LEAST_1,
    "sampling.new_tokens_bucket": _AT_LEAST_1,
    "rl.prompts_per_step": _AT_LEAST_1, "rl.group_size": _AT_LEAST_1, "rl.mu": _AT_LEAST_1,
    "rl.minibatch_size": _AT_LEAST, "rl.grad_accum": _AT_LEAST_1, "rl.epsilon_low": _AT_LEAST,
    "rl.epsilon_high": _AT_LEAST, "rl.dual_clip_c": _AT_LEAST, "rl.beta": _AT_LEAST,
    "rl.entropy_coef": (-float("inf"), float("inf"), True), "rl.max_refill_rounds": _AT_LEAST,
    "optim.learning_rate": _POSITIVE, "optim.warmup_steps": _AT_LEAST, "optim.end_lr_ratio": _FRACTION,
    "optim.weight_decay": _AT_LEAST, "optim.beta1": (0.0, 1.0, True), "optim.beta2": (0.0, 1.0, True),
    "optim.max_grad_norm": _AT_LEAST,
    "sft.batch_size": _AT_LEAST_1, "sft.eval_batch_size": _AT_LEAST_1,
    "divergence.patience": _AT_LEAST, "divergence.entropy_floor": _AT_LEAST,
    "divergence.entropy_ceiling": (0.0, 1.0, False), "divergence.kl_max": _POSITIVE,
}
_EXCLUSIVE_HIGH = {"optim.beta1", "optim.beta2"}  # Adam's moment decay must stay below 1


def _get(c: Any, key: str) -> Any:
    for part in key.split("."):
        c = getattr(c, part)
    return c


def _check_number(key: str, value: float, bounds: tuple[float, float, bool]) -> None:
    low, high, low_inclusive = bounds
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number")
    too_low = value < low if low_inclusive else value <= low
    too_high = value >= high if key in _EXCLUSIVE_HIGH else value > high
    if too_low or too_high:
        lo = f"{'>=' if low_inclusive else '>'} {low:g}"
        hi = "" if high == float("inf") else f" and {'<' if key in _EXCLUSIVE_HIGH else '<='} {high:g}"
        raise ConfigError(f"{key}={value} must be {lo}{hi}")


def validate(c: RunConfig) -> None:
    """Check every numeric field's range and the relations between fields, naming each number involved."""
    for key, bounds in NUMERIC_BOUNDS.items():
        _check_number(key, _get(c, key), bounds)
    if c.algo == "ppo":
        _validate_ppo(c.ppo)
    from jaxrl_llm.trainers import ALGORITHMS

    _choice(c.algo, "algo", tuple(ALGORITHMS))
    _choice(c.on_divergence, "on_divergence", ("stop", "warn"))
    _choice(c.model.dtype, "model.dtype", ("float32", "bfloat16"))
    _choice(c.model.param_dtype, "model.param_dtype", ("float32", "bfloat16"))
    g = c.rl
    _choice(g.kl_estimator, "rl.kl_estimator", ("k1", "k2", "k3"))
    resolve_policy_loss(g.policy_loss)
    _choice(
        g.loss_aggregation,
        "rl.loss_aggregation",
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    )
    _choice(g.scale_rewards, "rl.scale_rewards", ("group", "batch", "none"))
    _choice(c.optim.schedule, "optim.schedule", ("constant", "cosine", "linear"))
    sizes = (c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh.data/fsdp/tensor={sizes}: each is a positive size, and at most one is -1")
    if g.estimator:
        from jaxrl_llm.rl.estimators import needs_values

        if needs_values(resolve_estimator(g.estimator)) != (c.algo == "ppo"):
            raise ConfigError(f"rl.estimator={g.estimator} with algo={c.algo}: PPO's advantages are GAE over its "
                              f"critic's values (rl.estimator=gae or empty), and only --algo ppo has a critic")
    if g.group_size < 2 and c.algo in ("grpo", "rloo") and g.estimator != "reinforce_pp":
        raise ConfigError(f"rl.group_size={g.group_size}: a group-relative advantage needs at least 2 samples")
    rollout = g.prompts_per_step * g.group_size
    minibatch = g.minibatch_size or rollout
    if rollout % minibatch:
        raise ConfigError(
            f"rl.minibatch_size={minibatch} must divide the rollout size "
            f"rl.prompts_per_step * rl.group_size = {g.prompts_per_step} * {g.group_size} = {rollout}"
        )
    if minibatch % g.grad_accum:
        raise ConfigError(f"rl.grad_accum={g.grad_accum} must divide rl.minibatch_size={minibatch}")
    if g.dual_clip_c and g.dual_clip_c <= 1:
        raise ConfigError(f"rl.dual_clip_c={g.dual_clip_c} must be > 1 (or 0 to disable)")
    if not c.rewards:
        raise ConfigError("rewards=[]: at least one reward function is required")
    for i, spec in enumerate(c.rewards):
        _check_number(f"rewards.{i}.weight", spec.weight, (-float("inf"), float("inf"), True))
        _check_number(f"rewards.{i}.timeout_s", spec.timeout_s, _AT_LEAST)
    if not c.out_dir.strip():
        raise ConfigError("out_dir='': a run needs an output directory (e.g. runs/my_run)")


def validate_environment(c: RunConfig) -> None:
    """The input paths, and the mesh and batch sizes against the devices JAX sees (after `jax.distributed` is
    initialised), so a run that cannot start fails before any model loads."""
    import jax

    for key in ("data.train", "data.eval"):
        source = _get(c, key)
        if source and not source.startswith("hf:") and not Path(source).is_file():
            kind = "a directory, not a JSONL file" if Path(source).is_dir() else "missing"
            raise ConfigError(f"{key}={source}: the data file is {kind} (a JSONL path, or hf:NAME for a hub dataset)")
    from jaxrl_llm.rewards import resolve_reward

    for spec in c.rewards:  # an unknown name or a module that does not import fails here, not after the model load
        resolve_reward(spec.name, dict(spec.kwargs))
    if c.eval_reward:
        resolve_reward(c.eval_reward)
    model_path = Path(c.model.path)
    local = model_path.exists() or c.model.path.startswith((".", "/", "~")) or c.model.path.count("/") > 1
    if not c.model.init and local and not model_path.is_dir():
        raise ConfigError(f"model.path={c.model.path}: no such model directory (a Hugging Face model directory "
                          f"with config.json, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct)")

    from jaxrl_llm.sharding import MeshShape

    n = jax.device_count()
    try:
        data, fsdp, _ = MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor).resolve(n)
    except ValueError as e:
        raise ConfigError(f"mesh.data={c.mesh.data}, mesh.fsdp={c.mesh.fsdp}, mesh.tensor={c.mesh.tensor}: "
                          f"{str(e).split(': ', 1)[-1]}") from e
    ways = data * fsdp
    g = c.rl
    if c.algo == "sft" and c.sft.batch_size % ways:
        raise ConfigError(f"sft.batch_size={c.sft.batch_size} must be divisible by mesh.data * mesh.fsdp ({ways})")
    if c.algo not in ("sft", "rm"):
        micro = (g.minibatch_size or g.prompts_per_step * g.group_size) // g.grad_accum
        if micro % ways:
            raise ConfigError(f"the micro-batch rl.minibatch_size / rl.grad_accum = {micro} sequences must be "
                              f"divisible by mesh.data * mesh.fsdp ({ways}) for the data-parallel step")


def _validate_ppo(p: PPOSection) -> None:
    _choice(p.kl_estimator, "ppo.kl_estimator", ("k1", "k2", "k3"))
    for key in ("gamma", "lam", "value_clip", "critic_learning_rate", "kl_coef_init", "kl_target", "kl_horizon"):
        _check_number(f"ppo.{key}", getattr(p, key), (-float("inf"), float("inf"), True))
    if not 0 <= p.gamma <= 1 or not 0 <= p.lam <= 1:
        raise ConfigError(f"ppo.gamma={p.gamma} and ppo.lam={p.lam} must be in [0, 1]")
    if p.value_clip < 0 or p.kl_coef_init < 0 or p.kl_target < 0 or p.critic_warmup_steps < 0:
        raise ConfigError("ppo.value_clip, ppo.kl_coef_init, ppo.kl_target and ppo.critic_warmup_steps must be >= 0")
    if p.kl_target > 0 and (p.kl_horizon <= 0 or p.kl_coef_init <= 0):
        raise ConfigError("the adaptive KL controller (ppo.kl_target > 0) needs ppo.kl_horizon > 0 and "
                          "ppo.kl_coef_init > 0")
    if p.critic_learning_rate <= 0:
        raise ConfigError(f"ppo.critic_learning_rate={p.critic_learning_rate} must be > 0")


def _resolve(key: str, name: str, registry: dict[str, Any], register: Any) -> str:
    """`name` if in `registry`; a `module:function` is imported and added with `register(name, fn)`."""
    if name in registry:
        return name
    if ":" not in name:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(registry)}, or 'module:function' "
                          f"(see docs/extending.md)")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={name!r} cannot be imported: {e}") from e
    register(name, fn)
    return name


def resolve_estimator(name: str) -> str:
    """`name` if registered (`jaxrl_llm.rl.estimators.ADVANTAGE_ESTIMATORS`); a `module:function` is imported and
    registered under that name (its `kl_in_reward` attribute, if any, says where the KL goes)."""
    from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS, register_estimator

    def register(key: str, fn: Any) -> None:
        register_estimator(key, kl_in_reward=bool(getattr(fn, "kl_in_reward", False)))(fn)

    return _resolve("rl.estimator", name, ADVANTAGE_ESTIMATORS, register)


def resolve_policy_loss(name: str) -> str:
    """`name` if registered (`jaxrl_llm.rl.losses.POLICY_LOSSES`); a `module:function` is imported and registered."""
    from jaxrl_llm.rl.losses import POLICY_LOSSES, register_policy_loss

    return _resolve("rl.policy_loss", name, POLICY_LOSSES, lambda key, fn: register_policy_loss(key)(fn))


def advantage_estimator(c: RunConfig) -> str:
    """The estimator a run uses: `rl.estimator` if set, else the one named by `algo` (else GRPO's)."""
    from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS

    if c.rl.estimator:
        return resolve_estimator(c.rl.estimator)
    return c.algo if c.algo in ADVANTAGE_ESTIMATORS else "grpo"


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
