"""MLA (jaxinfer.models.mla) against transformers' DeepseekV3Attention, through the paged cache.

Goldens: scripts/make_goldens.py --only mla (tests/data/golden/mla_*.npz): one
attention layer with random weights in HF layout, yarn rope (mscale_all_dim
0.707 as DeepSeek-V2, so both the cos/sin attention factor and the softmax
scale differ from 1), a 12-token prefill then 3 single-token decodes.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import golden
from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.errors import UnsupportedModelError
from jaxinfer.models import mla
from jaxinfer.models.layers import rms_norm, rope_attention_factor, rope_inv_freq
from jaxinfer.models.transformer import PagedBatch
from jaxinfer.params import is_spec

GOLDENS = ("mla_qlora", "mla_noqlora")
PAGE_SIZE = 4
NUM_PAGES = 16


def rope_scaling_from_hf(rope: dict) -> RopeScaling:
  """What ModelConfig.from_hf has to pass for a yarn `rope_parameters` dict."""
  return RopeScaling(kind=rope["rope_type"], factor=float(rope["factor"]),
                     original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                     beta_fast=float(rope.get("beta_fast") or 32.0),
                     beta_slow=float(rope.get("beta_slow") or 1.0),
                     mscale=float(rope.get("mscale") or 0.0),
                     mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                     attention_factor=rope.get("attention_factor"),
                     truncate=bool(rope.get("truncate", True)))


def mla_config(meta: dict, rope: dict | None = None, **over) -> ModelConfig:
  """A DeepSeek-V3-style ModelConfig, built without ModelConfig.__post_init__ (which may not
  accept MLA configs yet: the architecture is wired elsewhere)."""
  rope = rope or meta["rope"]
  fields = dict(architecture="deepseek_v3", vocab_size=320, hidden_size=meta["hidden_size"],
                intermediate_size=128, num_layers=2, num_heads=meta["num_heads"],
                num_kv_heads=meta["num_heads"], head_dim=meta["qk_rope_head_dim"],
                rope_theta=float(rope["rope_theta"]), rope_scaling=rope_scaling_from_hf(rope),
                rms_norm_eps=meta["rms_norm_eps"], max_position_embeddings=meta["max_position_embeddings"],
                kv_lora_rank=meta["kv_lora_rank"], q_lora_rank=meta["q_lora_rank"],
                qk_rope_head_dim=meta["qk_rope_head_dim"], qk_nope_head_dim=meta["qk_nope_head_dim"],
                v_head_dim=meta["v_head_dim"], name="tiny-mla")
  fields.update(over)
  cfg = object.__new__(ModelConfig)
  for f in dataclasses.fields(ModelConfig):
    if f.name in fields:
      value = fields[f.name]
    elif f.default is not dataclasses.MISSING:
      value = f.default
    else:
      value = f.default_factory()
    object.__setattr__(cfg, f.name, value)
  return cfg


def load(name: str):
  g = golden(name)
  meta = json.loads(str(g["meta"]))
  cfg = mla_config(meta)
  specs = mla.mla_specs(cfg, meta["layer"])
  # Checkpoint layout -> ours through the specs, as the loaders do; every HF tensor is used once.
  names = {k[2:] for k in g.files if k.startswith("w:")}
  assert {s.hf for s in specs.values()} == names
  params = {}
  for key, spec in specs.items():
    array = g["w:" + spec.hf]
    assert array.shape == spec.checkpoint_shape(), (key, array.shape)
    params[key] = jnp.asarray(spec.from_checkpoint(array))
  return g, meta, cfg, params


def batch_for(steps, page_tables, pad_tokens=2, pad_seqs=1, page_size=PAGE_SIZE, num_pages=NUM_PAGES):
  """PagedBatch for one step: `steps` = [(seq, first position, q_len)], each sequence's
  pages given by page_tables[seq]; padding tokens write nowhere (slot past the pool)."""
  slots, cu, kv_lens, tables = [], [0], [], []
  for seq, start, n in steps:
    pos = np.arange(start, start + n)
    table = np.asarray(page_tables[seq])
    slots += list(table[pos // page_size] * page_size + pos % page_size)
    cu.append(cu[-1] + n)
    kv_lens.append(start + n)
    tables.append(table)
  slots += [num_pages * page_size] * pad_tokens
  P = max(len(t) for t in tables)
  tables += [np.zeros(P, np.int32)] * pad_seqs
  cu += [cu[-1]] * pad_seqs
  kv_lens += [0] * pad_seqs
  return PagedBatch(slot_mapping=jnp.asarray(slots, jnp.int32), kv_lens=jnp.asarray(kv_lens, jnp.int32),
                    page_indices=jnp.asarray(np.stack(tables), jnp.int32),
                    cu_q_lens=jnp.asarray(cu, jnp.int32), num_seqs=jnp.int32(len(steps)))


@functools.lru_cache(maxsize=None)
def jitted_block(cfg, impl):
  return jax.jit(functools.partial(mla.mla_attention_block, cfg=cfg, attention_impl=impl))


def run_schedule(cfg, params, x, schedule, page_tables, impl="xla", cache=None, page_size=PAGE_SIZE):
  """Runs steps of (seq, start, n) over one shared cache; every sequence reads rows of x
  (its residual stream, [n, D]) at its positions. Returns each sequence's outputs and the cache.
  cache: the layer cache to start from (default: a float32 latent of NUM_PAGES pages of PAGE_SIZE)."""
  h = rms_norm(jnp.asarray(x), params["attn_norm"], cfg.rms_norm_eps)
  if cache is None:
    cache = {"latent": jnp.zeros((NUM_PAGES, PAGE_SIZE, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                 jnp.float32)}
  num_pages = cache["latent"].shape[0]
  outs = {seq: np.full((x.shape[0], x.shape[1]), np.nan, np.float32) for seq in page_tables}
  block = jitted_block(cfg, impl)
  for steps in schedule:
    batch = batch_for(steps, page_tables, page_size=page_size, num_pages=num_pages)
    pos = np.concatenate([np.arange(s, s + n) for _, s, n in steps] + [np.zeros(2, int)])
    xs = jnp.concatenate([h[s:s + n] for _, s, n in steps] + [jnp.zeros((2, h.shape[1]), h.dtype)])
    out, cache = block(params, x=xs, positions=jnp.asarray(pos, jnp.int32), layer_cache=cache, batch=batch)
    out = np.asarray(out)
    row = 0
    for seq, s, n in steps:
      outs[seq][s:s + n] = out[row:row + n]
      row += n
  return outs, cache


def test_yarn_inv_freq_and_scales_match_transformers():
  g = golden("mla_qlora")
  meta = json.loads(str(g["meta"]))
  cfg = mla_config(meta)
  np.testing.assert_allclose(rope_inv_freq(cfg), g["inv_freq"], rtol=1e-6)
  assert rope_attention_factor(cfg) == pytest.approx(float(g["attention_factor"]), rel=1e-12)
  assert mla.softmax_scale(cfg) == pytest.approx(float(g["scaling"]), rel=1e-12)
  assert float(g["attention_factor"]) != 1.0 and float(g["scaling"]) != 24 ** -0.5  # both exercised
  for i, rope in enumerate(meta["variants"]):  # truncate=False, DeepSeek-V3's own mscales, a set factor
    cfg = mla_config(meta, rope)
    np.testing.assert_allclose(rope_inv_freq(cfg), g[f"variant{i}_inv_freq"], rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(float(g[f"variant{i}_attention_factor"]), rel=1e-12)
    assert mla.softmax_scale(cfg) == pytest.approx(float(g[f"variant{i}_scaling"]), rel=1e-12)


@pytest.mark.parametrize("name", GOLDENS)
def test_prefill_then_decodes_match_transformers(name):
  g, meta, cfg, params = load(name)
  prefill, n = int(g["prefill"]), g["x"].shape[0]
  schedule = [[(0, 0, prefill)]] + [[(0, t, 1)] for t in range(prefill, n)]
  outs, _ = run_schedule(cfg, params, g["x"], schedule, {0: [9, 3, 14, 6]})
  np.testing.assert_allclose(outs[0], g["out"], atol=1e-4, rtol=0)
  assert np.abs(g["out"]).max() > 0.1  # the comparison is not between near-zero outputs


def mixed_schedule(prefill, n):
  """Sequence 0 prefills at once then decodes; sequence 1 prefills in two chunks beside
  sequence 0's decodes and decodes after it: every step mixes kinds."""
  return [[(0, 0, prefill), (1, 0, 5)],
          [(1, 5, prefill - 5), (0, prefill, 1)],
          [(0, prefill + 1, 1), (1, prefill, 1)],
          [(1, prefill + 1, 1), (0, prefill + 2, 1)],
          [(1, prefill + 2, 1)]][:2 + n - prefill]


