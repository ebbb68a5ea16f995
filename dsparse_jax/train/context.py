"""Everything a run builds once from its config: task, tokenizer, model graph, sampler."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.data import batches
from dsparse_jax.data.math_task import ChainTaskConfig, build_tokenizer, problems
from dsparse_jax.data.tokenizer import Tokenizer
from dsparse_jax.model.config import ModelConfig, preset
from dsparse_jax.model.lora import LoRAConfig, parse_targets
from dsparse_jax.model.transformer import Transformer
from dsparse_jax.sampling.sampler import Sampler
from dsparse_jax.train.evaluation import Evaluator


@dataclasses.dataclass
class RunContext:
    config: object  # the ml_collections ConfigDict
    task: ChainTaskConfig
    tok: Tokenizer
    model_cfg: ModelConfig
    graphdef: object
    init_params: object  # nnx.State of a freshly initialised model (also a template)
    spec: AttentionSpec  # dense attention spec of the trainer
    sampler: Sampler
    evaluator: Evaluator
    seq_width: int  # static width of prompt + completion buffers
    rollout_spec: AttentionSpec | None = None  # sparse actor attention (config.sparse)
    lora_cfg: LoRAConfig | None = None  # the actor's adapter (config.lora, distillsparse)

    @property
    def mode(self) -> str:
        return self.config.rl.rollout_mode

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.init_params))


def model_config(config, vocab_size: int) -> ModelConfig:
    m = config.model
    overrides = {k: m[k] for k in m.keys() if k != "preset"}
    return preset(m.preset, vocab_size=vocab_size, **overrides)


def build(config) -> RunContext:
    task = ChainTaskConfig(num_vars=config.task.num_vars, num_terms=config.task.num_terms,
                           name_digits=config.task.name_digits)
    tok = build_tokenizer(task, config.seed)
    model_cfg = model_config(config, tok.vocab_size)
    model = Transformer(model_cfg, nnx.Rngs(config.seed))
    graphdef, params = nnx.split(model)
    spec = AttentionSpec(impl=config.attention.impl, page_size=config.attention.page_size)
    # Built in every mode (cheap, static); rl_loop.make_setup picks what the mode uses.
    rollout_spec = dataclasses.replace(spec, sparse=sparse_spec(config))
    lora_cfg = lora_config(config)
    sampler = Sampler(graphdef)
    eval_problems = problems(task, "eval", 0, config.eval.num_problems, config.seed)
    evaluator = Evaluator(sampler, tok, task, eval_problems, spec)
    return RunContext(config=config, task=task, tok=tok, model_cfg=model_cfg,
                      graphdef=graphdef, init_params=params, spec=spec, sampler=sampler,
                      evaluator=evaluator,
                      seq_width=batches.sequence_buffer(task, spec.page_size),
                      rollout_spec=rollout_spec, lora_cfg=lora_cfg)


def sparse_spec(config) -> SparseSpec:
    s = config.sparse
    return SparseSpec(policy=s.policy, budget=s.budget, sink_pages=s.sink_pages,
                      recent_pages=s.recent_pages, dense_layers=s.dense_layers)


def lora_config(config) -> LoRAConfig:
    c = config.lora
    return LoRAConfig(rank=c.rank, alpha=c.alpha, targets=parse_targets(c.targets))
