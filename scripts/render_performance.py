#!/usr/bin/env python
"""Render docs/performance.md from benchmarks/results/*.json: the page is generated, never
written by hand, so every number on it is in a JSON a command wrote.

For each benchmark (a results file's name up to its date: `offline-quant-2026-11-27-x.json`
is benchmark `offline-quant`; runs whose rows name their workloads and systems are told apart by
them too) and each machine class (the GPU's name, or the CPU's model, core count and widest
vector ISA), the latest run becomes a section (by the JSON's timestamp; runs that recorded only
their day cannot be ordered within it, so each of the last day's is shown): device / CPU, commit,
date, the command that wrote it, a link to the JSON, and its rows as a table. The ratios in the tables are the ones each benchmark
computed side by side within one run (`vs_*`, `speedup*`, `ratio*`); runs on different
machines or days are never divided by each other here, since a shared 2-core host drifts by
10% or more between runs. Files the renderer cannot read (not JSON, not an object) are listed
as skipped, not dropped silently.

  python scripts/render_performance.py           # rewrite docs/performance.md
  python scripts/render_performance.py --check   # exit 1 if the page is stale (tests do this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
# How the page links a results file: docs/results is a symlink to ../benchmarks/results, so the
# link works in the built site (mkdocs copies the JSON) and in a checkout.
LINK_PREFIX = "results/"
DATE = re.compile(r"-(\d{4}-\d{2}-\d{2})")
# At most this many columns and rows per table; the JSON holds the rest.
MAX_COLUMNS = 13
MAX_ROWS = 40
# Top-level lists of objects that are not results but raw samples or logs.
NOT_TABLES = {"runs", "raw", "train_log_every_10", "acceptance_curve", "failures", "notes"}
# Objects that describe the machine: they are the section's heading, not a table.
MACHINE_KEYS = {"cpu", "machine"}


# Scripts whose benchmarks moved into `jaxinfer bench SUBCOMMAND` with the same flags: a run's
# recorded command stays as it was run, and the page shows the command that repeats it today.
MOVED_SCRIPTS = {
    "bench_offline.py": "offline",
    "bench_peers.py": "peer",
    "bench_spec.py": "spec",
    "bench_structured.py": "structured",
    "bench_kv_cache.py": "kv-cache",
    "bench_mosaic.py": "mosaic",
    "bench_kernels.py": "kernels",
    "bench_quant_matmul.py": "quant",
    "bench_simd_peak.py": "simd-peak",
    "bench_cpu_tiles.py": "cpu-tiles",
    "trace_step.py": "trace",
    "profile_step.py": "profile",
    "mlperf.py": "mlperf",
    "simulate_router.py": "router-sim",
    "bench_router.py": "router",
    "bench_kv_transfer.py": "kv-transfer",
    "bench_serving.py": "serving",
    "bench_long_prompt.py": "long-prompt",
    "bench_eplb.py": "eplb",
    "simulate_adp.py": "adp-sim",
    "bench_layers.py": "layers",
}
# Scripts that served one investigation and were removed after it: the commit that still has them.
REMOVED_SCRIPTS = {
    "eval_int8_layouts.py": "1275bad",
    "bench_sampling.py": "4d584e8",
}
# (script, the recorded arguments) -> the subcommand and flags that do the same run today.
_BATCH1_INTERLEAVED = re.compile(r"(?:\S*/)?bench_batch1_interleaved\.py(?:\s+(\d+))?(?:\s+(\S+))?")


def current_command(command: str) -> str | None:
  """The `jaxinfer bench ...` command that repeats a run recorded as a since-moved script's
  command line; None when the recorded command is still current (or names no moved script)."""
  m = _BATCH1_INTERLEAVED.search(command)
  if m:
    rounds, out = m.group(1) or "5", m.group(2)
    return (f"jaxinfer bench offline --interleaved {rounds} --formats int8,int8-channel,int4,fp8 --peers none"
            + (f" --out {out}" if out else ""))
  for script, sub in MOVED_SCRIPTS.items():
    m = re.search(rf"(?:^|[\s=(])(?:\S*/)?{re.escape(script)}(?=\s|$|\))(.*)", command)
    if m:
      rest = m.group(1).split(" (")[0].strip().rstrip(")")  # a note in parentheses is not a flag
      return f"jaxinfer bench {sub}" + (f" {rest}" if rest else "")
  return None


@dataclass(frozen=True)
class Run:
  path: Path
  benchmark: str
  machine: str
  variant: str     # what the run compared: its workloads and systems ('' when its rows do not say)
  commit: str
  date: str        # YYYY-MM-DD
  sort_key: tuple  # (full timestamp or date, file name): the latest run sorts last
  command: str
  data: dict


def _isa(info: dict) -> str:
  if info.get("amx"):
    return "AMX"
  if info.get("avx512_vnni"):
    return "AVX-512 VNNI" + (" BF16" if info.get("avx512_bf16") else "")
  if info.get("avx512"):
    return "AVX-512"
  if info.get("avx2") or info.get("avx512") is False:
    return "AVX2"
  return "ISA not recorded"


def machine_class(data: dict) -> str:
  """The GPU's name, else 'CPU model, N cores, widest ISA' from whichever field the benchmark
  recorded its machine in."""
  if isinstance(data.get("device"), str) and data["device"].lower() not in ("cpu", ""):
    return data["device"]
  info = next((data[k] for k in ("cpu", "machine") if isinstance(data.get(k), dict)), {})
  model = info.get("cpu_model") or data.get("cpu_model")
  cores = info.get("cpus") or (data["cpu"] if isinstance(data.get("cpu"), int) else None)
  if not model and not info:
    return "machine not recorded"
  return f"{model or 'CPU model not recorded'}, {cores or '?'} cores, {_isa(info)}"


def variant(data: dict) -> str:
  """'workloads | systems' of a run whose rows name them (bench_offline's do): a batch-1 run
  against llama.cpp and a 64-prompt run of jaxinfer alone are different benchmarks, so one is
  not hidden behind the other as 'older'."""
  rows = data.get("rows") if isinstance(data.get("rows"), list) else []
  rows = [r for r in rows if isinstance(r, dict)]
  parts = []
  for key in ("workload", "system"):
    seen = sorted({str(r[key]) for r in rows if r.get(key) is not None})
    if seen:
      parts.append(", ".join(seen))
  return " | ".join(parts)


def load(path: Path) -> Run:
  """A results file as a Run; ValueError says why it cannot be rendered."""
  try:
    data = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"not readable JSON ({e.__class__.__name__}: {e})") from None
  if not isinstance(data, dict):
    raise ValueError(f"a JSON {type(data).__name__}, not an object")
  m = DATE.search(path.stem)
  if m is None:
    raise ValueError("no YYYY-MM-DD date in its name")
  benchmark = path.stem[:m.start()]
  stamp = data.get("date") if isinstance(data.get("date"), str) else m.group(1)
  commit = data.get("commit") or data.get("git_commit") or "not recorded"
  command = data.get("command")
  if isinstance(command, list):
    command = " ".join(map(str, command))
  return Run(path=path, benchmark=benchmark, machine=machine_class(data), variant=variant(data), commit=str(commit).split(" ")[0],
             date=stamp[:10], sort_key=(stamp, path.name), command=command or "not recorded in the JSON",
             data=data)


def _cell(v) -> str | None:
  """A table cell, or None for values a table cannot show (lists, objects, long text)."""
  if v is None:
    return "-"
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, int):
    return str(v)
  if isinstance(v, float):
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
  if isinstance(v, str) and len(v) <= 60:
    return v.replace("|", "\\|")
  return None


def _flatten(row: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in row.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _rows(value) -> list[dict] | None:
  """A list of objects, or an object of objects ({setup: {...}}, keyed in a first column)."""
  if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
    return [_flatten(r) for r in value]
  if isinstance(value, dict) and value and all(isinstance(r, dict) for r in value.values()):
    return [{"": k, **_flatten(r)} for k, r in value.items()]
  return None


RATIO = re.compile(r"(^|[._])(vs|ratio|speedup|pct)")
# Columns every offline row carries that say how the run was set up rather than what it measured
# (the JSON keeps them).
SETUP_COLUMNS = {"version", "startup_s", "compiled_programs", "peak_processes", "rss_after_run_mb", "process_s",
                 "generated_tokens", "model"}


def table(rows: list[dict]) -> list[str]:
  """Label columns (text) first, then measurements, then the side-by-side ratios, which are
  always shown; up to MAX_COLUMNS in all."""
  columns: list[str] = []
  for r in rows:
    for k, v in r.items():
      if k not in columns and k not in SETUP_COLUMNS and v is not None and _cell(v) is not None:
        columns.append(k)
  def is_label(c):
    return all(isinstance(r.get(c), (str, bool)) or r.get(c) is None for r in rows)
  ratios = [c for c in columns if RATIO.search(c) and not is_label(c)]
  labels = [c for c in columns if is_label(c) and c not in ratios]
  numbers = [c for c in columns if c not in ratios and c not in labels]
  columns = (labels + numbers)[:max(MAX_COLUMNS - len(ratios), 4)] + ratios
  if not columns:
    return []
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows[:MAX_ROWS]:
    lines.append("| " + " | ".join(_cell(r.get(c)) or "(see JSON)" for c in columns) + " |")
  if len(rows) > MAX_ROWS:
    lines.append(f"\n({len(rows) - MAX_ROWS} more rows in the JSON.)")
  return lines


def fields(values: dict) -> list[str]:
  """An object of numbers as a two-column table."""
  cells = {k: c for k, v in _flatten(values).items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and (c := _cell(v))}
  if not cells:
    return []
  return ["| field | value |", "|---|---:|"] + [f"| {k} | {c} |" for k, c in cells.items()]


def section(run: Run, older: list[Run]) -> list[str]:
  name = run.path.name
  out = [f"### {run.machine}" + (f": {run.variant}" if run.variant else ""), "",
         f"- run: [`{name}`]({LINK_PREFIX}{name}), commit `{run.commit}`, {run.date}",
         f"- command: `{run.command}`"]
  today = current_command(run.command)
  if today:
    out.append(f"- the same run today: `{today}`")
  for script, commit in REMOVED_SCRIPTS.items():
    if script in run.command:
      out.append(f"- the script was removed after this investigation: `git show {commit}:scripts/{script}`")
  if older:
    out.append("- older runs of it on this machine class: "
               + ", ".join(f"[`{o.path.name}`]({LINK_PREFIX}{o.path.name})" for o in older))
  out.append("")
  # A plot the benchmark drew beside its JSON (same name, .png) is shown with it.
  if run.path.with_suffix(".png").is_file():
    out += [f"![{run.benchmark}]({LINK_PREFIX}{run.path.with_suffix('.png').name})", ""]
  blocks = []
  for key, value in run.data.items():
    if (key in NOT_TABLES and isinstance(value, list)) or key in MACHINE_KEYS:
      continue
    rows = _rows(value)
    lines = table(rows) if rows else fields(value) if isinstance(value, dict) else []
    if lines:
      blocks.append((key, lines))
  top = fields({k: v for k, v in run.data.items() if not isinstance(v, (dict, list))})
  if top:
    blocks.append(("", top))
  for key, lines in blocks:
    out += ([f"`{key}`:", ""] if key and len(blocks) > 1 else []) + lines + [""]
  if not blocks:
    out += ["(No table in this JSON: open it for the numbers.)", ""]
  return out


def latest(runs: list[Run]) -> list[Run]:
  """The latest of runs of one benchmark on one machine class, in name order. A run that
  recorded only its day (no time) cannot be ordered against the other runs of that day, so
  each such run of the last day is shown, with the latest timestamped one of that day."""
  last_day = max(r.date for r in runs)
  today = [r for r in runs if r.date == last_day]
  timed = [r for r in today if len(r.sort_key[0]) > 10]
  out = [r for r in today if len(r.sort_key[0]) <= 10] + ([max(timed, key=lambda r: r.sort_key)] if timed else [])
  return sorted(out, key=lambda r: r.path.name)


def render(results: Path = RESULTS) -> str:
  runs: list[Run] = []
  skipped: list[tuple[str, str]] = []
  for path in sorted(results.glob("*.json")):
    try:
      runs.append(load(path))
    except ValueError as e:
      skipped.append((path.name, str(e)))
  groups: dict[str, dict[str, list[Run]]] = {}
  for run in runs:
    groups.setdefault(run.benchmark, {}).setdefault((run.machine, run.variant), []).append(run)
  out = ["# Performance", "",
         "<!-- Generated by scripts/render_performance.py from benchmarks/results/*.json: do not edit;",
         "     rerun the script after adding a result (tests/test_performance_page.py checks it). -->", "",
         "Every number here is in a JSON under `benchmarks/results/`, written by the command shown",
         "beside it. For each benchmark and each machine class, the latest run is shown (each of the",
         "last day's runs, where a run recorded only its day); older runs are linked, and git keeps",
         "the ones deleted. Ratios (`vs_*`, `speedup`, `ratio*`) were",
         "computed within one run, side by side on one machine: compare ratios, not absolute numbers",
         "across machines or days (the 2-core CPU hosts drift by 10% or more between runs).", "",
         "How to add a result: run `jaxinfer bench SUBCOMMAND --out benchmarks/results/NAME-DATE.json`",
         "([benchmarking](benchmarking.md)), then `python scripts/render_performance.py`.", ""]
  out += ["| benchmark | machine classes | latest runs shown | runs kept |", "|---|---:|---:|---:|"]
  for bench in sorted(groups):
    machines = {machine for machine, _ in groups[bench]}
    shown = sum(len(latest(runs)) for runs in groups[bench].values())
    out.append(f"| [{bench}](#{_anchor(bench)}) | {len(machines)} | {shown} | "
               f"{sum(map(len, groups[bench].values()))} |")
  out.append("")
  for bench in sorted(groups):
    out += [f"## {bench}", ""]
    for machine in sorted(groups[bench]):
      newest = latest(groups[bench][machine])
      older = sorted((r for r in groups[bench][machine] if r not in newest), key=lambda r: r.sort_key, reverse=True)
      for i, run in enumerate(newest):
        out += section(run, older if i == len(newest) - 1 else [])
  if skipped:
    out += ["## Skipped files", "", "These results files could not be rendered:", ""]
    out += [f"- `{name}`: {why}" for name, why in skipped] + [""]
  return "\n".join(out).rstrip("\n") + "\n"


def _anchor(heading: str) -> str:
  # Python-Markdown's toc slug: lowercase, punctuation dropped, spaces to '-'.
  slug = re.sub(r"[^\w\s-]", "", heading.lower()).strip()
  return re.sub(r"[-\s]+", "-", slug)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--results", type=Path, default=RESULTS, help="folder of results JSON")
  ap.add_argument("--out", type=Path, default=PAGE, help="the page to write or check")
  ap.add_argument("--check", action="store_true", help="exit 1 if --out differs from a fresh render")
  args = ap.parse_args(argv)
  if not args.results.is_dir():
    ap.error(f"--results {args.results}: not a folder")
  page = render(args.results)
  if args.check:
    current = args.out.read_text() if args.out.exists() else ""
    if current != page:
      print(f"{args.out} is stale against {args.results}: run python scripts/render_performance.py",
            file=sys.stderr)
      return 1
    print(f"{args.out} is up to date")
    return 0
  args.out.write_text(page)
  print(f"wrote {args.out} ({page.count(chr(10))} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