def test_mixed_batches_match_transformers():
  g, meta, cfg, params = load("mla_qlora")
  prefill, n = int(g["prefill"]), g["x"].shape[0]
  assert n == prefill + 3
  outs, _ = run_schedule(cfg, params, g["x"], mixed_schedule(prefill, n), {0: [9, 3, 14, 6], 1: [2, 11, 5, 8]})
  for seq in (0, 1):
    np.testing.assert_allclose(outs[seq], g["out"], atol=1e-4, rtol=0)


def test_cache_holds_the_latent_and_rope_key_only():
  g, meta, cfg, params = load("mla_noqlora")
  R, E = cfg.kv_lora_rank, cfg.qk_rope_head_dim
  table = [9, 3, 14, 6]
  _, cache = run_schedule(cfg, params, g["x"], [[(0, 0, 12)], [(0, 12, 1)]], {0: table})
  assert set(cache) == {"latent"} and cache["latent"].shape == (NUM_PAGES, PAGE_SIZE, R + E)
  latent = np.asarray(cache["latent"]).reshape(NUM_PAGES * PAGE_SIZE, R + E)
  slots = [table[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(13)]
  # The first R floats of a token are its normed latent c_KV (what W_UK / W_UV expand).
  h = rms_norm(jnp.asarray(g["x"][:13]), params["attn_norm"], cfg.rms_norm_eps)
  c_kv = rms_norm((h @ params["wkv_a"])[:, :R], params["kv_a_norm"], mla.LATENT_NORM_EPS)
  np.testing.assert_allclose(latent[slots, :R], c_kv, atol=1e-5)
  assert np.abs(latent[slots, R:]).min() > 0  # the rope key is there too
  assert not np.delete(latent, slots, axis=0).any()  # nothing else written (padding dropped)


def random_params(cfg, key):
  specs = mla.mla_specs(cfg, 0)
  keys = dict(zip(specs, jax.random.split(key, len(specs))))

  def init(name, spec):
    if spec.init == "ones":
      return 1.0 + 0.1 * jax.random.normal(keys[name], spec.shape)
    return jax.random.normal(keys[name], spec.shape) / np.sqrt(spec.fan_in)

  assert all(is_spec(s) for s in specs.values())
  return {k: init(k, s) for k, s in specs.items()}


def test_pallas_interpret_matches_xla():
  """The MLA kernel takes R + E = 32 + 16 = 48, no power of two (as DeepSeek-V3's 576)."""
  meta = json.loads(str(golden("mla_qlora")["meta"]))
  cfg = mla_config(meta, qk_rope_head_dim=16, head_dim=16)
  params = random_params(cfg, jax.random.key(0))
  x = np.asarray(jax.random.normal(jax.random.key(1), (15, cfg.hidden_size)))
  tables = {0: [9, 3, 14, 6], 1: [2, 11, 5, 8]}
  want, _ = run_schedule(cfg, params, x, mixed_schedule(12, 15), tables, impl="xla")
  got, _ = run_schedule(cfg, params, x, mixed_schedule(12, 15), tables, impl="pallas_interpret")
  for seq in (0, 1):
    np.testing.assert_allclose(got[seq], want[seq], atol=1e-5, rtol=0)


@pytest.mark.mosaic
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_mosaic_interpret_matches_xla(kv_dtype, monkeypatch):
  """A bf16 layer with attention through the Mosaic GPU MLA kernel (GPU interpret mode on the
  CPU) == the XLA path over the same cache: R = E = 64 (the kernel's narrowest widths),
  16-token pages, a bf16 latent and an fp8 one with a scale per 64 values (the cache's
  groups: gcd(R, E)); a prefill in two chunks beside decodes (three steps: interpret mode
  costs seconds a step)."""
  from pallas_kernels import ragged_paged_mla_mgpu as mgpu
  if not mgpu.MOSAIC_AVAILABLE:
    pytest.skip("Mosaic GPU interpret mode needs jax >= 0.11 (Python 3.12 venv)")
  calls = []
  kernel = mgpu.ragged_paged_mla_mgpu
  # Counted as the block is traced: the ops dispatch took this kernel, not the Triton fallback.
  monkeypatch.setattr(mgpu, "ragged_paged_mla_mgpu", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  meta = json.loads(str(golden("mla_qlora")["meta"]))
  cfg = mla_config(meta, kv_lora_rank=64, qk_rope_head_dim=64, head_dim=64, name="tiny-mla-64")
  # A bf16 model: the kernel takes a quantized cache under a 16-bit q only.
  params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), random_params(cfg, jax.random.key(0)))
  x = jax.random.normal(jax.random.key(1), (15, cfg.hidden_size), jnp.bfloat16)
  L, p = 128, 16
  tables = {0: [3], 1: [1]}

  def cache():
    c = {"latent": jnp.zeros((4, p, L), kv_dtype)}
    if kv_dtype != jnp.bfloat16:
      c["latent_scale"] = jnp.zeros((4, p, 2), jnp.float32)
    return c

  want, _ = run_schedule(cfg, params, x, mixed_schedule(12, 13), tables, impl="xla", cache=cache(),
                         page_size=p)
  got, _ = run_schedule(cfg, params, x, mixed_schedule(12, 13), tables, impl="mosaic_interpret",
                        cache=cache(), page_size=p)
  assert calls
  for seq in (0, 1):
    np.testing.assert_allclose(got[seq][:14], want[seq][:14], atol=2e-2, rtol=2e-2)


