"""The experiment's variants: a rollout mode (rl/modes.py) plus the settings that make it
a method of the paper's comparison (an off-policy correction, oversampling). One table,
read by harness/experiment.py (which runs them) and harness/results.py (which reports
them). Imports no jax: the experiment's parent process stays light.

Every variant sets the three fields that define it, so a variant means the same thing
whatever the config's defaults are. "2n": rl.samples_generated = 2 * rl.samples_per_prompt.
"""

from __future__ import annotations

from dsparse_jax.rl.modes import MODES


def _variant(mode: str, correction: str = "none", samples_generated: int | str = 0) -> dict:
    return {
        "rl.rollout_mode": mode,
        "rl.is_correction": correction,
        "rl.samples_generated": samples_generated,
    }


# name -> (config overrides, description); in report order.
_TABLE = {
    "dense": (_variant("dense"), MODES["dense"].description),
    "sparse": (_variant("sparse"), MODES["sparse"].description),
    "sparse_train": (_variant("sparse_train"), MODES["sparse_train"].description),
    "sparse_tis": (_variant("sparse", "tis"), "sparse rollout + dense training + TIS"),
    "sparse_mis": (_variant("sparse", "mis"), "sparse rollout + dense training + MIS"),
    "distillsparse": (_variant("distillsparse"), MODES["distillsparse"].description),
    "distillsparse_m2n": (
        _variant("distillsparse", samples_generated="2n"),
        "DistillSparse + oversampling M = 2n, top-n by reward",
    ),
    # The collapse of DistillSparse with its defaults (issue 39 item 4): one cause changed
    # at a time.
    "distillsparse_kl_only": (
        {**_variant("distillsparse"), "distill.loss": "kl_only"},
        "DistillSparse without phi's PPO term (distill.loss=kl_only)",
    ),
    "distillsparse_recomputed": (
        {**_variant("distillsparse"), "distill.teacher": "recomputed"},
        "DistillSparse distilled to theta after its update (distill.teacher=recomputed)",
    ),
    "distillsparse_paper_lambda": (
        {**_variant("distillsparse"), "distill.kl_coef": 1e-3},
        "DistillSparse at the paper's lambda = 1e-3 (distill.kl_coef; the default is 1)",
    ),
    "distillsparse_tis": (
        _variant("distillsparse", "tis"),
        "DistillSparse + TIS on theta's off-policy update",
    ),
    "distillsparse_tis_recomputed": (
        {**_variant("distillsparse", "tis"), "distill.teacher": "recomputed"},
        "DistillSparse + TIS, distilled to theta after its update",
    ),
    # phi's warm start and phi on a subset of rows (issue 39 items 2 and 5), on the
    # corrected method.
    "distillsparse_tis_warm": (
        {**_variant("distillsparse", "tis"), "distill.warmup_steps": 10},
        "DistillSparse + TIS, phi warm-started for 10 steps before RL (distill.warmup_steps)",
    ),
    "distillsparse_tis_m2n": (
        _variant("distillsparse", "tis", samples_generated="2n"),
        "DistillSparse + TIS + oversampling M = 2n, top-n by reward",
    ),
    "distillsparse_tis_rows2": (
        {**_variant("distillsparse", "tis"), "distill.row_stride": 2},
        "DistillSparse + TIS, phi trained on every second row (distill.row_stride=2)",
    ),
    "speculative": (
        {**_variant("speculative"), "rl.draft": "sparse_self"},
        "speculative: exact dense rollouts drafted by the sparse + phi actor (phi distilled "
        "to the verifier)",
    ),
}
VARIANTS = {name: overrides for name, (overrides, _) in _TABLE.items()}
DESCRIPTIONS = {name: description for name, (_, description) in _TABLE.items()}
ORDER = tuple(_TABLE)
MAIN = ("dense", "sparse", "distillsparse", "speculative")  # the main comparison: every seed
ALIASES = {
    "sparse+tis": "sparse_tis",
    "sparse+mis": "sparse_mis",
    "distillsparse+m2n": "distillsparse_m2n",
    "distillsparse+M=2n": "distillsparse_m2n",
    "distillsparse+m=2n": "distillsparse_m2n",
}
