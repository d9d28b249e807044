"""The package's structure, read from its source: no import cycle, the config a leaf, the layers pointing one
way (the library never imports the shell or the commands), and the algorithm contract's defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.code_shape import cycles, import_graph

ROOT = Path(__file__).resolve().parents[1] / "jaxrl_llm"
pytestmark = pytest.mark.quick
MODULE_GRAPH = import_graph(ROOT)
FULL_GRAPH = import_graph(ROOT, top_level_only=False)  # function-level imports too


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycle_even_through_function_level_imports():
    assert cycles(MODULE_GRAPH) == []
    assert cycles(FULL_GRAPH) == []


def test_a_cycle_is_found_when_there_is_one(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def x():\n    from pkg import a\n")
    assert cycles(import_graph(pkg)) == []
    assert cycles(import_graph(pkg, top_level_only=False)) == [["pkg.a", "pkg.b"]]


# The package's layers, lowest first: a module imports only modules of its own layer or of the layers below it.
# The package's root (`jaxrl_llm/__init__.py`) imports nothing at module level (its `train` is a lazy attribute).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "fields", "registry", "sharding", "algorithms"),  # leaves: errors, a field's allowed values, names ->
    # code, meshes, the algorithms' names
    ("models",),  # the causal LMs, their checkpoints and tokenizers
    ("rl", "sampling"),  # the RL math (pure, jittable) and the static sampler
    ("config",),  # the run's schema, which takes the RL math's option types as they are
    ("engine", "envs", "run", "optim"),  # the rollout engine, environments and tools, a run's folder, optimizers
    ("tasks",),  # data sources and their rewards' parsers
    ("data", "rewards"),  # prompt sets and reward functions
    ("evaluation",),  # held-out evaluation (sampling, rewards, pass@k)
    ("trainers",),  # the algorithms and the loop
    ("memory_plan", "preflight", "api"),  # what a command checks or plans before a run, and the Python API
    ("cli", "__main__"),  # the commands
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def part_of(module: str) -> str:
    """`jaxrl_llm.rl.kl` -> `rl`; `jaxrl_llm.optim` -> `optim`; the root `jaxrl_llm` -> ``."""
    return module.split(".")[1] if "." in module else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a higher layer than its own, as `importer -> imported`."""
    return sorted(f"{m} -> {t}" for m, imported in graph.items() for t in imported
                  if part_of(t) and RANK[part_of(t)] > RANK[part_of(m)])


def test_every_package_and_root_module_has_a_layer():
    parts = {part_of(m) for m in FULL_GRAPH} - {""}
    assert parts == set(RANK), f"unplaced: {sorted(parts - set(RANK))}, gone: {sorted(set(RANK) - parts)}"


def test_imports_point_down_the_layers_even_inside_functions():
    assert upward_imports(FULL_GRAPH) == []


def test_an_upward_import_is_found():
    """The check fails on each kind of arrow the layers forbid: the trainer reaching a command, the models reaching
    the data layer, the RL math reaching the run's config, a data source reaching a command."""
    for importer, imported in (("jaxrl_llm.trainers.policy", "jaxrl_llm.cli.errors"),
                               ("jaxrl_llm.models.hf_export", "jaxrl_llm.data"),
                               ("jaxrl_llm.rl.kl", "jaxrl_llm.config.schema"),
                               ("jaxrl_llm.tasks.arithmetic", "jaxrl_llm.cli.errors")):
        graph = {m: set(imported_) for m, imported_ in FULL_GRAPH.items()}
        graph[importer].add(imported)
        assert upward_imports(graph) == [f"{importer} -> {imported}"]


