"""Everything a run builds once from its config: task, tokenizer, model graph, sampler.

The task comes from config.data.source (default synthetic:chain, the embedded task with
its char tokenizer and a random init); a real dataset (jsonl: / parquet: / hf_disk: / tfds:) uses
the checkpoint's tokenizer (config.tokenizer.path, default <model.checkpoint_dir>: its
tokenizer.json and chat template, else Gemma's tokenizer.model; data/tokenizers/load.py)
and, with model.checkpoint_dir set, shapes and weights from a Hugging Face checkpoint.
docs/real_models.md.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from flax import nnx

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.config import schema
from dsparse_jax.config.validate import ConfigError, field_error
from dsparse_jax.data import batches, dataset_task, math_task, sources
from dsparse_jax.data.math_task import build_tokenizer
from dsparse_jax.data.rewards.rewarder import Rewarder
from dsparse_jax.data.task import Task
from dsparse_jax.data.tokenizers.base import Tokenizer
from dsparse_jax.data.tokenizers.hf import HFTokenizer
from dsparse_jax.data.tokenizers.load import load_tokenizer
from dsparse_jax.model import hf_checkpoint
from dsparse_jax.model.config import ModelConfig, preset
from dsparse_jax.model.lora import LoRAConfig, parse_targets
from dsparse_jax.model.transformer import Transformer
from dsparse_jax.sampling.sampler import Sampler
from dsparse_jax.train.evaluation import Evaluator


@dataclasses.dataclass
class RunContext:
    """What a run builds once from its config: the task, the tokenizer, the model and the
    objects around it. The RL phases' static settings are rl_state.RLSetup."""

    config: object  # the ml_collections ConfigDict
    task: Task
    tok: Tokenizer | HFTokenizer  # the task's char tokenizer, or load_tokenizer's
    model_cfg: ModelConfig
    graphdef: object
    init_params: object  # nnx.State of a freshly initialised model (also a template)
    spec: AttentionSpec  # dense attention spec of the trainer
    sampler: Sampler
    evaluator: Evaluator
    seq_width: int  # static width of prompt + completion buffers
    rollout_spec: AttentionSpec | None = None  # sparse actor attention (config.sparse)
    lora_cfg: LoRAConfig | None = None  # the actor's adapter (config.lora, distillsparse)
    rewarder: Rewarder | None = None  # config.reward (close() it when done)

    def __post_init__(self):
        if self.rewarder is None:
            self.rewarder = Rewarder.from_config(self.config)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.init_params))


def model_config(config, vocab_size: int) -> ModelConfig:
    overrides = schema.model_overrides(config.model)
    if overrides.setdefault("vocab_size", vocab_size) < vocab_size:
        raise ConfigError(
            f"config.model.vocab_size: {overrides['vocab_size']} is smaller than the "
            f"tokenizer's {vocab_size} pieces"
        )
    return preset(config.model.preset, **overrides)


@contextlib.contextmanager
def _user_input(field: str):
    """Errors reading the files a config field names are the user's: ConfigError naming
    the field (unless the message already names one)."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError, RuntimeError) as e:
        raise field_error(field, e) from e


def _data_task(config):
    """(task, tokenizer) of config.data.source."""
    with _user_input("data.source"):
        scheme, target = sources.parse_uri(config.get("data", {}).get("source", "synthetic:chain"))
    if scheme == "synthetic":
        if target != "chain":
            raise ConfigError(f"config.data.source: unknown synthetic task {target!r} (chain)")
        task = math_task.from_config(config.task)
        return task, build_tokenizer(task, config.seed)
    if config.sft.get("enabled", True):
        raise ConfigError(
            "config.sft.enabled: the SFT warm start is for the synthetic task "
            "only; real datasets start RL from a checkpoint (sft.enabled=False)"
        )
    d, ckpt = config.data, config.model.get("checkpoint_dir", "")
    path = config.tokenizer.path or ckpt
    if not path:
        raise ConfigError(
            "config.tokenizer.path: a real dataset needs a tokenizer (a directory holding "
            "tokenizer.json or tokenizer.model)"
        )
    with _user_input("tokenizer.path"):
        tok = load_tokenizer(path, chat=config.tokenizer.chat)
    scfg = sources.SourceConfig(
        question_field=d.question_field,
        answer_field=d.answer_field,
        solution_field=d.solution_field,
        instruction=d.instruction,
        chat=config.tokenizer.chat,
        max_prompt_tokens=d.max_prompt_tokens,
        overlong=d.overlong,
        max_bad_fraction=d.max_bad_fraction,
        data_dir=d.data_dir,
        split=d.split,
    )
    with _user_input("data.source"):
        task = dataset_task.build_task(
            d.source,
            d.eval_source,
            scfg,
            tok,
            config.eval.num_problems,
            d.max_new_tokens,
            config.seed,
            eval_split=d.eval_split,
        )
    return task, tok


def _model(config, tok):
    """(model config, graphdef, params): imported from model.checkpoint_dir, else random."""
    ckpt = config.model.get("checkpoint_dir", "")
    if not ckpt:
        model_cfg = model_config(config, tok.vocab_size)
        return (model_cfg, *nnx.split(Transformer(model_cfg, nnx.Rngs(config.seed))))
    with _user_input("model.checkpoint_dir"):
        model_cfg = hf_checkpoint.load_model_config(
            ckpt, param_dtype=config.model.param_dtype, dtype=config.model.dtype
        )
        if tok.vocab_size > model_cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {tok.vocab_size} pieces, more than the checkpoint's "
                f"vocab_size {model_cfg.vocab_size}"
            )
        graphdef, _ = hf_checkpoint.abstract_params(model_cfg)
        return model_cfg, graphdef, hf_checkpoint.load_params(ckpt, model_cfg)


def build(config) -> RunContext:
    task, tok = _data_task(config)
    model_cfg, graphdef, params = _model(config, tok)
    spec = AttentionSpec(impl=config.attention.impl, page_size=config.attention.page_size)
    # Built in every mode (cheap, static); rl_state.make_setup picks what the mode uses.
    rollout_spec = dataclasses.replace(spec, sparse=sparse_spec(config))
    lora_cfg = lora_config(config)
    sampler = Sampler(graphdef)
    eval_problems = task.problems("eval", 0, config.eval.num_problems, config.seed)
    rewarder = Rewarder.from_config(config)  # starts the worker of user functions
    evaluator = Evaluator(sampler, tok, task, eval_problems, spec, rewarder=rewarder)
    return RunContext(
        config=config,
        task=task,
        tok=tok,
        model_cfg=model_cfg,
        graphdef=graphdef,
        init_params=params,
        spec=spec,
        sampler=sampler,
        evaluator=evaluator,
        seq_width=batches.sequence_buffer(task, spec.page_size),
        rollout_spec=rollout_spec,
        lora_cfg=lora_cfg,
        rewarder=rewarder,
    )


def sparse_spec(config) -> SparseSpec:
    s = config.sparse
    return SparseSpec(
        policy=s.policy,
        budget=s.budget,
        sink_pages=s.sink_pages,
        recent_pages=s.recent_pages,
        dense_layers=s.dense_layers,
        group_pages=s.group_pages,
        candidate_groups=s.candidate_groups,
    )


def lora_config(config) -> LoRAConfig:
    c = config.lora
    return LoRAConfig(rank=c.rank, alpha=c.alpha, targets=parse_targets(c.targets))
