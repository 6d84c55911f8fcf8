"""Multi-host: two `jax.distributed` processes on loopback (4 CPU devices each, gloo
collectives) serve one model sharded over all 8 devices, the leader scheduling, as a
decode worker behind a one-process prefill worker: the KV a prefill worker sends is
written on both processes (`import_tokens` is mirrored), so they answer with
transformers' greedy ids, which one process gives too (tests/engine/test_engine.py).
Bad multi-host flags get one-line errors; the leader's runner interface names every
ModelRunner call once. (`generate` takes the same path: _load_llm, then the leader runs
and the follower follows until LLM.close.)"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import grpc
import pytest

from conftest import DATA, FUSION_EMITTERS_OFF, tiny_dir
from jaxinfer import distributed
from jaxinfer.cli import main
from jaxinfer.engine.runner import ModelRunner

FAMILY = "mixtral"  # 8 query and 8 kv heads, expert width 32: heads, kv heads and expert FFNs split over 8 devices
MESH = "1,1,8"  # the model axis spans both processes: every layer runs collectives across them


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
  end = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < end, f"timed out waiting for {what}"
    time.sleep(0.05)


def test_a_two_process_decode_worker_takes_kv_from_a_prefill_worker(tmp_path):
  """`serve --role decode` on two hosts behind `serve --role prefill` on one: the leader
  warms both hosts up through the broadcast (the server warms up after start); every
  prompt's KV comes from the prefill worker, and the greedy tokens equal one process's.
  A request cancelled mid-decode leaves both pools empty (full size again). On SIGTERM
  the leader releases the follower.

  Slow (over 30 s on two busy cores): three fresh processes each import jax, load the model
  and compile every warm-up program (the two decode hosts with collectives across them)."""
  from jaxinfer.serving.client import Client, build_request
  from jaxinfer.serving.process import JaxinferProcess
  from jaxinfer.serving.proto import inference_pb2_grpc as pb_grpc
  g = json.loads((DATA / "golden" / f"batch_{FAMILY}.json").read_text())
  # 4 devices per process, and the suite's cheapest LLVM pipeline and fusion emitters
  # (tests/conftest.py): the processes compile every warm-up program, most of this test's time.
  xla_flags = ("--xla_backend_optimization_level=0", FUSION_EMITTERS_OFF, "--xla_force_host_platform_device_count=4")
  env = dict(os.environ, XLA_FLAGS=" ".join(f for f in xla_flags if f), JAX_PLATFORMS="cpu")
  engine = ["--model", str(tiny_dir(FAMILY)), "--max-model-len", "128", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "8", "--metrics-port", "0"]  # 4 step buckets to warm up
  prefill_port = free_port()
  flags = ["serve", *engine, "--mesh", MESH, "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes",
           "2", "--role", "decode", "--prefill-workers", f"127.0.0.1:{prefill_port}"]
  log = tmp_path / "follower.log"
  follower = subprocess.Popen([sys.executable, "-m", "jaxinfer", *flags, "--process-id", "1"], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
  prefill = JaxinferProcess("serve", *engine, "--role", "prefill", "--port", str(prefill_port), env=env)
  leader = JaxinferProcess(*flags, "--process-id", "0", "--port", "0", env=env)
  try:
    prefill.wait()
    leader.wait()
    pools_empty = lambda: [w.metric("jaxinfer_kv_cache_usage_ratio") for w in (leader, prefill)] == [0.0, 0.0]
    with grpc.insecure_channel(leader.address) as ch:
      call = pb_grpc.InferenceStub(ch).Generate(build_request(g["records"][2]["prompt_ids"], stream=True,
                                                              temperature=0, max_tokens=100, ignore_eos=True),
                                                 timeout=120)
      next(call)  # the first token: its KV came over, the decode worker holds pages
      assert leader.metric("jaxinfer_kv_cache_usage_ratio") > 0
      call.cancel()
    wait_for(pools_empty, "both pools to empty after the cancel")
    with Client(leader.address, timeout=120) as c:
      for r in g["records"][:2]:
        out = c.generate(r["prompt_ids"], max_tokens=8, ignore_eos=True, temperature=0)
        assert out.token_ids == r["greedy_ids"][:8]
    wait_for(pools_empty, "both pools to empty")
    leader.stop()
    assert leader.proc.returncode == 0, leader.tail()
    assert follower.wait(60) == 0, log.read_text()[-3000:]
  finally:
    leader.stop()
    prefill.stop()
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


class FakeChannel:
  def __init__(self):
    self.sent = []

  def send(self, message):
    self.sent.append(message)


class FakeRunner:
  """Records the calls it runs; `kv_layout` and `token_buckets` are host-only reads."""

  def __init__(self):
    self.calls = []
    self.token_buckets = (8, 16)

  def __getattr__(self, name):
    return lambda *args, **kwargs: self.calls.append((name, args, kwargs)) or name


def test_the_leader_mirrors_cache_changing_calls_and_keeps_reads_local():
  channel, runner = FakeChannel(), FakeRunner()
  leader = distributed.LeaderRunner(runner, channel)
  assert leader.import_tokens([3, 4], 5, ["run"]) == "import_tokens"
  assert leader.export_tokens([3], 0, 2) == "export_tokens"
  assert leader.kv_layout() == "kv_layout"
  assert leader.token_buckets == (8, 16)
  assert channel.sent == [("import_tokens", ([3, 4], 5, ["run"]), {}), ("export_tokens", ([3], 0, 2), {})]
  assert [c[0] for c in runner.calls] == ["import_tokens", "export_tokens", "kv_layout"]
  with pytest.raises(AttributeError):
    leader.params  # neither mirrored nor local: not silently the leader's alone


def test_every_model_runner_method_is_mirrored_local_or_unused():
  """A new ModelRunner method must be classified in jaxinfer/distributed.py (a cache
  writer left out would run on the leader's devices only)."""
  public = {n for n, v in vars(ModelRunner).items() if callable(v) and not n.startswith("_")}
  named = [*distributed.MIRRORED, *distributed.LOCAL, *distributed.UNUSED, "execute", "launch"]
  assert len(named) == len(set(named))
  assert public - set(named) == set()
