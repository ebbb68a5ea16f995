"""The config schema: every field a run reads, with its default.

`defaults()` declares every section and key; configs/*.py start from it and override
values, and validation (config/validate.py) rejects any key that is not declared here, so
an installed copy of the library checks a config exactly as a checkout does. The
defaults are the default main job (configs/gemma_math.py): a tiny Gemma-shaped model on
the embedded chain-sum task, DistillSparse RL, CPU, no downloads.
"""

import ml_collections

# ModelConfig's fields as config fields (type of a command-line value). vocab_size: None
# takes the tokenizer's size.
MODEL_FIELDS = {
    "vocab_size": int,
    "d_model": int,
    "num_layers": int,
    "num_heads": int,
    "num_kv_heads": int,
    "head_dim": int,
    "mlp_dim": int,
    "layer_pattern": str,
    "sliding_window": int,
    "rope_base_global": float,
    "rope_base_local": float,
    "rope_scale_global": float,
    "query_scale": float,
    "attn_softcap": float,
    "final_softcap": float,
    "qk_norm": bool,
    "norm_eps": float,
    "family": str,
    "tie_embeddings": bool,
    "rope_type": str,
    "rope_low_freq_factor": float,
    "rope_high_freq_factor": float,
    "rope_original_max_len": int,
    "param_dtype": str,
    "dtype": str,
}


def model_overrides(model_section) -> dict:
    """ModelConfig keyword arguments from config.model: the fields that are set (not None),
    layer_pattern as a tuple."""
    out = {k: model_section[k] for k in MODEL_FIELDS if model_section.get(k) is not None}
    if "layer_pattern" in out:
        out["layer_pattern"] = tuple(p.strip() for p in out["layer_pattern"].split(","))
    return out


