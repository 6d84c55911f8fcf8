"""`jaxinfer serve` / `jaxinfer route` as a child process, for scripts, benchmarks and tests.

    with JaxinferProcess("serve", "--model", path, "--port", "0", "--metrics-port", "0").wait() as p:
      client = Client(p.address)
      ...
      p.metric("jaxinfer_kv_cache_usage_ratio")
    # leaving the block sends SIGTERM (the process drains) and waits for it

The ports (`--port 0`: any free one) are read off the process's start-up
lines; `wait` returns once it reports health SERVING (warm-up done), or
raises with the tail of its log if it exits or takes too long.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

_PORTS = {
    "port": re.compile(r"listening on \S+:(\d+)"),
    "metrics_port": re.compile(r"metrics on http://\S+:(\d+)/metrics"),
    "http_port": re.compile(r"OpenAI HTTP on http://\S+:(\d+)/v1"),
}


class JaxinferProcess:
  """`python -m jaxinfer ARGS...`; its stderr is kept in `log` (a list of lines)."""

  def __init__(self, *args: str, cwd=None, env=None):
    self.args = [str(a) for a in args]
    self.proc = subprocess.Popen([sys.executable, "-m", "jaxinfer", *self.args], stderr=subprocess.PIPE,
                                 text=True, cwd=cwd, env=env)
    self.log: list[str] = []
    self.port: int | None = None
    self.metrics_port: int | None = None
    self.http_port: int | None = None

  def wait(self, timeout: float = 600.0) -> "JaxinferProcess":
    """Returns once the process reports health SERVING; its ports are known then."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      line = self.proc.stderr.readline()
      if not line:
        raise RuntimeError(f"`jaxinfer {' '.join(self.args[:1])}` exited during start-up "
                           f"(code {self.proc.wait()}):\n" + self.tail())
      self.log.append(line)
      for name, pattern in _PORTS.items():
        if m := pattern.search(line):
          setattr(self, name, int(m.group(1)))
      if "health: SERVING" in line:
        # Keep draining stderr: a full pipe would block the process.
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        return self
    self.stop()
    raise RuntimeError(f"`jaxinfer {' '.join(self.args[:1])}` did not turn SERVING within {timeout:g} s:\n"
                       + self.tail())

  @property
  def address(self) -> str:
    return f"127.0.0.1:{self.port}"

  def tail(self, lines: int = 40) -> str:
    return "".join(self.log[-lines:])

  def metrics_text(self) -> str:
    if self.metrics_port is None:
      raise RuntimeError("the process was started without --metrics-port")
    with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
      return r.read().decode()

  def metric(self, name: str) -> float:
    """One sample of the Prometheus scrape, e.g. 'jaxinfer_kv_cache_usage_ratio'."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", self.metrics_text(), re.M)
    if m is None:
      raise KeyError(f"{name} is not in the process's /metrics")
    return float(m.group(1))

  def stop(self, timeout: float = 30.0) -> None:
    """SIGTERM (a drain), then SIGKILL past `timeout`."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()

  def __enter__(self) -> "JaxinferProcess":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()
