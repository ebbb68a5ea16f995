"""Dataset loading by URI: math datasets on local disk, read into Problems.

    synthetic:chain         the procedurally generated chain-sum task (math_task.py;
                            no records)
    jsonl:<path>            one JSON object per line
    parquet:<path>          a parquet file (pyarrow)
    hf_disk:<dir>           a Hugging Face `datasets` directory written by save_to_disk
                            (a Dataset, or a DatasetDict whose split data.split /
                            data.eval_split is read); local only, read with pyarrow, the
                            `datasets` package is not needed
    tfds:<name>[/<config>]  a prepared TFDS dataset under a local data_dir (no download)
    <path>                  without a scheme: .parquet -> parquet, .jsonl / .json (lines, or
                            one JSON array) -> jsonl, a save_to_disk directory -> hf_disk

A file target may be a comma list or a glob of files (train-*.parquet): one source, read
in order.

Records are dicts; the question and answer fields are configurable (GSM8K: question /
answer "... #### N"; MATH: problem / solution with \\boxed{}; DeepScaleR / Polaris:
problem / answer). Empty field names pick the first present of QUESTION_FIELDS /
ANSWER_FIELDS. A record in verl's layout (what verl's gsm8k preprocessing writes):

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": "..."}]   chat messages, rendered as they are
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "72"}
    extra_info    {"split": ..., "index": ..., ...}       passed on to reward functions

is read as such whenever its prompt is a list (and data.question_field names no other field
of the record): the messages are the prompt (data.instruction is not added),
reward_model.ground_truth the answer. Prompts are the tokenizer's (`tok.math_prompt`,
`tok.render_chat`: a checkpoint's own chat template, or Gemma turns for tokenizer.model).
A record without a usable question or answer is counted and skipped
with a warning; above `max_bad_fraction` of the records, loading fails. Prompts longer
than the static prompt width are dropped or truncated (`overlong`).

The problems of a dataset become a Task in dataset_task.py.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import warnings

import numpy as np

from dsparse_jax.data import answer_check
from dsparse_jax.data.task import Problem
from dsparse_jax.data.tokenizers.gemma import MATH_INSTRUCTION, GemmaTokenizer
from dsparse_jax.data.tokenizers.hf import HFTokenizer

# A tokenizer that formats prompts (render_chat, math_prompt): load.load_tokenizer's.
ChatTokenizer = GemmaTokenizer | HFTokenizer

SCHEMES = ("synthetic", "jsonl", "parquet", "hf_disk", "tfds")
QUESTION_FIELDS = ("question", "problem", "prompt", "query")
ANSWER_FIELDS = ("answer", "final_answer", "ground_truth", "solution")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    question_field: str = ""  # "" -> first present of QUESTION_FIELDS
    answer_field: str = ""  # "" -> first present of ANSWER_FIELDS
    solution_field: str = ""  # optional worked solution (kept for SFT / inspection)
    instruction: str = MATH_INSTRUCTION
    chat: bool = True  # the tokenizer's chat format (its template; Gemma turns)
    max_prompt_tokens: int = 512  # static prompt width, BOS included
    overlong: str = "drop"  # drop | truncate (the question's tail is cut)
    max_bad_fraction: float = 0.01
    data_dir: str = ""  # tfds only
    split: str = "train"  # tfds, and hf_disk DatasetDicts

    def __post_init__(self):
        if self.overlong not in ("drop", "truncate"):
            raise ValueError(f"overlong must be 'drop' or 'truncate', got {self.overlong!r}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError("max_bad_fraction must be in [0, 1]")


# A path without a scheme: its kind from its extension, or a save_to_disk directory.
EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
_HF_DISK_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def _kind_of_path(path: str) -> str | None:
    ext = os.path.splitext(path)[1].lower()
    if ext in EXTENSIONS:
        return EXTENSIONS[ext]
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _HF_DISK_FILES):
        return "hf_disk"
    return None


def parse_uri(uri: str) -> tuple[str, str]:
    """'jsonl:/data/x.jsonl' -> ('jsonl', '/data/x.jsonl'); a path without a scheme takes
    its kind from its extension (.parquet, .jsonl, .json) or from being a save_to_disk
    directory. The target may be a comma list or glob of files of that kind (one source)."""
    text = str(uri).strip()
    scheme, sep, rest = text.partition(":")
    if sep and scheme in SCHEMES and rest:
        return scheme, rest
    first = text.split(",")[0].strip()
    kind = _kind_of_path(first) or next(
        (_kind_of_path(p) for p in sorted(glob.glob(first)) if _kind_of_path(p)), None
    )
    if kind is None:
        raise ValueError(
            f"data source {uri!r}: expected <scheme>:<target> with scheme in {SCHEMES}, or a "
            ".parquet / .jsonl / .json file or a save_to_disk directory, e.g. "
            "jsonl:/data/gsm8k/train.jsonl or synthetic:chain"
        )
    return kind, text


def source_paths(scheme: str, target: str) -> list[str]:
    """The files of a file-based target: its comma-separated parts, each a path or a glob
    (sorted); a part that names nothing is a FileNotFoundError naming it."""
    out = []
    for part in (p.strip() for p in target.split(",")):
        if not part:
            continue
        found = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
        exists = os.path.isdir if scheme == "hf_disk" else os.path.isfile
        missing = [p for p in found if not exists(p)]
        if not found or missing:
            what = "directory" if scheme == "hf_disk" else "file"
            raise FileNotFoundError(f"data source {scheme + ':' + part!r}: no such {what}")
        out += found
    return out


# ------------------------------------------------------------------------------ readers
class _Bad:
    """A record that could not be read (kept so it is counted)."""

    def __init__(self, reason: str):
        self.reason = reason


def _read_jsonl(path: str) -> list:
    """JSON lines; a .json file holding one JSON array of records is read too."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        if path.lower().endswith(".json") and f.read(1) == "[":
            f.seek(0)
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                return [_Bad(f"{path}: invalid JSON ({e.msg})")]
            return list(records)
        f.seek(0)
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                out.append(_Bad(f"line {n}: invalid JSON ({e.msg})"))
    return out


def _read_parquet(path: str) -> list:
    try:
        import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError("parquet sources need pyarrow: pip install pyarrow") from e
    return pq.read_table(path).to_pylist()


def _read_arrow(path: str):
    """One arrow file of save_to_disk (IPC stream format; the file format also read)."""
    import pyarrow as pa  # pylint: disable=import-outside-toplevel

    try:
        with pa.OSFile(path) as f:
            return pa.ipc.open_stream(f).read_all()
    except pa.ArrowInvalid:
        with pa.OSFile(path) as f:
            return pa.ipc.open_file(f).read_all()


def _read_hf_disk(path: str, split: str) -> list:
    """Rows of a `datasets` save_to_disk directory: state.json lists the arrow files; a
    DatasetDict (dataset_dict.json) has one such directory per split."""
    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(dict_file):
        with open(dict_file) as f:
            splits = json.load(f).get("splits", [])
        if split not in splits:
            raise ValueError(f"hf_disk:{path}: no split {split!r} (it has {splits})")
        path = os.path.join(path, split)
    state_file = os.path.join(path, "state.json")
    if not os.path.isfile(state_file):
        raise FileNotFoundError(
            f"hf_disk:{path}: no state.json or dataset_dict.json: not a directory written "
            "by datasets' save_to_disk"
        )
    with open(state_file) as f:
        files = [d["filename"] for d in json.load(f).get("_data_files", [])]
    if not files:
        raise ValueError(f"hf_disk:{path}: state.json lists no _data_files")
    rows = []
    for name in files:
        rows += _read_arrow(os.path.join(path, name)).to_pylist()
    return rows


def _decode(v):
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, np.ndarray) and v.shape == ():
        return _decode(v.item())
    return v


