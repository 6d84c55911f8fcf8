"""`jaxinfer bench quant` (jaxinfer/bench/quant.py) on a short chain: one row per shape and token
count, each form timed, and a bad form named."""

import json

import pytest

from jaxinfer import bench


def test_quant_times_each_form_per_shape(tmp_path):
  out = tmp_path / "quant.json"
  assert bench.main(["quant", "--layers", "2", "--repeats", "1", "--tokens", "1",
                     "--forms", "float32,int8 split", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert [(r["shape"], r["tokens"]) for r in result["matmuls"]] == [
      ("gate/up D->F", 1), ("down F->D", 1), ("wq/wo D->D", 1)]
  assert all(r["float32 us"] > 0 and r["int8 split us"] > 0 for r in result["matmuls"])
  assert result["e2e"] == [] and result["accuracy"] is None


def test_quant_names_a_bad_form_or_format(capsys):
  with pytest.raises(SystemExit):
    bench.main(["quant", "--layers", "1", "--forms", "int3"])
  assert "--forms: unknown ['int3']" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    bench.main(["quant", "--e2e-formats", "int2"])
  assert "--e2e-formats: unknown ['int2']" in capsys.readouterr().err
