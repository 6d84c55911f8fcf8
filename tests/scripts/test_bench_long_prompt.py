"""`jaxinfer bench long-prompt` (jaxinfer/bench/long_prompt.py): the TTFT fit and table on cases
made by hand."""

import pytest

from jaxinfer.bench import long_prompt


def test_fit_recovers_the_linear_and_quadratic_terms():
  # ttft = 1e-3 L + 1e-7 L^2 exactly: the fit finds both and no residual.
  cases = [{"prompt_len": L, "ttft_s": 1e-3 * L + 1e-7 * L * L} for L in (1024, 2048, 4096)]
  f = long_prompt.fit(cases)
  assert f["linear_s_per_token"] == pytest.approx(1e-3)
  assert f["quadratic_s_per_token2"] == pytest.approx(1e-7)
  assert f["max_relative_residual"] < 1e-9
  assert f["attention_share_at_longest"] == pytest.approx(1e-7 * 4096**2 / (1e-3 * 4096 + 1e-7 * 4096**2))


def test_ttft_table_sets_each_system_against_jaxinfer_and_marks_missing_lengths():
  ours = {"system": "jaxinfer", "cases": [{"prompt_len": 1024, "ttft_s": 2.0}, {"prompt_len": 2048, "ttft_s": 4.0}]}
  peer = {"system": "llama.cpp", "cases": [{"prompt_len": 1024, "ttft_s": 3.0}]}
  lines = long_prompt.ttft_table([ours, peer], [1024, 2048]).splitlines()
  assert lines[0] == "| prompt tokens | jaxinfer | llama.cpp |"
  assert lines[2:] == ["| 1024 | 2.00 (1.00x) | 3.00 (1.50x) |", "| 2048 | 4.00 (1.00x) | - |"]
