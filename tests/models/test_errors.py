"""A model directory that cannot be loaded is one `ModelError` line naming the file (exit 2), never an internal
error: truncated or garbage safetensors, a missing or wrong shard, a malformed index or config.json, weights
whose shapes disagree with config.json. And exported weight files get the mode a plain `open()` gives."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import SafetensorError

import train
from jaxrl_llm.cli import generate
from jaxrl_llm.cli.errors import run_command
from jaxrl_llm.errors import ConversionError, ModelError, UsageError
from jaxrl_llm.models import hf, hf_export
from jaxrl_llm.models.hf import load_hf_model, read_tensor
from jaxrl_llm.models.hf_export import save_hf_model
from tests.runs import ROOT, tiny_run_args

ARITH_BASE = ROOT / "models" / "arith-base"
REDO = "re-download or re-export the model"
CORRUPT = f"the file is truncated or corrupt; {REDO}"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A private copy of the committed tiny Llama, free to break."""
    return Path(shutil.copytree(ARITH_BASE, tmp_path / "model"))


@pytest.fixture
def sharded_dir(tmp_path: Path) -> Path:
    """arith-base re-exported in shards of at most 300 kB, with `model.safetensors.index.json`."""
    config, params = load_hf_model(ARITH_BASE)
    return save_hf_model(params, config, tmp_path / "sharded", tokenizer_dir=ARITH_BASE, max_shard_bytes=300_000)


