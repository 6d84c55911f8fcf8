"""What moving a prompt's KV from a prefill worker to a decode worker costs.

    jaxinfer bench kv-transfer                  # SmolLM2-135M (the default model), 128 and 512 tokens
    jaxinfer bench kv-transfer --model tests/data/tiny/llama3 --lengths 128

Starts `jaxinfer serve --role prefill` and `--role decode` (on it) as
processes on loopback and measures, per prompt length (fresh random prompts,
so no prefix cache helps):

- raw KVTransfer.Prefill against the prefill worker: bytes per token, the
  time from the request to the header (prefill: the prompt's compute) and
  from the header to `done` (the pages: exported chunk by chunk on the
  prefill worker's engine thread, serialized, sent over loopback), Ack
  excluded;
- end to end: time to first token through the decode worker (prefill +
  transfer + import into the decode pool + the first token streamed) vs
  asking the prefill worker itself (it also serves Generate): the difference
  is what disaggregation adds to TTFT.
- jax.experimental.transfer, for comparison: a second process pulls an
  array of the same bytes from this one (the device-to-device path we did
  not use; see jaxinfer/serving/disagg.py).

Writes benchmarks/results/kv-transfer-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np

from jaxinfer.bench.harness import environment, write_results
from jaxinfer.bench.serving import start_server


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab - 1, length).tolist() for _ in range(n)]


async def raw_transfers(address: str, batch: list[list[int]]) -> list[dict]:
  import grpc

  from jaxinfer.serving.convert import sampling_to_proto
  from jaxinfer.serving.proto import kv_transfer_pb2 as kv_pb
  from jaxinfer.serving.proto import kv_transfer_pb2_grpc as kv_grpc

  rows = []
  async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
    stub = kv_grpc.KVTransferStub(ch)
    for ids in batch:
      call = stub.Prefill()
      t0 = time.perf_counter()
      await call.write(kv_pb.PrefillClientMessage(request=kv_pb.PrefillRequest(
          request_id="bench", prompt_token_ids=ids, sampling=sampling_to_proto(temperature=0, seed=1))))
      header = (await call.read()).header
      t1 = time.perf_counter()
      nbytes = chunks = 0
      while (msg := await call.read()).WhichOneof("kind") == "chunk":
        nbytes += len(msg.chunk.data)
        chunks += 1
      t2 = time.perf_counter()
      assert msg.done.num_bytes == nbytes
      await call.write(kv_pb.PrefillClientMessage(ack=kv_pb.Ack()))
      await call.done_writing()
      while await call.read() is not grpc.aio.EOF:
        pass
      rows.append(dict(prefill_s=t1 - t0, transfer_s=t2 - t1, bytes=nbytes, pages=header.num_pages,
                       chunks=chunks))
  return rows


async def ttfts(address: str, batch: list[list[int]]) -> list[float]:
  from jaxinfer.serving import Client
  out = []
  async with Client(address, timeout=600) as c:
    for ids in batch:
      t = time.perf_counter()
      async for r in c.astream(ids, temperature=0, max_tokens=2, ignore_eos=True):
        if r.token_ids:
          out.append(time.perf_counter() - t)
          break
  return out


_PULL = textwrap.dedent("""
    import sys, time, jax, jax.numpy as jnp
    from jax.experimental import transfer
    addr, n = sys.argv[1], int(sys.argv[2])
    s = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    conn = s.connect(addr)
    spec = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    for uuid in range(1, 6):
      t = time.perf_counter()
      jax.block_until_ready(conn.pull(uuid, [spec]))
      print(time.perf_counter() - t, flush=True)