def test_the_config_is_a_leaf_but_for_the_rl_maths_options():
    """The config takes `rl.loss` as the RL math's own `PolicyLossOptions` (and its choice lists), the model's
    choice lists (`models/options.py`), the samplers' (`sampling/options.py`) and the algorithms' names
    (`algorithms.py`); nothing else of the package but
    the errors and the fields' allowed values."""
    used = {m for m in reachable(FULL_GRAPH, "jaxrl_llm.config") if m.startswith("jaxrl_llm.")}
    assert used - {m for m in used if m.startswith("jaxrl_llm.config.")} == {
        "jaxrl_llm.errors", "jaxrl_llm.fields", "jaxrl_llm.rl.options", "jaxrl_llm.models.options",
        "jaxrl_llm.sampling.options", "jaxrl_llm.algorithms"}, used


def test_names_become_code_in_one_module():
    """`module:attribute` strings (losses, estimators, rewards, environments, tools, algorithms) are imported by
    `jaxrl_llm/registry.py` alone; the other dynamic imports are the package's own lazy attribute, its command
    dispatch and the family table."""
    users = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "import_module(" in p.read_text()}
    assert users == {"registry.py", "__init__.py", "__main__.py", "models/families/__init__.py"}, users


def test_environments_do_not_reach_into_the_rl_math():
    envs = [m for m in FULL_GRAPH if m.startswith("jaxrl_llm.envs")]
    reached = set().union(*(FULL_GRAPH[m] for m in envs))
    assert not {m for m in reached if m.startswith("jaxrl_llm.rl")}, sorted(reached)


@pytest.mark.parametrize("library", ["jaxrl_llm.rl", "jaxrl_llm.models", "jaxrl_llm.rewards", "jaxrl_llm.sampling",
                                     "jaxrl_llm.data", "jaxrl_llm.run", "jaxrl_llm.config", "jaxrl_llm.envs",
                                     "jaxrl_llm.engine", "jaxrl_llm.registry", "jaxrl_llm.tasks",
                                     "jaxrl_llm.evaluation"])
def test_the_library_never_imports_the_shell_or_the_commands(library):
    modules = [m for m in FULL_GRAPH if m == library or m.startswith(library + ".")]
    reached = set().union(*(reachable(FULL_GRAPH, m) for m in modules))
    above = {m for m in reached if m.startswith(("jaxrl_llm.trainers", "jaxrl_llm.cli", "jaxrl_llm.preflight",
                                                 "jaxrl_llm.api"))}
    assert above == set(), f"{library} reaches {sorted(above)}"


def test_the_planner_is_the_commands_and_imports_no_trainer():
    """`memory_plan` plans the trainers' memory from their parts (the model, the optimizer of `optim`, the
    log-prob chunking of `rl`) without importing them, and only `plan` (cli/) imports it."""
    planner = {m for m in FULL_GRAPH if m.startswith("jaxrl_llm.memory_plan")}
    reached = set().union(*(reachable(FULL_GRAPH, m) for m in planner))
    assert not {m for m in reached if m.startswith(("jaxrl_llm.trainers", "jaxrl_llm.cli"))}, sorted(reached)
    users = {m for m, imported in FULL_GRAPH.items() if imported & planner} - planner
    assert users == {"jaxrl_llm.cli.plan"}, users


def test_the_trainers_never_import_the_commands():
    """The trainers are library too: nothing they reach is a command's module (`cli/`) or the shell's entry
    points (the task datasets' writers are `python -m jaxrl_llm data`, in cli/)."""
    modules = [m for m in FULL_GRAPH if m.startswith("jaxrl_llm.trainers")]
    reached = set().union(*(reachable(FULL_GRAPH, m) for m in modules))
    assert not {m for m in reached if m.startswith(("jaxrl_llm.cli", "jaxrl_llm.api"))}, sorted(reached)


def test_every_algorithm_keeps_its_state_out_of_itself():
    from jaxrl_llm.trainers import ALGORITHMS, algorithm_class
    from jaxrl_llm.trainers.base import Algorithm

    for name in ALGORITHMS:
        cls = algorithm_class(name)
        assert issubclass(cls, Algorithm), name
        assert not hasattr(cls, "state") and not hasattr(cls, "load_state"), name  # the shell owns the state
        for method in ("init", "collect", "update", "export"):
            assert getattr(cls, method) is not getattr(Algorithm, method), f"{name} must define {method}"


