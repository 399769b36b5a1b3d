"""Keel's Kubernetes manifests, rendered and checked offline.

`render` runs `kubectl kustomize` on an overlay, `schema_errors` validates
every document against the Kubernetes OpenAPI schemas that
kubernetes-validate ships (strict: unknown fields are errors), and
`violations` checks the rules a rolling handoff depends on, which no schema
knows: the runner's and edge's preStop drain and a grace period above its
deadline, `maxUnavailable: 0`, probes, a hardened securityContext, secrets
by reference only, internal gRPC closed to other namespaces, pinned images
in production. Each rule reports what breaks it, so a test can remove a
preStop from a rendered copy and see the check name it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import yaml

from tests.support.processes import ROOT

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = K8S / "overlays"
# Schemas shipped inside kubernetes-validate: validation needs no network.
# 1.31 has native gRPC probes (GA since 1.27) and autoscaling/v2.
KUBERNETES_VERSION = "1.31.0"
RENDER_TIMEOUT_S = 60.0
# The grace period must outlast the preStop drain by at least this much:
# SIGTERM, the server's own stop and the pod's teardown come after it.
GRACE_MARGIN_S = 5
# The keel subcommands whose pods hand their work off before they stop.
DRAINED_SERVICES = ("runner", "edge")
DRAIN_COMMAND = ("keel", "drain", "--local", "--mode", "handoff", "--deadline-ms")
# Environment variables whose value is a secret: they must come from a Secret.
SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY|_KEY|DATABASE_URL)$")
Doc = dict[str, Any]
# The container port every pod serves its Prometheus metrics on.
METRICS_PORT_NAME = "metrics"


class KubectlMissing(RuntimeError):
    """No `kubectl` on PATH: nothing can render the overlays."""


class RenderError(RuntimeError):
    """`kubectl kustomize` refused an overlay."""


@dataclass(frozen=True)
class Violation:
    """One broken rule: which rule, on which resource, and how."""

    rule: str
    resource: str
    detail: str

    def __str__(self) -> str:
        return f"{self.resource}: {self.rule}: {self.detail}"


def overlay_names() -> list[str]:
    return sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise KubectlMissing("kubectl is not on PATH (.ci/run installs the apt package `kubectl`)")
    return found


def render(overlay: Path) -> list[Doc]:
    """The documents `kubectl kustomize overlay` prints."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(overlay)],
        capture_output=True,
        text=True,
        timeout=RENDER_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        version = subprocess.run(
            [kubectl(), "version", "--client"], capture_output=True, text=True, check=False
        )
        raise RenderError(
            f"kubectl kustomize {overlay} failed ({version.stdout.strip()}):\n{done.stderr}"
        )
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def name_of(doc: Doc) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def schema_errors(docs: list[Doc], version: str = KUBERNETES_VERSION) -> list[str]:
    """Strict schema validation; a kind without a schema is an error too
    (the command-line tool only warns, which would let a typo through)."""
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            errors.append(f"{name_of(doc)}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{name_of(doc)}: {error.message}")
    return errors


# ------------------------------------------------------------ invariants


def deployments(docs: list[Doc]) -> Iterator[Doc]:
    return (doc for doc in docs if doc.get("kind") == "Deployment")


def keel_service(container: Doc) -> str | None:
    """The `keel` subcommand a container runs (the image's entry point is
    `keel`, so it is the first argument unless a command is given)."""
    command = list(container.get("command") or ["keel"]) + list(container.get("args") or [])
    if len(command) >= 2 and Path(str(command[0])).name == "keel":
        return str(command[1])
    return None


