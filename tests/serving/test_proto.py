"""The committed Python stubs match inference.proto and kv_events.proto (regenerated here with grpcio-tools)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("inference", "kv_events")
# Lines that name the generator's version: they may differ without the API differing.
VERSION_LINE = re.compile(r"Protobuf Python Version|GRPC_GENERATED_VERSION =|^\s+\d+,$|_runtime_version")


def normalized(text: str) -> list[str]:
  return [line for line in text.splitlines() if not VERSION_LINE.search(line)]


@pytest.mark.parametrize("stem", PROTOS)
def test_stubs_are_fresh(tmp_path, stem):
  proto = f"jaxinfer/serving/proto/{stem}.proto"
  out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", proto],
                       cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"):
    fresh = (tmp_path / "jaxinfer/serving/proto" / name).read_text()
    committed = (ROOT / "jaxinfer/serving/proto" / name).read_text()
    assert normalized(committed) == normalized(fresh), (
        f"{name} is stale: regenerate it (see the comment at the top of {proto})")


@pytest.mark.parametrize("name", ["Generate", "Tokenize", "Detokenize", "GetModelInfo"])
def test_service_methods(name):
  from jaxinfer.serving.proto import inference_pb2 as pb
  service = pb.DESCRIPTOR.services_by_name["Inference"]
  assert service.full_name == "jaxinfer.v1.Inference"
  assert service.methods_by_name[name].server_streaming == (name == "Generate")


def test_kv_events_service():
  from jaxinfer.serving.proto import kv_events_pb2 as kv_pb
  service = kv_pb.DESCRIPTOR.services_by_name["KVEvents"]
  assert service.full_name == "jaxinfer.v1.KVEvents"
  assert service.methods_by_name["WatchKVEvents"].server_streaming
