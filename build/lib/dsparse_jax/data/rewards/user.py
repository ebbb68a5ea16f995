"""Users' own reward functions (config reward.fn): loading, signature detection, and calls
under a per-call timeout in a worker process.

A reward is named by a function reference:

    path/to/file.py:name     a function in a Python file (without :name, compute_score)
    package.module:name      a function in an importable module (or package.module.name)

Two signatures are recognised, by their parameter names:

    verl   compute_score(data_source, solution_str, ground_truth, extra_info=None)
           one row per call; returns a number (or a dict with a number under "score")
    tunix  fn(prompts, completions, **kwargs)
           a batch per call; kwargs are answer, ground_truth, data_source, extra_info
           (lists, one item per row); returns one number per row

The functions run in one worker process (`python -m dsparse_jax.data.rewards.user`),
started on the first call: a call that runs past `timeout_s` is interrupted (SIGALRM in
the worker; a hang that ignores it is ended by killing the worker, which restarts). The
worker imports only the reward files and the standard library, never jax.

Row outcomes are {"value": float} or {"error": one line, "traceback": text}: a raise, a
non-number (or non-finite) result and a timeout are all errors of that row. A batch fn
that raises is retried one row at a time, so only the rows that fail are errors. A batch
fn that returns another number of values than rows breaks its contract: every row's
outcome is {"fatal": one line} and the run stops (Rewarder.score).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import select
import signal
import subprocess
import sys
import time
import traceback

from dsparse_jax.errors import UserError

VERL, BATCH = "verl", "batch"
DEFAULT_NAME = "compute_score"  # verl's default custom_reward_function.name
BUILTIN = "builtin"  # the reference of the in-house grader (rewards/graders.py) in a reward.fn list
_GRACE_S = 5.0  # the parent's backstop past the worker's own per-call alarm


def split_ref(ref: str) -> tuple[str, str, bool]:
    """(file path or module, function name, is_file) of a function reference."""
    ref = ref.strip()
    if not ref:
        raise UserError("config.reward.fn: empty function reference")
    target, sep, name = ref.rpartition(":")
    if not sep or "/" in name or name.endswith(".py"):  # no ':name' part
        target, name = ref, ""
    if target.endswith(".py"):
        return target, name or DEFAULT_NAME, True
    if not name:  # package.module.name
        target, _, name = target.rpartition(".")
    if not target or not name.isidentifier():
        raise UserError(
            f"config.reward.fn: {ref!r} is not path/to/file.py[:name] or package.module:name"
        )
    return target, name, False


def load_fn(ref: str):
    """The function a reference names; a UserError naming config.reward.fn if it cannot be."""
    target, name, is_file = split_ref(ref)
    try:
        if is_file:
            if not os.path.isfile(target):
                raise UserError(f"config.reward.fn: no such file {target!r}")
            mod_name = "_reward_" + os.path.splitext(os.path.basename(target))[0]
            module_spec = importlib.util.spec_from_file_location(mod_name, target)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except UserError:
        raise
    except Exception as e:  # the file is the user's: any failure to import it is theirs
        raise UserError(
            f"config.reward.fn: cannot import {target!r}: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"config.reward.fn: {target!r} has no function {name!r}")
    return fn


def signature_kind(fn, ref: str = "") -> str:
    """VERL or BATCH from the parameter names; a UserError for any other signature."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise UserError(f"config.reward.fn: {ref}: cannot read its signature ({e})") from e
    names = list(params)
    if {"solution_str", "ground_truth"} <= set(names):
        return VERL
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if names[:2] == ["prompts", "completions"] and var_kw:
        return BATCH
    raise UserError(
        f"config.reward.fn: {ref} has parameters ({', '.join(names)}); expected verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info) or tunix's "
        "fn(prompts, completions, **kwargs)"
    )


def to_value(x) -> float:
    """A reward result as a finite float (verl's {"score": x} too); TypeError otherwise."""
    if isinstance(x, dict) and "score" in x:
        x = x["score"]
    if not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise TypeError(f"returned {x!r} ({type(x).__name__}), not a finite number")
    return float(x)


# ------------------------------------------------------------------------------ the calls
class CallTimeout(BaseException):  # not an Exception: a user's `except Exception` passes it
    pass


def _alarm(signum, frame):
    raise CallTimeout