def test_pallas_kernel_names_its_width_limit():
  """The golden's E = 8 is below the smallest Triton dot (16): refused by name, not run wrongly."""
  g, meta, cfg, params = load("mla_qlora")
  with pytest.raises(ValueError, match=r"E \(qk_rope_head_dim\)=8 must be a power of two >= 16"):
    run_schedule(cfg, params, g["x"], [[(0, 0, 12)]], {0: [9, 3, 14, 6]}, impl="pallas_interpret")


def test_specs_shapes_axes_and_names():
  meta = json.loads(str(golden("mla_qlora")["meta"]))
  cfg = mla_config(meta)
  specs = mla.mla_specs(cfg, 3)
  assert specs["wq_b"].shape == (32, 8, 24) and specs["wq_b"].axes == ("q_lora", "heads", "head_dim")
  assert specs["wkv_a"].shape == (64, 40) and specs["wkv_a"].axes == ("embed", "kv_lora")
  assert specs["wkv_b"].shape == (32, 8, 32) and specs["wkv_b"].checkpoint_shape() == (256, 32)
  assert specs["wo"].checkpoint_shape() == (64, 128)
  assert specs["attn_norm"].hf == "model.layers.3.input_layernorm.weight"
  assert all(s.hf.startswith("model.layers.3.self_attn.") for k, s in specs.items() if k != "attn_norm")
  plain = mla.mla_specs(mla_config(meta, q_lora_rank=0), 0)
  assert "wq" in plain and not {"wq_a", "q_a_norm", "wq_b"} & set(plain)
  with pytest.raises(UnsupportedModelError, match="attention_bias"):
    mla.mla_specs(mla_config(meta, attention_bias=True), 0)


