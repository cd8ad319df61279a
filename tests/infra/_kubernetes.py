"""Checks of Kubernetes objects: commands, settings, ports, probes, Services, shared home."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from tests.infra._commands import (
    Problem,
    bind_problems,
    check_commands,
    check_env_values,
    grpc_address,
    home_of,
    parse_skiff_argv,
    runs,
    volume_holding,
)

_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def pod_specs(docs: Sequence[Mapping]) -> Iterator[tuple[Mapping, Mapping, Mapping]]:
    """Yield (workload, pod template metadata, pod spec) for every workload."""
    for doc in docs:
        spec = doc.get("spec") or {}
        if doc.get("kind") == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        if doc.get("kind") == "Pod":
            yield doc, doc.get("metadata") or {}, spec
        elif "template" in spec:
            yield doc, spec["template"].get("metadata") or {}, spec["template"]["spec"]


def container_argv(container: Mapping, image_argv: Sequence[str]) -> list[str]:
    """Return a container's process: command replaces the image's, args follow it."""
    command, args = container.get("command"), container.get("args")
    return (command or ([] if args else list(image_argv))) + (args or [])


def check_kubernetes(
    docs: Sequence[Mapping], image_argv: Sequence[str], where: str
) -> list[Problem]:
    """Check the objects a kustomization makes (or lists)."""
    configmaps = {
        d["metadata"]["name"]: d.get("data") or {} for d in docs if d["kind"] == "ConfigMap"
    }
    problems = [p for n, data in configmaps.items() for p in check_env_values(data, f"{where}#{n}")]
    claims: dict[str, dict[str, str | None]] = {"init": {}, "server": {}}
    for workload, meta, pod in pod_specs(docs):
        volumes = {
            v["name"]: (v.get("persistentVolumeClaim") or {}).get("claimName")
            for v in pod.get("volumes") or ()
        }
        for container in [*(pod.get("initContainers") or ()), *pod["containers"]]:
            at = f"{where}#{workload['kind']}/{workload['metadata']['name']}/{container['name']}"
            env, found = _env(container, configmaps, at)
            problems += found
            argv = container_argv(container, image_argv)
            problems += check_commands([argv], at)
            mounts = [
                (volumes.get(m["name"]), m["mountPath"])
                for m in container.get("volumeMounts") or ()
            ]
            for command, homes in claims.items():
                for skiff_argv in runs(argv, command):
                    home, found = home_of(skiff_argv, at)
                    problems += found
                    homes[at] = volume_holding(home, mounts) if home else None
            for server in runs(argv, "server"):
                problems += _check_server(workload, meta, container, server, env, docs, at)
    return problems + _check_shared_home(claims, where)


def _env(container: Mapping, configmaps: Mapping, where: str) -> tuple[dict, list[Problem]]:
    env, problems = {}, []
    for source in container.get("envFrom") or ():
        name = (source.get("configMapRef") or {}).get("name")
        if name is not None and name not in configmaps:
            problems.append(Problem(where, f"envFrom names a ConfigMap {name} that is not here"))
        env.update(configmaps.get(name, {}))
    literal = {e["name"]: e["value"] for e in container.get("env") or () if "value" in e}
    env.update(literal)
    return env, problems + check_env_values(literal, where)


def _check_server(workload, meta, container, argv, env, docs, at) -> list[Problem]:
    port, problems = bind_problems(grpc_address(argv, env), at)
    named = {p.get("name"): p["containerPort"] for p in container.get("ports") or ()}
    if port not in named.values():
        problems.append(Problem(at, f"containerPorts {sorted(named.values())}; serves {port}"))
    for probe in _PROBES:
        check = container.get(probe) or {}
        probed = (check.get("grpc") or check.get("tcpSocket") or {}).get("port")
        if probe != "startupProbe" and not check:
            problems.append(Problem(at, f"no {probe}"))
        elif check and named.get(probed, probed) != port:
            problems.append(Problem(at, f"{probe} checks port {probed}; the server is on {port}"))
    if workload["kind"] == "Deployment" and workload["spec"].get("replicas", 1) < 2:
        problems.append(Problem(at, "fewer than 2 control-plane replicas"))
    if not parse_skiff_argv(argv).replica:  # the pods share the home: a plain server is refused
        problems.append(Problem(at, "serves a shared home without --replica"))
    labels = meta.get("labels") or {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"].get("selector") or {}
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            for p in svc["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                if named.get(target, target) != port:
                    problems.append(
                        Problem(at, f"Service {svc['metadata']['name']} targets {target}")
                    )
    return problems


def _check_shared_home(claims: Mapping[str, Mapping[str, str | None]], where: str) -> list[Problem]:
    """Every server's home must be on a claim that a `skiff init` wrote it on."""
    if not claims["init"] or not claims["server"]:
        return [Problem(where, "nothing runs `skiff init` and `skiff server` there")]
    written = sorted(map(str, claims["init"].values()))
    return [
        Problem(at, f"home is on claim {claim}; `skiff init` writes it on {written}")
        for at, claim in claims["server"].items()
        if claim is None or str(claim) not in written
    ]
