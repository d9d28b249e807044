"""`python -m jaxrl_llm.eval`: the command's code is `jaxrl_llm/cli/eval.py`."""

if __name__ == "__main__":
    import sys

    from jaxrl_llm.cli.errors import run_command
    from jaxrl_llm.cli.eval import main

    sys.exit(run_command("python -m jaxrl_llm.eval", main))
