"""The miniature of the paper's regime: long chains on an all-global GQA model.

Model preset `mini` (6 global layers, 2 KV heads x 2 query heads); the first 2 layers
stay dense, so 4 layers x 2 KV heads select their pages at every decode step. Task: the
chain sum over all 52 single-token variables (a-z, A-Z) in name order, each defined with
its sign and value on a shuffled `vars:` line (a line's sign and value are one lookup
into a random prompt page), with a vote line (a soft aggregate of every earlier sign)
every 4 terms: 215-token prompts, 569-token completions (36 pages), a 784-token (49-page)
sequence buffer. Length knob: --config.task.num_terms and num_vars (equal) with
--config.task.name_digits=1 (up to 520 names; 200 terms is 2.4k tokens).

  python launch/train.py --config=configs/mini_longchain.py --workdir=runs/mini_longchain

Every field not set here keeps the default of dsparse_jax/config/schema.py.
"""

import ml_collections

from dsparse_jax.config import schema


def get_config() -> ml_collections.ConfigDict:
    c = schema.defaults()
    c.name = "mini_longchain"
    c.model.preset = "mini"
    # The schema's shape overrides are for the tiny preset: take mini's own.
    c.model.d_model = None
    c.model.num_layers = None
    c.model.mlp_dim = None

    c.task.num_vars = 52
    c.task.letters = 52
    c.task.name_digits = 0
    c.task.num_terms = 52
    c.task.agg_every = 4
    c.task.order = "names"

    c.sparse.dense_layers = 2
    c.sparse.budget = 8

    c.sft.batch_size = 8
    # 250 steps on 8-term problems (lookups into 8 definitions, learned by ~step 250)
    # first: straight on 52 terms the lookups were not learned (docs/miniature.md).
    c.sft.curriculum = "8:32:250"
    c.sft.eval_every = 50
    c.eval.num_problems = 64
    return c
