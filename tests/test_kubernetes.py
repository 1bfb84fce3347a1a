"""deploy/kubernetes: kustomize builds it, and every manifest it builds passes a real
schema validator: kubernetes-validate (PyPI, pinned) for Kubernetes' own kinds, the
@kubernetes-models schemas (npm, pinned) generated from prometheus-operator's and
Gateway API's CRDs, and for InferencePool a schema transcribed from its API
reference (tests/kubernetes/inferencepool-v1.schema.json: no registry reachable
here ships that CRD). No cluster: nothing here is applied."""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvlease.engine.budgets import BudgetTable
from kvlease.engine.processes import LINGER
from kvlease.engine.tenancy import TierTable
from kvlease.grafana.build import ALERTS_FILE, render_kubernetes
from kvlease.server.middleware import SESSION_HEADER
from kvlease.server.serve import DRAIN_SECONDS, TEARDOWN_SECONDS, _kvlease_args, _value

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "deploy" / "kubernetes"
HERE = Path(__file__).resolve().parent / "kubernetes"
NODE_MODULES = ROOT / ".venv" / "node" / "node_modules"  # the Makefile's npm install
KUBERNETES = "1.34.1"  # the Kubernetes release whose schemas kubernetes-validate checks
CORE_GROUPS = ("v1", "apps/v1", "rbac.authorization.k8s.io/v1")
CRD_KINDS = {"PodMonitor", "PrometheusRule", "HTTPRoute"}


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to build the bundle (kustomize is built into it)"
    built = subprocess.run(
        [kubectl, "kustomize", str(BUNDLE)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(built) if doc]


def _one(manifests, kind, name=None) -> dict:
    found = [m for m in manifests if m["kind"] == kind and name in (None, m["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _generated_config_map(manifests, name) -> dict:
    """A configMapGenerator's map: kustomize names it `name-<hash of its data>`."""
    return _one([m for m in manifests if m["metadata"]["name"].startswith(name + "-")], "ConfigMap")


def _crd_errors(docs: list[dict]) -> list[dict]:
    assert (NODE_MODULES / "@kubernetes-models").is_dir(), "make test installs the npm schemas"
    result = subprocess.run(
        ["node", str(HERE / "crds.mjs"), str(NODE_MODULES)],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    return [json.loads(line) for line in result.stdout.splitlines()]


def _inference_pool_schema() -> dict:
    return json.loads((HERE / "inferencepool-v1.schema.json").read_text())


def test_the_bundle_builds_into_every_piece_the_fleet_needs(manifests):
    needed = "Deployment Service PodMonitor PrometheusRule InferencePool HTTPRoute ConfigMap"
    needed += " Namespace Role RoleBinding ServiceAccount"
    assert set(needed.split()) <= {m["kind"] for m in manifests}
    assert {m["metadata"].get("namespace") for m in manifests if m["kind"] != "Namespace"} == {
        "kvlease"
    }


def test_kubernetes_kinds_pass_kubernetes_validate_strictly(manifests):
    core = [m for m in manifests if m["apiVersion"] in CORE_GROUPS]
    assert len(core) >= 10
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_prometheus_operator_and_gateway_api_kinds_pass_their_crd_schemas(manifests):
    docs = [m for m in manifests if m["kind"] in CRD_KINDS]
    assert {d["kind"] for d in docs} == CRD_KINDS
    results = _crd_errors(docs)
    assert [r for r in results if r["error"]] == []


def test_the_inference_pool_passes_its_api_references_rules(manifests):
    pool = _one(manifests, "InferencePool")
    jsonschema.validate(pool, _inference_pool_schema())
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref  # required for a Service
    picker = _one(manifests, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in picker["spec"]["ports"]]
    kvlease = _one(manifests, "Deployment", "kvlease")
    labels = kvlease["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = kvlease["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert pool["spec"]["targetPorts"] == [{"number": port}]


def test_each_validator_refuses_a_broken_manifest(manifests):
    """So a pass above means something."""
    deployment = json.loads(json.dumps(_one(manifests, "Deployment", "kvlease")))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)
    monitor = json.loads(json.dumps(_one(manifests, "PodMonitor")))
    monitor["spec"]["podMetricsEndpoints"] = "http"
    route = json.loads(json.dumps(_one(manifests, "HTTPRoute")))
    route["spec"]["rules"][0]["backendRefs"][0]["name"] = 8000
    assert all(r["error"] for r in _crd_errors([monitor, route]))
    pool = json.loads(json.dumps(_one(manifests, "InferencePool")))
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]  # at most one
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, _inference_pool_schema())


def test_replicas_ask_for_a_gpu_and_take_keys_and_the_ledger_from_secrets(manifests):
    pod = _one(manifests, "Deployment", "kvlease")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in container["env"]}
    assert env["KVLEASE_USAGE_DB"]["valueFrom"]["secretKeyRef"]["name"] == "kvlease-ledger"
    assert "secretKeyRef" in env["KVLEASE_CACHE_SALT_KEY"]["valueFrom"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["keys"]["secret"]["secretName"] == "kvlease-jwt"
    args, rest = _kvlease_args(container["args"][1:])  # kvlease serve parses them
    assert args.jwt_keys.startswith("/etc/kvlease/keys/") and args.tiers and args.budgets
    assert "--data-parallel-size=1" in rest  # vLLM's, passed through
    assert not any("SECRET" in e["name"] and "value" in e for e in container["env"])


def test_the_grace_period_covers_the_drain_and_the_teardown(manifests):
    """Kubernetes sends SIGKILL after terminationGracePeriodSeconds: it must not cut the
    drain (`--shutdown-timeout`) or the engines' teardown after it short."""
    pod = _one(manifests, "Deployment", "kvlease")["spec"]["template"]["spec"]
    _, rest = _kvlease_args(pod["containers"][0]["args"][1:])
    drain = float(_value("--shutdown-timeout", rest) or DRAIN_SECONDS)
    assert pod["terminationGracePeriodSeconds"] >= drain + TEARDOWN_SECONDS + LINGER


def test_the_config_maps_hold_a_valid_tier_table_and_budget_file(manifests, tmp_path):
    config = _generated_config_map(manifests, "kvlease-config")
    (tmp_path / "tiers.toml").write_text(config["data"]["tiers.toml"])
    (tmp_path / "budgets.toml").write_text(config["data"]["budgets.toml"])
    TierTable.load(tmp_path / "tiers.toml")
    BudgetTable.load(tmp_path / "budgets.toml")
    pod = _one(manifests, "Deployment", "kvlease")["spec"]["template"]["spec"]
    mounted = {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]["name"]
    assert mounted == config["metadata"]["name"]  # kustomize's hashed name, followed


def test_the_endpoint_picker_binds_sessions_by_kvleases_session_header(manifests):
    config = _generated_config_map(manifests, "kvlease-endpoint-picker")
    picker = yaml.safe_load(config["data"]["config.yaml"])
    plugins = {p.get("name", p["type"]): p for p in picker["plugins"]}
    producer = plugins["kvlease-session"]
    assert producer["type"] == "session-id-producer"
    assert producer["parameters"]["headerName"].encode() == SESSION_HEADER
    scorer = plugins["session-affinity-scorer"]
    assert scorer["parameters"]["sessionIDProducerName"] == "kvlease-session"
    for profile in picker["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= plugins.keys()
    ttl_minutes = int(producer["parameters"]["ttl"].removesuffix("m"))
    tiers = tomllib.loads(_generated_config_map(manifests, "kvlease-config")["data"]["tiers.toml"])
    longest = max(t.get("lease_seconds", 0) for t in tiers["tiers"].values())
    assert ttl_minutes * 60 >= longest  # a binding outlives every lease


def test_dashboards_and_alert_rules_are_the_generated_ones():
    tiers = TierTable.load()
    for name, text in render_kubernetes(tiers).items():
        assert (BUNDLE / name).read_text() == text, f"run `kvlease grafana build` ({name})"
    rule = yaml.safe_load((BUNDLE / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS_FILE.read_text())["groups"]
    maps = list(yaml.safe_load_all((BUNDLE / "grafana-dashboards.yaml").read_text()))
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)
    assert {name for m in maps for name in m["data"]} == {
        p.name for p in (ROOT / "grafana" / "dashboards").glob("*.json")
    }
