"""The SFT length curriculum (data/curriculum.py): stages, their problems, validation."""

import pytest

from dsparse_jax.config import schema
from dsparse_jax.config.validate import ConfigError, validate
from dsparse_jax.data import curriculum, dataset_task
from dsparse_jax.data import math_task as mt

PROBLEM = mt.make_problem(mt.ChainTaskConfig(), "train", 0, 0)
NAMES = mt.ChainTaskConfig(num_vars=20, num_terms=20, name_digits=0, letters=52, order="names")


def test_stages_cover_the_steps_and_end_with_the_task():
    plan = curriculum.stages("4:16:30, 8:8:20", NAMES, batch_size=4, max_steps=100)
    assert [(s.task.num_terms, s.task.num_vars, s.batch_size) for s in plan] == [
        (4, 4, 16),
        (8, 8, 8),
        (20, 20, 4),
    ]
    assert [(s.start, s.end) for s in plan] == [(0, 30), (30, 50), (50, 100)]
    assert plan[-1].task == NAMES
    assert [curriculum.at(plan, i) for i in (0, 29, 30, 49, 50, 99)] == [
        plan[i] for i in (0, 0, 1, 1, 2, 2)
    ]
    # order="sum": the variables stay, only the term count changes
    summed = mt.ChainTaskConfig(num_vars=12, num_terms=10, name_digits=0)
    (first, last) = curriculum.stages("3:2:5", summed, 2, 10)
    assert (first.task.num_vars, first.task.num_terms) == (12, 3)
    assert curriculum.stages("", NAMES, 4, 10) == [curriculum.Stage(NAMES, 4, 0, 10)]


def test_each_stage_reads_its_own_problems_from_the_start():
    plan = curriculum.stages("4:3:2", NAMES, batch_size=2, max_steps=6)
    stage, batch = curriculum.train_problems(plan, 1, seed=7)
    assert stage is plan[0]
    assert batch == mt.problems(plan[0].task, "train", 3, 3, 7)  # step 1 of batch 3
    stage, batch = curriculum.train_problems(plan, 3, seed=7)
    assert stage is plan[1]
    assert batch == mt.problems(NAMES, "train", 2, 2, 7)  # the task's step 1, batch 2
    # every stage problem is written in the task's tokens (no unknown ids)
    tok = mt.build_tokenizer(NAMES, 0)
    for p in curriculum.train_problems(plan, 0, 7)[1]:
        assert tok.unk_id not in tok.encode(p.prompt + p.solution)


@pytest.mark.parametrize(
    "spec, msg",
    [
        ("8:32", "num_terms:batch_size:steps"),
        ("8:0:5", "num_terms:batch_size:steps"),
        ("a:1:5", "num_terms:batch_size:steps"),
        ("4:2:100", "leaving none of sft.max_steps=100"),
        ("30:2:5", "num_terms must be in"),  # order=sum: 30 terms > the task's 20 variables
    ],
)
def test_bad_curricula_name_the_field(spec, msg):
    c = schema.defaults()
    c.task.num_vars, c.task.num_terms = 20, 8
    c.sft.max_steps = 100
    c.sft.curriculum = spec
    with pytest.raises(ConfigError, match=rf"^config\.sft\.curriculum: .*{msg}"):
        validate(c)


def test_a_dataset_has_no_curriculum():
    c = schema.defaults()
    c.data.source = "jsonl:/nonexistent.jsonl"
    c.sft.curriculum = "4:2:5"
    with pytest.raises(ConfigError, match=r"^config\.sft\.curriculum: a curriculum needs"):
        validate(c)
    with pytest.raises(ValueError, match="synthetic chain task"):
        curriculum.stages("4:2:5", dataset_task.DatasetTask([PROBLEM], [PROBLEM], 64, 32), 2, 10)
