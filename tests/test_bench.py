"""Every `bench/` script runs at its smallest shape, so none rots unnoticed: each is run as a user runs it (`python
bench/X.py ...`, a subprocess), and must exit 0 and print its result. Peers that are not installed (TRL, vLLM) are
skipped the way the scripts offer (`--skip-trl`), or the script is skipped with the reason."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.families import TINY
from tests.runs import ROOT

pytestmark = pytest.mark.heavy(seconds=36)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# script -> (its smallest-shape arguments, with {tmp} / {chat_model} / {tiny_config}, and a line its output holds)
SMOKE: dict[str, tuple[list[str], str]] = {
    "algorithms.py": (["--only", "grpo", "--steps", "1", "--out", "{tmp}/runs", "--results", "{tmp}/algorithms.md"],
                      "| GRPO (`grpo_arithmetic.yaml`) |"),
    "code_shape.py": ([], "module-level import cycles:"),
    "overlap.py": (["--steps", "2", "--only", "K=1, split 1/1"], "K=1, split 1/1"),
    "decode_phases.py": (["--model", "{chat_model}", "--slots", "2", "--context", "16", "--steps", "2", "--repeats",
                          "1"], "tokens/s at this shape:"),
    "entropy_objectives.py": (["--model", "{chat_model}", "--only", "grpo", "--steps", "1", "--prompts", "1",
                               "--eval-size", "2", "--out", "{tmp}/runs", "--results", "{tmp}/entropy.md"],
                              "| plain GRPO |"),
    "gated_delta.py": (["--tokens", "64", "--heads", "2", "--head-dim", "8", "--chunk", "16", "--repeats", "1"],
                       "| 64 | "),
    "gpu_step.py": (["--tiny", "--steps", "1", "--prompts", "2", "--group", "2", "--prompt-len", "8",
                     "--new-tokens", "8"], '"finite": true'),
    "grpo_vs_trl.py": (["--model", "{chat_model}", "--steps", "1", "--warmup", "0", "--varied", "--new-tokens", "16",
                        *([] if _has("trl") else ["--skip-trl"])],
                       "update on the same rollouts ("),
    "long_context.py": (["--model", "{tiny_config}", "--contexts", "64", "--time-up-to", "64", "--sequence", "1,2",
                         "--query-chunk", "16"], "| 64 | "),
    "matmul_kernels.py": (["--shape", "64x32x16", "--calls", "3"], "| 64 x 32 x 16 |"),
    "memory_step.py": (["--model", "{tiny_config}", "--micro-batch", "1", "--grad-accum", "1", "--prompt-len", "8",
                        "--new-tokens", "8"], '"compiled_gib"'),
    "moe.py": (["--tokens", "64", "--hidden", "64", "--expert-size", "32", "--layers", "2", "--prompts", "2", "--n",
                "2", "--prompt-len", "8", "--new-tokens", "8", "--repeats", "1", "--vocab", "256"],
               "replay's share of the step:"),
    "multi_turn.py": (["--rows", "2", "--turns", "2", "--turn-tokens", "2", "--reply-tokens", "2", "--repeats", "1"],
                      "multi-turn / single-turn rollout:"),
    "packing.py": (["--tiny", "--rows", "4", "--max-new", "16", "--repeats", "1"], "packed / padded:"),
    "rollout_engine.py": (["--model", "{chat_model}", "--prompts", "2", "--n", "2", "--new-tokens", "4",
                           "--page-size", "4", "--repeats", "1", "--samplers", "static,engine,engine-xla",
                           "--devices", "2"],
                          "engine / static:"),
    "sampling.py": (["--batch", "2", "--prompt-len", "4", "--new-tokens", "4", "--repeats", "1", "--peer", "hf",
                     "--threads", "1"],
                    "ratio = ours_tok_s / hf_tok_s"),
    "update_profile.py": (["--model", "{chat_model}", "--rows", "4", "--group", "2", "--prompt-len", "8",
                           "--new-tokens", "4", "--warmup", "1", "--top", "3"], "| all ops (summed over threads) |"),
    "vllm_rollout.py": (["--model", "{chat_model}", "--prompts", "{tmp}/prompts.json", "--new-tokens", "2",
                         "--repeats", "1"], "tokens/s"),
}
NEEDS = {"vllm_rollout.py": "vllm", "sampling.py": "torch"}  # the peer a script cannot run without


def test_every_bench_script_has_a_smoke_run() -> None:
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")} - {"common.py"}  # common.py: the scripts' helpers
    assert scripts == set(SMOKE), f"add the new script's smallest shape to SMOKE: {sorted(scripts ^ set(SMOKE))}"


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_bench_script_runs_at_its_smallest_shape(script: str, tmp_path: Path, tiny_chat_model: Path) -> None:
    peer = NEEDS.get(script)
    if peer and not _has(peer):
        pytest.skip(f"{script} needs {peer}, which is not installed here")
    args, expected = SMOKE[script]
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "vocab_size": 64}))
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3], [4, 5]]))
    argv = [a.format(tmp=tmp_path, chat_model=tiny_chat_model, tiny_config=tmp_path / "config.json") for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"python bench/{script} {' '.join(argv)}:\n{proc.stderr[-3000:]}"
    assert expected in proc.stdout, proc.stdout[-3000:]
