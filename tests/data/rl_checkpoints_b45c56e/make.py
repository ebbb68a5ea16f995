"""Writes the RL checkpoints in this folder with the code of commit b45c56e (before issue
44's TrainState table), so tests/test_checkpoint_compat.py can prove that a checkpoint of
that layout still resumes. Not run by the tests; to rewrite the fixtures:

    git worktree add --detach /tmp/wt_old b45c56e
    cd /tmp/wt_old && PYTHONPATH=$PWD python <this checkout>/tests/data/rl_checkpoints_b45c56e/make.py

Each case is a run directory (config.json, checkpoints/2) of a tiny model. Every leaf of a
trainable holds a value that names it: BASE[its key] + 0.001 * (its index among the leaves
of that key), integer leaves (Adam counts) 3; the test recomputes these values from the
restored structures, so a key read into the wrong place or a structure mismatch fails.
"""

import json
import os
import shutil

import jax
import numpy as np

from dsparse_jax.config.validate import load_config, validate
from dsparse_jax.reliability import checkpoints
from dsparse_jax.train import context, rl_loop

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
STEP = 2
BASE = {  # checkpoint key -> the value its first float leaf holds
    "params": 1.0,
    "opt_state": 1.5,
    "lora": 2.0,
    "lora_opt_state": 2.5,
    "quality_head": 3.0,
    "quality_head_opt_state": 3.5,
    "draft_head": 4.0,
    "draft_head_opt_state": 4.5,
}
CASES = {  # the optional entries: phi + the quality head; the draft head; the history bank
    "distillsparse_prune": {
        "rl.rollout_mode": "distillsparse",
        "rl.prune.enabled": True,
        "rl.prune.generated": 4,
        "rl.prune.positions": "3",
        "rl.prune.head_hidden": 8,
        "distill.warmup_steps": 1,
    },
    "speculative_draft_head": {"rl.rollout_mode": "speculative", "rl.draft": "draft_head"},
    "speculative_history": {"rl.rollout_mode": "speculative", "rl.draft": "history"},
}


def tiny_config(overrides: dict):
    """tests/test_modes.base_config of b45c56e, with `overrides` (dotted keys)."""
    c = load_config(os.path.join(ROOT, "configs", "gemma_math.py"))
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 2, 64
    c.task.num_vars, c.task.num_terms = 4, 2
    c.attention.page_size = 8
    c.sparse.budget, c.sparse.dense_layers = 3, 1
    c.rl.prompts_per_step, c.rl.samples_per_prompt, c.rl.minibatches = 2, 2, 2
    c.rl.num_steps = 2
    c.rl.warmup_steps = c.lora.warmup_steps = 0
    c.lora.rank = 4
    c.eval.num_problems = 2
    for key, value in overrides.items():
        *sections, field = key.split(".")
        section = c
        for part in sections:
            section = section[part]
        section[field] = value
    validate(c)
    return c


def marked(tree, base: float):
    """`tree` with float leaf i = base + 0.001 * i and integer leaves 3."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [
        np.full(np.shape(x), base + 0.001 * i, np.asarray(x).dtype)
        if np.issubdtype(np.asarray(x).dtype, np.floating)
        else np.full(np.shape(x), 3, np.asarray(x).dtype)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, out)


def main():
    for name, overrides in CASES.items():
        config = tiny_config(overrides)
        ctx = context.build(config)
        setup = rl_loop.make_setup(ctx)
        st = rl_loop.init_state(ctx, setup, ctx.init_params)
        for field, key in (
            ("params", "params"),
            ("opt_state", "opt_state"),
            ("lora", "lora"),
            ("lora_opt_state", "lora_opt_state"),
            ("head", "quality_head"),
            ("head_opt_state", "quality_head_opt_state"),
            ("draft_head", "draft_head"),
            ("draft_head_opt_state", "draft_head_opt_state"),
        ):
            if getattr(st, field) is not None:
                setattr(st, field, marked(getattr(st, field), BASE[key]))
        bank = setup.history
        if bank is not None:  # two prompts' rows, as after two steps
            state = bank.state()
            state["tokens"] = (np.arange(state["tokens"].size) % 7).reshape(state["tokens"].shape)
            state["lengths"] = np.full(state["lengths"].shape, 5, np.int32)
            state["keys"][:2], state["owned"][:2], state["clock"] = (11, 12), True, np.int64(2)
            bank.load(state)
        out = os.path.join(HERE, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        ckpt = checkpoints.Checkpointer(out, "checkpoints")
        position = rl_loop.RL_DATA_OFFSET + STEP * config.rl.prompts_per_step
        warmed = config.distill.warmup_steps
        tree = rl_loop._saveable(st, jax.random.key(5), STEP, position, 1, bank, warmed)
        ckpt.save(STEP, tree, force=True)
        ckpt.close()
        keys = sorted(k for k in tree if k != "integrity")
        print(name, json.dumps(keys))
        ctx.rewarder.close()


if __name__ == "__main__":
    main()
