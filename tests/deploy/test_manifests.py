"""The Kubernetes manifests: every overlay renders with `kubectl kustomize`,
passes strict schema validation offline, and keeps the rules a rolling
handoff depends on. The checker itself is tested too: each rule must name
the resource that breaks it in a rendered copy (a runner without its
preStop drain, a grace period shorter than the drain, ...).

Without kubectl these tests skip on a developer machine and fail with
CI=true (.ci/run installs it).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route

from edge.routes.probes import routes as probe_routes
from tests.support.manifests import (
    K8S,
    OVERLAYS,
    Doc,
    KubectlMissing,
    image_pinned,
    keel_service,
    kubectl,
    overlay_names,
    render,
    schema_errors,
    violations,
)
from tests.support.processes import ROOT

SERVICES = {"ledger", "kernel", "compaction", "runner", "edge"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    try:
        kubectl()
    except KubectlMissing as missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{missing} (CI=true: the manifest tests must run)")
        pytest.skip(str(missing))
    return {name: render(OVERLAYS / name) for name in overlay_names()}


def deployment(docs: list[Doc], service: str) -> Doc:
    (found,) = [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and keel_service(d["spec"]["template"]["spec"]["containers"][0]) == service
    ]
    return found


def container(docs: list[Doc], service: str) -> Doc:
    containers: list[Doc] = deployment(docs, service)["spec"]["template"]["spec"]["containers"]
    return containers[0]


# ------------------------------------------------------------ the overlays


def test_dev_and_prod_overlays_exist() -> None:
    assert {"dev", "prod"} <= set(overlay_names())
    assert not (K8S / "keel.yaml").exists(), "the single-file layout is replaced by kustomize"


def test_every_overlay_passes_strict_schema_validation(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        assert schema_errors(docs) == [], name


def test_every_overlay_keeps_the_handoff_invariants(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        found = violations(docs, production=name == "prod")
        assert found == [], f"{name}:\n" + "\n".join(map(str, found))


def test_every_service_is_deployed_with_a_service(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
        for service in SERVICES:
            name = deployment(docs, service)["metadata"]["name"]
            assert ("Service", name) in kinds
            assert ("PodDisruptionBudget", name) in kinds


def test_dev_runs_one_replica_of_each(rendered: dict[str, list[Doc]]) -> None:
    for service in SERVICES:
        assert deployment(rendered["dev"], service)["spec"]["replicas"] == 1, service


def test_prod_autoscales_runners_and_edges_on_a_pinned_image(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["prod"]
    scaled = {
        d["spec"]["scaleTargetRef"]["name"]: d["spec"]["minReplicas"]
        for d in docs
        if d["kind"] == "HorizontalPodAutoscaler"
    }
    for service in ("runner", "edge"):
        assert scaled[deployment(docs, service)["metadata"]["name"]] >= 2
    for service in SERVICES - {"runner", "edge"}:
        assert deployment(docs, service)["spec"]["replicas"] >= 2
    images = {container(docs, service)["image"] for service in SERVICES}
    assert len(images) == 1 and image_pinned(images.pop())


def test_runner_advertises_its_pod_address(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        runner = container(docs, "runner")
        args = runner["args"]
        assert args[args.index("--address") + 1].startswith("$(POD_IP):")
        names = [e["name"] for e in runner["env"]]
        # $(VAR) expands only to variables defined before it or in the same list.
        assert "POD_IP" in names


@pytest.mark.parametrize("service", ["ledger", "kernel", "compaction", "runner", "edge"])
def test_every_service_reaches_the_database_from_its_secret(
    rendered: dict[str, list[Doc]], service: str
) -> None:
    # Blobs live in PostgreSQL: a runner or compaction service without the
    # URL would fall back to an empty store of its own and never show the
    # model what clients uploaded through the edge.
    for docs in rendered.values():
        env = {e["name"]: e for e in container(docs, service).get("env", [])}
        assert env["KEEL_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "keel-db"


def test_internal_grpc_probes_and_edge_http_probes(rendered: dict[str, list[Doc]]) -> None:
    # The edge serves /healthz and /readyz (edge/routes/probes.py).
    served = {route.path for route in probe_routes if isinstance(route, Route)}
    assert {"/healthz", "/readyz"} <= served
    for docs in rendered.values():
        for service in SERVICES - {"edge"}:
            probes = container(docs, service)
            assert "grpc" in probes["readinessProbe"] and "grpc" in probes["livenessProbe"]
        edge = container(docs, "edge")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert edge[probe]["httpGet"]["path"] in served
        assert edge["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_runbook_and_readme_name_files_that_exist() -> None:
    # A path as the docs write it: from the repository, deploy/ or deploy/k8s/.
    path = re.compile(r"(?<![\w/.-])((?:deploy|k8s|base|overlays|tests)/[\w./-]*\w)")
    for doc in (ROOT / "deploy/RUNBOOK.md", K8S / "README.md"):
        named = set(path.findall(doc.read_text(encoding="utf-8")))
        assert "deploy/k8s/base/runner.yaml" in named or "base/runner.yaml" in named, doc
        for name in named:
            places = (ROOT / name, ROOT / "deploy" / name, K8S / name)
            assert any(p.exists() for p in places), f"{doc.name} names {name}, which is missing"


# ------------------------------------------------------------ the checker


def _runner_pod(docs: list[Doc]) -> Doc:
    pod: Doc = deployment(docs, "runner")["spec"]["template"]["spec"]
    return pod


def _drop_prestop(service: str) -> Callable[[list[Doc]], Any]:
    return lambda docs: container(docs, service).pop("lifecycle")


def _set_grace(docs: list[Doc]) -> None:
    _runner_pod(docs)["terminationGracePeriodSeconds"] = 30


def _drop_readiness(docs: list[Doc]) -> None:
    container(docs, "kernel").pop("readinessProbe")


def _allow_unavailable(docs: list[Doc]) -> None:
    deployment(docs, "ledger")["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] = 1


def _run_as_root(docs: list[Doc]) -> None:
    container(docs, "compaction")["securityContext"]["runAsUser"] = 0


def _writable_root(docs: list[Doc]) -> None:
    container(docs, "edge")["securityContext"]["readOnlyRootFilesystem"] = False


def _literal_token(docs: list[Doc]) -> None:
    env = container(docs, "runner")["env"]
    token = next(e for e in env if e["name"] == "KEEL_INTERNAL_TOKEN")
    token.pop("valueFrom")
    token["value"] = "inline-token-0123456789"


def _inline_secret(docs: list[Doc]) -> None:
    docs.append(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keel-db"}, "data": {"url": ""}}
    )


def _no_network_policy(docs: list[Doc]) -> None:
    docs[:] = [d for d in docs if d["kind"] != "NetworkPolicy"]


def _open_ledger_to_all(docs: list[Doc]) -> None:
    policy = next(d for d in docs if d["metadata"]["name"] == "keel-internal")
    policy["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 7101}]})


def _latest_image(docs: list[Doc]) -> None:
    container(docs, "runner")["image"] = "registry.example.com/keel:latest"


def _untagged_image(docs: list[Doc]) -> None:
    container(docs, "edge")["image"] = "registry.example.com:5000/keel"


def _no_tmp_volume(docs: list[Doc]) -> None:
    mounts = container(docs, "runner")["volumeMounts"]
    mounts[:] = [m for m in mounts if m["mountPath"] != "/tmp"]


def _no_edge_budget(docs: list[Doc]) -> None:
    docs[:] = [d for d in docs if d["kind"] != "PodDisruptionBudget" or "edge" not in str(d)]


def _no_runner_autoscaler(docs: list[Doc]) -> None:
    docs[:] = [
        d
        for d in docs
        if not (d["kind"] == "HorizontalPodAutoscaler" and "runner" in d["metadata"]["name"])
    ]


BREAKAGES: list[tuple[str, Callable[[list[Doc]], Any], str, str]] = [
    ("runner without preStop", _drop_prestop("runner"), "prestop-drain", "keel-runner"),
    ("edge without preStop", _drop_prestop("edge"), "prestop-drain", "keel-edge"),
    ("grace equal to the drain", _set_grace, "grace-above-deadline", "keel-runner"),
    ("no readiness probe", _drop_readiness, "probes", "keel-kernel"),
    ("maxUnavailable 1", _allow_unavailable, "max-unavailable-0", "keel-ledger"),
    ("root user", _run_as_root, "security-context", "keel-compaction"),
    ("writable root filesystem", _writable_root, "security-context", "keel-edge"),
    ("literal token", _literal_token, "secret-by-reference", "keel-runner"),
    ("inline Secret", _inline_secret, "secret-by-reference", "Secret/keel-db"),
    ("no NetworkPolicy", _no_network_policy, "network-policy", "namespace"),
    ("ledger open to all", _open_ledger_to_all, "network-policy", "keel-ledger"),
    ("latest image", _latest_image, "pinned-image", "keel-runner"),
    ("untagged image", _untagged_image, "pinned-image", "keel-edge"),
    ("no runner HPA", _no_runner_autoscaler, "autoscaler", "keel-runner"),
    ("/tmp on the read-only root", _no_tmp_volume, "writable-paths", "keel-runner"),
    ("no edge budget", _no_edge_budget, "pod-disruption-budget", "keel-edge"),
]


@pytest.mark.parametrize(
    ("breakage", "rule", "resource"),
    [(b[1], b[2], b[3]) for b in BREAKAGES],
    ids=[b[0] for b in BREAKAGES],
)
def test_the_checker_names_each_broken_rule(
    rendered: dict[str, list[Doc]],
    breakage: Callable[[list[Doc]], Any],
    rule: str,
    resource: str,
) -> None:
    docs = copy.deepcopy(rendered["prod"])
    breakage(docs)
    found = violations(docs, production=True)
    assert any(v.rule == rule and resource in v.resource for v in found), found
    assert violations(rendered["prod"], production=True) == []


def test_strict_validation_rejects_unknown_fields_and_kinds(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = copy.deepcopy(rendered["prod"])
    container(docs, "runner")["livenessProbe"]["grcp"] = {"port": 7105}
    docs.append({"apiVersion": "keel.dev/v1", "kind": "Runner", "metadata": {"name": "x"}})
    errors = schema_errors(docs)
    assert any("grcp" in e for e in errors), errors
    assert any("Runner/x" in e for e in errors), errors


@pytest.mark.parametrize(
    ("image", "pinned"),
    [
        ("keel", False),
        ("keel:latest", False),
        ("registry.example.com:5000/keel", False),
        ("registry.example.com:5000/keel:0.1.0", True),
        ("keel@sha256:" + "a" * 64, True),
        ("keel:dev", True),
    ],
)
def test_image_pinning(image: str, pinned: bool) -> None:
    assert image_pinned(image) is pinned


# ------------------------------------------------------------ metrics


def test_every_pod_serves_metrics_and_is_annotated_for_scraping(
    rendered: dict[str, list[Doc]],
) -> None:
    for docs in rendered.values():
        config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
        port = int(config["KEEL_METRICS_PORT"])
        assert config["KEEL_METRICS_HOST"] == "0.0.0.0"  # reachable from Prometheus
        for service in SERVICES:
            pod = deployment(docs, service)["spec"]["template"]
            annotations = pod["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true", service
            assert int(annotations["prometheus.io/port"]) == port, service
            ports = {p["name"]: p["containerPort"] for p in container(docs, service)["ports"]}
            assert ports["metrics"] == port, service
        services = [d for d in docs if d["kind"] == "Service"]
        assert all(any(p["name"] == "metrics" for p in s["spec"]["ports"]) for s in services)
        allowed = {
            rule["port"]
            for policy in docs
            if policy["kind"] == "NetworkPolicy"
            for ingress in policy["spec"]["ingress"]
            for rule in ingress["ports"]
        }
        assert port in allowed


def test_the_servicemonitor_component_selects_every_metrics_port(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    # An overlay of the operator's, as the component's comment shows it.
    overlay = tmp_path / "monitored"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: keel\n"
        # kustomize takes only relative paths.
        f"resources: [{os.path.relpath(OVERLAYS / 'prod', overlay)}]\n"
        f"components: [{os.path.relpath(K8S / 'components' / 'servicemonitor', overlay)}]\n"
    )
    docs = render(overlay)
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    # A CRD's kind: no schema offline; everything else still validates.
    assert schema_errors([d for d in docs if d is not monitor]) == []
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "keel"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        d
        for d in docs
        if d["kind"] == "Service" and wanted.items() <= d["metadata"].get("labels", {}).items()
    ]
    assert {s["metadata"]["name"] for s in selected} == {
        deployment(docs, service)["metadata"]["name"] for service in SERVICES
    }
    (endpoint,) = monitor["spec"]["endpoints"]
    assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in selected)
    # Without the component no overlay needs the CRD.
    assert not any(d["kind"] == "ServiceMonitor" for docs in rendered.values() for d in docs)
