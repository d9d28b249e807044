"""The commands: `python train.py` and `python -m jaxrl_llm.<command>` for eval, generate, export, compare,
report and plan. Each is a thin `main(argv)` over the library, behind `errors.run_command`'s one-line errors."""
