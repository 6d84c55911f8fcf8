"""Structured output: grammars, masks in the step, matchers on commit, with speculation and gRPC.

The tiny Llama 3 has random weights, a 300-token byte-level BPE vocabulary
and 320 logits (20 padding ids); the tiny Mistral a sentencepiece one. With
random weights a sampled JSON string would run on, so string schemas carry
maxLength and arrays maxItems: a complete output then fits max_tokens.
"""

import json
import re

import jsonschema
import numpy as np
import pytest

from conftest import tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.grammar import Grammar, GrammarCompiler, fill_bitmasks, mask_words
from jaxinfer.errors import InvalidRequestError, TokenizerError
from jaxinfer.structured import StructuredOutput
from jaxinfer.tokenizer import Tokenizer

SCHEMAS = {
    "nested object, required fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 5},
                                       "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "array of enums": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                "minItems": 1, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False,
    },
    "bounded numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "number", "minimum": -1.5, "maximum": 2},
                       "ok": {"type": "boolean"}},
        "required": ["age", "score", "ok"], "additionalProperties": False,
    },
    "array of objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "kind": {"enum": ["a", "b", None]}},
                  "required": ["id", "kind"], "additionalProperties": False},
    },
}


def free_greedy(n=24):
  return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def constrained(seed, max_tokens=160, **kind):
  return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured=StructuredOutput(**kind))


@pytest.fixture(scope="module")
def llm():
  return LLM(tiny_dir("llama3"), max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
             warmup=False)


@pytest.fixture(scope="module")
def free_prompts():
  return ["the cat", "a b c d", "hello world", "x"]


@pytest.fixture(scope="module")
def free_ids(llm, free_prompts):
  """Greedy ids of the free prompts, run with no constrained request anywhere."""
  return [o.token_ids for o in llm.generate(free_prompts, free_greedy())]


def assert_free_unchanged(outs, free_ids):
  assert [o.token_ids for o in outs] == free_ids


# ---- the engine end to end ----------------------------------------------------------------

def test_json_schema_outputs_validate_in_a_batch_with_free_greedy_requests(llm, free_prompts, free_ids):
  seeds = range(6)
  cases = [(name, seed) for name in SCHEMAS for seed in seeds]
  prompts = free_prompts + ["{"] * len(cases)
  params = [free_greedy()] * len(free_prompts) + [constrained(seed, json_schema=SCHEMAS[name])
                                                 for name, seed in cases]
  outs = llm.generate(prompts, params)
  assert_free_unchanged(outs[:len(free_prompts)], free_ids)
  for (name, seed), o in zip(cases, outs[len(free_prompts):]):
    assert o.finish_reason == "stop", (name, seed, o.text)
    jsonschema.validate(json.loads(o.text), SCHEMAS[name])
  # Sampled at temperature 1, the seeds do not all agree: the grammar constrained real draws.
  assert len({o.text for o in outs[len(free_prompts):]}) > len(SCHEMAS)


def test_regex_choice_and_json_object_outputs(llm, free_prompts, free_ids):
  regexes = [r"\d{3}-\d{4}", r"[a-z]{2,5}@[a-z]{3}\.(com|org)", r"(yes|no)!{0,3}"]
  choices = ("yes", "no", "maybe so", "Ünïcode ✓")
  reqs = ([constrained(s, regex=r) for r in regexes for s in range(4)]
          + [constrained(s, choice=choices) for s in range(8)]
          + [constrained(s, max_tokens=200, json_object=True) for s in range(8)])
  outs = llm.generate(free_prompts + ["go"] * len(reqs), [free_greedy()] * len(free_prompts) + reqs)
  assert_free_unchanged(outs[:len(free_prompts)], free_ids)
  outs = outs[len(free_prompts):]
  for i, r in enumerate(regexes):
    for o in outs[4 * i:4 * i + 4]:
      # A regex can stop early only on EOS, which it allows once it matches.
      assert o.finish_reason == "stop" and re.fullmatch(r, o.text), (r, o.text)
  for o in outs[12:20]:
    assert o.finish_reason == "stop" and o.text in choices
  assert len({o.text for o in outs[12:20]}) > 1
  done = [o for o in outs[20:] if o.finish_reason == "stop"]
  assert len(done) >= 4  # random weights may nest an object past max_tokens now and then
  for o in done:
    assert isinstance(json.loads(o.text), dict)


def test_properties_come_in_the_schemas_order(llm):
  """StructuredOutput keeps the schema's key order (sorting it would reorder the output)."""
  schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
            "required": ["zeta", "alpha"], "additionalProperties": False}
  o = llm.generate(["{"], constrained(0, json_schema=schema))[0]
  assert o.finish_reason == "stop" and list(json.loads(o.text)) == ["zeta", "alpha"]


