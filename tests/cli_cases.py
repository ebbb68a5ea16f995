"""Runs launch/train.py's entry point (cli.run(train.main)) on many argument lists in ONE
Python process, as the process itself would: each case's exit status and everything
written to its stdout and stderr file descriptors (Python's and the C libraries' alike).

    python tests/cli_cases.py cases.json results.json

cases.json: a list of argument lists; results.json: a list of {"code", "stdout",
"stderr"}. Used by tests/test_cli_errors.py: the table of bad invocations pays Python's
and jax's start-up once instead of once per case.
"""

import json
import os
import sys
import tempfile
import traceback

from model_utils import load_launch


def run_case(main, argv) -> dict:
    """cli.run(main, argv) with fds 1 and 2 redirected to files: the exit status (a bug's
    uncaught exception prints its traceback and counts as 1, as the interpreter would)."""
    from dsparse_jax.config import cli

    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, f in files.items():
        os.dup2(f.fileno(), fd)
    try:
        try:
            cli.run(main, argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        for fd, old in saved.items():
            os.dup2(old, fd)
            os.close(old)
    out = {"code": code}
    for fd, name in ((1, "stdout"), (2, "stderr")):
        files[fd].seek(0)
        out[name] = files[fd].read().decode(errors="replace")
        files[fd].close()
    return out


def main() -> None:
    cases_path, results_path = sys.argv[1:]
    with open(cases_path) as f:
        cases = json.load(f)
    train = load_launch("train")
    results = [run_case(train.main, argv) for argv in cases]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