def defaults() -> ml_collections.ConfigDict:
    """A fresh ConfigDict with every field and its default (the default main job)."""
    c = ml_collections.ConfigDict()
    c.name = "gemma_math"
    c.seed = 0

    # Model: a preset, then any field of ModelConfig (model/config.py); a field left at None
    # keeps the preset's value (config.json records the resolved values). layer_pattern is
    # a comma list of global | local, repeated to num_layers (e.g. "local,global").
    c.model = ml_collections.ConfigDict()
    # tiny | mini | gemma2_2b | gemma3_1b | gemma3_4b | qwen2_5_1_5b | qwen3_1_7b | qwen3_4b
    # | llama3_2_1b | llama3_1_8b (model/config.py; the families: model/families.py)
    c.model.preset = "tiny"
    for name, kind in MODEL_FIELDS.items():
        c.model[name] = ml_collections.FieldReference(None, field_type=kind)
    c.model.d_model = 128
    c.model.num_layers = 4
    c.model.mlp_dim = 512
    c.model.param_dtype = "float32"
    c.model.dtype = "float32"
    # A Hugging Face directory of any family (config.json + *.safetensors): shapes and
    # initial weights come from it (preset and shape fields ignored). "" -> random init.
    c.model.checkpoint_dir = ""

    # Task data (docs/real_models.md): synthetic:chain (the embedded task, configured in
    # c.task) | jsonl:<path> | parquet:<path> (verl layout too) | hf_disk:<dir> (save_to_disk)
    # | tfds:<name> (with data_dir).
    c.data = ml_collections.ConfigDict()
    c.data.source = "synthetic:chain"
    c.data.eval_source = ""  # real data; "" -> hold out eval.num_problems from source
    c.data.question_field = ""  # "" -> question | problem | prompt | query
    c.data.answer_field = ""  # "" -> answer | final_answer | ground_truth | solution
    c.data.solution_field = ""
    c.data.instruction = (
        "Solve the following math problem step by step. Put your final answer within \\boxed{}."
    )
    c.data.max_prompt_tokens = 512  # static prompt width (BOS included), real data
    c.data.max_new_tokens = 1024  # generation length, real data
    c.data.overlong = "drop"  # prompts over max_prompt_tokens: drop | truncate
    c.data.max_bad_fraction = 0.01  # more unusable records than this: error
    c.data.data_dir = ""  # tfds: local data_dir (nothing is downloaded)
    c.data.split = "train"  # tfds splits
    c.data.eval_split = "test"

    # Real data: the checkpoint's tokenizer ("" -> <model.checkpoint_dir>): a directory
    # holding tokenizer.json (its chat template, generation_config.json's stop tokens; needs
    # requirements-hf.txt), else tokenizer.model (Gemma's SentencePiece, Gemma turns), or
    # one of those files (data/tokenizers/load.py). The synthetic task always uses its own
    # char tokenizer.
    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.path = ""
    c.tokenizer.chat = True  # prompts in the chat format; False: plain text (a base model)

    c.task = ml_collections.ConfigDict()
    c.task.num_vars = 8  # variables defined per problem (the lookups' targets)
    c.task.num_terms = 8  # solution length knob: 8 tokens per term (single-letter names)
    c.task.name_digits = 0  # variable names: a letter + this many digits (0: a-z only)
    c.task.letters = 26  # name letters: 26 (a-z) | 52 (a-z, A-Z: single-token names)
    c.task.repeat_terms = False  # terms drawn with replacement (num_terms > num_vars allowed)
    c.task.agg_every = 0  # a vote line (soft aggregate of the signs) every N terms; 0: none
    c.task.order = "sum"  # sum (a `sum:` line orders the terms) | names (every var, in name order)
    c.task.train_size = 0  # 0: endless training stream; N: N problems, repeated in epochs
    c.task.format_reward = 0.0  # reward for a well-formed but wrong answer

    # Rewards (data/rewards/: graders, rewarder, user; README "Bring your own reward and
    # data"). fn: "" (the built-in grader) or a comma list of path/to/file.py[:name] |
    # package.module:name | builtin, with verl's compute_score(data_source, solution_str,
    # ground_truth, extra_info) or tunix's fn(prompts, completions, **kwargs) signature.
    c.reward = ml_collections.ConfigDict()
    c.reward.fn = ""
    c.reward.weights = ""  # comma list, one per reward.fn ("" -> 1 each); the reward is the sum
    # built-in grader of real data: auto (in-house) | math | math_verify (the package's own
    # extraction) | math_verify_extracted (ours: the last \boxed, ####; its equivalence)
    c.reward.grader = "auto"
    c.reward.timeout_s = 10.0  # per call of a user function; past it the row scores 0
    # more failed rows than this fraction of the last error_window rows (once at least
    # error_min_rows were scored): the run stops
    c.reward.max_error_fraction = 0.1
    c.reward.error_window = 512
    c.reward.error_min_rows = 64

    c.attention = ml_collections.ConfigDict()
    c.attention.impl = "xla"  # auto | xla | pallas_tpu | triton_gpu
    c.attention.page_size = 16

    c.sft = ml_collections.ConfigDict()
    c.sft.enabled = True  # warm start on the synthetic task; False for real data + checkpoint
    c.sft.max_steps = 1500
    c.sft.batch_size = 32
    # Length curriculum (data/curriculum.py): stages "num_terms:batch_size:steps,..." on
    # shorter chain problems before the task itself; "" = none.
    c.sft.curriculum = ""
    c.sft.learning_rate = 3e-3
    c.sft.warmup_steps = 50
    c.sft.weight_decay = 0.0
    c.sft.max_grad_norm = 1.0
    c.sft.eval_every = 10  # held-out greedy evaluation (and the stop rule) every N steps
    c.sft.target_accuracy = 0.4  # stop once held-out greedy accuracy >= this
    c.sft.max_accuracy = 0.7  # a checkpoint above this leaves too little room for RL: warn
    c.sft.max_consecutive_skips = 5  # halt after this many non-finite steps in a row (0: off)

    c.rl = ml_collections.ConfigDict()
    c.rl.num_steps = 100
    c.rl.prompts_per_step = 8
    c.rl.samples_per_prompt = 8  # n (group size for advantages)
    c.rl.temperature = 1.0
    # Truncated sampling: the rollout draws from the top_k (0: off) then top_p (1.0: off)
    # truncation of softmax(logits / temperature), and the trainer's log-probs are those of
    # the same truncated distribution (docs/objectives.md). Not with modes that train phi.
    c.rl.top_k = 0
    c.rl.top_p = 1.0
    # Rollout cache: 0 = one buffer of prompt + completion budget; N > 0 = start at prompt
    # + N tokens and double (a decode step then costs O(position); one compile per buffer,
    # peak 1.5x the cache at the last growth; sampling/sampler.py buffer_schedule).
    c.rl.grow_buffer_from = 0
    # The rollout in sequential chunks of this many rows (whole prompts' M samples each;
    # the outputs are the same): 0 = automatic, the fewest chunks whose rollout fits the
    # device's memory (train/memory_plan.py, docs/scaling.md "Device memory").
    c.rl.rollout_chunk_rows = 0
    c.rl.learning_rate = 1e-4  # theta's peak learning rate (Adam)
    # theta's schedule, in RL steps (each rl.minibatches optimizer steps; train/rl_state.py
    # optimizer_steps_per_rl_step): a linear warmup (a fraction allowed, rounded to whole
    # optimizer steps), then constant or a cosine decay to 10% at rl.num_steps.
    c.rl.warmup_steps = 2.5
    c.rl.schedule = "constant"  # constant | cosine
    c.rl.weight_decay = 0.0
    c.rl.max_grad_norm = 1.0
    c.rl.minibatches = 2  # optimizer steps per rollout batch
    c.rl.microbatches = 1  # gradient accumulation inside a minibatch (exact)
    # theta's objective (docs/objectives.md; the tables rl/objectives.py): the advantage
    # estimator grpo | dr_grpo | rloo, and the policy loss ppo_clip | gspo | cispo, each with
    # its own clip range; phi's L_PPO (distillsparse) is PPO-clip with rl.clip_*.
    c.rl.advantage = "grpo"
    c.rl.policy_loss = "ppo_clip"
    c.rl.clip_low = 0.2  # PPO's token-ratio clip [1 - low, 1 + high] (high > low: clip-higher)
    c.rl.clip_high = 0.28
    c.rl.dual_clip = 0.0  # 0: off; else c > 1 (dual-clip PPO; ppo_clip only)
    c.rl.gspo_clip_low = 3e-4  # GSPO's sequence-ratio clip (the paper's)
    c.rl.gspo_clip_high = 4e-4
    c.rl.cispo_clip_low = 1.0  # CISPO's importance-weight clip (1.0: no lower bound, the paper's)
    c.rl.cispo_clip_high = 4.0
    # token-mean | seq-mean-token-mean | auto (the policy loss's paper's: seq-mean-token-mean
    # for gspo, token-mean otherwise)
    c.rl.loss_agg = "auto"
    c.rl.scale_adv_by_std = True  # False with rl.advantage=grpo: Dr. GRPO (older spelling)
    c.rl.kl_coef = 0.0  # KL to the frozen SFT reference (k3); 0: off
    c.rl.kl_kind = "k3"
    # Rollout mode (METHOD.md): dense | sparse (sparse rollout, dense training) |
    # sparse_train (the trainer is sparse too, on the rollout's recorded pages) |
    # distillsparse (sparse + LoRA actor, dense theta update, then LoRA distillation).
    c.rl.rollout_mode = "distillsparse"
    c.rl.samples_generated = 0  # M >= samples_per_prompt rollouts per prompt; 0: M = n
    # rollout_mode=speculative (sampling/speculative.py): the drafter and its settings.
    # sparse_self (sparse + phi actor) | history (earlier rollouts) | draft_head (learned)
    c.rl.draft = "sparse_self"
    c.rl.draft_tokens = 4  # k: tokens drafted per dense verify
    c.rl.history_ngram = 4  # history: the longest suffix matched
    c.rl.history_prompts = 1024  # history: prompts the bank holds (least recently used evicted)
    c.rl.history_per_prompt = 8  # history: newest rollouts kept per prompt
    # history: latest (the tokens after the latest longest match, deterministic) | counts
    # (a chain drawn from the continuations' counts, accepted with min(1, p/q)) | tree (the
    # likeliest continuations as a token tree, verified in one forward); docs/speculative.md
    c.rl.history_draft = "latest"
    c.rl.tree_width = 2  # history_draft=tree: nodes per depth (draft_tokens * tree_width)
    # draft=draft_head: the learned draft head (model/draft_head.py), trained online after
    # each theta update on the step's rollouts (train/draft_head.py), with its own Adam and
    # its own gradient-norm clip group.
    c.rl.draft_head = ml_collections.ConfigDict()
    c.rl.draft_head.layers = ""  # policy layers it reads, comma list; "": 1, L // 2, L - 1
    c.rl.draft_head.learning_rate = 1e-3
    c.rl.draft_head.max_grad_norm = 1.0  # its own clip group
    c.rl.draft_head.loss_weight = 1.0
    c.rl.draft_head.steps = 4  # Adam steps per minibatch of each RL step's kept rows
    c.rl.draft_head.warmup_steps = 100  # before RL step 1: steps on SFT solutions; 0: none
    # EAGLE-3's training-time test: also train draft steps 2..unroll on the head's own
    # unroll (its own output as the feature); 0 or 1: teacher-forced only; capped at
    # rl.draft_tokens (the steps a draft has); docs/speculative.md.
    c.rl.draft_head.unroll = 4
    c.rl.selection = "reward"  # top-n of the M by reward | acceptance (rate vs dense)
    # DAPO's dynamic sampling (docs/objectives.md, "Which rows train"): groups whose kept
    # rewards are all equal are dropped, and the step draws rl.prompts_per_step further
    # prompts at a time until it holds rl.prompts_per_step informative groups, or has drawn
    # max_draws times (then the batch is filled with dropped groups whose loss is masked).
    c.rl.dynamic_sampling = ml_collections.ConfigDict()
    c.rl.dynamic_sampling.enabled = False
    c.rl.dynamic_sampling.max_draws = 4
    # DAPO's overlong reward shaping and filtering, against the completion budget L_max:
    # buffer = L_cache > 0 adds -penalty * (|y| - (L_max - L_cache)) / L_cache to the reward
    # of a completion longer than L_max - L_cache (-penalty at L_max); filter masks the loss
    # of truncated completions (no EOS).
    c.rl.overlong = ml_collections.ConfigDict()
    c.rl.overlong.buffer = 0
    c.rl.overlong.penalty = 1.0
    c.rl.overlong.filter = False
    c.rl.acceptance_C = 1.0  # Bernoulli test probability min(1, p_dense / (C p_sparse))
    # auto | none | tis | mis (vs the rollout log-probs), any mode; auto: the mode's
    # (rl/modes.py: tis for distillsparse, whose uncorrected update collapsed; else none)
    c.rl.is_correction = "auto"
    c.rl.tis_cap = 2.0  # TIS weight min(pi_old / mu, C)
    c.rl.mis_lo = 0.5  # MIS keeps tokens with ratio in [lo, hi]
    c.rl.mis_hi = 2.0
    c.rl.mis_level = "token"  # token | sequence (geometric mean ratio)
    # Halt after this many consecutive steps whose update was skipped for a non-finite
    # loss or gradient (0: never halt). docs/reliability.md.
    c.rl.max_consecutive_skips = 5
    # Online rollout pruning with a learned quality head (ARRoL-style; docs/pruning.md):
    # generate `generated` rows per prompt, score the live ones at each checkpoint, keep
    # samples_per_prompt (n) balanced around rho; the head trains online on completed rows.
    c.rl.prune = ml_collections.ConfigDict()
    c.rl.prune.enabled = False
    c.rl.prune.generated = 0  # M' > n rows generated per prompt; 0: 2n
    c.rl.prune.positions = "24"  # comma list of checkpoints (completion tokens), increasing
    c.rl.prune.rho = 0.5  # target fraction of predicted successes among the kept n
    c.rl.prune.label_rows = 1  # per prompt and checkpoint: would-be-pruned rows run on (labels)
    c.rl.prune.layer = -1  # the layer whose output the head reads (negative: from the end)
    c.rl.prune.head_hidden = 64  # MLP width; 0: a linear probe
    c.rl.prune.head_learning_rate = 1e-3
    c.rl.prune.head_steps = 8  # Adam steps on each RL step's completed rows

    # Block-sparse decode of the rollout policy (not dense mode). Page size: attention.
    c.sparse = ml_collections.ConfigDict()
    c.sparse.policy = "centroid"  # centroid (page key means) | quest | streaming
    c.sparse.budget = 6  # KV pages read per step (sink and recent included)
    c.sparse.dense_layers = 2  # the first layers stay dense (global layers past are sparse)
    c.sparse.sink_pages = 1
    c.sparse.recent_pages = 2
    # Two-level selection (long contexts): 0 scores every page; G >= 2 scores groups of G
    # pages first and picks the budget among the pages of the candidate_groups best groups.
    c.sparse.group_pages = 0
    c.sparse.candidate_groups = 16

    # LoRA delta tree phi of the sparse actor (distillsparse only).
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 8
    c.lora.alpha = 16.0
    c.lora.targets = "all"  # comma list of q,k,v,o,gate,up,down (or all | attn | mlp)
    c.lora.learning_rate = 1e-3
    # phi's own schedule, in RL steps like rl.warmup_steps (phi takes rl.minibatches
    # optimizer steps per RL step): warmup, then constant or cosine to 10% at rl.num_steps.
    c.lora.warmup_steps = 0.0
    c.lora.weight_decay = 0.0
    c.lora.max_grad_norm = 1.0
    c.lora.schedule = "constant"  # constant | cosine

    # The phi update (docs/distillsparse.md, docs/speculative.md): L = [L_PPO(sparse logp;
    # old = rollout logp)] + kl_coef * D(actor, dense teacher). "auto" takes the mode's
    # entry of rl/modes.PHI_AUTO: distillsparse ppo+kl, cached, k3 (the paper's);
    # speculative kl_only, recomputed (the next verifier), tv (the rejection rate).
    c.distill = ml_collections.ConfigDict()
    c.distill.teacher = "auto"  # cached (dense logp before theta's update) | recomputed
    c.distill.loss = "auto"  # ppo+kl | kl_only (speculative: kl_only only)
    # k1 | k2 | k3 (sampled; which divergence's gradient each follows depends on whose
    # samples the rollout holds: rl/modes.DISTILL_KL) | exact_reverse | exact_forward | tv
    c.distill.kl = "auto"
    c.distill.kl_coef = 1.0  # lambda (the paper's: 1e-3)
    # phi trains on every row_stride-th kept row (1: all): P * n / row_stride rows, split
    # into rl.minibatches x rl.microbatches like theta's batch.
    c.distill.row_stride = 1
    # phi's warm start (modes that train phi): before RL step 1, this many steps of phi
    # distilled to the warm-start dense policy on the actor's own rollouts of training
    # prompts disjoint from RL's (theta frozen; the mode's divergence, no PPO term); 0: none.
    c.distill.warmup_steps = 0

    c.metrics = ml_collections.ConfigDict()
    c.metrics.position_bin = 256  # completion-position bin width of mismatch metrics
    # With M > n (rl.samples_generated), the mismatch figures of the kept rows are biased
    # (selection keeps rows near the dense policy): every this many RL steps they are also
    # computed on all M rows, logged as all_* (the recompute then runs on M rows instead
    # of n); 0: never. With M = n the all_* figures are the kept rows' at no cost.
    c.metrics.all_rows_every = 1
    # The actor's teacher-forced twin where only the mismatch figures read it (rollout_mode
    # sparse: rl/modes.RolloutMode.twin_metrics_only) is recomputed every this many RL
    # steps (0: never); the other steps' records lack its figures (kl_exact, alpha_*, ...).
    # Modes whose trainer or phi needs the twin compute it every step, whatever this says.
    c.metrics.twin_every = 1

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 10  # RL steps between held-out evaluations
    c.eval.num_problems = 128
    c.eval.mean_at_k = 4  # samples per problem for mean@k (temperature rl.temperature)
    c.eval.sparse = True  # sparse modes: also greedy accuracy of the rollout policy

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 10
    c.checkpoint.keep = 3

    # Device mesh (docs/scaling.md): data x fsdp x tensor devices, data = -1 takes all the
    # devices left; 1 x 1 x 1 is one device, unsharded (the CPU default).
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    # Memory of one device (GB) the memory plan fits the step into; 0 = the device's own
    # (its allocator's bytes_limit; CPU: the host's RAM over its local devices).
    c.mesh.device_memory_gb = 0.0
    # Multi-host (jax.distributed.initialize): auto (when a coordinator is given, or on a
    # multi-host TPU slice, which discovers its peers) | on | off. GPU nodes: coordinator
    # host:port, process count and id here or in JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES, JAX_PROCESS_ID.
    c.mesh.distributed = "auto"
    c.mesh.coordinator_address = ""
    c.mesh.num_processes = 0
    c.mesh.process_id = -1

    c.log = ml_collections.ConfigDict()
    c.log.tensorboard = True
    c.log.every = 10  # console: not a terminal -> one progress line every N steps
    c.log.num_samples = 4  # prompts of each RL step written to <workdir>/samples.jsonl
    # Weights & Biases (optional package, not in requirements.txt): WANDB_MODE=offline
    # writes the run under <workdir>/wandb without a network.
    c.log.wandb = False
    c.log.wandb_project = "dsparse_jax"
    return c


