"""Quantized checkpoints: convert --quantize int8 / fp8 / int4 round trips, GGUF Q8_0 kept as int8 and
Q4_0 / Q4_1 as int4, fp8 and int4 models, bad scales."""

import json
import logging

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import golden, tiny_dir
from helpers import write_llama_gguf
from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import import_model, load_model, orbax_io
from jaxinfer.cli import main
from jaxinfer.errors import CheckpointError
from jaxinfer.params import is_spec, param_specs
from jaxinfer.quant import (QuantizedWeight, dequantize, dequantize_weight, format_of, is_quantized, num_in_axes,
                            quantize_leaf, quantize_tree)
from jaxinfer.sharding import make_mesh, make_rules, param_shardings

Q = gguf.GGMLQuantizationType


def _leaves(tree):
  return jax.tree.leaves(tree)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  dst = tmp_path_factory.mktemp("ck") / "llama3-int8"
  assert main(["convert", str(tiny_dir("llama3")), str(dst), "--quantize", "int8"]) == 0
  return dst


def test_convert_quantize_round_trips_bit_exactly(converted):
  manifest = json.loads((converted / orbax_io.MANIFEST).read_text())
  assert manifest["quantization"] == "int8"
  written = import_model(tiny_dir("llama3"), "int8").weights
  restored = load_model(converted).params
  assert jax.tree.structure(written, is_leaf=is_quantized) == jax.tree.structure(restored, is_leaf=is_quantized)
  wq = restored["layers"][0]["wq"]
  assert isinstance(wq, QuantizedWeight) and wq.values.dtype == np.int8 and wq.scales.dtype == np.float32
  for a, b in zip(_leaves(written), _leaves(restored)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_quantized_checkpoint_of_the_old_in_out_layout_is_refused(converted, tmp_path):
  # Quantized values were stored [in..., out...] before the manifest gained values_layout;
  # their shapes can coincide with today's (square weights), so the manifest decides.
  import shutil
  old = tmp_path / "old"
  shutil.copytree(converted, old)
  manifest = json.loads((old / orbax_io.MANIFEST).read_text())
  assert manifest.pop("values_layout") == "out_in"
  (old / orbax_io.MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(CheckpointError, match=r"int8 values stored as \[in, out\] by an older jaxinfer") as e:
    load_model(old)
  assert str(e.value).endswith(f"rewrite it with `jaxinfer convert {manifest['source']} {old} --dtype "
                               f"{manifest['dtype']} --quantize int8 --overwrite`")


def test_converted_int8_generates_like_quantizing_at_load(converted):
  prompt = [5, 17, 200, 3, 99, 42, 7]
  sp = dict(max_model_len=64, warmup=False)
  a = LLM(converted, **sp)
  b = LLM(tiny_dir("llama3"), quantization="int8", **sp)
  np.testing.assert_array_equal(a.logits(prompt), b.logits(prompt))


def test_converted_int8_restores_sharded_over_a_mesh(converted):
  mesh = make_mesh(model=2)
  rules = make_rules({"kv_heads": None})  # tiny llama3 has 1 KV head
  params = load_model(converted, shardings_fn=lambda cfg, q=None: param_shardings(cfg, mesh, q, rules)).params
  P = jax.sharding.PartitionSpec
  w = params["layers"][0]["w_up"]
  assert w.values.sharding.spec == P("model", None) and w.scales.sharding.spec == P(None, "model")
  single = load_model(converted).params
  for a, b in zip(_leaves(single), _leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_converted_bfloat16_keeps_int8_and_float32_scales(tmp_path):
  dst = tmp_path / "bf16-int8"
  assert main(["convert", str(tiny_dir("smollm2")), str(dst), "--quantize", "int8", "--dtype", "bfloat16"]) == 0
  params = load_model(dst, dtype="bfloat16").params
  assert params["final_norm"].dtype == "bfloat16"
  # SmolLM2 ties its LM head to the embedding, which int8 quantizes per vocab row in groups of
  # 32 of its 64 values (quant.leaf_layout): scales [2, V].
  assert params["embed"].values.dtype == np.int8 and params["embed"].scales.shape == (2, params["embed"].shape[0])
  assert params["layers"][1]["w_down"].values.dtype == np.int8
  assert params["layers"][1]["w_down"].scales.dtype == np.float32


def test_scales_that_do_not_match_their_values_name_the_tensor(tmp_path):
  model = import_model(tiny_dir("llama3"), "int8")
  w = model.weights["layers"][1]["w_up"]
  model.weights["layers"][1]["w_up"] = QuantizedWeight(w.values, w.scales[:, :-1])  # one output short
  dst = orbax_io.save(model, tmp_path / "bad")
  with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*scales have shape"):
    load_model(dst)


def test_scales_with_groups_that_do_not_divide_the_input(tmp_path):
  model = import_model(tiny_dir("llama3"), "int8")
  w = model.weights["layers"][0]["wk"]
  D = w.values.shape[-1]  # [kv heads, head dim, D]: the inputs last
  model.weights["layers"][0]["wk"] = QuantizedWeight(w.values, np.repeat(w.scales, D - 1, axis=0))
  dst = orbax_io.save(model, tmp_path / "bad")
  with pytest.raises(CheckpointError, match=r"k_proj\.weight.*G dividing"):
    load_model(dst)


# ---- GGUF --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q8_0_file(tmp_path_factory):
  return write_llama_gguf(tiny_dir("smollm2"), tmp_path_factory.mktemp("g") / "q8.gguf", Q.Q8_0)


def quantized_leaves(path, quantization):
  """(spec, quantized leaf, the gguf package's float32 dequantization) per quantized weight,
  and the model's layer count."""
  quantized = import_model(path, quantization)
  floats = import_model(path)
  specs = param_specs(quantized.config)
  pairs = zip(jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(quantized.weights, is_leaf=is_quantized),
              jax.tree.leaves(floats.weights))
  return [(s, q, f) for s, q, f in pairs if is_quantized(q)], quantized.config.num_layers


def test_q8_0_loads_as_its_own_int8_blocks(q8_0_file):
  leaves, num_layers = quantized_leaves(q8_0_file, "int8")
  assert len(leaves) == 7 * num_layers + 1
  (head_spec, head, table), = [(s, q, f) for s, q, f in leaves if s.head]
  # The tied head is made from the table's floats in int8's groups of 32 along D, symmetric: a
  # Q8_0 table (d q, max |q| = 127 per block) comes back exactly.
  V, D = head_spec.shape
  assert head_spec.axes == ("vocab", "embed") and head.scales.shape == (D // 32, V) and head.mins is None
  np.testing.assert_array_equal(head.values, quantize_leaf(head_spec, table, "int8").values)
  np.testing.assert_array_equal(dequantize_weight(head_spec, head), table)
  for spec, q, f in leaves:
    if spec.head:
      continue
    in_size = int(np.prod(spec.shape[:num_in_axes(spec)]))
    assert q.scales.shape[0] == in_size // 32  # one scale per Q8_0 block: group-wise, not per channel
    # The same numbers exactly (q8_0 dequantizes to int8 * fp16 scale, both exact in float32),
    # including attn_q / attn_k, whose rows (and scales) llama.cpp permuted.
    np.testing.assert_array_equal(dequantize(q, num_in_axes(spec)), f)


def _float_reference_with_the_int8_table(path):
  """The float32 LLM of `path`, its tied table replaced by the dequantized int8 table that
  int8 and int4 hold (groups of 32 along D, made from the floats), and that int8 table."""
  ref_llm = LLM(path, max_model_len=64, warmup=False)
  spec = param_specs(ref_llm.config)["embed"]
  table = quantize_leaf(spec, np.asarray(ref_llm.runner.params["embed"]), "int8")
  ref_llm.runner.params = {**ref_llm.runner.params, "embed": jnp.asarray(dequantize_weight(spec, table))}
  return ref_llm, table


def test_q8_0_int8_logits_match_dequantized_float32(q8_0_file):
  # Q8_0 blocks are the float32 loader's weights exactly; on the CPU the group kernel sums
  # them against int16 activations (2^-15 of their row maximum), as int4's does: logits ~3.5
  # in size agree to 1e-3 (4.0e-4 seen); a layout or scale mix-up moves them by whole units. The tied
  # head is int8 in groups of 32 made from the floats, so the reference gets that table's
  # dequantized values.
  ids = golden("smollm2")["token_ids"].tolist()
  ref_llm, table = _float_reference_with_the_int8_table(q8_0_file)
  got_llm = LLM(q8_0_file, max_model_len=64, warmup=False, quantization="int8")
  np.testing.assert_array_equal(np.asarray(got_llm.runner.params["embed"].values), table.values)
  np.testing.assert_allclose(got_llm.logits(ids), ref_llm.logits(ids), atol=1e-3, rtol=0)


def test_q8_0_int8_greedy_batch_invariance(q8_0_file):
  llm = LLM(q8_0_file, max_model_len=128, max_num_seqs=8, warmup=False, quantization="int8")
  assert llm.runner.params["layers"][0]["wqkv"].scales.shape[0] > 1  # q/k/v fused (params.FUSED)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 300, n).tolist() for n in (3, 40, 9, 1, 20)]
  sp = SamplingParams(temperature=0, max_tokens=10)
  together = llm.generate(prompts, sp)
  for p, out in zip(prompts, together):
    assert out.token_ids == llm.generate([p], sp)[0].token_ids


def test_q8_0_int8_round_trips_through_convert(q8_0_file, tmp_path):
  dst = tmp_path / "q8"
  assert main(["convert", str(q8_0_file), str(dst), "--quantize", "int8"]) == 0
  written = import_model(q8_0_file, "int8").weights
  restored = load_model(dst).params
  assert restored["layers"][0]["w_down"].scales.shape[0] > 1  # the groups survived
  for a, b in zip(_leaves(written), _leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_other_gguf_types_fall_back_with_one_log_line(tmp_path, caplog):
  path = write_llama_gguf(tiny_dir("smollm2"), tmp_path / "q4.gguf", Q.Q4_1)
  with caplog.at_level(logging.WARNING, logger="jaxinfer.checkpoint.gguf"):
    model = import_model(path, "int8")
  lines = [r.getMessage() for r in caplog.records if "not loaded quantized" in r.getMessage()]
  assert len(lines) == 1 and "Q4_1" in lines[0] and "requantized to int8 per group of 32" in lines[0]
  w = model.weights["layers"][0]["w_gate"]
  D = w.values.shape[-1]
  assert isinstance(w, QuantizedWeight) and w.scales.shape[0] == w.mins.shape[0] == D // 32
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jaxinfer.checkpoint.gguf"):
    model = import_model(path, "int8-channel")
  lines = [r.getMessage() for r in caplog.records if "not loaded quantized" in r.getMessage()]
  assert len(lines) == 1 and "requantized to int8-channel per channel" in lines[0]
  w = model.weights["layers"][0]["w_gate"]
  assert w.scales.shape[0] == 1 and w.mins is None


def test_q8_0_under_int8_channel_is_requantized_per_channel_and_round_trips(q8_0_file, tmp_path):
  # The opt-in per-channel int8 does not keep Q8_0 blocks (its name says one scale per
  # channel); its head is per column; a converted checkpoint says int8-channel and restores
  # the same arrays.
  model = import_model(q8_0_file, "int8-channel")
  assert model.weights["layers"][0]["wq"].scales.shape[0] == 1
  assert model.weights["embed"].scales.shape == (1, model.weights["embed"].values.shape[1])
  dst = tmp_path / "ch"
  assert main(["convert", str(q8_0_file), str(dst), "--quantize", "int8-channel"]) == 0
  assert json.loads((dst / orbax_io.MANIFEST).read_text())["quantization"] == "int8-channel"
  for a, b in zip(_leaves(model.weights), _leaves(load_model(dst).params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- fp8 and int4 ------------------------------------------------------------------------------

def _same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("g4")
  return {q: write_llama_gguf(tiny_dir("smollm2"), d / f"{q.name}.gguf", q) for q in (Q.F32, Q.Q4_0, Q.Q4_1)}


@pytest.fixture(scope="module")
def fp8_llm(gguf_files):
  return LLM(gguf_files[Q.F32], max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, warmup=False,
             quantization="fp8")


@pytest.fixture(scope="module")
def int4_llm(gguf_files):
  return LLM(gguf_files[Q.Q4_1], max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, warmup=False,
             quantization="int4")


def _greedy_batch_invariant(llm):
  # Three prompts, one longer than the 32-token step budget (chunked prefill beside decodes).
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 300, n).tolist() for n in (3, 40, 9)]
  sp = SamplingParams(temperature=0, max_tokens=8)
  together = llm.generate(prompts, sp)
  for p, out in zip(prompts, together):
    assert out.token_ids == llm.generate([p], sp)[0].token_ids


def test_fp8_logits_close_to_float32(fp8_llm):
  # The float32 GGUF holds the tiny model's weights exactly, so transformers' float32 logits
  # (|logit| up to ~4, top two often close) are the reference. Measured: max |diff| 0.34, mean
  # 0.056, top-1 agreement 79% (int8 on the same file: 0.07, 0.012, 100%): e4m3's 3 mantissa
  # bits are ~4x coarser than per-channel int8 on these Gaussian weights. A wrong scale or
  # layout moves logits by whole units (mean ~1) and agrees at ~1/320 of positions.
  w = fp8_llm.runner.params["layers"][0]["w_gate_up"]  # gate/up fused (params.FUSED)
  assert isinstance(w, QuantizedWeight) and w.values.dtype == jax.numpy.float8_e4m3fn and w.scales.shape[0] == 1
  g = golden("smollm2")
  logits = fp8_llm.logits(g["token_ids"].tolist())
  np.testing.assert_allclose(logits, g["logits"], atol=0.5, rtol=0)
  assert np.abs(logits - g["logits"]).mean() < 0.1
  assert np.mean(logits.argmax(-1) == g["logits"].argmax(-1)) >= 0.7


def test_fp8_greedy_batch_invariance(fp8_llm):
  _greedy_batch_invariant(fp8_llm)


@pytest.mark.parametrize("quantization,src", [("fp8", Q.F32), ("int4", Q.Q4_1)], ids=["fp8", "int4"])
def test_fp8_and_int4_round_trip_through_convert_bit_exactly(gguf_files, tmp_path, quantization, src):
  dst = tmp_path / quantization
  assert main(["convert", str(gguf_files[src]), str(dst), "--quantize", quantization]) == 0
  assert json.loads((dst / orbax_io.MANIFEST).read_text())["quantization"] == quantization
  written = import_model(gguf_files[src], quantization).weights
  restored = load_model(dst).params
  assert jax.tree.structure(written, is_leaf=is_quantized) == jax.tree.structure(restored, is_leaf=is_quantized)
  for a, b in zip(_leaves(written), _leaves(restored)):
    _same_bits(a, b)


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_float_checkpoint_quantized_at_restore(tmp_path, quantization):
  # What LLM(checkpoint, quantization=...) does with a float checkpoint (the default model):
  # the restored float32 weights quantized on the host, in the format asked for.
  dst = tmp_path / "f32"
  assert main(["convert", str(tiny_dir("llama3")), str(dst)]) == 0
  floats = import_model(tiny_dir("llama3"))
  expected = quantize_tree(param_specs(floats.config), floats.weights, quantization)
  restored = load_model(dst, quantization=quantization).params
  assert format_of(restored["layers"][0]["wo"]) == quantization
  for a, b in zip(_leaves(expected), _leaves(restored)):
    _same_bits(a, b)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=["Q4_0", "Q4_1"])
def test_q4_loads_as_its_own_int4_blocks(gguf_files, qtype):
  leaves, num_layers = quantized_leaves(gguf_files[qtype], "int4")
  assert len(leaves) == 7 * num_layers + 1
  (head_spec, head, table), = [(s, q, f) for s, q, f in leaves if s.head]
  # The tied head is int8 in groups of 32 along D under int4 too (quant.leaf_layout), made from its floats.
  V, D = head_spec.shape
  assert head.values.dtype == jax.numpy.int8 and head.scales.shape == (D // 32, V) and head.mins is None
  np.testing.assert_array_equal(head.values, quantize_leaf(head_spec, table, "int4").values)
  for spec, q, f in leaves:
    if spec.head:
      continue
    in_size = int(np.prod(spec.shape[:num_in_axes(spec)]))
    assert q.values.dtype == jax.numpy.int4 and q.scales.shape[0] == q.mins.shape[0] == in_size // 32
    assert q.scales.dtype == q.mins.dtype == np.float16  # GGUF's d and m (Q4_0: -8 d) as stored
    # (values + 8) d + m against the gguf package's d q + m (Q4_0: (values + 8) d - 8 d
    # against d (q - 8)): the same float32 numbers, bit for bit.
    np.testing.assert_array_equal(dequantize(q, num_in_axes(spec)), f)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=["Q4_0", "Q4_1"])
def test_q4_int4_logits_match_dequantized_float32(gguf_files, int4_llm, qtype):
  # Same weights up to float32 rounding (exactly for Q4_0), and the same int8 table as the
  # reference's head. On the CPU the int4 kernel takes each token's activations as int16 (to
  # 2^-15 of the row's largest value): logits ~3.5 in size agree to 1e-3 (3.4e-4 seen); a
  # nibble-order or min mix-up moves them by whole units.
  ids = golden("smollm2")["token_ids"].tolist()
  ref_llm, table = _float_reference_with_the_int8_table(gguf_files[qtype])
  llm = int4_llm if qtype == Q.Q4_1 else LLM(gguf_files[qtype], max_model_len=64, warmup=False, quantization="int4")
  assert format_of(llm.runner.params["layers"][1]["w_down"]) == "int4"
  np.testing.assert_array_equal(np.asarray(llm.runner.params["embed"].values), table.values)
  np.testing.assert_allclose(llm.logits(ids), ref_llm.logits(ids), atol=1e-3, rtol=0)


def test_int4_greedy_batch_invariance(int4_llm):
  _greedy_batch_invariant(int4_llm)


def test_an_int4_checkpoint_with_a_float_head_asks_for_a_reconversion(gguf_files, tmp_path):
  # What jaxinfer wrote before int4 held the head in int8: the tied table stored as floats.
  model = import_model(gguf_files[Q.Q4_1], "int4")
  model.weights["embed"] = import_model(gguf_files[Q.Q4_1]).weights["embed"]
  dst = orbax_io.save(model, tmp_path / "old")
  with pytest.raises(CheckpointError, match=r"(token_embd|embed_tokens).*keeps the LM head in floats.*--quantize int4"):
    load_model(dst)


def _with_format_version(dst, version):
  manifest = json.loads((dst / orbax_io.MANIFEST).read_text())
  (dst / orbax_io.MANIFEST).write_text(json.dumps({**manifest, "format_version": version}))
  return dst


def test_an_int4_checkpoint_of_format_version_1_is_refused_with_the_command_that_rewrites_it(gguf_files, tmp_path):
  # Version 1's int4 mins meant min + 8 scale: read as version 2 they are wrong weights, not an
  # error, so the version alone refuses it (these tensors are version 2's, and would load).
  src = gguf_files[Q.Q4_1]
  dst = _with_format_version(orbax_io.save(import_model(src, "int4"), tmp_path / "old"), 1)
  with pytest.raises(CheckpointError) as e:
    load_model(dst)
  assert "format_version 1, older than 2" in str(e.value)
  assert str(e.value).endswith(f"rewrite it with `jaxinfer convert {src} {dst} --dtype float32 --quantize int4 "
                               f"--overwrite`")
  # Version 2 changed only int4: an int8 checkpoint of version 1 still loads; a future version does not.
  int8 = _with_format_version(orbax_io.save(import_model(src, "int8"), tmp_path / "int8"), 1)
  assert load_model(int8).config == import_model(src).config
  with pytest.raises(CheckpointError, match=r"format_version 3 is not one this jaxinfer reads \(1 to 2\)"):
    load_model(_with_format_version(int8, 3))


def test_an_int4_checkpoint_with_float32_scales_asks_for_a_reconversion(gguf_files, tmp_path):
  # Format version 1's int4 tensors (float32 scales, mins that were min + 8 scale) under the
  # current version number (a hand-edited or damaged checkpoint): refused by the scales' dtype.
  model = import_model(gguf_files[Q.Q4_1], "int4")
  w = model.weights["layers"][0]["w_down"]
  old = np.asarray(w.scales, np.float32)
  model.weights["layers"][0]["w_down"] = QuantizedWeight(w.values, old, np.asarray(w.mins, np.float32) + 8 * old)
  dst = orbax_io.save(model, tmp_path / "old")
  with pytest.raises(CheckpointError, match=r"(ffn_down|down_proj).*int4 scales are float32.*--quantize int4"):
    load_model(dst)


def test_int4_mins_that_do_not_match_their_scales_name_the_tensor(gguf_files, tmp_path):
  model = import_model(gguf_files[Q.Q4_0], "int4")
  w = model.weights["layers"][1]["w_gate"]
  model.weights["layers"][1]["w_gate"] = QuantizedWeight(w.values, w.scales, w.mins[:-1])
  dst = orbax_io.save(model, tmp_path / "bad")
  with pytest.raises(CheckpointError, match=r"(ffn_gate|gate_proj).*mins have shape"):
    load_model(dst)