def _label_match(selector: Doc, labels: dict[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        present = key in labels
        if (
            (operator == "In" and labels.get(key) not in values)
            or (operator == "NotIn" and present and labels[key] in values)
            or (operator == "Exists" and not present)
            or (operator == "DoesNotExist" and present)
        ):
            return False
    return True


def _check_rollout(name: str, spec: Doc) -> Iterator[Violation]:
    strategy = spec.get("strategy") or {}
    rolling = strategy.get("rollingUpdate") or {}
    if strategy.get("type", "RollingUpdate") != "RollingUpdate":
        yield Violation("rolling-update", name, f"strategy is {strategy.get('type')}")
    if rolling.get("maxUnavailable") not in (0, "0%"):
        yield Violation(
            "max-unavailable-0", name, f"maxUnavailable is {rolling.get('maxUnavailable')!r}"
        )
    if rolling.get("maxSurge") in (None, 0, "0%"):
        yield Violation("max-surge", name, "maxSurge must start a new pod before an old one goes")


def _check_drain(name: str, pod: Doc, container: Doc) -> Iterator[Violation]:
    pre_stop = (container.get("lifecycle") or {}).get("preStop") or {}
    exec_command = (pre_stop.get("exec") or {}).get("command") or []
    command = [str(part) for part in exec_command]
    # The drain command and one argument: the deadline in milliseconds.
    if tuple(command[:-1]) != DRAIN_COMMAND:
        yield Violation(
            "prestop-drain", name, f"preStop must be `{' '.join(DRAIN_COMMAND)} N`: {command}"
        )
        return
    if not command[-1].isdigit():
        yield Violation("prestop-drain", name, f"deadline {command[-1]!r} is not milliseconds")
        return
    deadline_s = int(command[-1]) / 1000
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if grace < deadline_s + GRACE_MARGIN_S:
        yield Violation(
            "grace-above-deadline",
            name,
            f"terminationGracePeriodSeconds {grace} must exceed the {deadline_s:g} s drain "
            f"by {GRACE_MARGIN_S} s",
        )


def _check_container(name: str, pod: Doc, container: Doc) -> Iterator[Violation]:
    where = f"{name} container {container.get('name')}"
    for probe in ("livenessProbe", "readinessProbe"):
        if not container.get(probe):
            yield Violation("probes", where, f"no {probe}")
    resources = container.get("resources") or {}
    for part in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            if resource not in (resources.get(part) or {}):
                yield Violation("resources", where, f"no {part}.{resource}")
    pod_ctx = pod.get("securityContext") or {}
    ctx = container.get("securityContext") or {}

    def effective(key: str) -> Any:
        return ctx.get(key, pod_ctx.get(key))

    user = effective("runAsUser")
    checks = {
        "runAsNonRoot true": effective("runAsNonRoot") is True,
        "runAsUser numeric, not 0": isinstance(user, int) and user > 0,
        "readOnlyRootFilesystem true": ctx.get("readOnlyRootFilesystem") is True,
        "allowPrivilegeEscalation false": ctx.get("allowPrivilegeEscalation") is False,
        "privileged not set": not ctx.get("privileged"),
        "capabilities drop ALL": "ALL" in ((ctx.get("capabilities") or {}).get("drop") or []),
        "seccompProfile RuntimeDefault": (effective("seccompProfile") or {}).get("type")
        == "RuntimeDefault",
    }
    for rule, held in checks.items():
        if not held:
            yield Violation("security-context", where, rule)
    for env in container.get("env") or []:
        if SECRET_NAME.search(env["name"]) and "value" in env:
            yield Violation("secret-by-reference", where, f"{env['name']} has a literal value")


def _check_writable_paths(name: str, pod: Doc, container: Doc, config: Doc) -> Iterator[Violation]:
    """A read-only root filesystem needs a volume for /tmp and the data dir."""
    scratch = {v["name"] for v in pod.get("volumes") or [] if "emptyDir" in v}
    mounted = [m["mountPath"] for m in container.get("volumeMounts") or [] if m["name"] in scratch]
    env = {e["name"]: e.get("value") for e in container.get("env") or []}
    data_dir = env.get("KEEL_DATA_DIR") or config.get("KEEL_DATA_DIR")
    for path in ("/tmp", data_dir):
        if path is None or not path.startswith("/"):
            yield Violation("writable-paths", name, f"KEEL_DATA_DIR is {path!r}, not absolute")
        elif not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounted):
            yield Violation("writable-paths", name, f"{path} is on the read-only root filesystem")


def _config_of(container: Doc, docs: list[Doc]) -> Doc:
    names = {
        (source.get("configMapRef") or {}).get("name") for source in container.get("envFrom") or []
    }
    merged: Doc = {}
    for doc in docs:
        if doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] in names:
            merged.update(doc.get("data") or {})
    return merged


def _open_ports(policies: list[Doc], labels: dict[str, str]) -> tuple[bool, set[Any]]:
    """Whether any policy isolates a pod, and the ports it opens to peers
    outside the namespace ("*" for every port)."""
    isolated = False
    outside: set[Any] = set()
    for policy in policies:
        spec = policy.get("spec") or {}
        if "Ingress" not in (spec.get("policyTypes") or ["Ingress"]):
            continue
        if not _label_match(spec.get("podSelector") or {}, labels):
            continue
        isolated = True
        for rule in spec.get("ingress") or []:
            peers = rule.get("from")
            # Only a bare podSelector peer stays in the policy's namespace.
            foreign = not peers or any(set(peer) != {"podSelector"} for peer in peers)
            if foreign:
                ports = [p.get("port") for p in rule.get("ports") or []]
                outside.update(ports if ports and None not in ports else ["*"])
    return isolated, outside