def _timed(timeout_s: float, f, *args, **kwargs):
    """f(*args) interrupted after timeout_s (main thread only: SIGALRM)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return f(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _error(e: BaseException, timeout_s: float) -> dict:
    if isinstance(e, CallTimeout):
        return {"error": f"timed out after {timeout_s:g} s", "traceback": ""}
    text = "".join(traceback.format_exception(e))
    return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300], "traceback": text}


def call_verl(fn, row: dict, timeout_s: float) -> dict:
    """One row through a verl compute_score: {"value"} or {"error", "traceback"}."""
    try:
        out = _timed(
            timeout_s,
            fn,
            row["data_source"],
            row["completion"],
            row["ground_truth"],
            row.get("extra_info"),
        )
        return {"value": to_value(out)}
    except (Exception, CallTimeout) as e:  # noqa: BLE001 -- the user's code: any error
        return _error(e, timeout_s)


def _batch_once(fn, rows: list[dict], timeout_s: float) -> list:
    kwargs = {
        "answer": [r["ground_truth"] for r in rows],
        "ground_truth": [r["ground_truth"] for r in rows],
        "data_source": [r["data_source"] for r in rows],
        "extra_info": [r.get("extra_info") for r in rows],
    }
    out = _timed(
        timeout_s, fn, [r["prompt"] for r in rows], [r["completion"] for r in rows], **kwargs
    )
    out = list(out)
    if len(out) != len(rows):
        raise WrongCount(
            f"returned {len(out)} values for {len(rows)} rows (a batch reward returns one "
            "number per completion)"
        )
    return out


class WrongCount(ValueError):
    """A batch reward returned another number of values than it was given rows."""


def _one(value) -> dict:
    try:
        return {"value": to_value(value)}
    except TypeError as e:
        return _error(e, 0.0)


def call_batch(fn, rows: list[dict], timeout_s: float):
    """Outcomes of a tunix batch fn, yielded row by row: one call for the batch; if it
    raises, one call per row (a timeout of the batch call fails every row)."""
    try:
        values = _batch_once(fn, rows, timeout_s)
    except CallTimeout as e:
        for _ in rows:
            yield _error(e, timeout_s)
        return
    except WrongCount as e:
        for _ in rows:
            yield {"fatal": str(e)}
        return
    except Exception:  # noqa: BLE001 -- retried row by row to find the failing rows
        values = None
    if values is not None:
        yield from (_one(v) for v in values)
        return
    for row in rows:
        try:
            yield _one(_batch_once(fn, [row], timeout_s)[0])
        except (Exception, CallTimeout) as e:  # noqa: BLE001
            yield _error(e, timeout_s)


def call_rows(fn, kind: str, rows: list[dict], timeout_s: float):
    """Outcomes of `rows`, one per row, in order (a generator)."""
    if kind == VERL:
        return (call_verl(fn, r, timeout_s) for r in rows)
    return call_batch(fn, rows, timeout_s)


# ------------------------------------------------------------------------- worker process
def _serve(refs: list[str], timeout_s: float) -> None:
    """The worker: loads the functions, then answers {"fn": i, "rows": [...]} lines with
    one outcome line per row."""
    try:
        fns = [load_fn(s) for s in refs]
        kinds = [signature_kind(f, s) for f, s in zip(fns, refs)]
    except UserError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return
    print(json.dumps({"kinds": kinds}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        i = req["fn"]
        for outcome in call_rows(fns[i], kinds[i], req["rows"], timeout_s):
            print(json.dumps(outcome), flush=True)


class RewardWorker:
    """The parent's side of the worker process: `kinds` of the functions, `call(i, rows)`."""

    def __init__(self, refs: list[str], timeout_s: float, start_timeout_s: float = 120.0):
        # Relative file paths resolve against this process's directory.
        self.refs = [_absolute(s) for s in refs]
        self.timeout_s, self.start_timeout_s = float(timeout_s), start_timeout_s
        self.proc = None
        self.kinds = self._start()

    def _start(self) -> list[str]:
        root = os.path.dirname(
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, os.getcwd()] + [p for p in sys.path if p])
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsparse_jax.data.rewards.user",
                json.dumps(self.refs),
                str(self.timeout_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the user's prints and warnings stay visible
            env=env,
            bufsize=0,
        )
        self._buf = b""
        first = self._read(self.start_timeout_s)
        if first is None:
            self.close()
            raise UserError(
                f"config.reward.fn: the reward worker did not start within "
                f"{self.start_timeout_s:g} s (importing {', '.join(self.refs)})"
            )
        if "error" in first:
            self.close()
            raise UserError(first["error"])
        return first["kinds"]

    def _read(self, timeout_s: float) -> dict | None:
        """The worker's next reply line, or None after timeout_s or at its exit."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def call(self, i: int, rows: list[dict]) -> list[dict]:
        """Outcomes of function i on rows; a row the worker does not answer in time is a
        timeout (the worker is killed and restarted for the rows after it)."""
        out: list[dict] = []
        while len(out) < len(rows):
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            pending = rows[len(out) :]
            try:
                request = json.dumps({"fn": i, "rows": pending}, default=str) + "\n"
                view = memoryview(request.encode())
                while view:  # an unbuffered pipe may take part of a large request
                    view = view[self.proc.stdin.write(view) :]
                for _ in pending:
                    reply = self._read(2 * self.timeout_s + _GRACE_S)
                    if reply is None:
                        raise TimeoutError
                    out.append(reply)
            except (TimeoutError, OSError, ValueError):
                code = self.proc.poll()
                self.close()
                why = (
                    f"timed out after {self.timeout_s:g} s (worker killed)"
                    if code is None
                    else f"the reward worker exited with status {code}"
                )
                out.append({"error": why, "traceback": ""})
        return out

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.proc = None


def _absolute(ref: str) -> str:
    target, name, is_file = split_ref(ref)
    return f"{os.path.abspath(target)}:{name}" if is_file else ref


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]), float(sys.argv[2]))
