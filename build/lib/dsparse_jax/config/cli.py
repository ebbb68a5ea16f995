"""Command lines of launch/, dsparse_jax.harness and dsparse_jax.bench: a config from
`--config=FILE` plus `--config.a.b=VALUE` overrides, `--flag=value` arguments, and the
error convention every command follows.

A user error (errors.UserError: an unknown key, a bad value, a missing or unreadable file,
an unusable workdir, an incompatible checkpoint, a bad mesh, a bad flag) prints one line
to stderr, `error: config.rl.bogus: unknown key (did you mean rl.kl_coef?)`, and exits
with status 2, without a traceback; `--verbose` or DSPARSE_VERBOSE=1 adds the traceback.
Anything else is a bug: its traceback is printed and the status is 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from dsparse_jax.errors import UserError

VERBOSE_ENV = "DSPARSE_VERBOSE"
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_value(text, kind, field: str):
    """`text` (a command-line string, or a value) as a field of type `kind`."""
    text = text if isinstance(text, str) else str(text)
    if kind is str:
        return text
    if kind is bool:
        if text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
    elif kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    else:
        raise UserError(f"config.{field}: cannot be set from the command line ({kind.__name__})")
    raise UserError(f"config.{field}: expected {kind.__name__}, got {text!r}")


def apply_override(config, dotted: str, text) -> None:
    """Sets config.<dotted> from a command-line value, typed like the field it replaces."""
    from dsparse_jax.config.validate import unknown_key

    parts = dotted.split(".")
    section = config
    for i, part in enumerate(parts):
        if not hasattr(section, "keys") or part not in section:
            raise unknown_key(".".join(parts[: i + 1]), config)
        if i < len(parts) - 1:
            section = section[part]
    name = parts[-1]
    if hasattr(section[name], "keys"):
        raise UserError(f"config.{dotted}: is a section; set its fields (config.{dotted}.x=...)")
    section[name] = parse_value(text, section.get_type(name), dotted)


def packaged_configs() -> dict[str, str]:
    """{name: path} of the configs that ship with the package (dsparse_jax.configs: the
    checkout's configs/ directory, installed with it; run from a checkout, that directory)."""
    from importlib import resources

    try:
        root = resources.files("dsparse_jax.configs")
    except ModuleNotFoundError:
        import dsparse_jax

        root = resources.files(dsparse_jax).joinpath("..", "configs")
        if not root.is_dir():
            return {}
    return {
        f.name[: -len(".py")]: os.path.normpath(str(f))
        for f in root.iterdir()
        if f.name.endswith(".py") and not f.name.startswith("_")
    }


def config_path(path: str) -> str:
    """A config file: `path` itself, else the packaged config it names (gemma_math,
    gemma_math.py or configs/gemma_math.py, from any directory); a UserError otherwise."""
    if os.path.isfile(path):
        return path
    name = os.path.basename(path).removesuffix(".py")
    packaged = packaged_configs()
    if name in packaged and os.path.isfile(packaged[name]):
        return packaged[name]
    raise UserError(
        f"--config: no such config file {path!r} (packaged: {', '.join(sorted(packaged))})"
    )


def load_config(path: str, overrides: dict | None = None):
    """get_config() of a config file with `overrides` ({"rl.learning_rate": "1e-4"})."""
    from dsparse_jax.config import schema
    from dsparse_jax.config.validate import load_config as load_file

    if not path:
        raise UserError("--config: give a config file, e.g. --config=configs/gemma_math.py")
    path = config_path(path)
    try:
        config = load_file(path)
    except Exception as e:  # the file is the user's: any failure to load it is theirs
        raise UserError(f"--config: cannot load {path!r}: {type(e).__name__}: {e}") from e
    for dotted, text in (overrides or {}).items():
        apply_override(config, dotted, text)
    for note in schema.apply_renames(config):
        print(note, file=sys.stderr)
    return config


def split_config_args(argv: list[str]) -> tuple[str | None, dict, list[str]]:
    """(--config FILE, {dotted: value} of --config.a.b=v, the other arguments)."""
    path, overrides, rest = None, {}, []
    for arg in argv:
        if arg.startswith("--config="):
            path = arg[len("--config=") :]
        elif arg.startswith("--config."):
            key, sep, value = arg[len("--config.") :].partition("=")
            if not sep:
                raise UserError(f"{arg}: expected --config.{key}=VALUE")
            overrides[key] = value
        else:
            rest.append(arg)
    return path, overrides, rest


def comma_list(kind=str):
    """An argparse type: "4,8,16" -> [4, 8, 16] (items of `kind`, empty ones dropped)."""

    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {kind.__name__}, got {text!r}"
            ) from None

    return parse


def boolean(text: str) -> bool:
    """An argparse type: true / false (1 / 0, yes / no, on / off)."""
    if text.strip().lower() not in _TRUE + _FALSE:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.strip().lower() in _TRUE


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors (one line, status 2)."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message}")


def _verbose(argv: list[str]) -> bool:
    return "--verbose" in argv or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def one_line(e: BaseException) -> str:
    """The message's first line, with a pointer to the rest."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    more = f" (+{len(lines) - 1} more lines with --verbose)" if len(lines) > 1 else ""
    return lines[0] + more


def run(main, argv: list[str] | None = None) -> None:
    """Runs main(argv) and exits: 0 (or main's int), 2 on a UserError (one line), 1 on a
    bug (traceback). `--verbose` is removed from argv before main sees it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = _verbose(argv)
    argv = [a for a in argv if a != "--verbose"]
    try:
        code = main(argv)
    except UserError as e:
        if verbose:
            traceback.print_exc()
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(code or 0)
