"""`jaxinfer serve` as a real process: it listens, turns SERVING, and on
SIGTERM lets in-flight requests finish within the grace period, aborts the
rest with UNAVAILABLE, and exits 0."""

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc

from conftest import tiny_dir
from jaxinfer.serving import Client
from jaxinfer.serving.proto import inference_pb2 as pb


def start(model_dir, *args):
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxinfer", "serve", "--model", str(model_dir), "--port", "0",
       "--max-num-seqs", "8", "--max-num-batched-tokens", "32", *args],
      stderr=subprocess.PIPE, text=True)
  lines = []
  port = None
  end = time.monotonic() + 300
  while time.monotonic() < end:
    line = proc.stderr.readline()
    if not line:
      break
    lines.append(line)
    if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
      port = int(m.group(1))
    if "health: SERVING" in line:
      break
  assert port is not None and proc.poll() is None, "".join(lines)
  threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
  return proc, port, lines


def test_sigterm_drains(tmp_path):
  model = tmp_path / "llama3"
  shutil.copytree(tiny_dir("llama3"), model)
  cfg = json.loads((model / "config.json").read_text())
  cfg["max_position_embeddings"] = 4096
  (model / "config.json").write_text(json.dumps(cfg))
  proc, port, log = start(model, "--grace-period", "2")
  try:
    with Client(f"127.0.0.1:{port}", timeout=120) as c:
      assert c.health() == "SERVING"
      short = c.stream([1, 2, 3], temperature=0, max_tokens=40, ignore_eos=True)
      long = c.stream([4, 5, 6], temperature=0, max_tokens=4000, ignore_eos=True)
      got_short, got_long = [next(short)], [next(long)]
      proc.send_signal(signal.SIGTERM)
      got_short += list(short)  # finishes within the grace period
      assert sum(len(d.token_ids) for d in got_short) == 40
      assert got_short[-1].finish_reason == pb.FINISH_REASON_LENGTH
      try:
        for d in long:
          got_long.append(d)
        raise AssertionError("the long request outlived the grace period")
      except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        assert "shut down before it finished (grace period 2 s)" in e.details()
    assert proc.wait(60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
  time.sleep(0.2)
  text = "".join(log)
  assert "SIGTERM: draining (grace period 2 s)" in text
  assert "1 in-flight requests finished, 1 aborted" in text, text


def test_bad_options_are_one_line_errors():
  out = subprocess.run([sys.executable, "-m", "jaxinfer", "serve", "--model", "/nonexistent/model"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1].startswith("jaxinfer: error:")
