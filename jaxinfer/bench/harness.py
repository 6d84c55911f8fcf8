"""What every `jaxinfer bench` subcommand shares: the workload, the environment a number was
measured in, the JSON it is written to, and the table it is printed as.

A result is only worth keeping with the machine, the commit and the command beside it, and on a
shared CPU host with the load average around the run (a 2-core host drifts by 10% or more
between runs, so systems are compared by ratios measured side by side in one run). So every
subcommand writes through `write_results`, which adds `environment()` to its payload.

Only the standard library is imported here: `jaxinfer bench --help` and the peers' plumbing
must not pay for jax.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# The repository checkout this package lives in (editable installs and `PYTHONPATH=.` runs):
# benchmarks/results/, tests/data/ and the peers' venvs in .peers/ are found from here. An
# installed wheel has no checkout around it: then the directory it runs in takes its place.
_CHECKOUT = Path(__file__).resolve().parents[2]
ROOT = _CHECKOUT if (_CHECKOUT / "benchmarks").is_dir() else Path.cwd()
RESULTS = ROOT / "benchmarks" / "results"


class UsageError(ValueError):
  """A flag value a subcommand's parser could not check alone: `jaxinfer bench` reports it as
  a usage error (exit status 2), not a traceback."""


def cpu_info() -> dict[str, Any]:
  """The CPU's model name and whether it has AMX and AVX-512 (what `lscpu` shows).

  The peers' numbers depend on it more than jaxinfer's do: vLLM-CPU's bfloat16
  matmuls (oneDNN) run on AMX where there is AMX and are many times slower
  without it, so every result should carry it and ratios are only comparable
  within one machine.
  """
  model, flags = "", set()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      key, _, val = line.partition(":")
      key = key.strip()
      if key == "model name" and not model:
        model = val.strip()
      elif key == "flags" and not flags:
        flags = set(val.split())
  except OSError:  # not Linux: the model name only
    pass
  return {"cpu_model": model or platform.processor(), "cpus": os.cpu_count(),
          "amx": "amx_tile" in flags, "avx512": "avx512f" in flags,
          # bfloat16 and int8 dot instructions (XLA CPU's YNNPACK dots use them where present)
          "avx512_bf16": "avx512_bf16" in flags, "avx512_vnni": "avx512_vnni" in flags, "avx2": "avx2" in flags}


def git_commit() -> str:
  """HEAD's short hash, with '+dirty' when tracked files differ from it (then the numbers are
  not HEAD's); 'unknown' outside a git checkout."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
  except OSError:
    return "unknown"
  return (head + ("+dirty" if dirty else "")) if head else "unknown"


def command_line(argv: Sequence[str] | None = None) -> str:
  """How this run was started, as a user would retype it: `jaxinfer bench ...` when it came
  through the CLI (the dispatcher passes its argv), else this process's argv."""
  if argv is not None:
    return "jaxinfer bench " + " ".join(argv)
  return " ".join([Path(sys.argv[0]).name if sys.argv[0].endswith("__main__.py") else sys.argv[0],
                   *sys.argv[1:]])


def subcommand_argv(name: str) -> list[str]:
  """The argv that runs `jaxinfer bench NAME` in a fresh process of this Python (a benchmark's
  own jaxinfer worker: a system measured in its own process, like each peer)."""
  return [sys.executable, "-m", "jaxinfer", "bench", name]


def load_average() -> list[float]:
  """1, 5 and 15-minute load averages (what `uptime` prints); [] where the OS has none."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return []


def environment(command: str | None = None, device: str | None = None) -> dict[str, Any]:
  """The fields a result carries about where and how it was measured: UTC date, commit,
  command, the machine (platform, Python, CPU model and vector ISA) and, for GPU runs, the
  device's name; `load_average_before` is taken now."""
  env: dict[str, Any] = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "commit": git_commit(), "command": command or command_line(),
      "machine": {"platform": platform.platform(), "python": platform.python_version(), **cpu_info()},
      "load_average_before": load_average()}
  if device:
    env["device"] = device
  return env


def results_path(kind: str, out: str | os.PathLike[str] | None = None) -> Path:
  """`out`, or benchmarks/results/<kind>-<today>.json (the name the performance page groups by)."""
  return Path(out) if out else RESULTS / f"{kind}-{datetime.date.today().isoformat()}.json"


def write_results(kind: str, payload: dict[str, Any], out: str | os.PathLike[str] | None = None, *,
                  env: dict[str, Any] | None = None) -> Path:
  """Writes `{"benchmark": kind, **environment, **payload, "load_average_after"}` as JSON to
  `out` (default `results_path(kind)`) and returns the path. `env` is the environment taken
  when the run started (so its load average is the one before the run); fields the payload
  sets itself win."""
  path = results_path(kind, out)
  path.parent.mkdir(parents=True, exist_ok=True)
  record = {"benchmark": kind, **(env or environment()), **payload}
  record.setdefault("load_average_after", load_average())
  path.write_text(json.dumps(record, indent=1))
  return path


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
  """rows as a Markdown table of `columns` (floats to 4 significant digits, '-' where absent)."""
  def cell(v: Any) -> str:
    if v is None:
      return "-"
    if isinstance(v, float):
      return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


# ---- workloads ----------------------------------------------------------------------------------

QUESTIONS = (
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a neural network is.", "Translate 'good morning' into Spanish.",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarize the plot of Hamlet.",
    "What is photosynthesis?", "Name the planets of the solar system.",
    "How do I reverse a list in Python?", "What causes earthquakes?",
    "Describe a cat to someone who has never seen one.", "What is 17 times 23?",
    "Suggest a name for a bakery.", "Write a short poem about autumn.",
)


def chat_questions(n: int) -> list[str]:
  """n user questions: QUESTIONS in turn, '(variant k)' appended past the first len(QUESTIONS)
  so that no two prompts of a batch share their whole text."""
  out = []
  for i in range(n):
    q = QUESTIONS[i % len(QUESTIONS)]
    out.append(q if i < len(QUESTIONS) else f"{q} (variant {i // len(QUESTIONS)})")
  return out


def prompts_token_ids(n: int) -> list[list[int]]:
  """n chat prompts of the default model, as token ids (the same for every system)."""
  from jaxinfer.default_model import default_checkpoint
  from jaxinfer.tokenizer import Tokenizer
  tok = Tokenizer.load(Path(default_checkpoint()) / "tokenizer")
  return [tok.encode_chat([{"role": "user", "content": q}]) for q in chat_questions(n)]


@dataclass(frozen=True)
class Workload:
  """One generation workload, the same for jaxinfer and every peer: `num_prompts` chat
  prompts of the default model, `max_tokens` greedy new tokens each, EOS ignored (so every
  system generates exactly num_prompts * max_tokens tokens)."""
  num_prompts: int
  max_tokens: int

  def __post_init__(self):
    if self.num_prompts < 1 or self.max_tokens < 1:
      raise ValueError(f"a workload needs num_prompts >= 1 and max_tokens >= 1, got {self}")

  @property
  def label(self) -> str:
    return f"{self.num_prompts} prompts x {self.max_tokens}"

  def token_ids(self) -> list[list[int]]:
    return prompts_token_ids(self.num_prompts)
