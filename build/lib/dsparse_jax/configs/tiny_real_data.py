"""The real-data pipeline on a laptop CPU in minutes: a tiny checkpoint of any family
(launch/tiny_checkpoint.py) on your own data file. Load, chat template, rollout, reward,
update, checkpoint; then export and evaluate as with any run:

  python launch/tiny_checkpoint.py --family=qwen3 --data=jsonl:my_data.jsonl --out=runs/tiny_ckpt
  python launch/train.py --config=configs/tiny_real_data.py --workdir=runs/tiny_qwen3 \\
    --config.model.checkpoint_dir=runs/tiny_ckpt --config.data.source=jsonl:my_data.jsonl
  python launch/export.py --workdir=runs/tiny_qwen3 --out=runs/tiny_qwen3_export
  python launch/evaluate.py --workdir=runs/tiny_qwen3 --samples=4

Short prompts (the question's tail is cut past 192 tokens) and 64 generated tokens, 4
prompts x 4 samples per step, 4 RL steps, f32. The model's weights are random: the
accuracy is about zero; this checks the plumbing, not the method.
"""

from dsparse_jax.config import schema


def get_config():
    c = schema.defaults()
    c.name = "tiny_real_data"
    c.model.checkpoint_dir = ""  # required: --config.model.checkpoint_dir=...
    c.data.source = ""  # required: --config.data.source=jsonl:... | parquet:... | ...
    c.data.max_prompt_tokens = 192
    c.data.max_new_tokens = 64
    c.data.overlong = "truncate"
    c.sft.enabled = False
    c.attention.page_size = 16
    c.sparse.budget = 6
    c.sparse.dense_layers = 1
    c.rl.prompts_per_step = 4
    c.rl.samples_per_prompt = 4
    c.rl.num_steps = 4
    c.rl.minibatches = 1
    c.eval.num_problems = 16
    c.eval.every = 2
    c.eval.mean_at_k = 0
    c.checkpoint.every = 2
    c.log.tensorboard = False
    return c