# Values renamed since a config or a run's config.json could hold them: field -> {old: new}.
RENAMED_VALUES = {"sparse.policy": {"distillsparse": "centroid"}}


def apply_renames(c: ml_collections.ConfigDict) -> list[str]:
    """Replaces renamed values with their new names; returns one note per replacement."""
    notes = []
    for field, renames in RENAMED_VALUES.items():
        section, name = field.rsplit(".", 1)
        holder = c
        for part in section.split("."):
            holder = holder.get(part) if holder is not None else None
        if holder is not None and holder.get(name) in renames:
            old = holder[name]
            holder[name] = renames[old]
            notes.append(f"note: {field}={old!r} is now called {renames[old]!r} (read as that)")
    return notes


def from_dict(values: dict) -> ml_collections.ConfigDict:
    """defaults() with the values of a dict (a run's config.json) set over them; keys the
    schema does not declare are kept too, so validation names them. Renamed values are read
    under their new names (RENAMED_VALUES), silently: the run directory is not the user's
    to edit."""
    c = defaults()
    _merge(c, values)
    apply_renames(c)
    return c


def _merge(c: ml_collections.ConfigDict, values: dict) -> None:
    for k, v in values.items():
        if isinstance(v, dict) and k in c and hasattr(c[k], "keys"):
            _merge(c[k], v)
        elif k in c and v is not None and c.get_type(k) is float and isinstance(v, int):
            c[k] = float(v)
        else:
            c[k] = v
