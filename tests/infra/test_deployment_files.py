"""The deployment files in infra/ use only settings, commands and flags that exist.

Always: parse compose, the Kubernetes objects, the systemd unit, the Dockerfile, the env
example and the README, and check them against control_plane.settings.SETTINGS and the
real `skiff` argument parser. Where kubectl, docker compose or systemd-analyze are
installed, also check what they make of the files. The last tests feed the checker
broken snippets to show it catches them.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from control_plane.settings import SETTINGS
from device_agent.cli import AGENT_ENV
from tests.infra._commands import (
    check_env_names,
    check_env_values,
    check_skiff_argv,
    skiff_argvs_in_script,
)
from tests.infra._compose import check_compose, dockerfile_argv
from tests.infra._kubernetes import check_kubernetes
from tests.infra._unit import check_agent_unit, check_unit, env_file_entries, readme_argvs

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
COMPOSE_FILE = INFRA / "compose" / "compose.yaml"
K8S_DIR = INFRA / "k8s"
UNIT_FILE = INFRA / "systemd" / "skiff-server.service"
ENV_EXAMPLE = INFRA / "systemd" / "skiff.env.example"
AGENT_UNIT = INFRA / "systemd" / "skiff-agent.service"
AGENT_ENV_EXAMPLE = INFRA / "systemd" / "skiff-agent.env.example"
IMAGE_ARGV = dockerfile_argv((INFRA / "Dockerfile").read_text())


def k8s_resources() -> list[dict]:
    """Return the objects the kustomization lists, read without kustomize."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    return [
        doc
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((K8S_DIR / name).read_text())
        if doc
    ]


def _compose() -> dict:
    """Return the compose model as plain data (no mapping shared through YAML anchors).

    Anchors make the replicas share one environment mapping; the tests below change one
    service at a time.
    """
    return json.loads(json.dumps(yaml.safe_load(COMPOSE_FILE.read_text())))


def _fail_on(problems) -> None:
    assert not problems, "\n".join(map(str, problems))


def _text_files():
    return sorted(p for p in INFRA.rglob("*") if p.is_file())


# -- the real files ---------------------------------------------------------------------


def test_every_skiff_variable_named_in_infra_is_a_setting():
    files = _text_files()
    assert len(files) >= 12, files
    _fail_on([p for f in files for p in check_env_names(f.read_text(), str(f.relative_to(REPO)))])


def test_image_runs_the_server_by_default():
    assert IMAGE_ARGV[:2] == ["skiff", "server"]
    _fail_on(check_skiff_argv(IMAGE_ARGV[1:], "infra/Dockerfile"))


def test_server_installs_name_the_server_extra():
    # Plain `skiff` is the device side only: a server image or unit installed without
    # [server] lacks the database, the health service and the operator commands.
    text = (INFRA / "Dockerfile").read_text()
    pip = [line for line in text.splitlines() if re.search(r"\bpip (wheel|install)\b", line)]
    assert len(pip) == 2 and all("[server]" in line for line in pip), pip
    unit = (INFRA / "systemd" / "skiff-server.service").read_text()
    assert "checkout[server]" in unit


def test_compose_file():
    doc = _compose()
    assert {"init", "server-1", "server-2", "postgres", "minio", "createbucket"} <= set(
        doc["services"]
    )
    _fail_on(check_compose(doc, IMAGE_ARGV, "compose.yaml"))


def test_kubernetes_objects_as_written():
    docs = k8s_resources()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "Job", "PersistentVolumeClaim"} <= kinds
    listed = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["resources"]
    written = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert written == set(listed), "every manifest in infra/k8s must be in kustomization.yaml"
    _fail_on(check_kubernetes(docs, IMAGE_ARGV, "k8s"))


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
def test_kubernetes_objects_as_kustomize_renders_them():
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(docs) == len(k8s_resources())
    _fail_on(check_kubernetes(docs, IMAGE_ARGV, "kubectl kustomize"))


def _has_docker_compose() -> bool:
    """Compose v2 (the docker CLI plugin); rendering needs no Docker engine."""
    if not shutil.which("docker"):
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _has_docker_compose(), reason="docker compose is not installed")
def test_compose_file_as_docker_compose_renders_it():
    out = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE_FILE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    _fail_on(check_compose(json.loads(out.stdout), IMAGE_ARGV, "docker compose config"))


