"""The suite's process settings (compile cache, threads, XLA flags, no network), its session fixtures, and its
order: the `heavy` tests first, longest first. Plain helpers live in modules by subject (tests/families.py,
runs.py, batches.py, numerics.py, attention_reference.py, xla_settings.py), none of which changes anything on
import."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# A persistent XLA compilation cache shared by the suite's processes (in-process runs and the subprocesses
# of the CLI, crash and multi-process tests inherit it): a program compiled once, by any test, loads from
# disk afterwards. Entries are keyed by the program, JAX version and flags, so a stale entry is never used.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "jaxrl_llm_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# One OpenMP thread for torch (the reference models of the parity tests, PEFT, the bench scripts' peers) and
# OpenBLAS, here and in the subprocesses that inherit the environment: the suite runs 2 pytest-xdist workers on
# 2 cores, and each torch process's default of one spinning OpenMP thread per core made them fight. On the
# 2-core machine SmolLM2's 48-token `generate` took 45 s with 2 threads and 4 s with one (the same results).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# No test may need the network: transformers and the hub read local directories only; and their warnings stay out
# of the subprocesses' stderr, which tests read.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import sys

import jax
import pytest

from tests.families import TINY, make_hf_model
from tests.runs import CHATML
from tests.xla_settings import FAST_COMPILE_FLAGS, PATIENT_COLLECTIVES_FLAGS

if "torch" in sys.modules:  # imported before this file (by a plugin): OMP_NUM_THREADS came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Compilation dominates a cold run of the suite: XLA:CPU's cheaper compile settings (tests/xla_settings.py). XLA reads
# XLA_FLAGS when the first backend starts, not at `import jax`; subprocesses that set their own XLA_FLAGS (virtual
# devices) add these.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS} {PATIENT_COLLECTIVES_FLAGS}".strip()


def heavy_seconds(item: pytest.Item) -> float:
    """The cold seconds a `heavy`-marked file declares for its longest test (0 for the rest)."""
    mark = item.get_closest_marker("heavy")
    return float(mark.kwargs.get("seconds", 1.0)) if mark else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `heavy` files (subprocess runs of train.py and bench/, the 8-device meshes, the real checkpoint, whole
    training runs) first, the longest first: pytest-xdist hands each worker runs of consecutive tests, and a
    2-minute test that started last would leave the other worker idle until it ended. Each file keeps its order (a
    module fixture is set up once)."""
    items.sort(key=lambda item: -heavy_seconds(item))  # stable: the same order within a file


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """`hf_model_dir(kind)` -> directory of a saved tiny random HF model (built once per session)."""
    cache: dict[str, Path] = {}

    def build(kind: str) -> Path:
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"hf_{kind}")
            make_hf_model(kind).save_pretrained(path)
            cache[kind] = path
        return cache[kind]

    return build


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """A random tiny Llama with the arithmetic tokenizer, and small train/test JSONL files."""
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.models.hf_export import save_hf_model
    from jaxrl_llm.tasks.arithmetic import make_problems, make_tokenizer

    root = tmp_path_factory.mktemp("tiny_task")
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(root / "tok")
    config = config_from_hf({**TINY, "vocab_size": len(tokenizer), "eos_token_id": 2, "bos_token_id": 1})
    save_hf_model(init_params(config, jax.random.key(0)), config, root / "model", tokenizer_dir=root / "tok")
    problems = make_problems(300, seed=5, max_digits=2)
    for name, rows in (("train", problems[:256]), ("test", problems[256:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A random tiny Llama with a small byte-level BPE tokenizer (trained here) and a ChatML chat template,
    like an instruct model's, in a Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.models.hf_export import save_hf_model

    root = tmp_path_factory.mktemp("tiny_chat_model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    texts = [f"user What is {a} + {b}? Reply with the number. assistant {a + b}" for a in range(30) for b in range(9)]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(root / "tok")
    config = config_from_hf({**TINY, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                             "max_position_embeddings": 256})
    save_hf_model(init_params(config, jax.random.key(0)), config, root / "model", tokenizer_dir=root / "tok")
    return root / "model"


