"""Loading a run's configuration: defaults < YAML file < the Python API's fields < dotted command-line overrides.

`load_run_config(yaml_path, overrides)` merges them with OmegaConf (which type-checks every value and names the full
key on error), resolves the YAML file's relative paths against its folder, refuses renamed keys with their new
names, then checks every field's allowed values (`schema.check_fields`), so a bad config fails before anything is
compiled. Every error is one line naming the key and where its value came from (`config_source`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl_llm.config.checks import check_fields
from jaxrl_llm.config.schema import STALE_ROLLOUT_CORRECTION, RunConfig
from jaxrl_llm.errors import ConfigError, one_line

# Keys of earlier versions and what replaced them: a config that still uses one gets a one-line error.
RENAMED = {
    "grpo": "rl (the RL loop's section, for GRPO, RLOO, REINFORCE++ and PPO alike)",
    "rl.ratio_level": "rl.policy_loss (token -> ppo_clip, sequence -> gspo)",
    "on_divergence": "monitor.on_divergence",
    "divergence.patience": "monitor.patience",
    "divergence.entropy_floor": "monitor.entropy_floor",
    "divergence.entropy_ceiling": "monitor.entropy_ceiling",
    "divergence.kl_max": "monitor.kl_max",
    "divergence.reward_stuck": "monitor.reward_stuck",
    "diagnostics.enabled": "monitor.warnings",
    "diagnostics.patience": "monitor.patience",
    "diagnostics.kl_max": "monitor.kl_warn",
    **{f"diagnostics.{k}": f"monitor.{k}" for k in (
        "baseline_steps", "empty_fraction", "reward_steps", "entropy_ratio", "length_low", "length_high",
        "repetition", "zero_std_groups", "throughput_ratio", "throughput_window", "drift_rows")},
    "divergence": "monitor (one section for the run's health checks)",
    **{f"rl.{k}": f"rl.loss.{k}" for k in (
        "epsilon_low", "epsilon_high", "dual_clip_c", "kl_estimator", "top_entropy_quantile", "clip_cov_ratio",
        "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef", "rollout_correction", "rollout_correction_cap")},
    "rl.loss_aggregation": "rl.loss.aggregation",
    "rl.sapo_tau_pos": "rl.policy_loss_kwargs.tau_pos (rl.policy_loss_kwargs: {tau_pos: ..., tau_neg: ...})",
    "rl.sapo_tau_neg": "rl.policy_loss_kwargs.tau_neg (rl.policy_loss_kwargs: {tau_pos: ..., tau_neg: ...})",
    "diagnostics": "monitor (one section for the run's health checks)",
}


def load_run_config(path: str | Path | None, overrides: list[str] | None = None, **fields: Any) -> RunConfig:
    """Defaults < YAML file < `fields` < dotted `overrides` ("rl.beta=0.04"), type-checked, range-checked.

    Every error is a one-line `ConfigError` that names the key and where its value came from: the YAML file,
    the Python API's `fields` or the command line."""
    overrides = list(overrides or [])
    add_import_path(Path.cwd())  # `python train.py` puts the script's folder on sys.path, not the current one
    merged = OmegaConf.structured(RunConfig)
    if path is not None:
        merged = _merge_yaml(merged, Path(path))
    if fields:  # the Python API's mapping: its type and key errors are config errors too, never omegaconf's
        _check_renamed(fields, API_WHERE)
        merged = _merge(merged, fields, API_WHERE)
    for item in overrides:
        merged = _merge_override(merged, item)
    try:
        config: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e, API_WHERE if fields else f"in {path}" if path else "")) from e
    try:
        check_fields(config)
    except ConfigError as e:
        raise ConfigError(f"{e} ({config_source(str(e), path, overrides, fields)})") from e
    if config.rollout.max_staleness and not _given("rl.loss.rollout_correction", path, overrides, fields):
        # Stale rollouts are importance-corrected unless the config says otherwise (docs/overlap.md).
        config.rl.loss = dataclasses.replace(config.rl.loss, rollout_correction=STALE_ROLLOUT_CORRECTION)
    return config


def _given(key: str, path: str | Path | None, overrides: list[str], fields: dict[str, Any] | None) -> bool:
    """Whether the dotted `key` is set by the YAML file, the Python API's `fields` or a command-line override."""
    if any(o.split("=", 1)[0].strip() == key for o in overrides) or (fields and _has_key(fields, key)):
        return True
    return path is not None and _has_key(OmegaConf.to_container(OmegaConf.load(path)), key)