def _long_syntax(doc: dict) -> dict:
    """Rewrite a compose model the way `docker compose config` normalises it."""
    for svc in doc["services"].values():
        svc["ports"] = [
            {"target": int(p.rsplit(":", 1)[1]), "host_ip": "127.0.0.1", "published": "7443"}
            for p in svc.get("ports", ())
        ]
        svc["volumes"] = [
            {"type": "volume", "source": v.split(":")[0], "target": v.split(":")[1]}
            for v in svc.get("volumes", ())
        ]
        for spec in (svc.get("depends_on") or {}).values():
            spec["required"] = True
        if isinstance((svc.get("healthcheck") or {}).get("test"), list):
            svc["healthcheck"]["test"] = ["CMD-SHELL", shlex.join(svc["healthcheck"]["test"][1:])]
    return doc


def test_checker_reads_the_long_compose_syntax():
    # What docker compose renders (ports, volumes and depends_on as mappings, shell
    # healthchecks), for machines that have it; this one may not.
    doc = _long_syntax(_compose())
    assert doc["services"]["server-1"]["volumes"][0]["source"] == "skiff-home"
    _fail_on(check_compose(doc, IMAGE_ARGV, "long"))
    doc["services"]["server-2"]["ports"][0]["target"] = 9000
    doc["services"]["server-2"]["volumes"][0]["source"] = "other"
    found = str(check_compose(doc, IMAGE_ARGV, "long"))
    assert "publishes [9000], serves 7443" in found and "is on other" in found


def test_systemd_unit():
    _fail_on(check_unit(UNIT_FILE.read_text(), "skiff-server.service"))


def test_agent_systemd_unit_and_env_example():
    _fail_on(check_agent_unit(AGENT_UNIT.read_text(), "skiff-agent.service"))
    entries = env_file_entries(AGENT_ENV_EXAMPLE.read_text())
    missing = (set(AGENT_ENV) | {"SKIFF_CA"}) - set(entries)
    assert not missing, f"skiff-agent.env.example does not mention {sorted(missing)}"
    settings = {k: v for k, v in entries.items() if k not in AGENT_ENV}
    _fail_on(check_env_values(settings, "skiff-agent.env.example"))


def test_the_agent_checker_catches_a_broken_unit():
    text = AGENT_UNIT.read_text().replace("LimitCORE=0\n", "").replace("agent run", "agent go")
    found = str(check_agent_unit(text, "u"))
    assert "LimitCORE=None" in found and "agent go" in found


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is missing")
@pytest.mark.parametrize("unit", [UNIT_FILE, AGENT_UNIT], ids=lambda p: p.name)
def test_systemd_unit_as_systemd_reads_it(unit):
    out = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    # The unit names /opt/skiff/bin/skiff, which this machine need not have; anything
    # else (an unknown key or section, a value systemd cannot parse) is a mistake.
    complaints = [
        line
        for line in (out.stdout + out.stderr).splitlines()
        if line.strip() and "is not executable" not in line
    ]
    assert not complaints, "\n".join(complaints)


def test_env_example_lists_every_setting_with_a_valid_value():
    entries = env_file_entries(ENV_EXAMPLE.read_text())
    _fail_on(check_env_values(entries, "skiff.env.example"))
    missing = {s.env for s in SETTINGS} - set(entries)
    assert not missing, f"skiff.env.example does not mention {sorted(missing)}"


def test_readme_commands_parse():
    argvs = readme_argvs((INFRA / "README.md").read_text())
    assert len(argvs) >= 3, argvs
    _fail_on([p for argv in argvs for p in check_skiff_argv(argv, "infra/README.md")])


# -- the checker catches mistakes -------------------------------------------------------


def test_checker_reports_an_unknown_variable():
    problems = check_env_names("A=1\n  SKIFF_GRPC=x SKIFF_FOO=1\n", "snippet")
    assert [str(p) for p in problems] == ["snippet:2: SKIFF_FOO is not a Skiff setting"]
    assert check_env_values({"SKIFF_FOO": "1"}, "snippet")


