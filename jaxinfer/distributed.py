"""Multi-host serving: one process per host, one scheduler, the same programs everywhere.

JAX runs a model over several hosts as a *multi-controller* program: every
process holds its own devices' shards of the weights and KV cache and must
launch the same jitted programs, in the same order, with the same host
inputs. jaxinfer keeps one scheduler, on the leader (process 0); the other
processes (followers) have no scheduler, tokenizer work or server. Each
time the leader's engine touches the devices it goes through the runner, and
`LeaderRunner` broadcasts that call first: for a step, the packed
`StepBatch` arrays (the step's inputs exactly as the leader built them);
for the rest (warm-up, sampler-history rows, KV page and token
export/import, the logits of a prompt), the call's arguments. `follow` is
the followers' loop: receive a call, run it on the local runner, repeat
until the leader closes.

`LeaderRunner` is an explicit interface, not a pass-through: each runner
call the engine makes is named once, in `MIRRORED` (it launches device
programs or changes the cache or sampler state, so every process runs it)
or in `LOCAL` (a host-only read of the leader's runner). Any other name is
an AttributeError, so a new cache-changing call cannot silently run on the
leader alone (the way a decode worker's imported KV once would have: its
`import_tokens` was forwarded to the leader's runner only).

    leader (process 0)                      follower (process i)
    engine.step()                           follow(runner)
      scheduler.schedule()                    |
      runner.execute(seqs)                    |
        batch = pack(seqs)                    |
        broadcast(("run_batch", batch)) ----> call = receive()
        run_batch(batch)  <== collectives ==> runner.run_batch(batch)

The channel is JAX's own collective (`multihost_utils.broadcast_one_to_all`
over a pickled call padded to a power-of-two bucket, so it compiles a
bounded number of programs), so a deployment needs nothing beyond the
coordinator address `jax.distributed` already needs. The processes trust
each other: calls are pickled.

Legend: P processes, one of them the leader (process 0).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Callable

import numpy as np

from jaxinfer.errors import InvalidRequestError, JaxinferError

log = logging.getLogger(__name__)

# The ModelRunner calls the leader's engine makes, each named once (tests/test_distributed.py
# checks that every public ModelRunner method is in one of these or in UNUSED).
# Mirrored: they launch device programs (the processes' collectives must meet) or change
# the KV cache or sampler history, so the followers run them too, in the leader's order,
# with its arguments. (Steps are mirrored as "run_batch", see LeaderRunner.launch.)
MIRRORED = ("warmup", "reset_state", "set_history", "export_pages", "export_tokens", "import_pages",
            "import_tokens", "logits")
# Local: host-only reads of the leader's runner (no device program, no state change;
# `collect` fetches a step's results, which every process holds in full).
LOCAL = ("collect", "kv_layout", "num_import_pages", "state_lost", "compiled_programs", "max_programs",
         "step_bucket", "num_seqs_bucket", "cache_spec", "token_buckets")
# Never reached through a LeaderRunner: the step's halves (`launch` sends the packed batch)
# and single-host tools (`jaxinfer bench trace`).
UNUSED = ("pack_step", "launch_packed", "run_batch", "sampler_mode", "trace_step")
_MIN_BYTES = 4096  # the smallest message bucket: a decode step's call fits
_CLOSE = "__close__"
_KEEPALIVE = "__keepalive__"


def initialize(coordinator: str, num_processes: int, process_id: int, *,
               timeout_s: int = 300) -> None:
  """Joins this process to a `jax.distributed` job (call before any other JAX work).

  On CPU the cross-process collectives go through gloo (loopback tests, CPU
  clusters); on GPU through NCCL, which JAX picks by itself.
  """
  if num_processes < 1:
    raise InvalidRequestError(f"--num-processes must be >= 1, got {num_processes}")
  if not 0 <= process_id < num_processes:
    raise InvalidRequestError(f"--process-id must be in [0, {num_processes}), got {process_id}")
  host, sep, port = coordinator.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise InvalidRequestError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes, process_id,
                             initialization_timeout=timeout_s)
  log.info("process %d of %d joined %s: %d local of %d devices", jax.process_index(),
           jax.process_count(), coordinator, jax.local_device_count(), jax.device_count())


def is_multi_host() -> bool:
  import jax
  return jax.process_count() > 1


def is_leader() -> bool:
  import jax
  return jax.process_index() == 0


class Channel:
  """Leader-to-all messages over JAX collectives (every process must take part in each)."""

  def send(self, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    self._broadcast(np.array([len(data)], np.int64))
    buf = np.zeros(_bucket(len(data)), np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    self._broadcast(buf)

  def receive(self) -> Any:
    n = int(self._broadcast(np.zeros(1, np.int64))[0])
    buf = self._broadcast(np.zeros(_bucket(n), np.uint8))
    return pickle.loads(np.asarray(buf)[:n].tobytes())

  @staticmethod
  def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def _bucket(n: int) -> int:
  return max(_MIN_BYTES, 1 << (n - 1).bit_length())


class LeaderRunner:
  """The leader's view of its ModelRunner: the calls in MIRRORED are sent to the followers
  first, those in LOCAL are the local runner's, any other is an AttributeError."""

  def __init__(self, runner: Any, channel: Channel | None = None):
    self._runner = runner
    self._channel = channel or Channel()
    self._closed = False

  def execute(self, seqs) -> Any:
    return self._runner.collect(self.launch(seqs))

  def launch(self, seqs) -> Any:
    # Followers get the packed step, not the scheduled sequences: packing needs
    # the requests' grammar matchers and full token lists, which live only here.
    T, prompt_lp, batch = self._runner.pack_step(seqs)
    self._call("run_batch", T, prompt_lp, batch)
    return self._runner.launch_packed(T, prompt_lp, batch)

  def warmup(self, progress=None) -> None:
    self._call("warmup")  # the progress bar is the leader's own
    self._runner.warmup(progress)

  def keepalive(self) -> None:
    """An empty call: followers wait in a collective, which must not sit idle for too long."""
    self._call(_KEEPALIVE)

  def close(self) -> None:
    """Lets the followers' `follow` return (the leader is done with the devices)."""
    if not self._closed:
      self._closed = True
      self._channel.send((_CLOSE, (), {}))

  def _call(self, name: str, *args, **kwargs) -> None:
    if self._closed:
      raise JaxinferError("the multi-host runner is closed: the followers have left")
    self._channel.send((name, args, kwargs))


