"""The KV cache spec: sizes worked out by hand, allocation shapes, shardings, the page
gather / token scatter that KV transfer uses, and the wire layout derived from it."""

import types

import jax
import numpy as np
import pytest

from jaxinfer.engine.kv_connector import KVLayout, KVTransferError
from jaxinfer.models.cache import CacheSpec, gather_pages, gqa_layer, mla_layer, scatter_tokens
from jaxinfer.sharding import make_mesh

# Duck-typed configs: the spec reads only these fields.
GQA = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=32, kv_lora_rank=0)
# DeepSeek-V3's attention: 61 layers, kv_lora_rank 512, rope head dim 64 (128 heads, none cached).
DEEPSEEK_V3 = types.SimpleNamespace(num_layers=61, num_kv_heads=128, head_dim=192, kv_lora_rank=512,
                                    qk_rope_head_dim=64)


def test_bytes_per_token_by_hand():
  # GQA: layers x (k, v) x kv heads x head_dim x itemsize.
  assert CacheSpec.from_config(GQA, np.float32).bytes_per_token() == 2 * 2 * 2 * 32 * 4 == 1024
  assert CacheSpec.from_config(GQA, "bfloat16").bytes_per_token() == 512
  # MLA: layers x (kv_lora_rank + rope dim) x itemsize, no head factor: DeepSeek-V3's 70,272 B in bf16.
  mla = CacheSpec.from_config(DEEPSEEK_V3, "bfloat16")
  assert mla.bytes_per_token() == 61 * (512 + 64) * 2 == 70272
  assert {l.kind for l in mla.layers} == {"mla"} and mla.layers[0].names == ("latent",)
  # A mixed stack: one GQA layer (2 x 2 x 32) and one MLA layer (16 + 8), float32.
  mixed = CacheSpec((gqa_layer(2, 32), mla_layer(16, 8)), "float32")
  assert mixed.bytes_per_token() == (2 * 2 * 32 + 24) * 4 == 608
  assert mixed.page_bytes(16) == 608 * 16
  assert mixed.num_pages_for(608 * 16 * 10 + 5, 16) == 10 and mixed.num_pages_for(1 << 30, 16, cap=7) == 7


def test_allocation_shapes_and_axes():
  mixed = CacheSpec((gqa_layer(2, 32), mla_layer(16, 8)), "float32")
  assert mixed.shapes(5, 4) == [{"k": (5, 4, 2, 32), "v": (5, 4, 2, 32)}, {"latent": (5, 4, 24)}]
  assert mixed.axes() == [{"k": ("pages", "page_size", "kv_heads", "head_dim"),
                           "v": ("pages", "page_size", "kv_heads", "head_dim")},
                          {"latent": ("pages", "page_size", "kv_latent")}]
  abstract = mixed.abstract(5, 4)
  assert abstract[1]["latent"] == jax.ShapeDtypeStruct((5, 4, 24), np.float32)
  zeros = mixed.zeros(5, 4)
  assert zeros[0]["v"].shape == (5, 4, 2, 32) and not np.asarray(zeros[0]["v"]).any()
  bf16 = CacheSpec.from_config(GQA, "bfloat16").zeros(3, 2)
  # On the CPU a bfloat16 cache holds its bits as uint16 (jaxinfer.indexing).
  assert len(bf16) == 2 and bf16[1]["k"].dtype == np.uint16


def test_shardings_split_kv_heads_and_replicate_the_latent():
  mixed = CacheSpec((gqa_layer(2, 32), mla_layer(16, 8)), "float32")
  mesh = make_mesh(data=4, model=2)
  sh = mixed.shardings(mesh, 8, 4)
  cache = mixed.zeros(8, 4, sh)
  k, latent = cache[0]["k"], cache[1]["latent"]
  assert k.addressable_shards[0].data.shape == k.sharding.shard_shape(k.shape) == (8, 4, 1, 32)
  assert latent.addressable_shards[0].data.shape == (8, 4, 24)  # no head axis: whole everywhere
  assert len(k.sharding.device_set) == 8


def _random_cache(spec, num_pages, page_size, seed):
  rng = np.random.default_rng(seed)
  return [{n: (rng.standard_normal(s) + 3).astype(np.float32) for n, s in layer.items()}
          for layer in spec.shapes(num_pages, page_size)]


