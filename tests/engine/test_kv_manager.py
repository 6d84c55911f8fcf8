"""KVManager: exact page ids, reference counts, prefix hits, eviction order, events."""

import pytest

from jaxinfer.engine.kv_manager import NULL_PAGE, KVEvent, KVManager, hash_block

PS = 4


def tokens(n, start=0):
  return list(range(start, start + n))


def test_allocation_takes_pages_in_order_and_never_page_zero():
  kv = KVManager(num_pages=8, page_size=PS)
  assert kv.num_free_pages == 7
  assert kv.allocate("a", 5) == [1, 2]
  assert kv.allocate("a", 8) == [1, 2]  # still fits
  assert kv.allocate("a", 9) == [1, 2, 3]
  assert kv.allocate("b", 1) == [4]
  assert NULL_PAGE not in kv.pages("a") + kv.pages("b")
  assert [kv.ref_count(p) for p in range(8)] == [0, 1, 1, 1, 1, 0, 0, 0]
  assert kv.num_free_pages == 3 and kv.usage == pytest.approx(4 / 7)


def test_can_allocate_is_exact_and_failed_allocate_changes_nothing():
  kv = KVManager(num_pages=4, page_size=PS)
  kv.allocate("a", 8)
  assert kv.can_allocate("b", 4) and not kv.can_allocate("b", 5)
  with pytest.raises(RuntimeError, match="out of KV pages for 'b': need 2, have 1"):
    kv.allocate("b", 5)
  assert kv.pages("b") == [] and kv.num_free_pages == 1


def test_free_returns_uncached_pages_at_once():
  kv = KVManager(num_pages=4, page_size=PS)
  kv.allocate("a", 12)
  kv.free("a")
  assert kv.num_free_pages == 3 and kv.pages("a") == []
  assert kv.allocate("b", 12) == [3, 2, 1]  # FIFO free list, and a frees its tail first


def test_prefix_hit_shares_full_blocks_by_reference():
  kv = KVManager(num_pages=10, page_size=PS)
  prompt = tokens(10)
  kv.allocate("a", 10)
  kv.cache_blocks("a", prompt, num_final=10)  # blocks [0..3], [4..7]; [8, 9] is partial
  events = kv.drain_events()
  h0 = hash_block(None, prompt[:4])
  h1 = hash_block(h0, prompt[4:8])
  assert events == [KVEvent("stored", h0, None, tuple(prompt[:4])),
                    KVEvent("stored", h1, h0, tuple(prompt[4:8]))]
  hit = kv.lookup(prompt[:9] + [99, 98])
  assert hit == [1, 2]
  assert kv.allocate("b", 11, cached=hit) == [1, 2, 4]
  assert [kv.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]
  assert kv.hit_tokens == 8 and kv.queried_tokens == 11


def test_lookup_always_leaves_one_token_to_compute():
  kv = KVManager(num_pages=10, page_size=PS)
  kv.allocate("a", 8)
  kv.cache_blocks("a", tokens(8), num_final=8)
  assert kv.lookup(tokens(8)) == [1]  # the last block would leave nothing to compute
  assert kv.lookup(tokens(9)) == [1, 2]


def test_only_final_tokens_are_cached():
  kv = KVManager(num_pages=10, page_size=PS)
  kv.allocate("a", 8)
  kv.cache_blocks("a", tokens(8), num_final=7)  # token 7 is speculative
  assert len(kv.drain_events()) == 1
  kv.cache_blocks("a", tokens(8), num_final=8)
  assert [e.kind for e in kv.drain_events()] == ["stored"]


def test_unreferenced_cached_pages_are_evicted_lru_tail_first():
  kv = KVManager(num_pages=5, page_size=PS)  # 4 usable pages
  kv.allocate("a", 8)
  kv.cache_blocks("a", tokens(8), num_final=8)
  kv.allocate("b", 4)
  kv.cache_blocks("b", tokens(4, start=50), num_final=4)
  kv.free("a")  # evictable, tail first: 2, then 1
  kv.free("b")  # then 3
  kv.drain_events()
  assert kv.num_free_pages == 4
  assert kv.allocate("c", 4) == [4]  # a truly free page before any eviction
  assert kv.allocate("c", 8) == [4, 2]
  assert kv.drain_events() == [KVEvent("removed", hash_block(hash_block(None, tokens(4)), tokens(4, 4)))]
  assert kv.lookup(tokens(9)) == [1]  # the head block of 'a' survived
  assert kv.allocate("c", 12) == [4, 2, 1]
  assert kv.allocate("c", 16) == [4, 2, 1, 3]
  assert kv.num_free_pages == 0 and kv.cached_hashes() == set()


def test_hit_on_an_evictable_page_revives_it():
  kv = KVManager(num_pages=4, page_size=PS)
  kv.allocate("a", 8)
  kv.cache_blocks("a", tokens(8), num_final=8)
  kv.free("a")
  hit = kv.lookup(tokens(9))
  assert hit == [1, 2] and kv.pages_needed("b", 9, hit) == 3
  kv.allocate("b", 9, cached=hit)
  assert kv.pages("b") == [1, 2, 3] and kv.num_free_pages == 0
  assert [kv.ref_count(p) for p in (1, 2, 3)] == [1, 1, 1]


def test_duplicate_block_keeps_the_first_page():
  kv = KVManager(num_pages=8, page_size=PS)
  kv.allocate("a", 4)
  kv.allocate("b", 4)
  kv.cache_blocks("a", tokens(4), 4)
  kv.cache_blocks("b", tokens(4), 4)
  assert len(kv.drain_events()) == 1
  kv.free("b")
  assert kv.num_free_pages == 6  # b's page went straight back to the free list
  assert kv.lookup(tokens(5)) == [1]


def test_prefix_caching_off_and_reset():
  kv = KVManager(num_pages=4, page_size=PS, enable_prefix_caching=False)
  kv.allocate("a", 8)
  kv.cache_blocks("a", tokens(8), 8)
  assert kv.lookup(tokens(9)) == [] and kv.drain_events() == []
  kv2 = KVManager(num_pages=4, page_size=PS)
  kv2.allocate("a", 8)
  kv2.cache_blocks("a", tokens(8), 8)
  kv2.free("a")
  kv2.drain_events()
  kv2.reset_prefix_cache()
  assert [e.kind for e in kv2.drain_events()] == ["removed", "removed"]
  assert kv2.lookup(tokens(9)) == [] and kv2.num_free_pages == 3


def test_hashes_are_stable_and_chained():
  assert hash_block(None, [1, 2, 3]) == hash_block(None, (1, 2, 3))
  assert hash_block(None, [1, 2, 3]) != hash_block(hash_block(None, [0]), [1, 2, 3])
  # Pinned: workers in different processes must agree on a block's name.
  assert hash_block(None, [1, 2, 3]) == 0xd4f76cd6cc5ae57c