def _mirrored(name: str):
  def call(self: LeaderRunner, *args, **kwargs):
    self._call(name, *args, **kwargs)
    return getattr(self._runner, name)(*args, **kwargs)
  call.__name__ = call.__qualname__ = name
  call.__doc__ = f"ModelRunner.{name}, run by the followers first (mirrored)."
  return call


def _local(name: str) -> property:
  return property(lambda self: getattr(self._runner, name),
                  doc=f"The leader's ModelRunner.{name} (host-only, not mirrored).")


for _name in MIRRORED:
  if _name not in vars(LeaderRunner):  # warmup keeps its progress bar on the leader
    setattr(LeaderRunner, _name, _mirrored(_name))
for _name in LOCAL:
  setattr(LeaderRunner, _name, _local(_name))
del _name


def follow(runner: Any, channel: Channel | None = None, on_call: Callable[[str], None] | None = None) -> int:
  """A follower's loop: runs the leader's runner calls until it closes; returns the calls run.

  A call that fails with a JaxinferError failed on the leader too (the same
  inputs, the same checks), which reported it to its client; the follower
  logs it and goes on, exactly as the leader's engine does.
  """
  channel = channel or Channel()
  calls = 0
  while True:
    name, args, kwargs = channel.receive()
    if name == _CLOSE:
      return calls
    if name == _KEEPALIVE:
      continue
    if name != "run_batch" and name not in MIRRORED:
      raise JaxinferError(f"the leader sent an unknown runner call {name!r}: are both on one version?")
    try:
      getattr(runner, name)(*args, **kwargs)
    except JaxinferError as e:
      log.warning("runner call %s failed (as on the leader): %s", name, e)
    calls += 1
    if on_call is not None:
      on_call(name)
