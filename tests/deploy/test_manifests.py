"""deploy/ comes up as written: every object of every kustomization and of ``scepsy render``
validates against Kubernetes 1.32, every probe dials a port its container listens on (from the
pod IP), the routes belong to the optimizer alone, and every container is hardened and sized."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from optimizer.cli import main as cli
from optimizer.rollout.kube.render import render_routes
from proxy import cli as proxy_cli
from shared.settings import Settings, parse_host_port
from shared.settings_schema import decode
from tests.deploy import kustomize
from tests.deploy.objects import (
    DEPLOY,
    EXAMPLE,
    Obj,
    argv,
    build,
    kubectl_build,
    kustomization_dirs,
    render,
)

pytestmark = pytest.mark.timeout(120)

CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}
WILDCARD = {"0.0.0.0", "::", ""}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def deploy_objects() -> dict[str, list[Obj]]:
    return {str(d.relative_to(DEPLOY)): build(d) for d in kustomization_dirs()}


@pytest.fixture(scope="module")
def built() -> dict[str, list[Obj]]:
    return deploy_objects()


def emulated_config(tmp: Path) -> Path:
    """examples/cluster.yaml with every model emulated and every cluster knob set."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    for m in doc["rollout"]["models"]:
        m.update(engine="emulator", extra_args=[])
        m.pop("source", None)
    doc["rollout"]["kubernetes"].update(
        runtime_class_name="nvidia",
        image_pull_secrets=["regcred"],
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        node_selector={"pool": "gpu"},
        resources={"requests": {"cpu": 1, "memory": "1Gi"}},
        model_cache={"host_path": "/srv/hf"},
    )
    path = tmp / "emulated.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    tmp = tmp_path_factory.mktemp("render")
    return {
        "render": render(tmp / "default"),
        "render rag_x3": render(tmp / "rag_x3", EXAMPLE, "--scenario", "rag_x3"),
        "render emulated": render(tmp / "emulated", emulated_config(tmp)),
    }


