"""A quantized KV cache (kv_cache_dtype 'int8' / 'fp8') through the engine: logits against
transformers' float32 goldens, the pool it buys, greedy batch invariance with preemption and
prefix hits, KV transfer, and the options it refuses."""

import numpy as np
import pytest

from conftest import golden, tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.engine import EngineConfig
from jaxinfer.engine.kv_connector import KVLayout, KVTransferError
from jaxinfer.errors import InvalidRequestError

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, warmup=False)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("family,kv,atol", [
    # Measured max |diff| (|logit| up to ~4.4): qwen3 int8 0.054, fp8 0.21; gpt_oss (sinks,
    # sliding windows) int8 0.042; deepseek_v3 (MLA latent, grouped scales) int8 0.058. A wrong
    # scale, a scale from another token or head, or one scale over c_KV and the rope key
    # (deepseek: 1.22) moves them by whole units.
    ("qwen3", "int8", 0.15), ("qwen3", "fp8", 0.5), ("gpt_oss", "int8", 0.15), ("deepseek_v3", "int8", 0.15)])
def test_logits_near_transformers_float32(family, kv, atol):
  g = golden(family)
  llm = LLM(tiny_dir(family), kv_cache_dtype=kv, **ENGINE)
  cache = llm.runner.cache[0]
  assert {n: str(a.dtype) for n, a in cache.items() if n.endswith("_scale")} and \
      all(str(a.dtype) in ("int8", "uint8", "float8_e4m3fn") for n, a in cache.items() if not n.endswith("_scale"))
  logits = llm.logits(g["token_ids"].tolist())
  np.testing.assert_allclose(logits, g["logits"], atol=atol, rtol=0)
  assert np.mean(logits.argmax(-1) == g["logits"].argmax(-1)) >= (0.9 if kv == "int8" else 0.75)


def test_the_same_bytes_hold_more_tokens():
  """qwen3: 2 layers x (k, v) x 2 kv heads x 32 dims. float32: 1024 bytes per token; int8:
  32 values + one float32 scale per head, 288 bytes (3.6x the tokens)."""
  opts = dict(ENGINE, max_model_len=128, kv_cache_bytes=2**18)
  f32, q8 = (LLM(tiny_dir("qwen3"), kv_cache_dtype=kv, **opts).engine for kv in ("auto", "int8"))
  assert f32.runner.cache_spec.bytes_per_token() == 2 * 2 * 2 * 32 * 4
  assert q8.runner.cache_spec.bytes_per_token() == 2 * 2 * 2 * (32 + 4)
  assert (f32.kv.num_pages, q8.kv.num_pages) == (2**18 // (16 * 1024), 2**18 // (16 * 288))
  assert q8.kv_summary() == ("56 pages x 16 tokens = 0.2 MiB of int8 (288 bytes per token, scales included): "
                             "880 tokens, 6 sequences of 128")


@pytest.mark.parametrize("family,kv", [("qwen3", "fp8"), ("deepseek_v3", "int8")])  # int8 GQA: the transfer test
def test_greedy_batch_invariance_with_preemption_and_prefix_hits(family, kv):
  """A 13-page pool for 8 prompts of up to 70 tokens + 24 new: requests are preempted and
  recomputed, and the second batch hits the prefix cache; every output equals the prompt
  run alone (quantization is per token, so no token's values depend on its batch)."""
  llm = LLM(tiny_dir(family), kv_cache_dtype=kv, **dict(ENGINE, num_pages=13, max_model_len=128))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 320, n).tolist() for n in (3, 40, 9, 1, 70, 16, 5, 33)]
  alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
  before = llm.engine.stats()
  for _ in range(2):
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == alone
  after = llm.engine.stats()
  assert after["preemptions"] > before["preemptions"]
  assert llm.engine.kv.hit_tokens > 0