def _error(path: Path, **kwargs: Any) -> str:
    """The message of the `ModelError` loading `path` raises, checked to be a single line."""
    with pytest.raises(ModelError) as e:
        load_hf_model(path, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    assert e.value.exit_code == 2 and isinstance(e.value, UsageError)
    return message


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


# ------------------------------------------------------------------------------------------- the classes


def test_model_error_is_a_usage_error_and_conversion_error_is_one():
    assert issubclass(ModelError, UsageError) and issubclass(ModelError, ValueError)
    assert issubclass(ConversionError, ModelError)
    assert ModelError.exit_code == ConversionError.exit_code == 2


# ------------------------------------------------------------------------------------------- weights files


def test_truncated_safetensors_names_the_file(model_dir):
    weights = model_dir / "model.safetensors"
    _truncate(weights)
    message = _error(model_dir)
    assert message.startswith(f"{weights} cannot be read (")
    assert "file not fully covered" in message  # safetensors' own reason is kept
    assert message.endswith(f"): {CORRUPT}")


def test_garbage_safetensors_names_the_file(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(np.random.default_rng(0).bytes(1000))
    message = _error(model_dir)
    assert message.startswith(f"{weights} cannot be read (Error while deserializing header")
    assert message.endswith(f"): {CORRUPT}")


def test_too_short_safetensors_names_the_file(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"abc")  # not even the 8-byte header length
    message = _error(model_dir)
    assert message.startswith(f"{weights} cannot be read (") and message.endswith(CORRUPT)


def test_a_block_that_fails_to_read_names_the_file_and_tensor(model_dir, monkeypatch):
    """safetensors checks the header and file size when it opens a file, so a file truncated before the load
    fails there (above); the bytes are read later, per block, and an error then is named the same way."""
    real_open = hf.safe_open

    class FailingSlice:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def get_shape(self) -> list[int]:
            return self.inner.get_shape()

        def __getitem__(self, index: Any) -> Any:
            raise SafetensorError("Error while reading: unexpected end of file")

    class FailingHandle:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __enter__(self) -> FailingHandle:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_slice(self, name: str) -> FailingSlice:
            return FailingSlice(self.inner.get_slice(name))

    monkeypatch.setattr(hf, "safe_open", lambda file, framework: FailingHandle(real_open(file, framework=framework)))
    message = _error(model_dir)
    assert message == (f"tensor 'model.embed_tokens.weight' of {model_dir / 'model.safetensors'} cannot be read "
                       f"(Error while reading: unexpected end of file): {CORRUPT}")


# ------------------------------------------------------------------------------------------- shards and index


def test_sharded_export_loads_back(sharded_dir):
    shards = sorted(p.name for p in sharded_dir.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded_dir / "model.safetensors").exists()
    _, want = load_hf_model(ARITH_BASE)
    _, got = load_hf_model(sharded_dir)
    np.testing.assert_array_equal(np.asarray(got["layers"]["mlp"]["up"]["kernel"]),
                                  np.asarray(want["layers"]["mlp"]["up"]["kernel"]))


def test_missing_shard_names_it(sharded_dir):
    shard = sorted(sharded_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert _error(sharded_dir) == (f"{shard} is missing: model.safetensors.index.json lists it as a shard of the "
                                   "checkpoint; re-download the model with all its shards, or re-export it")


def test_two_missing_shards_name_the_first_and_count_the_rest(sharded_dir):
    shards = sorted(sharded_dir.glob("model-*.safetensors"))
    shards[2].unlink()
    shards[1].unlink()
    assert _error(sharded_dir).startswith(f"{shards[1]} is missing (and 1 more shard(s)): ")


def test_truncated_shard_names_it(sharded_dir):
    shard = sorted(sharded_dir.glob("model-*.safetensors"))[-1]
    _truncate(shard)
    message = _error(sharded_dir)
    assert message.startswith(f"{shard} cannot be read (") and message.endswith(CORRUPT)


def test_index_pointing_at_the_wrong_shard_names_it(sharded_dir):
    index_file = sharded_dir / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(sharded_dir.glob("model-*.safetensors"))
    name = next(n for n, f in index["weight_map"].items() if f == shards[-1].name)
    index["weight_map"][name] = shards[0].name  # a tensor of the last shard, said to be in the first
    index_file.write_text(json.dumps(index))
    assert _error(sharded_dir) == (f"tensor {name!r} is missing from the checkpoint: {shards[0]} does not "
                                   f"hold it, though model.safetensors.index.json says it does; {REDO}")


def test_malformed_index_json_names_it(sharded_dir):
    index_file = sharded_dir / "model.safetensors.index.json"
    index_file.write_text('{"metadata": {},\n "weight_map": {"model.norm.weight": }\n}')
    assert _error(sharded_dir) == f"{index_file}:2: invalid JSON (Expecting value); {REDO}"


def test_index_without_weight_map_names_it(sharded_dir):
    index_file = sharded_dir / "model.safetensors.index.json"
    index_file.write_text('{"metadata": {"total_size": 1}}')
    assert _error(sharded_dir) == f'{index_file} has no "weight_map" object of tensor name -> shard file; {REDO}'


# ------------------------------------------------------------------------------------------- config.json


def _edit_config(model_dir: Path, **changes: Any) -> Path:
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))
    return config_file


def test_shape_against_config_json_names_both_files(model_dir):
    config_file = _edit_config(model_dir, intermediate_size=512)  # the weights have 256
    assert _error(model_dir) == (
        f"tensor 'model.layers.0.mlp.down_proj.weight' has shape [128, 256] in {model_dir / 'model.safetensors'}, "
        f"expected [128, 512] from {config_file}: the weights and config.json disagree; {REDO}"
    )


def test_shape_error_is_still_a_conversion_error(model_dir):
    _edit_config(model_dir, hidden_size=64, head_dim=16)
    with pytest.raises(ConversionError, match=r"'model\.embed_tokens\.weight' has shape \[19, 128\] in .*"
                                              r"expected \[19, 64\] from .*config\.json"):
        load_hf_model(model_dir)


def test_malformed_config_json_names_it(model_dir):
    config_file = model_dir / "config.json"
    config_file.write_text('{\n  "model_type": "llama",\n  "hidden_size": 128,,\n}')
    assert _error(model_dir) == (f"{config_file}:3: invalid JSON (Expecting property name enclosed in double "
                                 f"quotes); fix it or {REDO}")


def test_config_json_not_an_object_names_it(model_dir):
    config_file = model_dir / "config.json"
    config_file.write_text("[1, 2]")
    assert _error(model_dir) == (f"{config_file} holds a JSON list, not an object of config keys; fix it or {REDO}")


def test_config_json_without_a_needed_key_names_it(model_dir):
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    del config["num_attention_heads"]
    config_file.write_text(json.dumps(config))
    assert _error(model_dir) == (f"{config_file} has no 'num_attention_heads' key, which a Hugging Face config.json "
                                 f"needs; fix it or {REDO}")


def test_config_json_with_an_unusable_value_names_it(model_dir):
    config_file = _edit_config(model_dir, num_key_value_heads=3)
    assert _error(model_dir) == (f"{config_file} has a value that cannot be used (num_heads (4) must be a multiple "
                                 f"of num_kv_heads (3)); fix it or {REDO}")


def test_unsupported_model_type_names_config_json(model_dir):
    config_file = _edit_config(model_dir, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConversionError) as e:
        load_hf_model(model_dir)
    assert str(e.value).startswith(f"{config_file}: unsupported model_type 'gpt2'")


def test_overrides_are_not_blamed_on_config_json():
    """A bad override is the caller's, not the file's: it is not reported as a malformed config.json."""
    with pytest.raises(ValueError, match="param_dtype must be 'float32' or 'bfloat16'") as e:
        load_hf_model(ARITH_BASE, param_dtype="float16")
    assert not isinstance(e.value, ModelError)


# ------------------------------------------------------------------------------------------- reward models


def test_reward_model_loader_names_the_truncated_file(model_dir, tmp_path):
    from jaxrl_llm.models.reward_model import load_hf_reward_model, save_hf_reward_model

    config, params = load_hf_model(ARITH_BASE)
    rm_dir = save_hf_reward_model(params, np.zeros((config.hidden_size, 1), np.float32), config, tmp_path / "rm",
                                  tokenizer_dir=ARITH_BASE)
    assert read_tensor(rm_dir, "score.weight").shape == (1, config.hidden_size)
    weights = rm_dir / "model.safetensors"
    _truncate(weights)
    with pytest.raises(ModelError) as e:
        load_hf_reward_model(rm_dir)
    assert str(e.value).startswith(f"{weights} cannot be read (") and str(e.value).endswith(CORRUPT)
    with pytest.raises(ModelError, match=r"cannot be read \(.*truncated or corrupt") as e:
        read_tensor(rm_dir, "score.weight")  # the RM trainer reads the score head through it
    assert str(weights) in str(e.value)


# ------------------------------------------------------------------------------------------- commands


def test_train_cli_reports_a_truncated_model_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    weights = model_dir / "model.safetensors"
    _truncate(weights)
    data = ROOT / "data" / "arithmetic"
    code = train.cli(tiny_run_args(tmp_path / "run", f"model.path={model_dir}", f"data.train={data / 'train.jsonl'}",
                                   f"data.eval={data / 'test.jsonl'}"))
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"train.py: error: {weights} cannot be read (")
    assert lines[0].endswith(CORRUPT)
    assert "Traceback" not in captured.err and "internal error" not in captured.err