def pod_specs(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(owning object, pod spec) of every Pod and workload."""
    for obj in objects:
        for spec in kustomize.pod_specs(obj):
            yield obj, spec


def pod_labels(obj: Obj) -> dict[str, str]:
    meta = obj["metadata"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]
    return dict(meta.get("labels", {}))


# --- schemas ---------------------------------------------------------------------------------


def test_every_kustomization_builds_objects_that_validate_against_1_32(
    built: dict[str, list[Obj]],
) -> None:
    assert set(built) == {".", "examples/sidecar", "prometheus"}
    for where, objects in built.items():
        assert objects, where
        for obj in objects:
            if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
                continue  # no schema shipped; checked against the pods below
            kubernetes_validate.validate(obj, "1.32", strict=True)


@pytest.mark.parametrize("root", kustomization_dirs(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_builder_matches_kubectl_kustomize(root: Path) -> None:
    real = kubectl_build(root)
    if real is None:
        pytest.skip("kubectl not installed: the builder's exactness is not checked here")

    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(build(root), key=key) == sorted(real, key=key)


def test_render_output_validates_against_1_32(rendered: dict[str, list[Obj]]) -> None:
    for where, objects in rendered.items():
        assert any(o["kind"] == "Pod" for o in objects), where
        for obj in objects:
            kubernetes_validate.validate(obj, "1.32", strict=True)


def test_generated_names_follow_kustomize_and_references_follow_them(
    built: dict[str, list[Obj]],
) -> None:
    base = built["."]
    generated = {o["metadata"]["name"] for o in base if o["kind"] in ("ConfigMap", "Secret")}
    assert all(re.fullmatch(r"scepsy-(settings|proxy)-[a-z0-9]{10}", n) for n in generated)
    referenced = {
        v.get("configMap", {}).get("name") or v.get("secret", {}).get("secretName")
        for _, spec in pod_specs(base)
        for v in spec.get("volumes", [])
    }
    assert generated <= referenced

    # The suffixes kustomize's own hasher tests (api/hasher) expect.
    def cm(data: dict[str, str]) -> Obj:
        return {"kind": "ConfigMap", "metadata": {"name": ""}, "data": data}

    assert kustomize.name_hash(cm({})) == "42745tchd9"
    assert kustomize.name_hash(cm({"one": ""})) == "9g67k2htb6"
    assert kustomize.name_hash(cm({"two": "2", "one": ""})) == "6578g4h258"
    secret = {"kind": "Secret", "type": "my-type", "metadata": {"name": ""}, "data": {}}
    assert kustomize.name_hash(secret) == "t75bgf6ctb"


# --- probes ----------------------------------------------------------------------------------


def mounted_file(path: str, container: Obj, spec: Obj, objects: list[Obj]) -> str:
    """The text of ``path`` inside ``container``, from the ConfigMap or Secret mounted there."""
    target = PurePosixPath(path)
    for mount in container.get("volumeMounts", []):
        root = PurePosixPath(mount["mountPath"])
        if root not in target.parents:
            continue
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        kind, name = (
            ("ConfigMap", volume["configMap"]["name"])
            if "configMap" in volume
            else ("Secret", volume["secret"]["secretName"])
        )
        (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
        text = obj["data"][str(target.relative_to(root))]
        return text if kind == "ConfigMap" else base64.b64decode(text).decode()
    raise AssertionError(f"{container['name']}: nothing mounted at {path}")


def listen_address(container: Obj, spec: Obj, objects: list[Obj]) -> tuple[str, int] | None:
    """HOST, PORT the container's server binds, read from its settings or its flags."""
    words = argv(container)
    if words[:1] == ["scepsy-proxy"]:
        args = proxy_cli._parser().parse_args(words[1:])
        settings = decode(
            Settings, yaml.safe_load(mounted_file(args.config, container, spec, objects))
        )
        return parse_host_port(args.listen or settings.proxy.listen, "proxy.listen")
    if words[:2] == ["scepsy", "run"]:
        args = cli.build_parser("run").parse_args(words[1:])
        settings = decode(
            Settings, yaml.safe_load(mounted_file(args.config, container, spec, objects))
        )
        return parse_host_port(args.listen or settings.optimizer.listen, "optimizer.listen")
    if "--host" in words and "--port" in words:  # vllm, sglang, scepsy-engine
        return words[words.index("--host") + 1], int(words[words.index("--port") + 1])
    return None


def port_number(port: int | str, container: Obj) -> int:
    if isinstance(port, int):
        return port
    named: dict[str, int] = {
        p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p
    }
    assert port in named, f"{container['name']}: no port named {port}"
    return named[port]


def probe_problems(objects: list[Obj]) -> list[str]:
    problems = []
    for owner, spec in pod_specs(objects):
        for c in kustomize.containers(spec):
            where = f"{owner['kind']} {owner['metadata']['name']} container {c['name']}"
            for key in PROBES:
                handler = (c.get(key) or {}).get("httpGet") or (c.get(key) or {}).get("tcpSocket")
                if handler is None:
                    continue
                if "host" in handler:
                    problems.append(
                        f"{where}: {key} sets host {handler['host']}, which the "
                        f"kubelet dials from the node, not the pod"
                    )
                listen = listen_address(c, spec, objects)
                if listen is None:
                    problems.append(f"{where}: {key}, but what it listens on is unknown")
                    continue
                host, port = listen
                if port != port_number(handler["port"], c):
                    problems.append(
                        f"{where}: {key} dials port {handler['port']}, it listens on {port}"
                    )
                if host not in WILDCARD:
                    problems.append(f"{where}: {key} dials the pod IP, it listens on {host}")
    return problems


def test_every_probe_dials_a_port_its_container_listens_on_from_the_pod_ip(
    built: dict[str, list[Obj]], rendered: dict[str, list[Obj]]
) -> None:
    for where, objects in {**built, **rendered}.items():
        assert probe_problems(objects) == [], where
    probed = [
        c["name"]
        for objs in built.values()
        for _, s in pod_specs(objs)
        for c in kustomize.containers(s)
        if any(k in c for k in PROBES)
    ]
    assert sorted(probed) == ["optimizer", "proxy", "scepsy-proxy"]


def test_the_probe_check_catches_a_loopback_listener_and_a_node_host(
    built: dict[str, list[Obj]],
) -> None:
    import copy

    objects = copy.deepcopy(built["examples/sidecar"])
    for obj in objects:
        if obj["kind"] == "Secret":
            text = base64.b64decode(obj["data"]["proxy-settings.yaml"]).decode()
            text = text.replace("0.0.0.0:8080", "127.0.0.1:8080")
            obj["data"]["proxy-settings.yaml"] = base64.b64encode(text.encode()).decode()
    ((_, spec),) = pod_specs(objects)
    spec["initContainers"][0]["startupProbe"]["httpGet"]["host"] = "127.0.0.1"
    problems = probe_problems(objects)
    assert any("sets host 127.0.0.1" in p for p in problems)
    assert any("it listens on 127.0.0.1" in p for p in problems)


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        op, key, values = expr["operator"], expr["key"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def test_pod_monitors_scrape_ports_that_listen_beyond_loopback(
    built: dict[str, list[Obj]], rendered: dict[str, list[Obj]]
) -> None:
    pods = [
        (o, s, objs) for objs in [*built.values(), *rendered.values()] for o, s in pod_specs(objs)
    ]
    monitors = [o for o in built["prometheus"] if o["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {
        "scepsy-proxy",
        "scepsy-optimizer",
        "scepsy-engines",
    }
    for monitor in monitors:
        assert monitor["metadata"]["namespace"] == "scepsy"
        matched = [
            (o, s, objs)
            for o, s, objs in pods
            if selects(monitor["spec"]["selector"], pod_labels(o))
        ]
        assert matched, f"{monitor['metadata']['name']} selects no pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["path"] == "/metrics"
            for owner, spec, objs in matched:
                ports = [
                    (c, p)
                    for c in kustomize.containers(spec)
                    for p in c.get("ports", [])
                    if "port" not in endpoint or p.get("name") == endpoint["port"]
                ]
                assert ports, f"{monitor['metadata']['name']}: {owner['metadata']['name']}"
                for c, p in ports:
                    listen = listen_address(c, spec, objs)
                    assert listen is not None and listen[0] in WILDCARD, c["name"]
                    assert listen[1] == p["containerPort"], c["name"]
    names = {
        monitor["metadata"]["name"]: [
            pod_labels(o).get("app.kubernetes.io/name", "")
            for o, _, _ in pods
            if selects(monitor["spec"]["selector"], pod_labels(o))
        ]
        for monitor in monitors
    }
    assert sorted(set(names["scepsy-proxy"])) == ["rag-agent", "scepsy-proxy"]


def test_scrape_config_keeps_the_proxy_ports(built: dict[str, list[Obj]]) -> None:
    (scrape,) = kustomize.documents(DEPLOY / "prometheus" / "scrape.yaml")
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "scepsy-proxy"]
    rules = {
        tuple(r["source_labels"]): r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    port_rule = rules[("__meta_kubernetes_pod_container_port_name",)]
    label_rule = rules[("__meta_kubernetes_pod_label_scepsy_io_proxy",)]
    for objects in (built["."], built["examples/sidecar"]):
        for owner, spec in pod_specs(objects):
            proxies = [c for c in kustomize.containers(spec) if argv(c)[:1] == ["scepsy-proxy"]]
            if proxies:
                assert re.fullmatch(label_rule, pod_labels(owner)["scepsy.io/proxy"])
                assert any(re.fullmatch(port_rule, p["name"]) for p in proxies[0]["ports"])


# --- routes: one writer ----------------------------------------------------------------------


def routes_key() -> tuple[str, str]:
    rollout = decode(Settings, yaml.safe_load((DEPLOY / "settings.yaml").read_text())).rollout
    return rollout.kubernetes.namespace, rollout.kubernetes.routes_configmap


def test_no_kustomization_holds_the_routes_the_optimizer_writes(
    built: dict[str, list[Obj]],
) -> None:
    namespace, name = routes_key()
    for where, objects in built.items():
        for obj in objects:
            key = (obj["metadata"].get("namespace"), obj["metadata"]["name"])
            assert not (obj["kind"] == "ConfigMap" and key == (namespace, name)), where


def test_a_second_apply_of_the_base_leaves_the_optimizers_routes_alone(
    built: dict[str, list[Obj]],
) -> None:
    """Apply as kubectl does (each object replaces the one of its kind, namespace and name)."""
    rollout = decode(Settings, yaml.safe_load((DEPLOY / "settings.yaml").read_text())).rollout
    cluster: dict[tuple[str, str | None, str], Any] = {}

    def apply(objects: list[Obj]) -> None:
        for obj in objects:
            cluster[(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])] = obj

    apply(built["."])
    routes = render_routes([("llama-3-8b", "http://scepsy-r0.scepsy.svc:8000")], rollout.kubernetes)
    apply([routes])  # the optimizer's first rollout
    apply(built["."])  # kubectl apply -k deploy/ again, or a GitOps sync
    apply(built["examples/sidecar"])
    namespace, name = routes_key()
    assert cluster[("ConfigMap", namespace, name)] is routes


def test_proxies_mount_the_routes_optionally(built: dict[str, list[Obj]]) -> None:
    _, name = routes_key()
    mounts = [
        v
        for objs in built.values()
        for _, spec in pod_specs(objs)
        for v in spec.get("volumes", [])
        if v.get("configMap", {}).get("name") == name
    ]
    assert len(mounts) == 2  # the gateway's and the sidecar example's
    assert all(v["configMap"]["optional"] is True for v in mounts)


# --- hardening and sizing --------------------------------------------------------------------


@pytest.mark.parametrize("where", [".", "examples/sidecar"])
def test_every_container_is_hardened_and_sized(built: dict[str, list[Obj]], where: str) -> None:
    for owner, spec in pod_specs(built[where]):
        pod_ctx = spec.get("securityContext", {})
        for c in kustomize.containers(spec):
            ctx = c.get("securityContext", {})
            name = f"{owner['metadata']['name']}/{c['name']}"
            assert ctx.get("allowPrivilegeEscalation") is False, name
            assert ctx.get("readOnlyRootFilesystem") is True, name
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], name
            assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, name
            seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile"))
            assert seccomp == {"type": "RuntimeDefault"}, name
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), name
            assert "memory" in resources.get("limits", {}), name


def test_the_settings_files_of_deploy_load() -> None:
    for path in [
        DEPLOY / "settings.yaml",
        DEPLOY / "proxy-settings.yaml",
        DEPLOY / "examples" / "sidecar" / "proxy-settings.yaml",
    ]:
        settings = decode(Settings, yaml.safe_load(path.read_text()))
        assert settings.store.path == "/var/lib/scepsy/store"
