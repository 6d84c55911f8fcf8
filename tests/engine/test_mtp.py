"""MTP drafts (jaxinfer.models.mtp) in the engine: lossless greedy, bookkeeping, bad input."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from conftest import DATA, tiny_dir
from helpers import with_trained_head
from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint.hf import read_config
from jaxinfer.checkpoint.mtp_head import save_mtp_head
from jaxinfer.errors import CheckpointError, InvalidRequestError
from jaxinfer.models.mtp import mtp_specs
from jaxinfer.params import is_spec

# 32-token steps (6 buckets; 8 sequences verifying 1 + 3 tokens fit one step) and a pool
# of 17 pages of 16: eight of the golden batch's prompts (43..190 tokens, four sharing 40)
# are preempted, and their second run still finds prompts in the prefix cache.
OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, num_pages=17, warmup=False)
RECORDS = slice(4, 12)


def mtp(k):
  return {"method": "mtp", "num_speculative_tokens": k}


def with_random_head(tmp_path_factory, family: str, cfg_change=None):
  """A copy of a tiny checkpoint with a random MTP head beside it (what train_mtp saves).
  Greedy equality must hold whatever the head predicts."""
  d = tmp_path_factory.mktemp("mtp") / family
  shutil.copytree(tiny_dir(family), d)
  cfg = read_config(d)
  cfg = cfg_change(cfg) if cfg_change else cfg
  leaves, treedef = jax.tree.flatten(mtp_specs(cfg), is_leaf=is_spec)
  rng = np.random.default_rng(0)
  w = jax.tree.unflatten(treedef, [(rng.normal(size=s.shape) / np.sqrt(s.shape[0])).astype(np.float32)
                                   if s.init == "normal" else np.ones(s.shape, np.float32) for s in leaves])
  save_mtp_head(d, cfg, w, dtype=np.float32)
  return d


@pytest.fixture(scope="module")
def llama3_head(tmp_path_factory):
  return with_random_head(tmp_path_factory, "llama3")


@pytest.fixture(scope="module", params=[1, 3])
def llm(request, tmp_path_factory):
  """The tiny llama3 with its trained head (helpers.with_trained_head): drafts are accepted."""
  return LLM(with_trained_head(tmp_path_factory), speculative=mtp(request.param), **OPTIONS)


def batch_golden(name):
  return json.loads((DATA / "golden" / f"batch_{name}.json").read_text())


def greedy(n):
  return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def check_golden_batch(llm, family):
  """Twice (the second run hits the prefix cache), with preemptions, token for token
  transformers' greedy ids. Drafting adds one program per token bucket (the MTP pass)."""
  g = batch_golden(family)
  prompts = [r["prompt_ids"] for r in g["records"][RECORDS]]
  want = [r["greedy_ids"] for r in g["records"][RECORDS]]
  for _ in range(2):
    outs = llm.generate(prompts, greedy(g["max_new_tokens"]))
    assert [o.token_ids for o in outs] == want
  stats = llm.engine.stats()
  assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0  # drafts were verified
  assert stats["preemptions"] > 0
  assert sum(o.num_cached_tokens for o in outs) > 0
  assert llm.engine.kv.usage == 0.0
  runner = llm.engine.runner
  # Greedy: per token bucket the forward and the MTP pass, per row bucket the greedy sampler;
  # the history-row setter.
  rows = {runner.num_seqs_bucket(T) for T in runner.token_buckets}
  assert runner.compiled_programs() <= 2 * len(runner.token_buckets) + len(rows) + 1 <= runner.max_programs()


def test_greedy_with_mtp_drafts_equals_greedy_without(llm):
  check_golden_batch(llm, "llama3")
  assert llm.engine.stats()["spec_accepted_tokens"] > 0  # the trained head's drafts match at times


def test_abort_mid_speculation_frees_every_page(llm):
  engine = llm.engine
  g = batch_golden("llama3")
  verified = engine.stats()["spec_verify_steps"]
  for i, r in enumerate(g["records"][:6]):
    engine.add_request(f"abort{i}", r["prompt_ids"][:40], greedy(40))
  while engine.stats()["spec_verify_steps"] == verified:
    engine.step()
  for i in range(6):
    engine.abort(f"abort{i}")
  assert not engine.has_unfinished()
  assert engine.kv.usage == 0.0 and engine.kv.num_free_pages == engine.kv.num_pages - 1


def test_deepseek_v3_with_an_mtp_layer(tmp_path_factory):
  """MLA + MoE block at layer num_hidden_layers, its latent cache one more layer in the pool."""
  d = with_random_head(tmp_path_factory, "deepseek_v3")
  llm = LLM(d, speculative=mtp(2), **OPTIONS)
  assert len(llm.engine.runner.cache_spec.layers) == 4 and llm.engine.runner.cache_spec.uniform_layer().kind == "mla"
  check_golden_batch(llm, "deepseek_v3")


def test_mtp_without_a_head_says_how_to_train_one():
  with pytest.raises(InvalidRequestError, match=r"needs an MTP head .* train one with: "
                                                r"python scripts/train_mtp.py --model .*llama3"):
    LLM(tiny_dir("llama3"), speculative=mtp(2), warmup=False)


