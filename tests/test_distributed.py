"""Multi-host: two `jax.distributed` processes on loopback (4 CPU devices each, gloo
collectives) run one model sharded over all 8 devices, the leader scheduling, and
produce transformers' greedy ids; bad multi-host flags get one-line errors."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import DATA, tiny_dir
from jaxinfer.cli import main

FAMILY = "mixtral"  # 8 query and 8 kv heads, expert width 32: heads, kv heads and expert FFNs split over 8 devices
MESH = "1,1,8"  # the model axis spans both processes: every layer runs collectives across them


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_give_transformers_greedy_ids(tmp_path):
  g = json.loads((DATA / "golden" / f"batch_{FAMILY}.json").read_text())
  records = g["records"][:4]
  n = 8  # a prefix of transformers' 16 greedy ids: enough steps, half the time
  src = tmp_path / "in.jsonl"
  src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": r["prompt_ids"]}) + "\n"
                         for i, r in enumerate(records)))
  out = tmp_path / "out.jsonl"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  coordinator = f"127.0.0.1:{free_port()}"
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jaxinfer", "generate", "--model", str(tiny_dir(FAMILY)),
       "--mesh", MESH, "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i),
       "--input", str(src), "--output", str(out), "--quiet", "--no-chat-template",
       "--max-tokens", str(n), "--ignore-eos", "--max-model-len", "128",
       "--max-num-seqs", "4", "--max-num-batched-tokens", "32"],
      env=env, stdout=logs[i].open("w"), stderr=subprocess.STDOUT) for i in range(2)]
  try:
    # One process failing leaves the other waiting in a collective: stop both then.
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  logs = [f.read_text() for f in logs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  # The follower really ran the steps: one per new token at least.
  followed = re.search(r"process 1 ran (\d+) device calls from the leader", logs[1])
  assert followed and int(followed.group(1)) >= n, logs[1][-3000:]
  results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
  assert sorted(results) == [f"r{i}" for i in range(len(records))]
  for i, r in enumerate(records):
    assert results[f"r{i}"]["token_ids"] == r["greedy_ids"][:n], i


def test_a_two_process_server_serves_and_its_follower_leaves_on_drain(tmp_path):
  """`serve` on two hosts: the leader warms both up through the broadcast (the
  server warms up after start), answers, and on SIGTERM releases the follower."""
  from jaxinfer.serving.client import Client
  from jaxinfer.serving.process import JaxinferProcess
  g = json.loads((DATA / "golden" / f"batch_{FAMILY}.json").read_text())
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  flags = ["serve", "--model", str(tiny_dir(FAMILY)), "--mesh", MESH, "--coordinator",
           f"127.0.0.1:{free_port()}", "--num-processes", "2", "--max-model-len", "128",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
  log = tmp_path / "follower.log"
  follower = subprocess.Popen([sys.executable, "-m", "jaxinfer", *flags, "--process-id", "1"], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
  leader = JaxinferProcess(*flags, "--process-id", "0", "--port", "0", env=env)
  try:
    leader.wait()
    with Client(leader.address, timeout=300) as c:
      for r in g["records"][:2]:
        out = c.generate(r["prompt_ids"], max_tokens=8, ignore_eos=True, temperature=0)
        assert out.token_ids == r["greedy_ids"][:8]
    leader.stop()
    assert leader.proc.returncode == 0, leader.tail()
    assert follower.wait(60) == 0, log.read_text()[-3000:]
  finally:
    leader.stop()
    follower.kill()
  followed = re.search(r"process 1 ran (\d+) device calls from the leader", log.read_text())
  assert followed and int(followed.group(1)) >= 16, log.read_text()[-3000:]


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2"], "--num-processes needs --coordinator"),
    (["--coordinator", "nohost", "--num-processes", "2", "--mesh", "1,1,1"], "--coordinator must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2", "--mesh", "1,1,1"],
     r"--process-id must be in \[0, 2\)"),
    (["--mesh", "1,8"], "--mesh must be DATA,EXPERT,MODEL"),
])
def test_bad_multi_host_flags(argv, message, capsys):
  assert main(["generate", "--model", str(tiny_dir("llama3")), *argv, "hi"]) == 1
  assert re.search(message, capsys.readouterr().err)