def test_from_hf_gives_the_same_rope_scaling():
  """ModelConfig.from_hf reads the yarn keys this test's helper reads (and an HF DeepSeek-V3 dict)."""
  meta = json.loads(str(golden("mla_qlora")["meta"]))
  hf = dict(model_type="deepseek_v3", vocab_size=320, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32,
            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
            max_position_embeddings=16384, rms_norm_eps=1e-6, rope_parameters=dict(meta["rope"]),
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid")
  cfg = ModelConfig.from_hf(hf)
  assert cfg.rope_scaling == rope_scaling_from_hf(meta["rope"])
  np.testing.assert_allclose(rope_inv_freq(cfg), golden("mla_qlora")["inv_freq"], rtol=1e-6)
  assert mla.softmax_scale(cfg) == pytest.approx(float(golden("mla_qlora")["scaling"]), rel=1e-12)


def test_int8_weights_run_the_absorbed_form():
  """int8 weight-only quantization (jaxinfer.quant): wkv_b, contracted over its output dims by the
  absorption, is dequantized; the output stays near transformers' float one."""
  from jaxinfer.quant import is_quantized, quantize_tree
  g, meta, cfg, params = load("mla_qlora")
  specs = mla.mla_specs(cfg, meta["layer"])
  qparams = jax.tree.map(jnp.asarray, quantize_tree(specs, jax.device_get(params)))
  assert is_quantized(qparams["wkv_b"]) and is_quantized(qparams["wq_b"])
  sched = [[(0, 0, 12)]] + [[(0, t, 1)] for t in range(12, 15)]
  outs, _ = run_schedule(cfg, qparams, g["x"], sched, {0: [9, 3, 14, 6]})
  err = np.abs(outs[0] - g["out"]).max()
  assert 0 < err < 0.05, err


def test_bfloat16_stays_close():
  """bf16 weights and cache: the same code path, outputs near transformers' float32 ones."""
  g, meta, cfg, params = load("mla_qlora")
  bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  h = rms_norm(jnp.asarray(g["x"], jnp.bfloat16), bf["attn_norm"], cfg.rms_norm_eps)
  cache = {"latent": jnp.zeros((NUM_PAGES, PAGE_SIZE, 40), jnp.bfloat16)}
  batch = batch_for([(0, 0, 15)], {0: [9, 3, 14, 6]}, pad_tokens=0)
  out, cache = mla.mla_attention_block(bf, cfg, h, jnp.arange(15, dtype=jnp.int32), cache, batch,
                                       attention_impl="xla")
  assert out.dtype == jnp.bfloat16 and cache["latent"].dtype == jnp.bfloat16
  assert np.abs(np.asarray(out, np.float32) - g["out"]).max() < 0.05  # 0.017 measured
