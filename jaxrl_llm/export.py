"""`python -m jaxrl_llm.export`: the command's code is `jaxrl_llm/cli/export.py`."""

if __name__ == "__main__":
    import sys

    from jaxrl_llm.cli.errors import run_command
    from jaxrl_llm.cli.export import main

    sys.exit(run_command("python -m jaxrl_llm.export", main))
