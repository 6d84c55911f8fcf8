"""`jaxinfer bench serving` (jaxinfer/bench/serving.py): its per-request statistics (the phases
themselves start servers: run `jaxinfer bench serving` to see them)."""

from jaxinfer.bench import serving as bench_serving


def request(ttft, latency, tokens, itl):
  return {"ttft": ttft, "latency": latency, "tokens": tokens, "itl": itl,
          "tpot": (latency - ttft) / (tokens - 1) if tokens > 1 else None}


def test_one_token_requests_have_a_ttft_and_no_tpot():
  """--output-len 1 (a prefill-only run): TPOT and ITL do not exist, and are not zeros."""
  s = bench_serving.summarize([request(0.5, 0.5, 1, []), request(1.5, 1.5, 1, [])], seconds=2.0)
  assert s["ttft_ms"] == {"mean": 1000.0, "p50": 1000.0, "p90": 1400.0, "p99": 1490.0}
  assert s["tpot_ms"] == s["itl_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
  assert (s["output_tokens"], s["tokens_per_s"]) == (2, 1.0)


def test_tpot_is_taken_over_the_requests_that_have_one():
  s = bench_serving.summarize([request(0.5, 0.5, 1, []), request(1.0, 2.0, 3, [0.5, 0.5])], seconds=4.0)
  assert s["tpot_ms"]["mean"] == 500.0 and s["itl_ms"]["p99"] == 500.0