def test_generate_reports_a_missing_shard_in_one_line(sharded_dir, capsys):
    shard = sorted(sharded_dir.glob("model-*.safetensors"))[0]
    shard.unlink()
    prog = "python -m jaxrl_llm generate"
    code = run_command(prog, generate.main, ["--model", str(sharded_dir), "--prompt", "1+1="])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"{prog}: error: {shard} is missing: model.safetensors.index.json lists it as a shard of the "
                   "checkpoint; re-download the model with all its shards, or re-export it\n")


# ------------------------------------------------------------------------------------------- export modes


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _plain_mode(directory: Path) -> int:
    """The mode `open(..., "w")` gives a new file in `directory` under the current umask."""
    probe = directory / "plain.txt"
    with open(probe, "w") as f:
        f.write("x")
    mode = _mode(probe)
    probe.unlink()
    return mode


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_exported_weights_have_plain_file_modes(tmp_path, umask):
    config, params = load_hf_model(ARITH_BASE)
    old = os.umask(umask)
    try:
        single = save_hf_model(params, config, tmp_path / "single", tokenizer_dir=ARITH_BASE)
        sharded = save_hf_model(params, config, tmp_path / "sharded", max_shard_bytes=300_000)
        want = _plain_mode(tmp_path)
    finally:
        os.umask(old)
    assert want == 0o666 & ~umask
    files = [single / "model.safetensors", *sharded.glob("model-*.safetensors"),
             sharded / "model.safetensors.index.json", single / "config.json", single / "tokenizer.json"]
    assert len(files) > 5
    assert {f.name: _mode(f) for f in files} == {f.name: want for f in files}


def test_exported_adapters_have_plain_file_modes(tmp_path):
    import jax

    from jaxrl_llm.models.lora import LoraSpec, init_adapters, save_peft_adapters

    config, params = load_hf_model(ARITH_BASE)
    spec = LoraSpec(rank=2, alpha=4.0, targets="q_proj|v_proj")
    out = save_peft_adapters(init_adapters(params, spec, jax.random.key(0)), config, spec, tmp_path / "adapter",
                             base_model=str(ARITH_BASE))
    want = _plain_mode(out)
    assert _mode(out / "adapter_model.safetensors") == want == _mode(out / "adapter_config.json")


def test_umask_is_read_without_changing_it():
    old = os.umask(0o027)
    try:
        assert hf_export._umask() == 0o027
        assert os.umask(0o027) == 0o027  # still what it was
    finally:
        os.umask(old)


def test_umask_fallback_without_proc_restores_it(monkeypatch):
    def no_proc(*_: Any) -> Path:
        raise OSError("no /proc here")

    monkeypatch.setattr(hf_export, "Path", no_proc)  # as on macOS: only os.umask can read it
    old = os.umask(0o007)
    try:
        assert hf_export._umask() == 0o007
        assert os.umask(0o007) == 0o007
    finally:
        os.umask(old)