def test_sentencepiece_vocabulary():
  """The tiny Mistral's sentencepiece vocabulary goes to llguidance as byte strings."""
  llm = LLM(tiny_dir("mistral"), max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
            warmup=False)
  outs = llm.generate(["a"] * 6, [constrained(s, regex=r"[a-z]{1,4} \d{2}") for s in range(3)]
                      + [constrained(s, choice=("hello there", "bye")) for s in range(3)])
  for o in outs[:3]:
    assert o.finish_reason == "stop" and re.fullmatch(r"[a-z]{1,4} \d{2}", o.text), o.text
  for o in outs[3:]:
    assert o.finish_reason == "stop" and o.text in ("hello there", "bye"), o.text


def test_logprobs_are_the_models_unconstrained_distribution(llm):
  """A constrained token's logprob is log_softmax of the raw logits, not of the masked row."""
  prompt = llm.tokenizer.encode("abc")
  o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=2,
                                            structured=StructuredOutput(regex=r"[0-9]{3}")))[0]
  assert o.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}", o.text)
  raw = llm.logits(prompt + o.token_ids[:-1])[len(prompt) - 1:]  # [3, V]
  want = raw - np.log(np.exp(raw - raw.max(-1, keepdims=True)).sum(-1, keepdims=True)) - raw.max(-1, keepdims=True)
  got = [want[j, t] for j, t in enumerate(o.token_ids)]
  np.testing.assert_allclose(o.logprobs, got, rtol=1e-4, atol=1e-4)
  assert max(got) < -1e-3  # the mask did restrict: a masked row would give the digits all the mass


def test_speculative_decoding_keeps_outputs_valid_and_identical(llm):
  """Seeded constrained requests commit the same tokens with n-gram drafts as without:
  drafts the grammar rejects are cut, and row j is masked by the state after j drafts."""
  schema = SCHEMAS["array of enums"]
  reqs = [constrained(s, json_schema=schema) for s in range(6)] + [constrained(s, regex=r"(ab|ba){2,6}")
                                                                     for s in range(4)]
  prompts = ['{"tags": ["red", "red", "blue"]} {"tags": ["red",'] * 6 + ["abab abba"] * 4
  plain = llm.generate(prompts, reqs)
  spec_llm = LLM(tiny_dir("llama3"), speculative={"method": "ngram", "num_speculative_tokens": 3},
                 max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, warmup=False)
  spec = spec_llm.generate(prompts, reqs)
  assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
  for o in spec[:6]:
    assert o.finish_reason == "stop"
    jsonschema.validate(json.loads(o.text), schema)
  for o in spec[6:]:
    assert o.finish_reason == "stop" and re.fullmatch(r"(ab|ba){2,6}", o.text)
  assert spec_llm.engine.stats()["spec_accepted_tokens"] > 0


def test_preemption_does_not_consume_tokens_twice(llm):
  """A pool too small for the batch preempts requests; recomputing their KV must not feed
  their tokens to the matcher again (which would reject them or end them early)."""
  reqs = [constrained(s, json_schema=SCHEMAS["nested object, required fields"]) for s in range(8)]
  want = llm.generate(["{"] * 8, reqs)  # seeded: the same tokens in any batch
  small = LLM(tiny_dir("llama3"), num_pages=17, max_num_seqs=8, max_num_batched_tokens=32,
              max_model_len=256, warmup=False)
  got = small.generate(["{"] * 8, reqs)
  assert small.engine.stats()["preemptions"] > 0
  assert [o.token_ids for o in got] == [o.token_ids for o in want]
  assert all(o.finish_reason == "stop" for o in got)


# ---- errors, abort ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind,value,message", [
    ("json_schema", {"type": "frobnicate"}, r"^structured\.json_schema: .*frobnicate"),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, r"^structured\.json_schema: "),
    ("regex", "a(b", r"^structured\.regex: .*unclosed group"),
    ("regex", "[a&&b]x", r"^structured\.regex: no output can satisfy it"),  # valid, but matches nothing
    ("json_schema", {"type": "string", "minLength": 5, "maxLength": 2}, r"^structured\.json_schema: Unsatisfiable"),
])
def test_rejected_grammars_fail_at_add_request_and_the_engine_keeps_serving(llm, kind, value, message):
  engine = llm.engine
  with pytest.raises(InvalidRequestError, match=message):
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=16, structured=StructuredOutput(**{kind: value})))
  assert engine.num_unfinished == 0 and not engine.has_unfinished()  # nothing was queued
  o = llm.generate(["ok"], constrained(0, regex=r"[0-9]{2}"))[0]
  assert re.fullmatch(r"[0-9]{2}", o.text)


