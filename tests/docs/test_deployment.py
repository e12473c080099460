"""deploy/kubernetes/astrai-replicas.yaml (docs/deployment.md) holds together: Kubernetes shapes a typo would break,
the `astrai serve` arguments parsed by astrai's own CLI parser, the router's worker URLs naming the worker pods,
and the router's flags accepted by sglang-router (when it is installed). Negative controls: a misspelt astrai flag
and a worker URL naming a pod that does not exist are caught by the same checks."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astrai.cli._common import parse
from astrai.cli.serve import ServeConfig

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "astrai-replicas.yaml"
KINDS = {"Secret": "v1", "Service": "v1", "StatefulSet": "apps/v1", "Deployment": "apps/v1"}


@pytest.fixture(scope="module")
def docs():
    loaded = [d for d in yaml.safe_load_all(MANIFEST.read_text(encoding="utf-8")) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in loaded}


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _serve_args(docs) -> list[str]:
    container = _container(docs["StatefulSet", "astrai-worker"])
    assert container["command"] == ["astrai", "serve"]
    return [str(a) for a in container["args"]]


def test_every_object_is_a_known_kind_with_its_api_version(docs):
    assert {kind for kind, _ in docs} == set(KINDS)
    for (kind, name), doc in docs.items():
        assert doc["apiVersion"] == KINDS[kind], (kind, name)


def test_workloads_select_their_own_pods_and_services_find_them(docs):
    labels = {}
    for (kind, name), doc in docs.items():
        if kind in ("StatefulSet", "Deployment"):
            pod = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= pod.items(), name
            labels[name] = pod
            ports = {p["name"] for p in _container(doc).get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in _container(doc):
                    assert _container(doc)[probe]["httpGet"]["port"] in ports, (name, probe)
    for (kind, name), doc in docs.items():
        if kind == "Service":
            assert any(doc["spec"]["selector"].items() <= pod.items() for pod in labels.values()), name
    workers = docs["StatefulSet", "astrai-worker"]
    assert docs["Service", workers["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"  # headless
    secret = _container(workers)["env"][0]["valueFrom"]["secretKeyRef"]
    assert secret["key"] in docs["Secret", secret["name"]]["stringData"]


def test_the_worker_arguments_parse_as_astrai_serve(docs):
    cfg = parse(ServeConfig, _serve_args(docs))
    assert (cfg.host, cfg.port, cfg.tensor_parallel_size) == ("0.0.0.0", 8000, 2)
    gpus = _container(docs["StatefulSet", "astrai-worker"])["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == cfg.tensor_parallel_size  # one pod holds the whole tensor-parallel group
    with pytest.raises(SystemExit):  # negative control: a misspelt flag does not parse
        parse(ServeConfig, [*_serve_args(docs), "--tensor-paralel-size", "2"])


def _router_args(docs) -> list[str]:
    return [str(a) for a in _container(docs["Deployment", "astrai-router"])["args"]]


def _worker_urls(docs) -> list[str]:
    args = _router_args(docs)
    start = args.index("--worker-urls") + 1
    return list(itertools.takewhile(lambda a: not a.startswith("--"), args[start:]))


def test_the_router_names_every_worker_pod(docs):
    workers = docs["StatefulSet", "astrai-worker"]
    port = parse(ServeConfig, _serve_args(docs)).port
    expected = [f"http://astrai-worker-{i}.{workers['spec']['serviceName']}:{port}"
                for i in range(workers["spec"]["replicas"])]  # fmt: skip
    assert _worker_urls(docs) == expected
    assert f"http://astrai-worker-{workers['spec']['replicas']}.astrai-workers:{port}" not in expected  # control


def test_the_router_sends_the_workers_key(docs):
    """Without --api-key the router's own calls to keyed workers get 401 (model `unknown`, loads -1)."""
    router = _container(docs["Deployment", "astrai-router"])
    args = _router_args(docs)
    value = args[args.index("--api-key") + 1]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in router["env"]}
    worker_env = {
        e["name"]: e["valueFrom"]["secretKeyRef"] for e in _container(docs["StatefulSet", "astrai-worker"])["env"]
    }
    match = re.fullmatch(r"\$\((\w+)\)", value)  # Kubernetes' $(VAR) expansion from the container's env
    assert match and env[match.group(1)] == worker_env["ASTRAI_API_KEY"], (value, env)


def test_the_router_flags_exist_in_sglang_router(docs):
    pytest.importorskip("sglang_router", reason="sglang-router (a dev extra) is not installed")
    help_text = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                               text=True, timeout=60).stdout  # fmt: skip
    flags = [a for a in _router_args(docs) if a.startswith("--")]
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", help_text)]
    assert flags and not missing, missing
