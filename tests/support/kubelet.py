"""A kubelet and a Deployment controller for Keel's manifests, with real OS processes.

The rollout simulator (tests/deploy/test_rollout.py) runs the pods of the
rendered manifests on this host, as Kubernetes would run them:

- A pod is one process: the image's entry point (deploy/Dockerfile) with
  the container's args, in the environment the kubelet builds — the image's
  ENV, then the `envFrom` ConfigMaps, then `env` (values, Secrets by
  reference, `status.podIP`) — with `$(VAR)` references expanded.
- Its network is a loopback address of its own, a new one per pod as a new
  pod gets a new IP, so it listens on the ports its manifest names;
  `0.0.0.0` means that address, in an argument or a variable. A Service
  name with its port (`keel-ledger:7101`) in an argument or a variable
  resolves to the pod published behind it.
- Its volumes are directories of its own (an emptyDir at each mount path);
  the image's virtualenv is this one. (The process itself runs from the
  repository root, as tests/support/processes.py starts every child; its hooks run
  in the image's WORKDIR. Nothing in the manifests is a relative path.)
- The kubelet calls a pod ready once its startup probe and then its
  readiness probe pass (gRPC health SERVING, or an HTTP GET answered 2xx or
  3xx). It stops a pod by running the preStop command in the pod's
  environment, then SIGTERM, then SIGKILL at the end of the grace period,
  which counts from the start of the termination, preStop included.
- A Deployment rolls with its RollingUpdate strategy: it starts `maxSurge`
  new pods, waits until they are ready, deletes as many old ones, and goes
  on without waiting for their termination, until no old pod is left.

Probes are polled every PROBE_PERIOD_S rather than each probe's
periodSeconds: what is simulated is the order of events, not the pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.dockerfile import parse as parse_dockerfile
from tests.support.manifests import Doc, keel_service
from tests.support.processes import ChildProcess

PROBE_PERIOD_S = 0.1
PROBE_TIMEOUT_S = 2.0
READY_DEADLINE_S = 90.0
WILDCARD = "0.0.0.0"


def _on_pod_ip(value: str, ip: str) -> str:
    """`value` with the wildcard address (alone or with a port) as the pod's
    own: in an argument (`--host 0.0.0.0`) or a variable
    (`KEEL_METRICS_HOST=0.0.0.0`) alike."""
    if value == WILDCARD or value.startswith(WILDCARD + ":"):
        return ip + value[len(WILDCARD) :]
    return value


_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_SHELL_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True)
class Image:
    """What deploy/Dockerfile's final stage gives every container."""

    entrypoint: tuple[str, ...]
    env: Mapping[str, str]
    workdir: str
    # Where the image's virtualenv is (it is this process's virtualenv here).
    venv: str


def keel_image() -> Image:
    stage = parse_dockerfile()[-1]
    env: dict[str, str] = {}
    for name, value in stage.env().items():
        # The base image's PATH is this host's.
        env[name] = _expand_shell(value, {"PATH": os.environ.get("PATH", ""), **env})
    (entrypoint,) = stage.values("ENTRYPOINT")
    return Image(
        entrypoint=tuple(json.loads(entrypoint)),
        env=env,
        workdir=stage.values("WORKDIR")[-1],
        venv=env["VIRTUAL_ENV"],
    )


def _expand_shell(value: str, known: Mapping[str, str]) -> str:
    return _SHELL_VARIABLE.sub(lambda m: known.get(m[1] or m[2], ""), value)


@dataclass(frozen=True)
class Probe:
    port: int
    # A gRPC health check of this service ("" the server's), or else an
    # HTTP GET of `path`.
    grpc_service: str | None
    path: str = ""


@dataclass(frozen=True)
class PodTemplate:
    """One Deployment's pod, as its manifest describes it."""

    deployment: str
    # The `keel` subcommand (runner, edge, ...).
    component: str
    args: tuple[str, ...]
    env: tuple[Doc, ...]
    config_maps: tuple[str, ...]
    ports: Mapping[str, int]
    pre_stop: tuple[str, ...]
    grace_s: float
    startup: Probe | None
    readiness: Probe | None
    # (mount path, volume name)
    mounts: tuple[tuple[str, str], ...]
    replicas: int
    max_surge: int
    max_unavailable: int


