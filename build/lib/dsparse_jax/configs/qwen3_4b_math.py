"""The paper's setting: Qwen3-4B-Base, DistillSparse RL on DeepScaleR-style math in verl's
parquet layout, 16K-token generations.

Qwen3-4B-Base (36 layers, 32 query and 8 KV heads of 128, tied head); page 16, a 32-page
KV budget per decode step (sink 1 + recent 2 included; the reference's 16K budget), the
first 2 layers dense, n = 8 kept of M = 16 rollouts per prompt, 32 prompts per step,
lr 1e-6, clip 0.2 / 0.28, no KL to the reference, bf16. No SFT warm start. Weights,
tokenizer (tokenizer.json + its chat template) and data are local files; nothing is
downloaded at run time (docs/real_models.md):

  CKPT=/data/Qwen3-4B-Base     # config.json, *.safetensors, tokenizer.json, tokenizer_config.json
  DATA=/data/deepscaler        # verl parquet: prompt (chat list), reward_model.ground_truth

The whole step does not fit one device at once: the device memory plan (docs/scaling.md)
says per device what the weights, optimizer, phi, one rollout chunk's KV cache and a
microbatch's activations take, and the rollout runs in chunks of rows that fit.

GPU node (one H100 or two H200):
  python launch/train.py --config=configs/qwen3_4b_math.py --workdir=runs/qwen3_4b_math \\
    --config.model.checkpoint_dir=$CKPT --config.data.source=parquet:$DATA/train.parquet \\
    --config.data.eval_source=parquet:$DATA/math500.parquet --config.attention.impl=triton_gpu

TPU pod slice (v5p-8; run on every host):
  python launch/train.py --config=configs/qwen3_4b_math.py --workdir=gs://BUCKET/qwen3_4b_math \\
    --config.model.checkpoint_dir=$CKPT --config.data.source=parquet:$DATA/train.parquet \\
    --config.data.eval_source=parquet:$DATA/math500.parquet --config.attention.impl=pallas_tpu \\
    --config.mesh.data=-1 --config.mesh.fsdp=4
"""

import importlib.util
import os

GENERATION = 16384


def _sibling(name):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    spec = importlib.util.spec_from_file_location(name[:-3] + "_cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def get_config():
    g3 = _sibling("gemma3_1b_gsm8k.py")
    c = g3.apply_paper_settings(g3.base_config(), generation_length=GENERATION)
    c.name = "qwen3_4b_math"
    # With checkpoint_dir, shapes come from its config.json; these match it (preset shapes).
    c.model.preset = "qwen3_4b"
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 2560, 36, 9728
    c.model.checkpoint_dir = ""  # required: --config.model.checkpoint_dir=...
    c.sparse.budget = 32  # pages of 16: 512 KV tokens per step (paper: 24-32 for 12K-16K)
    c.data.source = "parquet:/data/deepscaler/train.parquet"
    c.data.eval_source = "parquet:/data/deepscaler/math500.parquet"
    c.data.max_prompt_tokens = 1024  # verl's max_prompt_length for DeepScaleR
    c.rl.prompts_per_step = 32
    c.rl.num_steps = 500
    c.rl.minibatches = 4  # 64 of the 256 kept rows per optimizer step
    c.rl.microbatches = 16
    c.eval.every = 25
    c.eval.num_problems = 500  # MATH-500
    c.eval.mean_at_k = 4
    c.checkpoint.every = 25
    return c
