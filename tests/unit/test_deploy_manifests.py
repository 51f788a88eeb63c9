"""deploy/: every Kubernetes manifest validates against the API's schemas (kubernetes-validate's,
offline, strict: unknown fields fail) and the LeaderWorkerSet's (deploy/schemas, trimmed from its
CRD, pod templates checked by Kubernetes' own PodTemplateSpec); every command a manifest or a
Dockerfile runs parses with moe-serve's own parsers; probes, ports and the scrape config agree with
what the commands serve."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from moe_serve import docs_gen

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
LWS_SCHEMA = ROOT / "deploy" / "schemas" / "leaderworkerset-v1.json"
VERSION = kubernetes_validate.utils.latest_version()
# What Kubernetes and the LWS controller put into $(VAR) references, for parsing the commands.
ENV_VALUES = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "moe-serve-ep-0.moe-serve-ep",
              "POD_IP": "10.0.0.1"}


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _lws_validator() -> jsonschema.Draft202012Validator:
    version_dir = f"v{VERSION}-local-strict"
    defs = schema_contents(f"kubernetes-json-schema/{version_dir}/_definitions.json", VERSION)
    registry = Resource.from_contents(defs) @ Registry()
    return jsonschema.Draft202012Validator(json.loads(LWS_SCHEMA.read_text()), registry=registry)


def _validate(doc: dict) -> None:
    if doc["kind"] == "LeaderWorkerSet":
        _lws_validator().validate(doc)
    else:
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_manifests_are_all_there():
    kinds = sorted((name, d["kind"]) for name, d in _documents())
    assert kinds == [("grafana-dashboard.yaml", "ConfigMap"), ("multi-node-lws.yaml", "LeaderWorkerSet"),
                     ("multi-node-lws.yaml", "Service"), ("prometheus-scrape.yaml", "ConfigMap"),
                     ("single-node.yaml", "Deployment"), ("single-node.yaml", "Service")]


@pytest.mark.parametrize("name,doc", _documents(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_manifest_is_valid(name, doc):
    _validate(doc)


def _pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    return []


def test_validation_is_strict():
    """A misspelt field fails, in a Deployment's pod and in each of the LeaderWorkerSet's templates and
    its own spec; so does a wrong type."""
    docs = {d["kind"]: d for _, d in _documents()}
    breakages = []
    for kind in ("Deployment", "LeaderWorkerSet"):
        for i in range(len(_pod_templates(docs[kind]))):
            bad = copy.deepcopy(docs[kind])
            container = _pod_templates(bad)[i]["spec"]["containers"][0]
            container["livenesProbes"] = container.pop("livenessProbe", {})
            breakages.append(bad)
    bad = copy.deepcopy(docs["LeaderWorkerSet"])
    bad["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    breakages.append(bad)
    bad = copy.deepcopy(docs["LeaderWorkerSet"])
    bad["spec"]["leaderWorkerTemplate"]["size"] = "two"
    breakages.append(bad)
    bad = copy.deepcopy(docs["LeaderWorkerSet"])
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    breakages.append(bad)
    for bad in breakages:
        with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
            _validate(bad)


def _expand(word: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: ENV_VALUES[m.group(1)], word)


def _containers() -> list[tuple[str, dict, dict]]:
    """(where, pod template, container) of every container that runs moe-serve."""
    out = []
    for name, doc in _documents():
        for t in _pod_templates(doc):
            for c in t["spec"]["containers"]:
                out.append((f"{name}:{t.get('metadata', {}).get('labels', {}).get('role', doc['kind'])}", t, c))
    return out


def _parse(argv: list[str]):
    """Parse a `moe-serve ...` command line as the CLI would; SystemExit (argparse's error) fails."""
    parsers = docs_gen.cli_parsers()
    assert argv[0] == "moe-serve", argv
    sub = argv[1]
    if sub == "launch":
        launch = parsers["moe-serve launch"].parse_args(argv[2:])
        rest = launch.serve_args[1:] if launch.serve_args[:1] == ["--"] else launch.serve_args
        assert launch.serve_args[:1] == ["--"], "moe-serve launch: the serve flags go after --"
        return launch, parsers["python -m launcher serve"].parse_args(rest)
    return None, parsers[f"moe-serve {sub}"].parse_args(argv[2:])


def test_every_command_parses_with_the_cli():
    seen = 0
    for where, _, c in _containers():
        argv = [_expand(w) for w in c["command"] + c.get("args", [])]
        try:
            _parse(argv)
        except SystemExit:
            pytest.fail(f"{where}: `{' '.join(argv)}` does not parse (see the argparse message above)")
        seen += 1
    assert seen == 3


def test_the_command_check_catches_a_wrong_flag():
    with pytest.raises(SystemExit):
        _parse(["moe-serve", "launch", "--nproc-per-node", "8", "--", "--model", "m", "--dist-interfaces", "eth0"])
    with pytest.raises(SystemExit):
        _parse(["moe-serve", "launch", "--nproc-per-node", "8", "--dist-interface", "eth0", "--", "--model", "m"])
    with pytest.raises(SystemExit):
        _parse(["moe-serve", "serve", "--port", "eight"])


def test_the_lws_job_is_one_job():
    """The leader is node 0 on its own address, the workers join it on the same store port, all with
    the same size, interface and checkpoint; probes and the Service point at the leader's --port."""
    (lws,) = [d for _, d in _documents() if d["kind"] == "LeaderWorkerSet"]
    leader_t, worker_t = _pod_templates(lws)
    leader_c, worker_c = leader_t["spec"]["containers"][0], worker_t["spec"]["containers"][0]
    (leader_launch, leader), (worker_launch, worker) = _parse([_expand(w) for w in leader_c["command"]]), \
        _parse([_expand(w) for w in worker_c["command"]])
    assert leader_c["command"][leader_c["command"].index("--node-rank") + 1] == "0"
    assert worker_c["command"][worker_c["command"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert leader_c["command"][leader_c["command"].index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
    assert worker_c["command"][worker_c["command"].index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert leader_launch.master_port == worker_launch.master_port
    assert leader_launch.nproc_per_node == worker_launch.nproc_per_node
    assert leader.model == worker.model and leader.dist_interface == worker.dist_interface is not None
    gpus = {c["resources"]["limits"]["nvidia.com/gpu"] for c in (leader_c, worker_c)}
    assert gpus == {leader_launch.nproc_per_node}
    ports = {p["name"]: p["containerPort"] for p in leader_c["ports"]}
    assert ports == {"http": leader.port, "store": leader_launch.master_port}
    assert leader.host == "0.0.0.0"
    assert "readinessProbe" not in worker_c  # only rank 0's front end serves HTTP
    (svc,) = [d for n, d in _documents() if n == "multi-node-lws.yaml" and d["kind"] == "Service"]
    assert svc["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                                       "role": leader_t["metadata"]["labels"]["role"]}


def test_probes_and_scraping_point_at_what_the_server_serves():
    routes = docs_gen.server_openapi()["paths"]
    prom = yaml.safe_load([d for n, d in _documents() if n == "prometheus-scrape.yaml"][0]["data"]["prometheus.yml"])
    (job,) = prom["scrape_configs"]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep and keep[0]["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    scraped = 0
    for where, t, c in _containers():
        _, ns = _parse([_expand(w) for w in c["command"]])
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                get = c[probe]["httpGet"]
                assert get["path"] == "/health" and "/health" in routes, where
                assert ports[get["port"]] == ns.port, where
        notes = t["metadata"].get("annotations", {})
        if notes.get("prometheus.io/scrape") == "true":
            scraped += 1
            assert int(notes["prometheus.io/port"]) == ns.port and notes["prometheus.io/path"] in routes, where
            assert "livenessProbe" in c, where
    assert scraped == 2  # the single-node pod and the LWS leader


def test_grafana_configmap_carries_the_dashboard():
    (cm,) = [d for n, d in _documents() if n == "grafana-dashboard.yaml"]
    assert json.loads(cm["data"]["moe-serve.json"]) == json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_installs_the_package_and_runs_the_cli(dockerfile):
    """Not built here (no container engine): what can be checked without one. Every package the
    project ships is copied in, with the files pip needs; torch is the version scripts/setup.sh pins;
    the default command parses."""
    text = (ROOT / "deploy" / "docker" / dockerfile).read_text()
    copied = {w for line in re.findall(r"^COPY (.+)$", text, re.M) for w in line.split()[:-1]}
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r'include = \[(.*?)\]', pyproject).group(1)
    for pkg in re.findall(r'"(\w+)\*"', packages):
        assert pkg in copied, f"{dockerfile} does not copy the package {pkg}"
    assert {"pyproject.toml", "README.md"} <= copied
    for path in copied:
        assert (ROOT / path).exists(), path
    pinned = re.search(r'torch==([\d.]+)', (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert f"ARG TORCH_VERSION={pinned}" in text
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    _, ns = _parse(entry + cmd)
    assert ns.host == "0.0.0.0" and str(ns.port) in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()