def _check_network(docs: list[Doc]) -> Iterator[Violation]:
    policies = [doc for doc in docs if doc.get("kind") == "NetworkPolicy"]
    if not policies:
        yield Violation("network-policy", "namespace", "no NetworkPolicy")
    for deployment in deployments(docs):
        pod = deployment["spec"]["template"]
        labels = (pod.get("metadata") or {}).get("labels") or {}
        containers = pod["spec"]["containers"]
        isolated, outside = _open_ports(policies, labels)
        if not isolated:
            yield Violation("network-policy", name_of(deployment), "no NetworkPolicy selects it")
            continue
        public: set[Any] = set()
        if any(keel_service(c) == "edge" for c in containers):
            for container in containers:
                for port in container.get("ports") or []:
                    public.update({port["containerPort"], port.get("name")})
        # The metrics port answers Prometheus, which runs in a namespace of its own.
        for container in containers:
            for port in container.get("ports") or []:
                if port.get("name") == METRICS_PORT_NAME:
                    public.update({port["containerPort"], port["name"]})
        for port in sorted(outside - public, key=str):
            yield Violation(
                "network-policy",
                name_of(deployment),
                f"port {port} is open to peers outside the namespace",
            )


def _check_secrets(docs: list[Doc]) -> Iterator[Violation]:
    for doc in docs:
        if doc.get("kind") == "Secret":
            yield Violation(
                "secret-by-reference", name_of(doc), "a Secret in the manifests holds its values"
            )
        if doc.get("kind") == "ConfigMap":
            for key in doc.get("data") or {}:
                if SECRET_NAME.search(key):
                    yield Violation("secret-by-reference", name_of(doc), f"{key} in a ConfigMap")


def _check_disruption_budgets(docs: list[Doc]) -> Iterator[Violation]:
    budgets = [doc for doc in docs if doc.get("kind") == "PodDisruptionBudget"]
    for deployment in deployments(docs):
        labels = deployment["spec"]["template"].get("metadata", {}).get("labels") or {}
        if not any(_label_match(b["spec"].get("selector") or {}, labels) for b in budgets):
            yield Violation("pod-disruption-budget", name_of(deployment), "no budget selects it")


def image_pinned(image: str) -> bool:
    """A digest, or a tag other than `latest` (`host:port/name` is no tag)."""
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and last.rsplit(":", 1)[1] not in ("", "latest")


def _check_production(docs: list[Doc]) -> Iterator[Violation]:
    autoscalers = {
        doc["spec"]["scaleTargetRef"]["name"]: doc
        for doc in docs
        if doc.get("kind") == "HorizontalPodAutoscaler" and doc["apiVersion"] == "autoscaling/v2"
    }
    for deployment in deployments(docs):
        name = deployment["metadata"]["name"]
        containers = deployment["spec"]["template"]["spec"]["containers"]
        for container in containers:
            if not image_pinned(str(container.get("image", ""))):
                yield Violation(
                    "pinned-image", name_of(deployment), f"image {container.get('image')!r}"
                )
        if not any(keel_service(c) in DRAINED_SERVICES for c in containers):
            continue
        autoscaler = autoscalers.get(name)
        if autoscaler is None:
            yield Violation("autoscaler", name_of(deployment), "no autoscaling/v2 HPA")
        elif autoscaler["spec"].get("minReplicas", 1) < 2:
            yield Violation("replicas", name_of(deployment), "HPA minReplicas below 2")
        if deployment["spec"].get("replicas", 2) < 2:
            yield Violation("replicas", name_of(deployment), "fewer than 2 replicas")


def violations(docs: list[Doc], *, production: bool) -> list[Violation]:
    """Every broken rule in one rendered overlay (empty: all hold)."""
    found: list[Violation] = []
    for deployment in deployments(docs):
        name = name_of(deployment)
        spec = deployment["spec"]
        pod = spec["template"]["spec"]
        found.extend(_check_rollout(name, spec))
        for container in pod["containers"]:
            found.extend(_check_container(name, pod, container))
            found.extend(_check_writable_paths(name, pod, container, _config_of(container, docs)))
            if keel_service(container) in DRAINED_SERVICES:
                found.extend(_check_drain(name, pod, container))
    found.extend(_check_network(docs))
    found.extend(_check_secrets(docs))
    found.extend(_check_disruption_budgets(docs))
    if production:
        found.extend(_check_production(docs))
    return found
