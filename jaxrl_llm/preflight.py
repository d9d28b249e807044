"""Preflight: everything a run checks before it loads a model, above the config and the algorithms.

    load_config(path, overrides, **fields)   the config (`config.load_run_config`) and the algorithm's own checks
    preflight(config)                        plugins resolved (rewards, estimator, policy loss), required settings,
                                             data files, the model on disk or the hub, optional packages (wandb),
                                             and the micro-batch against the devices JAX sees (after
                                             `jax.distributed` is initialised)

`train.py` and the Python API (`jaxrl_llm.train`) call both; each error is one line naming the key and where its
value was set (the YAML file, the command line, the Python API's mapping).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxrl_llm.config import ConfigError, RunConfig, config_source, get_field, load_run_config, looks_local, shown_path
from jaxrl_llm.envs.base import resolve_environment
from jaxrl_llm.envs.sandbox import sandbox_problem
from jaxrl_llm.envs.tools import resolve_tools
from jaxrl_llm.errors import one_line
from jaxrl_llm.rewards import resolve_reward
from jaxrl_llm.rl.plugins import resolve_estimator, resolve_policy_loss
from jaxrl_llm.tasks import reasoning_gym
from jaxrl_llm.trainers import algorithm_class, check_devices, validate
from jaxrl_llm.trainers.rl import sandbox_users

HUB_TIMEOUT_S = 10.0


def load_config(path: str | Path | None, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """`load_run_config`, then the algorithm's `validate`, each error annotated with where its keys were set."""
    overrides = list(overrides or [])
    config = load_run_config(path, overrides, **fields)
    try:
        validate(config)
    except ConfigError as e:
        raise type(e)(f"{e} ({config_source(str(e), path, overrides, fields)})") from e
    return config


def preflight(config: RunConfig, path: str | Path | None = None, overrides: list[str] | None = None,
              fields: dict[str, Any] | None = None) -> None:
    """The checks that touch the world (see the module docstring), annotated like `load_config`'s."""
    try:
        resolve_plugins(config)
        check_required(config)
        check_inputs(config)
        check_optional_packages(config)
        check_sandbox(config)
        check_devices(config)
    except ConfigError as e:
        raise type(e)(f"{e} ({config_source(str(e), path, list(overrides or []), fields)})") from e


def resolve_plugins(c: RunConfig) -> None:
    """Every `module:function` the config names imports, and every built-in name exists."""
    for spec in c.rewards:  # an unknown name or a module that does not import fails here, not after the model load
        resolve_reward(spec.name, dict(spec.kwargs))
    if c.eval_reward:
        resolve_reward(c.eval_reward)
    if c.rl.estimator:
        resolve_estimator(c.rl.estimator)
    resolve_policy_loss(c.rl.policy_loss)
    if c.env.name:
        resolve_environment(c.env.name)
        resolve_tools(c.env.tools)


def check_required(c: RunConfig) -> None:
    """One line naming every required setting the run lacks (the defaults name no model, data or reward)."""
    algorithm, missing = algorithm_class(c.algo), []
    if not c.model.path and not (algorithm.from_scratch and c.model.init):
        missing.append("model.path (a Hugging Face model directory or hub id)")
    if not c.data.train:
        missing.append("data.train (a JSONL file, or hf:NAME for a hub dataset)")
    if algorithm.needs_rewards and not c.rewards and not c.env.name:  # an environment's rewards are a reward
        missing.append("rewards (a list such as [{name: math_answer}] or [{name: my_module:my_reward}], or an "
                       "environment that rewards: env.name)")
    if missing:
        raise ConfigError(f"algo={c.algo} needs {'; '.join(missing)}: set {'them' if len(missing) > 1 else 'it'} "
                          f"in the YAML file or on the command line (python train.py --print-config lists every "
                          f"field)")
    held_out = algorithm.held_out_prompts(c)
    if held_out and not (c.rewards or c.eval_reward or c.env.name):
        raise ConfigError(f"{held_out}={get_field(c, held_out)} needs a reward to score the held-out answers: set "
                          f"eval_reward (e.g. math_answer) or rewards, or {held_out}='' for no evaluation")


def check_inputs(c: RunConfig) -> None:
    """The data files exist, and the model (and a critic's model) is a directory or a reachable hub id."""
    for key in ("data.train", "data.eval", "dpo.eval_prompts"):
        source = get_field(c, key)
        if source and not source.startswith(("hf:", "python:", reasoning_gym.PREFIX)) and not Path(source).is_file():
            kind = "a directory, not a JSONL file" if Path(source).is_dir() else "missing"
            raise ConfigError(f"{key}={source}: the data file is {kind} (a JSONL path, or hf:NAME for a hub dataset)")
    # generated tasks: installed, known, with options they accept, and a held-out set on other seeds
    reasoning_gym.check_sources(c.data.train, c.data.eval)
    if not (algorithm_class(c.algo).from_scratch and c.model.init):
        check_model_source("model.path", c.model.path)
    for key, source in algorithm_class(c.algo).model_sources(c).items():
        check_model_source(key, source)


def check_optional_packages(c: RunConfig) -> None:
    if c.logging.wandb:
        try:
            import wandb  # noqa: F401  (an optional dependency: imported only when asked for)
        except ImportError:
            raise ConfigError("logging.wandb=true needs the wandb package, which is not installed: pip install "
                              "wandb (or pip install 'jaxrl_llm[wandb]'), or set logging.wandb=false") from None


def check_sandbox(c: RunConfig) -> None:
    """A run that executes model code can: bubblewrap is usable, or the user opted in to the plain subprocess by
    name (env.sandbox: subprocess), which as root runs the code as nobody or refuses (jaxrl_llm.envs.sandbox)."""
    users = sandbox_users(c)
    problem = sandbox_problem(c.env.sandbox) if users else ""
    if problem:
        raise ConfigError(f"{' and '.join(users)} run model code, and env.sandbox={c.env.sandbox} cannot here: "
                          f"{problem}")


def check_model_source(key: str, value: str) -> None:
    """`value` is a model directory, or a hub id that is cached or exists on the hub; else a one-line
    `ConfigError` that says which (a local-looking path is "not found", never looked up on the hub)."""
    path = Path(value).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ConfigError(f"{key}={value} is a file; it must be a model directory (with config.json) or a hub id")
    if looks_local(value):
        raise ConfigError(f"{key}={value}: not found (no directory {shown_path(path)}; relative paths in a YAML "
                          f"file are relative to its folder, on the command line to the current folder)")
    from huggingface_hub import constants, model_info, try_to_load_from_cache  # only for a hub id
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return
    where = f"{key}={value}: not a local directory ({shown_path(path)} does not exist), and as a hub id it"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{where} is not in the local cache (HF_HUB_OFFLINE is set)")
    try:
        model_info(value, timeout=HUB_TIMEOUT_S)
    except GatedRepoError as e:
        raise ConfigError(f"{where} is gated: accept its license on the hub and log in (hf auth login)") from e
    except RepositoryNotFoundError as e:
        raise ConfigError(f"{where} is not on the Hugging Face hub (or is private: log in with hf auth login)") from e
    except Exception as e:  # no network, DNS, proxy, timeout: one line, at once
        raise ConfigError(f"{where} cannot be looked up: the hub is unreachable ({type(e).__name__}: "
                          f"{one_line(str(e))[:120]}); check the path, or download the model while online") from e