""")


def transfer_library(nbytes: int) -> dict:
  """Five pulls of an nbytes float32 array by another process through jax.experimental.transfer."""
  try:
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer
    server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    n = nbytes // 4
    for uuid in range(1, 6):
      server.await_pull(uuid, [jnp.full((n,), float(uuid), jnp.float32)])
    out = subprocess.run([sys.executable, "-c", _PULL, server.address(), str(n)], capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
      return dict(usable=False, error=out.stderr[-2000:])
    times = [float(x) for x in out.stdout.split()]
    return dict(usable=True, jax=jax.__version__, bytes=nbytes, pull_s=times,
                median_pull_s=statistics.median(times))
  except Exception as e:  # reported, not fatal: the gRPC numbers stand on their own
    return dict(usable=False, error=f"{type(e).__name__}: {e}")


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
  p.add_argument("--lengths", default="128,512")
  p.add_argument("--requests", type=int, default=5, help="per length (after one warm-up request)")
  p.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
  env = environment(args.command)

  from jaxinfer.checkpoint import load_model
  from jaxinfer.default_model import default_checkpoint
  model = args.model or str(default_checkpoint())
  cfg = load_model(model, dtype="float32").config
  opts = ["--model", model, "--max-num-seqs", "8"]
  prefill = start_server([*opts, "--role", "prefill", "--kv-transfer-timeout", "60"])
  decode = None
  try:
    decode = start_server([*opts, "--role", "decode", "--prefill-workers", f"127.0.0.1:{prefill.port}"])
    rows = []
    for i, length in enumerate(int(x) for x in args.lengths.split(",")):
      # One warm-up each (export / import programs compile on first use), then fresh prompts.
      asyncio.run(raw_transfers(f"127.0.0.1:{prefill.port}", prompts(1, length, cfg.vocab_size, 100 + i)))
      asyncio.run(ttfts(f"127.0.0.1:{decode.port}", prompts(1, length, cfg.vocab_size, 200 + i)))
      raw = asyncio.run(raw_transfers(f"127.0.0.1:{prefill.port}",
                                      prompts(args.requests, length, cfg.vocab_size, 300 + i)))
      via_decode = asyncio.run(ttfts(f"127.0.0.1:{decode.port}", prompts(args.requests, length, cfg.vocab_size, 400 + i)))
      local = asyncio.run(ttfts(f"127.0.0.1:{prefill.port}", prompts(args.requests, length, cfg.vocab_size, 500 + i)))
      med = lambda xs: statistics.median(xs)
      row = dict(prompt_tokens=length, requests=args.requests,
                 bytes_per_request=raw[0]["bytes"], bytes_per_token=raw[0]["bytes"] / length,
                 pages=raw[0]["pages"], chunks=raw[0]["chunks"],
                 prefill_s=med([r["prefill_s"] for r in raw]), transfer_s=med([r["transfer_s"] for r in raw]),
                 transfer_mb_per_s=raw[0]["bytes"] / med([r["transfer_s"] for r in raw]) / 1e6,
                 ttft_via_decode_s=med(via_decode), ttft_on_one_worker_s=med(local),
                 ttft_added_s=med(via_decode) - med(local), raw=raw)
      rows.append(row)
      print(f"{length:5d} tokens: {row['bytes_per_token']:.0f} B/token, {row['bytes_per_request'] / 2**20:.2f} MiB, "
            f"prefill {row['prefill_s'] * 1e3:.1f} ms, transfer {row['transfer_s'] * 1e3:.1f} ms "
            f"({row['transfer_mb_per_s']:.0f} MB/s); TTFT via decode {row['ttft_via_decode_s'] * 1e3:.1f} ms "
            f"vs one worker {row['ttft_on_one_worker_s'] * 1e3:.1f} ms", flush=True)
  finally:
    if decode is not None:
      decode.stop()
    prefill.stop()
  lib = transfer_library(max(r["bytes_per_request"] for r in rows))
  print(f"jax.experimental.transfer: {lib}", flush=True)
  out = write_results("kv-transfer", dict(
      model=model, dtype="float32", page_size=16, chunk_bytes=4 << 20, rows=rows, transfer_library=lib,
      note="gRPC over loopback on a CPU host shared with other jobs: transfer_s includes the "
           "prefill worker's device-to-host export per chunk and serialization; ttft_added_s "
           "also includes the decode worker's import and scheduling"), args.out, env=env)
  print(f"wrote {out}")
  return 0
