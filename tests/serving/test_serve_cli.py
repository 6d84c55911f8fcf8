"""`jaxinfer serve` as a real process: it listens (gRPC and, with
--http-port, OpenAI HTTP over the same engine), turns SERVING, and on
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
import pytest
import httpx

from conftest import tiny_dir
from jaxinfer.serving import Client
from jaxinfer.serving.proto import inference_pb2 as pb


def start(model_dir, *args):
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxinfer", "serve", "--model", str(model_dir), "--port", "0",
       "--max-num-seqs", "8", "--max-num-batched-tokens", "32", *args],
      stderr=subprocess.PIPE, text=True)
  lines = []
  port = http_port = None
  end = time.monotonic() + 300
  while time.monotonic() < end:
    line = proc.stderr.readline()
    if not line:
      break
    lines.append(line)
    if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
      port = int(m.group(1))
    if m := re.search(r"OpenAI HTTP on http://127\.0\.0\.1:(\d+)/v1", line):
      http_port = int(m.group(1))
    if "health: SERVING" in line:
      break
  assert port is not None and proc.poll() is None, "".join(lines)
  threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
  return proc, port, http_port, lines


def test_sigterm_drains(tmp_path):
  model = tmp_path / "llama3"
  shutil.copytree(tiny_dir("llama3"), model)
  cfg = json.loads((model / "config.json").read_text())
  cfg["max_position_embeddings"] = 4096
  (model / "config.json").write_text(json.dumps(cfg))
  proc, port, http_port, log = start(model, "--grace-period", "2", "--http-port", "0")
  try:
    with Client(f"127.0.0.1:{port}", timeout=120) as c:
      assert c.health() == "SERVING"
      http = f"http://127.0.0.1:{http_port}"
      assert httpx.get(f"{http}/health").status_code == 200
      # One engine, one registry: HTTP's /metrics counts the tokens of both transports.
      r = httpx.post(f"{http}/v1/completions", json=dict(prompt=[1, 2], max_tokens=3, ignore_eos=True), timeout=60)
      assert r.json()["usage"]["completion_tokens"] == 3
      assert len(c.generate([1, 2], max_tokens=4, ignore_eos=True).token_ids) == 4
      assert "jaxinfer_generation_tokens_total 7.0" in httpx.get(f"{http}/metrics").text
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
    with pytest.raises(httpx.ConnectError):  # the HTTP listener went down with the rest
      httpx.get(f"{http}/health")
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


def test_decode_prefill_workers_expand_dns_names_before_loading_the_model(capsys):
  """`--prefill-workers dns:HOST:PORT` (a headless Service) resolves at start, like `route`'s;
  a name that does not resolve is a one-line error naming the flag, before any weights load."""
  from jaxinfer.cli import main

  assert main(["serve", "--role", "decode", "--model", "/nonexistent/model",
               "--prefill-workers", "dns:no-such-host.invalid:50051"]) == 1
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("jaxinfer: error: --prefill-workers: 'dns:no-such-host.invalid:50051'"), err
  assert "does not resolve" in err