def test_function_level_imports_are_only_of_optional_or_heavy_libraries():
    """The package imports its own modules at the top; inside functions only libraries a run may not need,
    imported on first use: wandb, textarena and reasoning_gym (optional), and the heavy ones a command or a data
    source loads."""
    from bench.code_shape import function_level_imports

    lazy = {"wandb", "math_verify", "matplotlib", "datasets", "transformers", "tokenizers", "huggingface_hub",
            "safetensors", "tensorboardX", "textarena", "reasoning_gym"}
    found = [(where, module) for where, module in function_level_imports(ROOT) if module.split(".")[0] not in lazy]
    assert found == []


def test_model_families_are_data():
    """A family is one module of models/families/ (named in FAMILY_MODULES, defining FAMILY); no other module
    branches on a family's name (only the reference family, llama, is a default)."""
    import re

    from jaxrl_llm.models.families import FAMILIES, FAMILY_MODULES

    modules = {p.stem for p in (ROOT / "models" / "families").glob("*.py")} - {"__init__"}
    assert modules == set(FAMILY_MODULES) and set(FAMILIES) == modules
    named = re.compile("|".join(f'"{name}"' for name in FAMILIES))
    outside = {(str(p.relative_to(ROOT)), m) for p in ROOT.rglob("*.py") if "families" not in p.parts
               for m in named.findall(p.read_text())}
    # env.tool_format's "mistral" names the tool-call text format (envs/tool_formats.py), not the architecture
    tool_format = {("config/schema.py", '"mistral"'), ("envs/tool_formats.py", '"mistral"')}
    assert outside <= {("models/config.py", '"llama"'), ("models/hf.py", '"llama"'), *tool_format}, sorted(outside)


def test_the_transformer_block_is_composed_once_and_the_layer_stack_driven_once():
    """The block's composition (rotary on q and k, the gated MLP, the residual adds) is `models/block.py`'s alone,
    and the loop over the layers is `models/stack.py`'s alone (`run_layers`): the training forward, the static
    sampler's prefill and token step and the rollout engine's prefill and decode steps hand it their layer parts, and
    no other module runs the block (but `DecoderLayer.__call__`, which runs it once to create a layer's weights).
    `models/moe.py` applies the gated activation inside each expert (a feed-forward part the block takes), and
    nothing else of the block."""
    import ast
    import re

    composing = re.compile(r"\b(apply_rope|gated_activation|transformer_block)\(")
    users = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") for line in p.read_text().splitlines()
             if composing.search(line) and not line.lstrip().startswith("def ")}
    assert users == {"models/block.py", "models/stack.py", "models/decoder.py", "models/moe.py"}, sorted(users)
    assert set(composing.findall((ROOT / "models/moe.py").read_text())) == {"gated_activation"}

    def callers_of(name: str) -> set[str]:
        found = set()
        for path in ROOT.rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.ClassDef):
                    for inner in ast.walk(node):
                        if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name)
                                and inner.func.id == name):
                            found.add(f"{path.relative_to(ROOT)}:{node.name}")
        return found

    block_users = {c for c in callers_of("transformer_block") if not c.startswith("models/block.py")}
    assert block_users == {"models/stack.py:run_layers", "models/stack.py:step", "models/decoder.py:DecoderLayer",
                           "models/decoder.py:__call__"}, sorted(block_users)
    drivers = {c.split(":")[0] for c in callers_of("run_layers")}
    assert drivers == {"models/decoder.py", "models/decode.py", "engine/model.py"}, sorted(drivers)


def test_no_module_branches_on_an_algorithms_name():
    """What differs between algorithms is asked of their class (`Algorithm.keeps_reference`, `teacher`,
    `model_sources`, `held_out_prompts`, ...), so adding one is a class and a line of `algorithms.py`; the names are
    listed once (`algorithms.py`), never compared."""
    compared = re.compile(r"\balgo\s*(==|!=|\bin\b|\bnot in\b)")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in ROOT.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if compared.search(line.split("#")[0])]
    assert found == [], found
