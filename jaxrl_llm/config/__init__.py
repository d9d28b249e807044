"""The run's configuration, a leaf of the package: the schema (`schema.py`: sections, defaults, allowed values)
and loading (`loading.py`: YAML, the Python API's fields, dotted overrides, renames). `docs.py` renders it as
`--print-config` and docs/config-reference.md. Checks that need an algorithm or the outside world are elsewhere:
`jaxrl_llm.trainers` (each algorithm's `validate`) and `jaxrl_llm.preflight`."""

from jaxrl_llm.config.checks import check_fields, get_field
from jaxrl_llm.config.loading import (
    API_WHERE,
    RENAMED,
    add_import_path,
    config_source,
    load_run_config,
    looks_local,
    resolve_path,
    resolve_yaml_paths,
    shown_path,
    to_dict,
    to_yaml,
)
from jaxrl_llm.config.schema import (
    DataSection,
    DistributedSection,
    DPOSection,
    EnvSection,
    LoggingSection,
    LoraSection,
    MeshSection,
    ModelSection,
    MonitorSection,
    OptimSection,
    PPOSection,
    RewardSpec,
    RLSection,
    RolloutSection,
    RunConfig,
    SamplingSection,
    SFTSection,
)
from jaxrl_llm.errors import ConfigError

__all__ = [
    "API_WHERE", "RENAMED", "ConfigError", "DPOSection", "EnvSection",
    "DataSection", "DistributedSection", "LoggingSection", "LoraSection", "MeshSection", "ModelSection",
    "MonitorSection", "OptimSection", "PPOSection", "RLSection", "RewardSpec", "RolloutSection", "RunConfig",
    "SFTSection",
    "SamplingSection", "add_import_path", "check_fields", "config_source", "get_field", "load_run_config",
    "looks_local", "resolve_path", "resolve_yaml_paths", "shown_path", "to_dict", "to_yaml",
]