def test_a_head_of_other_shapes_is_named(tmp_path_factory):
  d = with_random_head(tmp_path_factory, "llama3",
                       lambda c: dataclasses.replace(c, intermediate_size=2 * c.intermediate_size))
  with pytest.raises(CheckpointError, match=r"MTP tensor 'model\.layers\.2\.mlp\.down_proj\.weight' has shape"):
    LLM(d, speculative=mtp(1), warmup=False)


def test_drafts_read_the_kv_of_every_committed_position(llama3_head):
  """The step's first draft equals a teacher-forced MTP pass over the whole committed
  sequence (target hidden h_i and token t_{i+1} at every position, in a fresh cache): so
  the module's K/V is right after a chunked prefill, after accepted drafts and after
  rejected ones (whose K/V must have been overwritten)."""
  import jax.numpy as jnp
  from jaxinfer.checkpoint import load_model
  from jaxinfer.checkpoint.mtp_head import find_mtp_head
  from jaxinfer.engine.runner import ModelRunner, ScheduledSeq
  from jaxinfer.models.cache import CacheSpec
  from jaxinfer.models.mtp import mtp_hidden, mtp_logits
  from jaxinfer.models.transformer import PagedBatch, forward

  m = load_model(llama3_head)
  cfg, params = m.config, m.params
  head = jax.tree.map(jnp.asarray, find_mtp_head(llama3_head, cfg)[1])
  k, ps = 2, 16
  # One 4-token bucket (prefill chunks of 4, verifications of 1 + k): one step program.
  runner = ModelRunner(cfg, params, num_pages=10, page_size=ps, max_num_seqs=2, max_num_batched_tokens=4,
                       max_model_len=128, num_speculative_tokens=k, mtp_params=head)
  pages = list(range(1, 9))

  @jax.jit
  def reference(tokens, n):
    """argmax of the module at each position i < n - 1 (next token known), tokens padded to 64."""
    L = tokens.shape[0]
    spec = CacheSpec.from_config(cfg, jnp.float32, draft_layers=1)
    cache = spec.zeros(L // ps + 2, ps)
    pos = jnp.arange(L, dtype=jnp.int32)
    batch = PagedBatch(jnp.where(pos < n, pos + ps, 0), n[None], jnp.arange(1, L // ps + 2, dtype=jnp.int32)[None],
                       jnp.stack([0, n]).astype(jnp.int32), jnp.int32(1))
    h, _ = forward(params, cfg, tokens, pos, cache[:-1], batch, attention_impl="xla")
    nxt = jnp.append(tokens[1:], 0)
    m = n - 1  # the module runs where the next token is known
    mtp_batch = batch._replace(slot_mapping=jnp.where(pos < m, pos + ps, 0), kv_lens=m[None],
                               cu_q_lens=jnp.stack([0, m]).astype(jnp.int32))
    g, _ = mtp_hidden(head, params["embed"], cfg, h, nxt, pos, cache[-1], mtp_batch, attention_impl="xla")
    return jnp.argmax(mtp_logits(head, params, cfg, g), axis=-1)

  def reference_draft(ids):
    """The teacher-forced module at the last position whose next token is known."""
    tokens = np.zeros(64, np.int32)
    tokens[:len(ids)] = ids
    return int(reference(tokens, np.int32(len(ids)))[len(ids) - 2])

  def greedy_next(ids, n):
    out = list(ids)
    for _ in range(n):
      out.append(int(np.argmax(runner.logits(out)[-1])))
    return out[len(ids):]

  def run(ids, start, num_new, drafts=()):
    seq = ScheduledSeq(row=0, token_ids=list(ids), start=start, num_new=num_new, pages=pages,
                       params=SamplingParams(temperature=0), seed=0, draft_ids=list(drafts))
    return runner.execute([seq])

  ids = list(range(3, 23))  # 20 prompt tokens, in chunks of 4
  for start in range(0, 16, 4):
    assert run(ids, start, 4).num_committed[0] == 0
  r = run(ids, 16, 4)
  ids.append(int(r.ids[0, 0]))
  kinds = []
  # Drafts: the module's own (mostly rejected: a random head), the true continuation (all
  # accepted), half right (one accepted, then rejected).
  for mode in ("own", "right", "own", "half", "own", "right", "own"):
    assert int(r.drafts[0, 0]) == reference_draft(ids)
    true = greedy_next(ids, k)
    drafts = {"own": r.drafts[0].tolist(), "right": true, "half": [true[0], (true[1] + 1) % cfg.vocab_size]}[mode]
    r = run(ids, len(ids) - 1, 1 + k, drafts)
    c = int(r.num_committed[0])
    assert r.ids[0, :c].tolist() == greedy_next(ids, c)  # lossless, as always
    kinds.append(c)
    ids += r.ids[0, :c].tolist()
  assert int(r.drafts[0, 0]) == reference_draft(ids)
  assert kinds[1] == k + 1 and kinds[3] == 2  # all accepted (+ bonus), and one accepted
