"""deploy/k8s/, checked offline (no cluster, no network): every resource file and every rendered
overlay passes kubernetes-validate's bundled schemas in strict mode; kustomization references
resolve (rendered with `kubectl kustomize` when kubectl is installed).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shared.settings import DEFAULT_PORTS
from tests.support import ROOT
from tests.support.deploy import check_env_names

K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.32.0"


def k8s_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def resource_files() -> list[Path]:
    out = []
    for k in kustomizations():
        spec = yaml.safe_load(k.read_text())
        out += [k.parent / r for r in spec.get("resources", []) if (k.parent / r).is_file()]
    return sorted(set(out))


@pytest.mark.parametrize("path", resource_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_k8s_resource_file_passes_schema(path: Path) -> None:
    docs = k8s_docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(K8S)))
def test_kustomization_references_resolve(path: Path) -> None:
    spec = yaml.safe_load(path.read_text())
    assert spec["apiVersion"].startswith("kustomize.config.k8s.io/")
    assert spec["kind"] in ("Kustomization", "Component")
    for ref in spec.get("resources", []) + spec.get("components", []):
        target = path.parent / ref
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{path}: {ref} does not exist"
    for patch in spec.get("patches", []):
        if "path" in patch:
            assert (path.parent / patch["path"]).is_file(), f"{path}: patch {patch['path']} does not exist"


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: overlays are checked by reference only")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


@pytest.mark.parametrize("overlay", ["nvidia", "mi50"])
def test_k8s_overlay_renders_and_validates(overlay: str) -> None:
    docs = render(overlay)
    by_kind: dict[tuple[str, str], dict[str, Any]] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "burstrl") == "burstrl"
    configmaps = {n for k, n in by_kind if k == "ConfigMap"}
    for doc in docs:
        for c in containers(doc):
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, f"{doc['metadata']['name']}: dangling configmap"
            for e in c.get("env", []):
                secret = e.get("valueFrom", {}).get("secretKeyRef")
                assert secret is None or secret["name"] == "burstrl-secrets"  # created out of band (README)
            if str(c.get("image", "")).startswith("burstrl/"):
                role = c["name"]
                names = [e["name"] for e in c.get("env", [])] + list(by_kind[("ConfigMap", "burstrl-config")]["data"])
                check_env_names(names, f"k8s {overlay}/{role}")
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
                assert c["ports"][0]["containerPort"] == DEFAULT_PORTS[role]
                assert ":" in c["image"] and not c["image"].endswith(":latest")
    rollout = by_kind[("Deployment", "rollout")]
    assert rollout["spec"]["replicas"] >= 2, "rollout replicas scale in the overlay"
    if overlay == "nvidia":
        job = by_kind[("Job", "trainer")]
        cmd = containers(job)[0]["command"]
        assert cmd[0] == "torchrun" and cmd[-2:] == ["-m", "services.trainer"]
        assert containers(job)[0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    else:
        assert ("Job", "trainer") not in by_kind, "the MI50 cluster's trainer is the rented burst"
        engine = next(c for c in containers(rollout) if c["name"] == "engine")
        assert "vllm-gfx906" in engine["image"] and engine["resources"]["limits"]["amd.com/gpu"] == 1


@pytest.mark.parametrize("overlay", ["nvidia", "mi50"])
def test_k8s_services_called_by_name_have_a_service(overlay: str) -> None:
    """What other pods call by name has a Service: the api (clients), reward (rollout's tool calls
    run in its sandbox). rollout and ref are only scraped per pod; they pull their work from Redis."""
    docs = render(overlay)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "burstrl-config")
    for d in docs:
        if d["kind"] != "Deployment" or d["metadata"]["name"] not in ("api", "reward"):
            continue
        name = d["metadata"]["name"]
        assert name in services, f"Deployment {name} has no Service"
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert services[name]["spec"]["selector"].items() <= labels.items(), f"Service {name} selects no pod"
        ports = {p["containerPort"] for c in containers(d) for p in c.get("ports", [])}
        assert {p["port"] for p in services[name]["spec"]["ports"]} & ports, f"Service {name}: wrong port"
    url = config["data"]["BURSTRL_TOOLS_SANDBOX_URL"]
    assert url == f"http://reward:{DEFAULT_PORTS['reward']}" and "reward" in services


def test_k8s_validation_catches_a_bad_manifest() -> None:
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {"replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
