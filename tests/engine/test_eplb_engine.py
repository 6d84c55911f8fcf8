"""EPLB through the engine (EngineConfig.eplb, models/eplb.py): the tiny DeepSeek-V3 with its 8
experts over 8 fake CPU devices and 8 redundant slots, re-planned online every 2 steps, gives
transformers' logits and greedy ids while its expert weights move; a placement file loads; a
placement that does not fit the model or mesh is named."""

import json

import numpy as np
import pytest

from conftest import golden, tiny_dir
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import InvalidRequestError
from jaxinfer.models.eplb import EplbConfig, Placement, plan
from jaxinfer.sharding import make_mesh

OPTS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, warmup=False)


def test_online_replanning_moves_experts_and_keeps_the_outputs():
  mesh = make_mesh(1, 8, 1)
  llm = LLM(tiny_dir("deepseek_v3"), mesh=mesh, eplb={"num_redundant_experts": 8, "replan_interval": 2,
                                                         "window": 4}, **OPTS)
  engine = llm.engine
  first = engine.eplb.placement
  layer = llm.runner.params["layers"][1]["moe"]
  assert layer["w_gate"].shape[0] == 16 and layer["w_gate"].sharding.shard_shape(layer["w_gate"].shape)[0] == 2
  batch = json.loads((tiny_dir("deepseek_v3").parent.parent / "golden" / "batch_deepseek_v3.json").read_text())
  records = batch["records"][:2]
  outs = llm.generate([r["prompt_ids"] for r in records], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
  assert [o.token_ids for o in outs] == [r["greedy_ids"][:6] for r in records]
  # The counts (uneven: 2 prompts through 2 MoE layers) moved experts at least once, and the
  # runner holds the weights of the placement the balancer planned last.
  stats = engine.stats()
  assert stats["eplb_replans"] >= 1 and stats["eplb_slots"] == 16
  assert engine.eplb.placement != first
  slots = np.asarray(engine.eplb.placement.slots)
  moe = llm.runner.params["layers"][1]["moe"]
  table = np.asarray(moe["eplb_slots"])
  for e in range(8):
    assert set(table[e, :np.asarray(moe["eplb_replicas"])[e]]) == set(np.flatnonzero(slots[0] == e))
  # After the moves the logits are still transformers'.
  g = golden("deepseek_v3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)


def test_placement_file_loads_and_mismatches_are_named(tmp_path):
  path = tmp_path / "placement.json"
  plan(np.arange(1, 9), num_devices=8, num_redundant=8).save(path)
  llm = LLM(tiny_dir("deepseek_v3"), mesh=make_mesh(1, 8, 1), eplb=str(path), **OPTS)
  assert llm.engine.eplb.placement == Placement.load(path).for_layers(2)
  assert llm.engine.engine_config.eplb == EplbConfig(placement=Placement.load(path))
  g = golden("deepseek_v3")
  np.testing.assert_allclose(llm.logits(g["token_ids"].tolist()), g["logits"], atol=1e-4, rtol=0)
  plan(np.arange(1, 9), num_devices=4, num_redundant=0).save(path)
  with pytest.raises(InvalidRequestError, match="for 4 expert-parallel devices, the mesh splits the experts over 8"):
    LLM(tiny_dir("deepseek_v3"), mesh=make_mesh(1, 8, 1), eplb=str(path), **OPTS)
  with pytest.raises(InvalidRequestError, match="eplb needs a mixture-of-experts model"):
    LLM(tiny_dir("llama3"), eplb={"num_redundant_experts": 0}, **OPTS)
  with pytest.raises(InvalidRequestError, match="unknown eplb option\\(s\\) \\['redundant'\\]"):
    LLM(tiny_dir("deepseek_v3"), eplb={"redundant": 8}, **OPTS)


def test_cli_plans_a_placement_from_recorded_counts(tmp_path, capsys):
  from jaxinfer.cli import main
  counts = tmp_path / "counts.json"
  counts.write_text(json.dumps({"expert_tokens": [[80, 40, 20, 10, 10, 10, 10, 10]]}))
  out = tmp_path / "placement.json"
  assert main(["eplb", "plan", "--counts", str(counts), "--devices", "4", "--redundant", "4", "-o", str(out)]) == 0
  assert Placement.load(out).slots == ((0, 1, 5, 0, 1, 6, 0, 2, 7, 0, 3, 4),)  # tests/models/test_eplb.py's plan
  # Plain layout 120 / 47.5 rows, placed 50 / 47.5.
  assert "busiest device / mean (worst layer, from these counts): 2.526 with one expert per slot in order, " \
         "1.053 placed" in capsys.readouterr().err
  assert main(["eplb", "plan", "--counts", str(counts), "--devices", "3", "-o", str(out)]) == 1
  assert "8 experts + 0 redundant = 8 slots do not split evenly over 3 devices" in capsys.readouterr().err


def test_cli_flags_become_the_engine_option():
  from jaxinfer.cli import _engine_options, build_parser
  args = build_parser().parse_args(["serve", "--eplb", "p.json", "--eplb-replan-interval", "50", "--eplb-window", "9"])
  assert _engine_options(args)["eplb"] == {"placement": "p.json", "num_redundant_experts": 0,
                                           "replan_interval": 50, "window": 9}
  assert "eplb" not in _engine_options(build_parser().parse_args(["serve"]))
