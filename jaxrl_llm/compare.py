"""`python -m jaxrl_llm.compare`: the command's code is `jaxrl_llm/cli/compare.py`."""

if __name__ == "__main__":
    import sys

    from jaxrl_llm.cli.compare import main
    from jaxrl_llm.cli.errors import run_command

    sys.exit(run_command("python -m jaxrl_llm.compare", main))