@pytest.mark.parametrize("layers", [(gqa_layer(2, 8),) * 2, (mla_layer(6, 2),) * 2,
                                    (gqa_layer(1, 4), mla_layer(6, 2))])
def test_gather_then_scatter_round_trips_pages(layers):
  spec = CacheSpec(layers, "float32")
  N, p = 9, 4
  src = _random_cache(spec, N, p, 0)
  src_ids, dst_ids = np.array([3, 7, 1]), np.array([8, 2, 5])
  pages = gather_pages(src, src_ids)
  for layer, got in zip(src, pages):
    for name in layer:
      np.testing.assert_array_equal(np.asarray(got[name]), layer[name][src_ids])
  # As token runs (page-major flattened) into other pages of a fresh pool, slot by slot.
  runs = [{n: np.asarray(a).reshape((-1,) + a.shape[2:]) for n, a in layer.items()} for layer in pages]
  pos = np.arange(len(src_ids) * p)
  slots = dst_ids[pos // p] * p + pos % p
  dst = scatter_tokens(spec.zeros(N, p), slots, runs)
  for a, b in zip(src, dst):
    for name in a:
      np.testing.assert_array_equal(np.asarray(b[name])[dst_ids], a[name][src_ids])
      others = np.setdiff1d(np.arange(N), dst_ids)
      assert not np.asarray(b[name])[others].any()


def test_scatter_keeps_the_rest_of_a_page_written_mid_page():
  spec = CacheSpec((mla_layer(3, 1),), "float32")
  cache = _random_cache(spec, 4, 4, 1)
  before = cache[0]["latent"].copy()
  run = [{"latent": np.full((3, 4), -1.0, np.float32)}]
  slots = np.array([2 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1])  # the last token of page 2, two of page 3
  got = np.asarray(scatter_tokens(jax.device_put(cache), slots, run)[0]["latent"])
  assert (got[2, 3] == -1).all() and (got[3, :2] == -1).all()
  np.testing.assert_array_equal(got[2, :3], before[2, :3])
  np.testing.assert_array_equal(got[3, 2:], before[3, 2:])
  np.testing.assert_array_equal(got[:2], before[:2])


def test_wire_layout_derives_from_the_spec():
  gqa = CacheSpec.from_config(GQA, np.float32)
  assert KVLayout.from_cache_spec(gqa, 16) == KVLayout(2, 16, 2, 32, "float32", ("k", "v"))
  mla = CacheSpec.from_config(DEEPSEEK_V3, "bfloat16")
  layout = KVLayout.from_cache_spec(mla, 64)
  assert layout == KVLayout(61, 64, 1, 576, "bfloat16", ("latent",))
  assert layout.page_bytes == mla.page_bytes(64)
  with pytest.raises(KVTransferError, match=r"mixes layer kinds \['gqa', 'mla'\]"):
    KVLayout.from_cache_spec(CacheSpec((gqa_layer(2, 32), mla_layer(16, 8)), "float32"), 16)


def test_check_transfer_reads_pages_of_any_page_size_and_the_wire_latent():
  spec = CacheSpec((mla_layer(6, 2),) * 2, "float32")
  pages = [{"latent": np.arange(3 * 8 * 8, dtype=np.float32).reshape(3, 8, 8)}] * 2
  runs = spec.check_transfer(pages, page_major=True)
  assert runs[0]["latent"].shape == (24, 8)
  np.testing.assert_array_equal(runs[1]["latent"][9], pages[0]["latent"][1, 1])
  # The wire form of a headless latent is one 'kv head' ([n, p, 1, r + R]): the same tokens.
  wire = [{"latent": a["latent"][:, :, None, :]} for a in pages]
  np.testing.assert_array_equal(spec.check_transfer(wire, page_major=True)[0]["latent"], runs[0]["latent"])
  with pytest.raises(KVTransferError, match=r"layer 0 'latent': kv_latent is 7, expected 8"):
    spec.check_transfer([{"latent": a["latent"][..., :7]} for a in pages], page_major=True)
  with pytest.raises(KVTransferError, match=r"layer 1: the transfer has arrays \['k'\], this cache \['latent'\]"):
    spec.check_transfer([pages[0], {"k": pages[0]["latent"]}], page_major=True)
