"""Multi-host: two `jax.distributed` processes on loopback (4 CPU devices each, gloo
collectives) serve one model sharded over all 8 devices, the leader scheduling, and
answer with transformers' greedy ids; bad multi-host flags get one-line errors.
(`generate` takes the same path: _load_llm, then the leader runs and the follower
follows until LLM.close.)"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import DATA, tiny_dir
from jaxinfer.cli import main

FAMILY = "mixtral"  # 8 query and 8 kv heads, expert width 32: heads, kv heads and expert FFNs split over 8 devices
MESH = "1,1,8"  # the model axis spans both processes: every layer runs collectives across them


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_a_two_process_server_serves_and_its_follower_leaves_on_drain(tmp_path):
  """`serve` on two hosts: the leader warms both up through the broadcast (the
  server warms up after start), answers, and on SIGTERM releases the follower.

  Slow (~45 s on two busy cores): two fresh processes each import jax, load the model and
  compile every warm-up program (collectives across the two), which is the broadcast path
  the follower's >= 16 device calls check."""
  from jaxinfer.serving.client import Client
  from jaxinfer.serving.process import JaxinferProcess
  g = json.loads((DATA / "golden" / f"batch_{FAMILY}.json").read_text())
  # 4 devices per process, and the suite's cheapest LLVM pipeline (tests/conftest.py): both
  # processes compile every warm-up program, most of this test's time.
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  flags = ["serve", "--model", str(tiny_dir(FAMILY)), "--mesh", MESH, "--coordinator",
           f"127.0.0.1:{free_port()}", "--num-processes", "2", "--max-model-len", "128",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "8"]  # 4 step buckets to warm up
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
