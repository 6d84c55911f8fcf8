"""deploy/ stays true to the code: every manifest's command line parses with the
real CLI, ports line up with probes and Services, and the Dockerfile copies
what exists. (The manifests are not applied to a cluster anywhere: docs/DEPLOY.md.)"""

from pathlib import Path

import pytest
import yaml

from jaxinfer.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def documents():
  for path in sorted(DEPLOY.glob("*.yaml")):
    for doc in yaml.safe_load_all(path.read_text()):
      if doc:
        yield path.name, doc


def containers():
  for name, doc in documents():
    if doc["kind"] == "Deployment":
      for c in doc["spec"]["template"]["spec"]["containers"]:
        yield name, doc, c


def test_there_is_a_deployment_per_role_and_a_service_in_front_of_the_router():
  roles = {c["args"][0] for _, _, c in containers()}
  assert {"serve", "route"} <= roles
  services = {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == "Service"}
  assert services["jaxinfer-worker"]["spec"]["clusterIP"] == "None"  # per-pod DNS records for dns: workers
  assert services["jaxinfer"]["spec"]["selector"] == {"app": "jaxinfer-router"}


@pytest.mark.parametrize("name,doc,container", list(containers()),
                         ids=[f"{n}:{c['name']}" for n, _, c in containers()])
def test_each_command_line_parses_and_its_ports_match(name, doc, container):
  args = build_parser().parse_args(container["args"])  # an unknown flag exits: SystemExit
  ports = {p["containerPort"] for p in container["ports"]}
  assert args.port in ports and args.port == container["readinessProbe"]["grpc"]["port"]
  for flag in ("metrics_port", "http_port"):
    if getattr(args, flag, None) is not None:
      assert getattr(args, flag) in ports, f"{name}: --{flag} not exposed"
  assert args.host == "0.0.0.0", f"{name}: a pod must listen beyond loopback"
  grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
  assert grace > args.grace_period, f"{name}: Kubernetes would kill the pod mid-drain"
  selector = doc["spec"]["selector"]["matchLabels"]
  assert doc["spec"]["template"]["metadata"]["labels"] == selector


def test_dockerfile_copies_what_exists():
  for line in (DEPLOY / "Dockerfile").read_text().splitlines():
    if line.startswith("COPY "):
      for src in line.split()[1:-1]:
        assert (ROOT / src).exists(), src


def test_disaggregated_router_and_decode_pods_name_the_prefill_pods_alike():
  """The router refuses decode workers whose --prefill-workers differ from its own
  (spelled the same), so both must name the prefill Service the same way."""
  parsed = {c["name"]: build_parser().parse_args(c["args"]) for n, _, c in containers()
            if n == "disaggregated.yaml"}
  assert parsed["prefill"].role == "prefill" and parsed["decode"].role == "decode"
  assert parsed["decode"].prefill_workers == parsed["router"].prefill_workers
  assert parsed["router"].prefill_workers.startswith("dns:jaxinfer-prefill.")
  assert parsed["router"].decode_workers.startswith("dns:jaxinfer-decode.")
  services = {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == "Service"}
  for name in ("jaxinfer-prefill", "jaxinfer-decode"):
    assert services[name]["spec"]["clusterIP"] == "None"
