"""`python -m jaxrl_llm.report`: the command's code is `jaxrl_llm/cli/report.py`."""

if __name__ == "__main__":
    import sys

    from jaxrl_llm.cli.errors import run_command
    from jaxrl_llm.cli.report import main

    sys.exit(run_command("python -m jaxrl_llm.report", main))