def test_kv_transfer_between_quantized_engines_continues_the_request():
  """Pages and their scales move together: a request prefilled on one int8 engine and decoded
  on another gives what one int8 engine gives; float32 pages are refused by name and dtype."""
  prod, cons = (LLM(tiny_dir("qwen3"), kv_cache_dtype="int8", **ENGINE).engine for _ in range(2))
  ref = LLM(tiny_dir("qwen3"), kv_cache_dtype="int8", **ENGINE)
  prompt = list(range(5, 45))
  want = ref.generate([prompt], GREEDY)[0]
  prod.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), hold_kv=True)
  outs = []
  while prod.has_unfinished():
    outs += prod.step()  # (under async scheduling a step's output comes one step() later)
  first = outs[-1]
  arrays = prod.export_kv("r", 0, len(prod.kv.pages("r")))
  assert set(arrays[0]) == {"k", "v", "k_scale", "v_scale"}
  assert arrays[0]["k"].dtype == np.int8 and arrays[0]["k_scale"].shape == (3, 16, 2)

  class Remote:
    def get_num_new_matched_tokens(self, req, num_computed):
      return req.num_prompt_tokens - num_computed

    def update_state_after_alloc(self, req, pages, num_external_tokens):
      pass

    def request_finished(self, req):
      return False

  cons.set_kv_connector(Remote())
  cons.add_request("r", prompt, GREEDY)
  assert cons.step() == []
  bad = [{n: a.astype(np.float32) if n == "k" else a for n, a in layer.items()} for layer in arrays]
  with pytest.raises(KVTransferError, match="layer 0 'k': dtype is float32, this cache holds int8"):
    cons.import_kv("r", 0, bad)
  cons.import_kv("r", 0, arrays)
  cons.finish_remote_kv("r", first.token_ids[0], first.logprobs[0], None)
  got = []
  while cons.has_unfinished():
    got += cons.step()
  assert got[-1].token_ids == want.token_ids


@pytest.mark.parametrize("family,kv,heads,dim,groups", [
    ("qwen3", "int8", 2, 32, 1), ("qwen3", "fp8", 2, 32, 1), ("deepseek_v3", "int8", 1, 40, 5)])
def test_the_grpc_wire_carries_values_and_scales_bit_exact(family, kv, heads, dim, groups):
  """pack_pages -> bytes -> unpack_pages gives every array back bit-exact, in the dtype and
  token shape the cache's own check accepts: per-head scales (GQA) and an MLA latent's
  grouped ones (one 'kv head'); the byte count is the layout's, scales included."""
  from jaxinfer.checkpoint.hf import read_config
  from jaxinfer.models.cache import CacheSpec, kv_cache_dtype
  from jaxinfer.serving.disagg import layout_from_proto, layout_to_proto, pack_pages, unpack_pages
  cfg = read_config(tiny_dir(family))
  spec = CacheSpec.from_config(cfg, kv_cache_dtype(kv, "float32"))
  layout = KVLayout.from_cache_spec(spec, page_size=4)
  assert (layout.num_kv_heads, layout.head_dim, layout.scale_groups) == (heads, dim, groups)
  assert layout_from_proto(layout_to_proto(layout)) == layout
  rng = np.random.default_rng(0)
  pages = [{name: (rng.standard_normal((3, 4) + shape) * 50).astype(spec.dtypes()[l][name])
            for name, shape in ((a.name, a.shape) for a in layer.arrays)} for l, layer in enumerate(spec.layers)]
  data = pack_pages(pages, layout)
  assert len(data) == 3 * layout.page_bytes == 3 * spec.page_bytes(4)
  back = spec.check_transfer(unpack_pages(data, 3, layout), page_major=True)
  for want, got in zip(spec.check_transfer(pages, page_major=True), back):
    assert want.keys() == got.keys()
    for name in want:
      assert got[name].dtype == want[name].dtype
      np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8))
  with pytest.raises(KVTransferError, match="scale_groups: ours 0"):
    KVLayout.from_cache_spec(CacheSpec.from_config(cfg, "float32"), 4).check_matches(layout)


def test_bad_kv_cache_dtypes_are_refused():
  with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, float32, bfloat16, int8, fp8"):
    EngineConfig(kv_cache_dtype="int4")
  with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
    LLM(tiny_dir("qwen3"), kv_cache_dtype="float16", **ENGINE)