def _read_tfds(name: str, data_dir: str, split: str) -> list:
    try:
        import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError(
            f"tfds:{name} needs tensorflow_datasets (pip install "
            "tensorflow-datasets), and the dataset prepared under a local "
            "data_dir: nothing is downloaded at run time"
        ) from e
    if not data_dir:
        raise ValueError(f"tfds:{name} needs data.data_dir (a local TFDS data_dir)")
    builder = tfds.builder(name, data_dir=data_dir)
    try:  # array_record datasets read without TensorFlow
        source = builder.as_data_source(split=split)
        rows = [source[i] for i in range(len(source))]
    except Exception:  # noqa: BLE001 -- tfrecord-prepared data needs TF: try that
        try:
            rows = list(tfds.as_numpy(builder.as_dataset(split=split)))
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(
                f"tfds:{name} split {split!r} could not be read from {data_dir!r} ({e}). "
                "Prepare it in array_record format (readable without TensorFlow) or "
                "install tensorflow"
            ) from e
    return [{k: _decode(v) for k, v in r.items()} if isinstance(r, dict) else r for r in rows]


def read_records(uri: str, cfg: SourceConfig = SourceConfig()) -> list:
    """Raw records of a jsonl / parquet / hf_disk / tfds source (unreadable ones as _Bad);
    a comma list or glob of files is read as one source, in order."""
    scheme, target = parse_uri(uri)
    if scheme == "synthetic":
        raise ValueError("synthetic sources have no records: use math_task.problems")
    if scheme == "tfds":
        return _read_tfds(target, cfg.data_dir, cfg.split)
    read = {
        "jsonl": _read_jsonl,
        "parquet": _read_parquet,
        "hf_disk": lambda p: _read_hf_disk(p, cfg.split),
    }[scheme]
    return [r for path in source_paths(scheme, target) for r in read(path)]