def test_a_model_without_tokenizer_refuses_structured_requests():
  llm = LLM(tiny_dir("qwen2"), max_num_seqs=2, max_model_len=64, warmup=False)  # ships no tokenizer
  with pytest.raises(TokenizerError, match="structured output needs the model's tokenizer"):
    llm.engine.add_request("r", [1, 2], SamplingParams(max_tokens=4, structured=StructuredOutput(regex="a")))
  assert not llm.engine.has_unfinished()


def test_abort_frees_the_matcher(llm):
  engine = llm.engine
  engine.add_request("a", [5, 6, 7], constrained(0, json_schema=SCHEMAS["bounded numbers"]))
  req = engine._requests["a"]
  engine.step()
  assert req.output.grammar is not None
  out = engine.abort("a")
  assert out.finish_reason == "abort" and req.output.grammar is None
  assert not engine.has_unfinished()


# ---- grammars and masks, no model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler():
  return GrammarCompiler(Tokenizer.from_hf_dir(tiny_dir("llama3")), vocab_size=320)


def allowed_ids(row):
  return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def test_masks_of_verify_rows_follow_the_drafts_and_skip_padding(compiler):
  tok = compiler.tokenizer
  g = compiler.matcher(StructuredOutput(regex=r"(ab|cd)+"))
  a, b, c = (tok.token_to_id(ch) for ch in "abc")
  allowed = np.full((5, mask_words(320)), -1, np.int32)
  fill_bitmasks([(g, 1, [a, b])], allowed)
  assert (allowed[0] == -1).all() and (allowed[4] == -1).all()  # rows not named stay free
  assert set(allowed_ids(allowed[1])) >= {a, c} and b not in allowed_ids(allowed[1])
  assert list(allowed_ids(allowed[2])) == [b]  # after "a" only "b"
  after_ab = set(allowed_ids(allowed[3]))
  assert {a, c} <= after_ab and set(tok.eos_ids) <= after_ab  # complete: EOS allowed
  # the drafts were not consumed: the matcher is back at the start
  assert g.valid_prefix([b]) == 0 and g.valid_prefix([a, b, c]) == 3
  # any text: every id of the tokenizer may be allowed, the 20 padding ids never
  anything = compiler.matcher(StructuredOutput(regex=r"(.|\n)*"))
  row = np.full((1, mask_words(320)), -1, np.int32)
  fill_bitmasks([(anything, 0, [])], row)
  ids = allowed_ids(row[0])
  assert ids.max() < tok.vocab_size == 300 and len(ids) > 200
  # llguidance already leaves those ids out; fill_bitmasks clears past num_tokens itself
  # (what a tokenizer that claims its padding ids would need): 290 cuts inside a word.
  fill_bitmasks([(Grammar(anything.matcher, num_tokens=290), 0, [])], row)
  assert allowed_ids(row[0]).max() == ids[ids < 290].max() and set(allowed_ids(row[0])) == set(ids[ids < 290])


def test_compiled_grammars_are_cached_and_matchers_independent(compiler):
  s = StructuredOutput(choice=("yes", "no"))
  g1, g2 = compiler.matcher(s), compiler.matcher(StructuredOutput(choice=["yes", "no"]))
  assert compiler._compiled[s] is not None and len([k for k in compiler._compiled if k == s]) == 1
  y = compiler.tokenizer.encode("yes", add_special_tokens=False)
  for t in y:
    g1.consume(t)
  assert g1.finished and not g2.finished


# ---- gRPC ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("structured", [
    StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutput(json_object=True),
    StructuredOutput(regex=r"\d+"),
    StructuredOutput(choice=("yes", "no")),
])
def test_grpc_round_trip(structured):
  from jaxinfer.serving import convert
  from jaxinfer.serving.proto import inference_pb2 as pb
  params = SamplingParams(temperature=0.5, max_tokens=9, structured=structured)
  wire = convert.sampling_to_proto(params).SerializeToString()
  back = convert.sampling_from_proto(pb.SamplingOptions.FromString(wire))
  assert back.structured == structured and back.max_tokens == 9
  # keyword form, as Client.generate(..., structured={...}) passes it
  kw = {structured.kind: getattr(structured, structured.kind)}
  assert convert.sampling_from_proto(convert.sampling_to_proto(structured=kw)).structured == structured


def test_grpc_bad_structured_options_name_the_field():
  from jaxinfer.serving import convert
  from jaxinfer.serving.proto import inference_pb2 as pb
  with pytest.raises(InvalidRequestError, match=r"^sampling\.structured is set but none of"):
    convert.sampling_from_proto(pb.SamplingOptions(structured=pb.StructuredOutput()))
  with pytest.raises(InvalidRequestError, match=r"^sampling\.structured\.json_schema is not valid JSON"):
    convert.sampling_from_proto(pb.SamplingOptions(structured=pb.StructuredOutput(json_schema="{")))
  assert convert.sampling_from_proto(pb.SamplingOptions()).structured is None
