"""The algorithms `--algo` names, listed once: each name's class (`module:Class`, imported on first use by
`trainers.algorithm_class`) and its offline preset under `configs/` (what `train.py --algo NAME` runs without
`--config`). A leaf with no imports: the config's `algo` field takes its allowed values from here, `train.py` its
choices and presets, the trainers their classes; what differs between algorithms is asked of the class, never
branched on by name."""

from __future__ import annotations

from typing import NamedTuple


class AlgorithmEntry(NamedTuple):
    target: str  # `module:Class`, a subclass of `trainers.base.Algorithm`
    preset: str  # its offline preset, a file of configs/
    estimator: str = ""  # its advantage estimator when `rl.estimator` is empty (the GRPO family's three)


ALGORITHMS: dict[str, AlgorithmEntry] = {
    "grpo": AlgorithmEntry("jaxrl_llm.trainers.grpo:GRPOFamily", "grpo_arithmetic.yaml", "grpo"),
    "rloo": AlgorithmEntry("jaxrl_llm.trainers.grpo:GRPOFamily", "rloo_arithmetic.yaml", "rloo"),
    "reinforce_pp": AlgorithmEntry("jaxrl_llm.trainers.grpo:GRPOFamily", "reinforce_pp_arithmetic.yaml",
                                   "reinforce_pp"),
    "ppo": AlgorithmEntry("jaxrl_llm.trainers.ppo:PPO", "ppo_arithmetic.yaml"),
    "sft": AlgorithmEntry("jaxrl_llm.trainers.sft:SFT", "sft_arithmetic.yaml"),
    "rm": AlgorithmEntry("jaxrl_llm.trainers.rm:RewardModelTraining", "rm_arithmetic.yaml"),
    "dpo": AlgorithmEntry("jaxrl_llm.trainers.dpo:DPO", "dpo_arithmetic.yaml"),
    "distill": AlgorithmEntry("jaxrl_llm.trainers.distill:Distillation", "distill_arithmetic.yaml"),
}