# ----------------------------------------------------------------------------- problems
def _field(rec: dict, name: str, candidates) -> str | None:
    """The field named (if present), else the first candidate holding usable text, else
    the first present."""
    if name:
        return name if name in rec else None
    usable = next((c for c in candidates if _text(rec.get(c)) is not None), None)
    return usable or next((c for c in candidates if c in rec), None)


def _missing_field(rec: dict, setting: str, name: str) -> str:
    """Why a record has no usable `setting` (data.question_field / data.answer_field)."""
    if name and name not in rec:
        return (
            f"data.{setting}={name!r} is not a field of the records (they have "
            f"{', '.join(sorted(rec)) or 'none'}): set --config.data.{setting}"
        )
    return f"no usable {setting.split('_')[0]} field ({name or 'auto'})"


def _text(v) -> str | None:
    v = _decode(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    return v if isinstance(v, str) and v.strip() else None


def _fit(question: str, cfg: SourceConfig, tok: ChatTokenizer, render=None) -> str | None:
    """The templated prompt render(question) (default: tok.math_prompt) if it fits (its
    tokens with BOS <= max_prompt_tokens), else the truncated one (overlong='truncate') or
    None (overlong='drop')."""
    render = render or (lambda q: tok.math_prompt(q, cfg.instruction, cfg.chat))
    prompt = render(question)
    if len(tok.encode(prompt, add_bos=True)) <= cfg.max_prompt_tokens:
        return prompt
    if cfg.overlong == "drop":
        return None
    q_ids = tok.encode(question)
    over = len(tok.encode(prompt, add_bos=True)) - cfg.max_prompt_tokens
    keep = len(q_ids) - over
    while keep > 0:
        prompt = render(tok.decode(q_ids[:keep]))
        n = len(tok.encode(prompt, add_bos=True))
        if n <= cfg.max_prompt_tokens:
            return prompt
        keep -= max(1, n - cfg.max_prompt_tokens)
    return None  # the template alone does not fit


def _messages(v) -> list[dict] | None:
    """verl's prompt: a non-empty list of {role: system | user | assistant, content: str}
    with a user message, or None."""
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if not isinstance(v, (list, tuple)) or not v:
        return None
    ok = all(
        isinstance(m, dict)
        and m.get("role") in ("system", "user", "assistant")
        and isinstance(m.get("content"), str)
        for m in v
    )
    return list(v) if ok and any(m["role"] == "user" for m in v) else None


def is_verl_record(rec: dict, cfg: SourceConfig) -> bool:
    """verl's layout: a list under prompt (unless data.question_field names another field
    of the record: then that field is the question)."""
    if cfg.question_field and cfg.question_field != "prompt" and cfg.question_field in rec:
        return False
    return isinstance(rec.get("prompt"), (list, tuple, np.ndarray))


def _verl_problem(n: int, rec: dict, cfg: SourceConfig, tok: ChatTokenizer):
    """A Problem of a verl record, None if its prompt is too long, or the reason it
    is bad (a string)."""
    messages = _messages(rec.get("prompt"))
    if messages is None:
        return (
            f"record {n}: prompt is not a list of chat messages {{role, content}} with a user turn"
        )
    rm = rec.get("reward_model")
    ground_truth = _text(rm.get("ground_truth")) if isinstance(rm, dict) else None
    if ground_truth is None:
        return f"record {n}: no usable reward_model.ground_truth"
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")

    def render(text: str) -> str:
        turns = list(messages)
        turns[last] = {"role": "user", "content": text}
        return tok.render_chat(turns, cfg.chat)

    prompt = _fit(messages[last]["content"], cfg, tok, render)
    if prompt is None:
        return None
    extra = rec.get("extra_info")
    extra = extra if isinstance(extra, dict) else {}
    return Problem(
        prompt=prompt,
        solution=_text(extra.get("answer")) or "",
        answer=answer_check.reference_answer(ground_truth),
        grader="math",
        data_source=_text(rec.get("data_source")) or "",
        extra_info=extra,
        ground_truth=ground_truth,
    )


def to_problems(
    records: list, cfg: SourceConfig, tok: ChatTokenizer, name: str = "data"
) -> tuple[list[Problem], dict]:
    """Usable problems of raw records and counts {total, bad, overlong, truncated, kept}."""
    out, reasons = [], []
    stats = {"total": len(records), "bad": 0, "overlong": 0, "truncated": 0}
    for n, rec in enumerate(records):
        if isinstance(rec, _Bad):
            reasons.append(rec.reason)
            continue
        if not isinstance(rec, dict):
            reasons.append(f"record {n}: not an object ({type(rec).__name__})")
            continue
        if is_verl_record(rec, cfg):
            got = _verl_problem(n, rec, cfg, tok)
            if isinstance(got, str):
                reasons.append(got)
            elif got is None:
                stats["overlong"] += 1
            else:
                out.append(got)
                full = tok.render_chat(_messages(rec["prompt"]), cfg.chat)
                stats["truncated"] += got.prompt != full
            continue
        qf = _field(rec, cfg.question_field, QUESTION_FIELDS)
        af = _field(rec, cfg.answer_field, ANSWER_FIELDS)
        question = _text(rec.get(qf)) if qf else None
        raw_answer = _text(rec.get(af)) if af else None
        answer = answer_check.reference_answer(raw_answer) if raw_answer else ""
        if question is None:
            reasons.append(
                f"record {n}: {_missing_field(rec, 'question_field', cfg.question_field)}"
            )
            continue
        if not answer:
            reasons.append(f"record {n}: {_missing_field(rec, 'answer_field', cfg.answer_field)}")
            continue
        prompt = _fit(question, cfg, tok)
        if prompt is None:
            stats["overlong"] += 1
            continue
        stats["truncated"] += prompt != tok.math_prompt(question, cfg.instruction, cfg.chat)
        sf = cfg.solution_field or af
        solution = (_text(rec.get(sf)) or "") if sf else ""
        out.append(Problem(prompt=prompt, solution=solution, answer=answer, grader="math"))
    stats["bad"] = len(reasons)
    stats["kept"] = len(out)
    if reasons:
        frac = len(reasons) / max(1, len(records))
        msg = (
            f"{name}: skipped {len(reasons)} of {len(records)} bad records "
            f"({frac:.1%}); first: {'; '.join(reasons[:3])}"
        )
        if frac > cfg.max_bad_fraction:
            raise ValueError(msg + f" -- more than max_bad_fraction={cfg.max_bad_fraction}")
        warnings.warn(msg)
    if stats["overlong"]:
        warnings.warn(
            f"{name}: dropped {stats['overlong']} prompts longer than "
            f"{cfg.max_prompt_tokens} tokens"
        )
    if not out:
        raise ValueError(f"{name}: no usable problems in {len(records)} records")
    return out, stats


def load_problems(uri: str, cfg: SourceConfig, tok: ChatTokenizer) -> tuple[list[Problem], dict]:
    return to_problems(read_records(uri, cfg), cfg, tok, name=uri)
