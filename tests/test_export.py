"""Trained weights out: phi as a PEFT LoRA adapter that peft loads onto the exported base
(logits compared with our forward), and the tokenizer as transformers reads it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (requirements-hf.txt)")
transformers = pytest.importorskip("transformers", reason="transformers not installed")

from test_hf_checkpoint import (  # noqa: E402
    LOGIT_ATOL,
    _hf_logits,
    _our_logits,
    _tokens,
    saved,  # noqa: F401 -- the fixture
)

from dsparse_jax.data import math_task  # noqa: E402
from dsparse_jax.model import hf_checkpoint as hfc  # noqa: E402
from dsparse_jax.model.lora import LoRAConfig, init_lora  # noqa: E402


def _random_lora(cfg, lcfg, seed=0):
    lora = init_lora(cfg, lcfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.2, jnp.float32), lora)


def test_lora_to_peft_layout():
    cfg = hfc.model_config_from_hf(
        dict(
            hfc.DEFAULTS["gemma2"],
            model_type="gemma2",
            vocab_size=32,
            hidden_size=8,
            intermediate_size=12,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
        )
    )
    lora = _random_lora(cfg, LoRAConfig(rank=3, alpha=6.0))
    t = hfc.lora_to_peft(lora)
    p = "base_model.model.model.layers.0."
    assert t[p + "self_attn.q_proj.lora_A.weight"].shape == (3, 8)
    assert t[p + "self_attn.q_proj.lora_B.weight"].shape == (8, 3)  # 2 heads x 4
    assert t[p + "self_attn.o_proj.lora_A.weight"].shape == (3, 8)
    assert t[p + "mlp.down_proj.lora_A.weight"].shape == (3, 12)
    # B_hf A_hf is the transposed delta A.B of our [in..., out...] weight.
    a, b = (np.asarray(lora[0]["o"][x]) for x in ("a", "b"))
    delta = np.tensordot(a, b, axes=1).reshape(8, 8)
    got = t[p + "self_attn.o_proj.lora_B.weight"] @ t[p + "self_attn.o_proj.lora_A.weight"]
    np.testing.assert_allclose(got, delta.T, rtol=1e-5, atol=1e-6)


def test_phi_adapter_loads_onto_the_exported_base_with_peft(saved, tmp_path):  # noqa: F811
    peft = pytest.importorskip("peft", reason="peft not installed (requirements-hf.txt)")
    kind, model, path = saved
    cfg, graphdef, params = hfc.load(path)
    lcfg = LoRAConfig(rank=4, alpha=8.0, layers=(0, cfg.num_layers - 1))
    lora = _random_lora(cfg, lcfg)
    tokens = _tokens(cfg.vocab_size, seed=3)
    plain = _our_logits(cfg, graphdef, params, tokens)
    want = _our_logits(cfg, graphdef, params, tokens, lora=lora, lora_scale=lcfg.scale)
    assert np.abs(want - plain).max() > 1e-2  # the adapter changes the model
    out = str(tmp_path / "export")
    hfc.export(out, params, cfg, dtype="float32")
    files = hfc.export_lora_adapter(
        os.path.join(out, "phi_adapter"), lora, rank=lcfg.rank, alpha=lcfg.alpha, base_model=out
    )
    assert files == [hfc.ADAPTER_CONFIG, hfc.ADAPTER_WEIGHTS]
    base = type(model).from_pretrained(out, attn_implementation="eager", torch_dtype=torch.float32)
    assert np.abs(_hf_logits(base.eval(), tokens) - plain).max() <= LOGIT_ATOL
    adapted = peft.PeftModel.from_pretrained(base, os.path.join(out, "phi_adapter")).eval()
    assert np.abs(_hf_logits(adapted, tokens) - want).max() <= LOGIT_ATOL


def test_tokenizer_reloads_in_transformers(tmp_path):
    task = math_task.ChainTaskConfig()
    tok = math_task.build_tokenizer(task, 0)
    tok.save_hf(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), use_fast=False)
    p = math_task.make_problem(task, "eval", 0, 0)
    text = p.prompt + p.solution
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf_tok.encode(text)[0] == tok.bos_id
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id) == (tok.eos_id, tok.pad_id)
