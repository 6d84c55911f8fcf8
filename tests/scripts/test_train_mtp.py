"""scripts/train_mtp.py end to end on a tiny model: it learns, saves the head beside the
checkpoint, and the engine drafts with that head (greedy output unchanged)."""

import json
import shutil
from pathlib import Path

from conftest import tiny_dir
from helpers import load_script
from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint.mtp_head import head_paths

ROOT = Path(__file__).resolve().parents[2]
train_mtp = load_script("train_mtp")

PROMPTS = ["Count from one to ten.", "Name three colours.", "Write a haiku about rain.",
           "What is two plus two?", "Spell the word cat.", "Say hello in French."]


def test_a_trained_head_learns_is_saved_beside_the_model_and_drafts(tmp_path):
  model = tmp_path / "llama3"
  shutil.copytree(tiny_dir("llama3"), model)
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("# one per line\n" + "\n".join(PROMPTS) + "\n")
  out = tmp_path / "train.json"
  assert train_mtp.main(["--model", str(model), "--prompts", str(prompts), "--max-tokens", "24",
                         "--max-steps", "40", "--batch", "2", "--eval-every", "20", "--eval-frac", "0.34",
                         "--lr", "3e-3", "--results", str(out)]) == 0
  result = json.loads(out.read_text())
  curve = result["acceptance_curve"]
  assert [c["step"] for c in curve] == [0, 20, 40]
  # Self-distillation on held-out prompts: both the first and the chained step improve.
  assert curve[-1]["loss_1"] < 0.9 * curve[0]["loss_1"]
  assert curve[-1]["loss_2"] < 0.9 * curve[0]["loss_2"]
  assert curve[-1]["acc_1"] > curve[0]["acc_1"] + 0.1
  assert result["engine_check_max_abs_err"] < 1e-3  # training's attention == the engine's
  assert result["settings"]["sequences"] == 2 * len(PROMPTS)  # one greedy, one sampled each
  head, info = head_paths(model)
  assert head.is_file() and json.loads(info.read_text())["steps"] == 40

  ids = [[1, 5, 9, 200, 17, 3], [1, 42, 42, 42]]
  sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
  options = dict(max_num_seqs=4, max_num_batched_tokens=32, warmup=False)
  want = [o.token_ids for o in LLM(model, **options).generate(ids, sp)]
  llm = LLM(model, speculative={"method": "mtp", "num_speculative_tokens": 2}, **options)
  assert [o.token_ids for o in llm.generate(ids, sp)] == want
  assert llm.engine.stats()["spec_verify_steps"] > 0