def _probe(spec: Doc | None, ports: Mapping[str, int]) -> Probe | None:
    if spec is None:
        return None
    if "grpc" in spec:
        return Probe(int(spec["grpc"]["port"]), str(spec["grpc"].get("service", "")))
    port = spec["httpGet"]["port"]
    return Probe(ports[port] if isinstance(port, str) else int(port), None, spec["httpGet"]["path"])


def pod_templates(docs: list[Doc]) -> dict[str, PodTemplate]:
    """Every Deployment's pod by component; replicas are the Deployment's,
    else its autoscaler's minimum."""
    minimum = {
        d["spec"]["scaleTargetRef"]["name"]: int(d["spec"]["minReplicas"])
        for d in docs
        if d["kind"] == "HorizontalPodAutoscaler"
    }
    templates: dict[str, PodTemplate] = {}
    for doc in (d for d in docs if d["kind"] == "Deployment"):
        name, spec = doc["metadata"]["name"], doc["spec"]
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        component = keel_service(container)
        assert component is not None, f"{name} does not run keel"
        ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}
        hook = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        rolling = spec.get("strategy", {}).get("rollingUpdate", {})
        templates[component] = PodTemplate(
            deployment=name,
            component=component,
            args=tuple(str(a) for a in container.get("args", [])),
            env=tuple(container.get("env", [])),
            config_maps=tuple(
                source["configMapRef"]["name"]
                for source in container.get("envFrom", [])
                if "configMapRef" in source
            ),
            ports=ports,
            pre_stop=tuple(str(word) for word in hook.get("command", [])),
            grace_s=float(pod.get("terminationGracePeriodSeconds", 30)),
            startup=_probe(container.get("startupProbe"), ports),
            readiness=_probe(container.get("readinessProbe"), ports),
            mounts=tuple((m["mountPath"], m["name"]) for m in container.get("volumeMounts", [])),
            replicas=int(spec.get("replicas", minimum.get(name, 1))),
            max_surge=int(rolling.get("maxSurge", 1)),
            max_unavailable=int(rolling.get("maxUnavailable", 0)),
        )
    return templates


@dataclass
class Pod:
    name: str
    template: PodTemplate
    ip: str
    root: Path
    env: dict[str, str]
    argv: list[str]
    workdir: Path
    process: ChildProcess

    def address(self, port: int | str) -> str:
        number = self.template.ports[port] if isinstance(port, str) else port
        return f"{self.ip}:{number}"

    @property
    def alive(self) -> bool:
        return self.process.proc.poll() is None


@dataclass(frozen=True)
class Termination:
    """What the kubelet did to stop one pod, and how the pod took it."""

    pod: str
    # time.monotonic() when the pod was deleted.
    began: float
    pre_stop_code: int | None  # None: no hook, or killed at the grace period
    pre_stop_output: str
    pre_stop_s: float
    # The process ended on its own while its preStop ran (a drained runtime exits).
    exited_in_pre_stop: bool
    killed: bool
    exit_code: int
    seconds: float


