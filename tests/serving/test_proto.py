"""The committed Python stubs match inference.proto (regenerated here with grpcio-tools)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = "jaxinfer/serving/proto/inference.proto"
STUBS = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")
# Lines that name the generator's version: they may differ without the API differing.
VERSION_LINE = re.compile(r"Protobuf Python Version|GRPC_GENERATED_VERSION =|^\s+\d+,$|_runtime_version")


def normalized(text: str) -> list[str]:
  return [line for line in text.splitlines() if not VERSION_LINE.search(line)]


def test_stubs_are_fresh(tmp_path):
  out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", PROTO],
                       cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  for name in STUBS:
    fresh = (tmp_path / "jaxinfer/serving/proto" / name).read_text()
    committed = (ROOT / "jaxinfer/serving/proto" / name).read_text()
    assert normalized(committed) == normalized(fresh), (
        f"{name} is stale: regenerate it (see the comment at the top of {PROTO})")


@pytest.mark.parametrize("name", ["Generate", "Tokenize", "Detokenize", "GetModelInfo"])
def test_service_methods(name):
  from jaxinfer.serving.proto import inference_pb2 as pb
  service = pb.DESCRIPTOR.services_by_name["Inference"]
  assert service.full_name == "jaxinfer.v1.Inference"
  assert service.methods_by_name[name].server_streaming == (name == "Generate")
