"""Gemma 3 1B (instruction-tuned) on GSM8K: DistillSparse RL with the paper's settings.

Page 16, a 32-page KV budget per decode step (sink 1 + recent 2 included), the first 2
layers dense, n = 8 kept of M = 16 rollouts per prompt, lr 1e-6, clip 0.2 / 0.28, bf16.
No SFT warm start: RL starts from the checkpoint. Data and weights are local files
(nothing is downloaded at run time; docs/real_models.md says how to prepare them):

  CKPT=/data/gemma-3-1b-it      # config.json, *.safetensors, tokenizer files (HF format)
  DATA=/data/gsm8k              # train.jsonl / test.jsonl: {"question", "answer": "... #### N"}

GPU node (one H100/H200):
  python launch/train.py --config=configs/gemma3_1b_gsm8k.py --workdir=runs/g3_1b_gsm8k \\
    --config.model.checkpoint_dir=$CKPT --config.data.source=jsonl:$DATA/train.jsonl \\
    --config.data.eval_source=jsonl:$DATA/test.jsonl --config.attention.impl=triton_gpu

TPU pod slice (run on every host):
  python launch/train.py --config=configs/gemma3_1b_gsm8k.py --workdir=gs://BUCKET/g3_1b_gsm8k \\
    --config.model.checkpoint_dir=$CKPT --config.data.source=jsonl:$DATA/train.jsonl \\
    --config.data.eval_source=jsonl:$DATA/test.jsonl --config.attention.impl=pallas_tpu

Mesh (c.mesh, from dsparse_jax/config/schema.py): data = -1 spreads the batch over every device;
where a replica does not fit one chip (e.g. 16 GiB TPU chips), shard it with
--config.mesh.data=-1 --config.mesh.fsdp=4 (batch sizes must divide the data axis).
"""

from dsparse_jax.config import schema


def base_config():
    """The schema's defaults (dsparse_jax/config/schema.py): every real-model config
    starts from them."""
    return schema.defaults()


def apply_paper_settings(c, generation_length: int):
    """Settings shared by the real-model configs (paper, page 16)."""
    m = c.model
    m.param_dtype = "bfloat16"
    m.dtype = "bfloat16"
    c.attention.impl = "auto"
    c.attention.page_size = 16
    c.sparse.policy = "centroid"
    c.sparse.budget = 32
    c.sparse.dense_layers = 2
    c.sparse.sink_pages = 1
    c.sparse.recent_pages = 2
    c.sft.enabled = False
    c.rl.rollout_mode = "distillsparse"
    c.rl.samples_per_prompt = 8  # n
    c.rl.samples_generated = 16  # M
    c.rl.learning_rate = 1e-6
    c.rl.warmup_steps = 0
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.28
    c.rl.temperature = 1.0
    c.rl.kl_coef = 0.0
    c.lora.learning_rate = 1e-5
    c.distill.loss = "ppo+kl"
    c.distill.kl_coef = 1e-3  # the reference code's lambda (the tiny main job uses 1.0)
    c.data.max_new_tokens = generation_length
    if "mesh" in c:
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.tokenizer.chat = True
    return c


def get_config():
    c = apply_paper_settings(base_config(), generation_length=1024)
    c.name = "gemma3_1b_gsm8k"
    # With checkpoint_dir, shapes come from its config.json; these match it (preset shapes).
    c.model.preset = "gemma3_1b"
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 1152, 26, 6912
    c.model.checkpoint_dir = ""  # required: --config.model.checkpoint_dir=...
    c.data.source = "jsonl:/data/gsm8k/train.jsonl"
    c.data.eval_source = "jsonl:/data/gsm8k/test.jsonl"
    c.data.question_field = "question"
    c.data.answer_field = "answer"  # "... #### N": the reference is N
    c.data.max_prompt_tokens = 320
    c.rl.prompts_per_step = 32
    c.rl.num_steps = 500
    c.rl.minibatches = 4
    c.rl.microbatches = 4
    c.eval.every = 25
    c.eval.num_problems = 1319  # the whole GSM8K test split
    c.eval.mean_at_k = 4
    c.checkpoint.every = 25
    return c