class Node:
    """This host as a one-node cluster: pod addresses and directories, the
    manifests' ConfigMaps, the Secrets given, and the Services' names."""

    def __init__(
        self,
        docs: list[Doc],
        root: Path,
        secrets: Mapping[str, Mapping[str, str]],
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.image = keel_image()
        self.root = root
        self.secrets = secrets
        # What the simulation adds last to every pod's environment.
        self.extra_env = dict(extra_env or {})
        self.config_maps = {
            d["metadata"]["name"]: {str(k): str(v) for k, v in d.get("data", {}).items()}
            for d in docs
            if d["kind"] == "ConfigMap"
        }
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        # "keel-ledger:7101" -> the address of the pod behind it.
        self.dns: dict[str, str] = {}
        self.pods: list[Pod] = []
        # A /24 of loopback addresses of this run's own (two runs at once
        # must not meet on a port).
        pid = os.getpid()
        self._subnet = f"127.{64 + pid % 128}.{1 + (pid >> 7) % 254}."
        self._counts: dict[str, int] = {}

    # -- addresses and environment --

    def publish(self, service: str, pod: Pod) -> None:
        """Routes `service`'s ports to `pod` (a Service with one ready pod)."""
        for port in self.services[service]["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            number = pod.template.ports[target] if isinstance(target, str) else int(target)
            self.dns[f"{service}:{port['port']}"] = pod.address(number)

    def _resolve(self, value: str) -> str:
        for name, address in self.dns.items():
            value = re.sub(rf"(?<![\w.-]){re.escape(name)}(?!\w)", address, value)
        return value

    def _localize(self, value: str, paths: Mapping[str, Path]) -> str:
        """Image paths (mounts, the virtualenv) in `value` as this host's.

        One pass over `value`: a host path put in for one image path must not
        be rewritten again for another (a checkout under /tmp holds the
        virtualenv, and /tmp is also a mount)."""
        if not paths:
            return value
        ordered = sorted(paths, key=len, reverse=True)
        pattern = "|".join(re.escape(image_path) for image_path in ordered)
        return re.sub(
            rf"(?<![^:])(?:{pattern})(?=/|:|$)",
            lambda match: str(paths[match[0]]).replace("\\", "/"),
            value,
        )

    def _value(self, entry: Doc, ip: str, env: Mapping[str, str]) -> str | None:
        if "value" in entry:
            return _REFERENCE.sub(lambda m: env.get(m[1], m[0]), str(entry["value"]))
        source = entry["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", source
            return ip
        reference = source.get("secretKeyRef") or source["configMapKeyRef"]
        store = self.secrets if "secretKeyRef" in source else self.config_maps
        value = store.get(reference["name"], {}).get(reference["key"])
        if value is None and not reference.get("optional", False):
            raise AssertionError(f"{entry['name']}: no {reference} in the cluster")
        return value

    def _environment(
        self, template: PodTemplate, ip: str, paths: Mapping[str, Path]
    ) -> dict[str, str]:
        env = {k: self._localize(v, paths) for k, v in self.image.env.items()}
        for name in template.config_maps:
            env.update({k: self._localize(v, paths) for k, v in self.config_maps[name].items()})
        for entry in template.env:
            value = self._value(entry, ip, env)
            if value is not None:
                from_secret = "secretKeyRef" in entry.get("valueFrom", {})
                env[entry["name"]] = value if from_secret else self._localize(value, paths)
        env = {k: self._resolve(_on_pod_ip(v, ip)) for k, v in env.items()}
        env.update(self.extra_env)
        return env

    def _argv(self, words: tuple[str, ...], env: Mapping[str, str], ip: str) -> list[str]:
        argv = []
        for word in words:
            word = _REFERENCE.sub(lambda m: env.get(m[1], m[0]), word)
            argv.append(self._resolve(_on_pod_ip(word, ip)))
        found = shutil.which(argv[0], path=env.get("PATH"))
        assert found is not None, f"{argv[0]} is not on the pod's PATH"
        return [found, *argv[1:]]

    # -- the kubelet --

    def start(self, template: PodTemplate) -> Pod:
        count = self._counts[template.component] = self._counts.get(template.component, 0) + 1
        name = f"{template.deployment}-{count}"
        ip = f"{self._subnet}{len(self.pods) + 1}"
        root = self.root / name
        volumes = {mount: root / volume for mount, volume in template.mounts}
        for folder in volumes.values():
            folder.mkdir(parents=True, exist_ok=True)
        paths = {**volumes, self.image.venv: Path(sys.prefix)}
        env = self._environment(template, ip, paths)
        argv = self._argv((*self.image.entrypoint, *template.args), env, ip)
        workdir = Path(self._localize(self.image.workdir, paths))
        pod = Pod(name, template, ip, root, env, argv, workdir, ChildProcess(argv, env=env))
        self.pods.append(pod)
        return pod

    async def wait_ready(self, pod: Pod, deadline_s: float = READY_DEADLINE_S) -> None:
        """Returns once the startup probe, then the readiness probe, pass."""
        deadline = time.monotonic() + deadline_s
        for probe in (pod.template.startup, pod.template.readiness):
            while probe is not None and not await self._passes(pod, probe):
                if not pod.alive or time.monotonic() > deadline:
                    raise AssertionError(
                        f"{pod.name} never passed {probe} (exit={pod.process.proc.poll()}):\n"
                        + "\n".join(pod.process.lines[-30:])
                    )
                await asyncio.sleep(PROBE_PERIOD_S)  # the kubelet's probe period

    async def _passes(self, pod: Pod, probe: Probe) -> bool:
        if probe.grpc_service is not None:
            async with grpc.aio.insecure_channel(pod.address(probe.port)) as channel:
                check = health_pb2.HealthCheckRequest(service=probe.grpc_service)
                try:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        check, timeout=PROBE_TIMEOUT_S
                    )
                except grpc.aio.AioRpcError:
                    return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        try:
            async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as http:
                response = await http.get(f"http://{pod.address(probe.port)}{probe.path}")
        except httpx.HTTPError:
            return False
        return 200 <= response.status_code < 400

    async def terminate(self, pod: Pod) -> Termination:
        """preStop, SIGTERM, and SIGKILL at the end of the grace period."""
        began = time.monotonic()
        grace = pod.template.grace_s
        code, output = None, ""
        if pod.template.pre_stop:
            code, output = await self._exec(pod, pod.template.pre_stop, grace)
        pre_stop_s = time.monotonic() - began
        exited_in_pre_stop = not pod.alive
        remaining = max(0.0, grace - (time.monotonic() - began))
        killed = False
        try:
            exit_code = await asyncio.to_thread(pod.process.terminate, remaining)
        except subprocess.TimeoutExpired:
            killed = True
            await asyncio.to_thread(pod.process.kill)
            exit_code = pod.process.proc.returncode
        return Termination(
            pod.name,
            began,
            code,
            output,
            pre_stop_s,
            exited_in_pre_stop,
            killed,
            exit_code,
            time.monotonic() - began,
        )

    async def _exec(
        self, pod: Pod, command: tuple[str, ...], timeout_s: float
    ) -> tuple[int | None, str]:
        """A lifecycle hook's command, run in the pod's environment."""
        argv = self._argv(command, pod.env, pod.ip)
        hook = await asyncio.create_subprocess_exec(
            *argv,
            env=pod.env,
            cwd=pod.workdir,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(hook.communicate(), timeout_s)
        except TimeoutError:
            hook.kill()
            out, _ = await hook.communicate()
            return None, out.decode(errors="replace")
        except asyncio.CancelledError:
            hook.kill()  # the test is over: no hook outlives it
            await hook.wait()
            raise
        return hook.returncode, out.decode(errors="replace")

    def kill_all(self) -> None:
        for pod in self.pods:
            with contextlib.suppress(Exception):
                pod.process.kill()


@dataclass
class Deployment:
    """A Deployment's pods on `node`. `on_ready` and `on_deleted` are its
    Endpoints changing: a pod joins once ready and leaves as soon as it is
    deleted, before its preStop runs."""

    node: Node
    template: PodTemplate
    on_ready: Callable[[Pod], None] = lambda pod: None
    on_deleted: Callable[[Pod], None] = lambda pod: None
    replicas: int = 0
    pods: list[Pod] = field(default_factory=list)
    terminating: list[asyncio.Task[Termination]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.replicas = self.replicas or self.template.replicas

    async def _surge(self, count: int) -> list[Pod]:
        started = [self.node.start(self.template) for _ in range(count)]
        await asyncio.gather(*(self.node.wait_ready(pod) for pod in started))
        for pod in started:
            self.pods.append(pod)
            self.on_ready(pod)
        return started

    async def scale_up(self) -> list[Pod]:
        return await self._surge(self.replicas - len(self.pods))

    def delete(self, pod: Pod) -> None:
        self.pods.remove(pod)
        self.on_deleted(pod)
        self.terminating.append(
            asyncio.create_task(self.node.terminate(pod), name=f"terminate-{pod.name}")
        )

    async def roll(self) -> list[Termination]:
        """Replaces every pod under the RollingUpdate rules; returns how
        each old pod was stopped, once every one has been."""
        assert self.template.max_unavailable == 0, "only maxUnavailable: 0 is simulated"
        old = list(self.pods)
        while old:
            await self._surge(min(self.template.max_surge, len(old)))
            for _ in range(min(self.template.max_surge, len(old))):
                self.delete(old.pop(0))
        return list(await asyncio.gather(*self.terminating))