def test_checker_reports_a_value_its_setting_rejects():
    problems = check_env_values({"SKIFF_POLL_INTERVAL_S": "5m", "SKIFF_GRPC": "x"}, "s")
    assert [p.message for p in problems] == ["SKIFF_POLL_INTERVAL_S='5m' is not a int"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["server", "--grpcc", "0.0.0.0:1"], "does not parse: skiff: error: unrecognized"),
        (["server", "--kek", "/k.json"], "does not parse"),  # init has --kek, server not
        (["serve"], "does not parse: skiff: error: argument COMMAND: invalid choice"),
        (["server", "--gr", "0.0.0.0:1"], "--gr is not a flag of this command"),
    ],
)
def test_checker_reports_bad_command_lines(argv, expected):
    problems = check_skiff_argv(argv, "snippet")
    assert len(problems) == 1 and expected in problems[0].message, problems


def test_checker_finds_commands_inside_shell_scripts():
    script = "test -f x || exec /opt/skiff/bin/skiff init --home /h --dbb u; echo skiff"
    assert skiff_argvs_in_script(script) == [["init", "--home", "/h", "--dbb", "u"]]
    assert check_skiff_argv(["init", "--home", "/h", "--dbb", "u"], "s")


def test_checker_reports_compose_mistakes():
    one = _compose()
    del one["services"]["server-2"]
    assert "1 control-plane replica(s)" in str(check_compose(one, IMAGE_ARGV, "c"))

    split = _compose()
    split["services"]["server-2"]["environment"]["SKIFF_DB"] = "postgresql+psycopg://other/db"
    assert "replicas use different databases" in str(check_compose(split, IMAGE_ARGV, "c"))

    bad = _compose()
    bad["services"]["server-1"]["command"] = ["skiff", "server", "--home", "/var/lib/skiff/home"]
    bad["services"]["server-2"]["environment"]["SKIFF_FOO"] = "1"
    found = "\n".join(map(str, check_compose(bad, IMAGE_ARGV, "c")))
    assert "c#server-1: gRPC binds 127.0.0.1:7443" in found  # the default, in a container
    assert "c#server-2: SKIFF_FOO is not a Skiff setting" in found
    assert "c#server-1: serves a shared home without --replica" in found

    unsafe = _compose()
    unsafe["services"]["server-1"]["depends_on"] = ["init"]
    found = str(check_compose(unsafe, IMAGE_ARGV, "c"))
    assert "without conditions" in found and "does not wait for init" in found


def test_checker_reports_kubernetes_mistakes():
    docs = copy.deepcopy(k8s_resources())
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    server = deployment["spec"]["template"]["spec"]["containers"][0]
    server["ports"][0]["containerPort"] = 8443
    server["command"] = [*server["command"], "--grpcc", "x"]
    deployment["spec"]["replicas"] = 1
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    configmap["data"]["SKIFF_FOO"] = "1"
    found = "\n".join(map(str, check_kubernetes(docs, IMAGE_ARGV, "k")))
    assert "SKIFF_FOO is not a Skiff setting" in found
    assert "--grpcc" in found

    server["command"] = server["command"][:-2]
    found = "\n".join(map(str, check_kubernetes(docs, IMAGE_ARGV, "k")))
    assert "containerPorts [8443]; serves 7443" in found
    assert "fewer than 2 control-plane replicas" in found
    server["command"].remove("--replica")
    assert "without --replica" in str(check_kubernetes(docs, IMAGE_ARGV, "k"))
    server["command"].append("--replica")

    configmap["data"]["SKIFF_GRPC"] = "0.0.0.0:9000"
    server["ports"][0]["containerPort"] = 9000
    found = str(check_kubernetes(docs, IMAGE_ARGV, "k"))
    assert "readinessProbe checks port 7443; the server is on 9000" in found


def test_checker_reports_unit_mistakes():
    text = UNIT_FILE.read_text().replace("LimitCORE=0\n", "").replace("server --home", "serve")
    found = "\n".join(map(str, check_unit(text, "u")))
    assert "LimitCORE=None; want 0" in found
    assert "`skiff serve /var/lib/skiff` does not parse" in found
