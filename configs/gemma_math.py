"""Default main job: tiny Gemma-shaped model on the embedded chain-sum task.

SFT warm start (cached in the workdir) until held-out greedy accuracy reaches
sft.target_accuracy, then GRPO. Runs on a 2-core CPU with no downloads:

  python launch/train.py --config=configs/gemma_math.py --workdir=runs/gemma_math

Any field can be overridden, e.g. --config.rl.learning_rate=1e-4 --config.rl.num_steps=20.
RL runs in rl.rollout_mode = distillsparse (sparse + LoRA actor, dense training with TIS
on the actor's tokens, LoRA distillation; docs/distillsparse.md); the other modes are one override away:
--config.rl.rollout_mode=dense | sparse | sparse_train.

Every field and its default is declared in dsparse_jax/config/schema.py; this config is
those defaults.
"""

import ml_collections

from dsparse_jax.config import schema


def get_config() -> ml_collections.ConfigDict:
    return schema.defaults()
