"""The command-line programs (entry points): train, evaluate, export, tiny_checkpoint.

Each module's `main(argv)` is the program; `console()` runs it with the error convention
of config/cli.py (the `dsparse-*` console commands of the package metadata), and
launch/<name>.py runs the same from a checkout.
"""
