"""Gemma 2 2B on MATH (Hendrycks; problem / solution with \\boxed{}): DistillSparse RL
with the paper's settings (page 16, 32-page budget, first 2 layers dense, n = 8, M = 16,
lr 1e-6, clip 0.2 / 0.28, bf16, mesh data=-1; see configs/gemma3_1b_gsm8k.py), 2048
generated tokens.

  CKPT=/data/gemma-2-2b-it      # config.json, *.safetensors, tokenizer files (HF format)
  DATA=/data/math               # train.parquet / test.parquet: {"problem", "solution"}

GPU node:
  python launch/train.py --config=configs/gemma2_2b_math.py --workdir=runs/g2_2b_math \\
    --config.model.checkpoint_dir=$CKPT --config.data.source=parquet:$DATA/train.parquet \\
    --config.data.eval_source=parquet:$DATA/test.parquet --config.attention.impl=triton_gpu

TPU pod slice (run on every host):
  python launch/train.py --config=configs/gemma2_2b_math.py --workdir=gs://BUCKET/g2_2b_math \\
    --config.model.checkpoint_dir=$CKPT --config.data.source=parquet:$DATA/train.parquet \\
    --config.data.eval_source=parquet:$DATA/test.parquet --config.attention.impl=pallas_tpu

DeepScaleR / Polaris-style records ({"problem", "answer"}): --config.data.answer_field=answer.
TFDS math_dataset prepared locally: --config.data.source=tfds:math_dataset/algebra__linear_1d
--config.data.data_dir=/data/tfds --config.data.question_field=question
--config.data.answer_field=answer.
"""

import importlib.util
import os


def _sibling(name):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    spec = importlib.util.spec_from_file_location(name[:-3] + "_cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def get_config():
    g3 = _sibling("gemma3_1b_gsm8k.py")
    c = g3.apply_paper_settings(g3.base_config(), generation_length=2048)
    c.name = "gemma2_2b_math"
    # With checkpoint_dir, shapes come from its config.json; these match it (preset shapes).
    c.model.preset = "gemma2_2b"
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 2304, 26, 9216
    c.model.checkpoint_dir = ""  # required: --config.model.checkpoint_dir=...
    c.data.source = "parquet:/data/math/train.parquet"
    c.data.eval_source = "parquet:/data/math/test.parquet"
    c.data.question_field = "problem"
    c.data.answer_field = "solution"  # the reference is the solution's last \boxed{}
    c.data.max_prompt_tokens = 512
    c.rl.prompts_per_step = 32
    c.rl.num_steps = 500
    c.rl.minibatches = 4
    c.rl.warmup_steps = 1.25  # RL steps: the 5 optimizer steps this config always had
    c.rl.microbatches = 8
    c.eval.every = 25
    c.eval.num_problems = 500  # MATH-500-sized held-out set
    c.eval.mean_at_k = 4
    c.checkpoint.every = 25
    return c
