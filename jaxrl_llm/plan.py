"""`python -m jaxrl_llm.plan`: the command's code is `jaxrl_llm/cli/plan.py`."""

if __name__ == "__main__":
    import sys

    from jaxrl_llm.cli.errors import run_command
    from jaxrl_llm.cli.plan import main

    sys.exit(run_command("python -m jaxrl_llm.plan", main))