def _merge(merged: Any, tree: Any, where: str) -> Any:
    """`tree` (a mapping) merged over `merged`, its container and type errors one line naming the key."""
    _check_containers(OmegaConf.to_container(tree) if isinstance(tree, DictConfig) else tree, RunConfig, "", where)
    try:
        return OmegaConf.merge(merged, tree if isinstance(tree, DictConfig) else OmegaConf.create(tree))
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e, where)) from e
    except TypeError as e:  # a container OmegaConf cannot merge that _check_containers did not foresee
        raise ConfigError(f"invalid configuration {where}: {one_line(str(e))}") from e


def _merge_yaml(merged: Any, path: Path) -> Any:
    """The YAML file at `path` merged over `merged`, its relative paths resolved against its folder."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (--config takes a YAML preset, e.g. configs/)")
    try:
        _check_top_level(path)
        loaded = OmegaConf.load(path)
    except ConfigError:
        raise
    except Exception as e:  # YAML syntax: the parser's message has the line and column
        raise ConfigError(f"{path} is not valid YAML: {one_line(str(e))}") from e
    _check_renamed(OmegaConf.to_container(loaded), f"in {path}")
    if isinstance(loaded, DictConfig):
        loaded = OmegaConf.create(resolve_yaml_paths(OmegaConf.to_container(loaded), path.parent))
    add_import_path(path.parent)  # reward / estimator modules beside the YAML file
    return _merge(merged, loaded, f"in {path}")


def _merge_override(merged: Any, item: str) -> Any:
    """The dotted command-line override `item` ("rl.beta=0.04") merged over `merged`."""
    key, eq, value = item.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"command-line override {item!r} must be key=value, e.g. rl.beta=0.04 or steps=10")
    _check_renamed(key.strip(), f"on the command line ({item!r})")
    if not value.strip():  # `data.eval=` means the empty string (YAML would read null)
        item = f"{key}=''"
    where = f"on the command line ({item!r})"
    try:
        dotted = OmegaConf.from_dotlist([item])
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e, where)) from e
    except yaml.YAMLError as e:  # the value is parsed as YAML: `rewards=[` has no closing bracket
        raise ConfigError(f"command-line override {item!r}: the value is not valid YAML: {one_line(str(e))}") from e
    return _merge(merged, dotted, where)


API_WHERE = "in the Python API's config"  # where `load_run_config`'s keyword fields (jaxrl_llm.train) come from


def _describe(value: Any) -> str:
    """`value` as an error message shows it: its type and a short repr."""
    kinds = {Mapping: "a mapping", list: "a list", tuple: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number"}  # bool before int: True is an int too
    name = next((v for t, v in kinds.items() if isinstance(value, t)), f"a value of type {type(value).__name__}")
    return f"{name} ({one_line(repr(value))[:40]})"


def _check_containers(tree: Any, cls: type, prefix: str, where: str) -> None:
    """`ConfigError` naming the key where `tree` (a YAML file's or the Python API's mapping) has a list for a
    section or mapping, a mapping for a list, or a single value for either: OmegaConf's merge reports those
    without the key ("Cannot merge incompatible container types", a bare TypeError)."""
    if not isinstance(tree, Mapping):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in tree or tree[f.name] is None:  # None: OmegaConf's own "is not Optional" names the key
            continue
        value, key, kind = tree[f.name], f"{prefix}{f.name}", hints[f.name]
        origin = typing.get_origin(kind)
        if dataclasses.is_dataclass(kind) or origin is dict:
            if not isinstance(value, Mapping):
                what = "the section's fields" if dataclasses.is_dataclass(kind) else "keys to values"
                raise ConfigError(f"config key {key} {where}: expected a mapping of {what}, got {_describe(value)}")
            if dataclasses.is_dataclass(kind):
                _check_containers(value, kind, f"{key}.", where)
        elif origin is list:
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"config key {key} {where}: expected a list, got {_describe(value)}")
            item = typing.get_args(kind)[0]
            if dataclasses.is_dataclass(item):
                for i, entry in enumerate(value):
                    if not isinstance(entry, Mapping):
                        raise ConfigError(f"config key {key}[{i}] {where}: expected a mapping such as "
                                          f"{{name: math_answer}}, got {_describe(entry)}")
                    _check_containers(entry, item, f"{key}[{i}].", where)


def _check_top_level(path: str | Path) -> None:
    """`ConfigError` unless the YAML document at `path` is a mapping (or empty): OmegaConf's own errors for a
    list or a single value ("Cannot merge incompatible container types") do not say what is wrong."""
    with open(path, encoding="utf-8") as f:
        root = yaml.compose(f, Loader=yaml.SafeLoader)  # the node tree only: a syntax error keeps its line/column
    if root is None or isinstance(root, yaml.MappingNode) or root.tag == "tag:yaml.org,2002:null":
        return  # an empty file (or only comments, or `null`) is the defaults, as before
    if isinstance(root, yaml.SequenceNode):
        kind = "a list"
    else:
        names = {"int": "a number", "float": "a number", "bool": "a boolean", "str": "a string"}
        kind = f"{names.get(root.tag.rsplit(':', 1)[-1], 'a single value')} ({one_line(str(root.value))[:40]!r})"
    raise ConfigError(f"{path}: the top level must be a mapping of config sections (model:, data:, rl:, ...), "
                      f"not {kind}")


# Fields holding paths: relative values in a YAML file are relative to the file's folder, on the command line to
# the current folder. The ones that may also be a hub id keep a value that only looks like one ("org/name").
PATH_FIELDS = ("out_dir", "export_dir", "model.path", "model.tokenizer", "data.train", "data.eval",
               "ppo.critic_init", "dpo.eval_prompts", "distill.teacher")
HUB_ID_FIELDS = ("model.path", "model.tokenizer", "ppo.critic_init", "distill.teacher", "rewards[].kwargs.path")
NOT_A_PATH = {"model.tokenizer": "arithmetic", "ppo.critic_init": "policy"}


def looks_local(value: str) -> bool:
    """A path no hub id can be: absolute, ./ ../ ~, or more than one `/` (hub ids are NAME or ORG/NAME)."""
    return value.startswith((".", "/", "~")) or value.count("/") > 1 or "\\" in value


def shown_path(path: Path) -> str:
    """An absolute path as a run shows it: relative to the current folder when inside it, else absolute."""
    path = Path(os.path.normpath(path.expanduser().absolute()))
    try:
        return str(path.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


def resolve_path(key: str, value: Any, base: Path) -> Any:
    """`value` of the path field `key`, read from a YAML file in `base`, made relative to the current folder."""
    if (not isinstance(value, str) or not value or value.startswith(("hf:", "reasoning_gym:"))
            or NOT_A_PATH.get(key) == value):
        return value
    if Path(value).expanduser().is_absolute():
        return value
    if key in HUB_ID_FIELDS and not looks_local(value) and not (base / value).exists():
        return value  # a hub id (a missing local directory is reported when the run checks its inputs)
    return shown_path(base / value)


def resolve_yaml_paths(tree: Any, base: Path) -> Any:
    """The YAML mapping `tree` with its path fields (`PATH_FIELDS`, rewards' `kwargs.path`) resolved against `base`."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    for key in PATH_FIELDS:
        section, _, name = key.rpartition(".")
        node = tree.get(section) if section else tree
        if isinstance(node, dict) and name in node:
            node[name] = resolve_path(key, node[name], base)
    if isinstance(tree.get("rewards"), list):
        tree["rewards"] = [
            {**r, "kwargs": {**r["kwargs"], "path": resolve_path("rewards[].kwargs.path", r["kwargs"]["path"], base)}}
            if isinstance(r, dict) and isinstance(r.get("kwargs"), dict) and "path" in r["kwargs"] else r
            for r in tree["rewards"]
        ]
    return tree


def add_import_path(folder: Path) -> None:
    """Let `module:function` names import modules from `folder` (appended: installed packages win)."""
    entry = str(folder.expanduser().absolute())
    if entry not in sys.path:
        sys.path.append(entry)


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
    where = f" {where}" if where else ""
    return f"config key {key}{where}: {msg}".replace("  ", " ") if key else f"invalid configuration{where}: {msg}"


def _has_key(tree: Any, key: str) -> bool:
    """Whether the nested mapping `tree` sets the dotted `key` (list items by index: rewards.0.weight)."""
    for part in key.split("."):
        if isinstance(tree, (list, tuple)) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        elif isinstance(tree, Mapping) and part in tree:
            tree = tree[part]
        else:
            return False
    return True


def config_source(message: str, path: str | Path | None, overrides: list[str],
                  fields: dict[str, Any] | None = None) -> str:
    """Where the `key=value` settings a message names were set: the command line, the Python API's mapping
    (`fields`), the YAML file or defaults."""
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
    # After the YAML file: train.py passes --algo as a field, and a message naming `algo` names a key set
    # in the file or on the command line too.
    if fields and any(_has_key(fields, k) for k in keys):
        return f"set {API_WHERE}"
    if keys:
        return "the default"
    return f"from {path}" if path is not None else API_WHERE if fields else "from the defaults"


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
