"""`jaxinfer bench trace` (jaxinfer/bench/trace.py) reading a profiler trace: only top-level XLA
operations count."""

from jaxinfer.bench import trace as trace_step


def _op(name, ts, dur, tid=1):
  return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_operations_inside_a_loop_and_python_frames_do_not_count_twice():
  events = [
      _op("$engine.py:475 step", 0, 100),          # a Python frame around everything
      _op("while.12", 10, 30),                      # a loop ...
      _op("copy_bitcast_fusion.3", 12, 5),          # ... and an operation inside it
      _op("ffi_call.7", 45, 20),
      _op("ThunkExecutor::Execute", 0, 100),        # runtime bookkeeping, not an operation
      _op("ffi_call.8", 50, 10, tid=2),             # another thread's operation, overlapping
      {"ph": "i", "name": "marker", "ts": 3, "tid": 1},
  ]
  got = [(e["name"], e["tid"]) for e in trace_step.top_level_ops(events)]
  assert got == [("while.12", 1), ("ffi_call.7", 1), ("ffi_call.8", 2)]
