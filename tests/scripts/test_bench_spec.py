"""`jaxinfer bench spec` (jaxinfer/bench/spec.py): each configuration's row against the run
without speculation at its batch size, on rows made by hand."""

from jaxinfer.bench import spec


def row(method, k, batch, tokens_per_s, seconds, steps, ids):
  return dict(method=method, k=k, batch=batch, tokens_per_s=tokens_per_s, seconds=seconds, steps=steps, ids=ids)


def test_summarize_sets_each_row_against_none_at_its_batch():
  rows = spec.summarize([row("none", 0, 1, 10.0, 2.0, 100, [[1, 2]]),
                         row("ngram", 2, 1, 15.0, 1.0, 40, [[1, 2]]),
                         row("none", 0, 16, 100.0, 4.0, 50, [[3]]),
                         row("mtp", 1, 16, 80.0, 5.0, 50, [[4]])])
  got = [(r["speedup"], r["same_tokens_as_without"], r["ms_per_step"], r["step_cost_vs_none"]) for r in rows]
  # ngram at batch 1: 25 ms a step against none's 20 (1.25x the cost), 2.5x fewer steps: 1.5x the speed.
  assert got == [(1.0, True, 20.0, 1.0), (1.5, True, 25.0, 1.25), (1.0, True, 80.0, 1.0), (0.8, False, 100.0, 1.25)]
  assert "| 1 | ngram | 2 | 15.0 | 1.50x | 40 | 25.0 | 1.25x | - | - | True |" in spec.table(rows)
