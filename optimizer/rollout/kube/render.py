"""Kubernetes manifests for a target placement (DESIGN §3.7): pure, dicts in the API's shape.

Role: one Pod per GPU group (:class:`~optimizer.plan.target.GroupSpec`) pinned to its node, one
Service per replica, and the routes ConfigMap the proxies' route sync reads. The kubernetes
backend applies them; ``scepsy render`` writes them.

A pod holds one engine container per replica of the group (ports ``engine_port + k``) and, when
the group's GPUs are shared, an MPS control daemon as a native sidecar (an init container with
``restartPolicy: Always``, so it runs before the engines start). They share an ``emptyDir`` at
``/mps`` (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``); each engine gets its own
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (share x 100) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
(its memory per GPU) from the placement.

GPU identity: stock Kubernetes hands a container any N GPUs of its node, not chosen indices. The
pod requests the group's N whole GPUs (on the MPS daemon, or on the engine when unshared) so
the scheduler accounts for them, and every container names the placement's GPUs itself with
``NVIDIA_VISIBLE_DEVICES`` (NVML indices, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); inside the pod they
are renumbered 0..N-1, which ``CUDA_VISIBLE_DEVICES`` uses. This assumes nodes whose GPUs only
Scepsy schedules and a container runtime that honours ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA
runtime's default). Emulated engines (``engine: emulator``) use no GPU and no MPS.

Cluster knobs (``rollout.kubernetes``): the user's ``node_selector`` is merged under the
placement's ``kubernetes.io/hostname`` pin; ``tolerations``, ``runtime_class_name`` and
``image_pull_secrets`` go on every engine pod; ``resources`` (CPU, memory) on every engine
container, beside the GPU count the placement sets; a ``model_cache`` volume is mounted into
vllm/sglang engines at its ``mount_path`` with ``HF_HOME`` pointing there. With ``harden`` every
container drops all capabilities and privilege escalation under the RuntimeDefault seccomp
profile; emulator containers (our image, uid 65532) also run as non-root on a read-only root.

Invariants: the output is a function of its inputs only (same target, same bytes), so a second
server-side apply changes nothing; every object carries the owner labels
(:func:`owner_labels`); names are DNS labels derived from group and replica ids; the pod's
``scepsy.io/group-spec`` annotation holds the group as JSON, from which the backend observes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from optimizer.plan.target import GroupSpec, ReplicaSpec, TargetReplica
from shared.cluster import Cluster
from shared.rollout_settings import KubernetesSettings, ModelServing, RolloutSettings

__all__ = [
    "ANNOTATION_GROUP",
    "LABEL_GROUP",
    "LABEL_REPLICA",
    "MPS_DIR",
    "ROUTES_KEY",
    "engine_command",
    "group_from_pod",
    "owner_labels",
    "pod_name",
    "render_group",
    "render_routes",
    "render_target",
    "replica_url",
    "service_name",
]

LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_OWNER = "scepsy.io/owner"
LABEL_GROUP = "scepsy.io/group"
LABEL_REPLICA = "scepsy.io/replica"
ANNOTATION_GROUP = "scepsy.io/group-spec"
ANNOTATION_MODEL = "scepsy.io/model"
ROUTES_KEY = "routes.json"
MPS_DIR = "/mps"
MIB = 1 << 20
CACHE_VOLUME = "model-cache"
NONROOT_UID = 65532  # the uid of deploy/image's images (the emulator's)


def owner_labels(k: KubernetesSettings) -> dict[str, str]:
    """The labels every object Scepsy creates carries; deletes require them."""
    return {LABEL_MANAGED: "scepsy", LABEL_OWNER: k.owner}


def pod_name(group_id: str) -> str:
    return f"scepsy-{group_id}"


def service_name(replica_id: str) -> str:
    return f"scepsy-{replica_id}"


def replica_url(replica_id: str, k: KubernetesSettings) -> str:
    return f"http://{service_name(replica_id)}.{k.namespace}.svc:{k.service_port}"


def engine_command(
    serving: ModelServing, spec: ReplicaSpec, port: int, gpu_type: str, gpu_memory_bytes: int
) -> list[str]:
    """The engine's command line for one replica."""
    fraction = f"{min(0.95, spec.memory_bytes_per_gpu / gpu_memory_bytes):.3f}"
    if serving.engine == "vllm":
        cmd = [
            "vllm",
            "serve",
            serving.weights,
            "--served-model-name",
            serving.name,
            "--tensor-parallel-size",
            str(spec.tp),
            "--gpu-memory-utilization",
            fraction,
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
        ]
    elif serving.engine == "sglang":
        cmd = [
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            serving.weights,
            "--served-model-name",
            serving.name,
            "--tp-size",
            str(spec.tp),
            "--mem-fraction-static",
            fraction,
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
        ]
    else:
        cmd = [
            "scepsy-engine",
            "--model",
            serving.weights,
            "--served-model-name",
            serving.name,
            "--gpu",
            gpu_type,
            "--tp",
            str(spec.tp),
            "--share",
            f"{spec.share:g}",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
        ]
    return cmd + list(serving.extra_args)


def _image(serving: ModelServing, k: KubernetesSettings) -> str:
    return {"vllm": k.vllm_image, "sglang": k.sglang_image}.get(serving.engine, k.emulator_image)


def _env(pairs: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"name": n, "value": v} for n, v in pairs]


def _security_context(kube: KubernetesSettings, ours: bool) -> dict[str, Any] | None:
    """The container's securityContext: hardened unless ``harden`` is off; ``ours`` (our image,
    the emulator) also runs as its non-root user on a read-only root file system."""
    if not kube.harden:
        return None
    ctx: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if ours:
        ctx.update(
            {
                "runAsNonRoot": True,
                "runAsUser": NONROOT_UID,
                "runAsGroup": NONROOT_UID,
                "readOnlyRootFilesystem": True,
            }
        )
    return ctx


def _group_json(group: GroupSpec) -> str:
    return orjson.dumps(
        {
            "id": group.id,
            "node": group.node,
            "gpus": list(group.gpus),
            "replicas": [
                {
                    "id": r.id,
                    "model": r.spec.model,
                    "gpus": list(r.spec.gpus),
                    "share": r.spec.share,
                    "memory_bytes_per_gpu": r.spec.memory_bytes_per_gpu,
                    "revision": r.spec.revision,
                }
                for r in group.replicas
            ],
        },
        option=orjson.OPT_SORT_KEYS,
    ).decode()


def group_from_pod(pod: dict[str, Any]) -> GroupSpec:
    """The group a rendered pod holds (from its annotation); ``ValueError`` if malformed."""
    try:
        raw = orjson.loads(pod["metadata"]["annotations"][ANNOTATION_GROUP])
        return GroupSpec(
            raw["id"],
            raw["node"],
            tuple(raw["gpus"]),
            tuple(
                TargetReplica(
                    r["id"],
                    ReplicaSpec(
                        r["model"],
                        raw["node"],
                        tuple(r["gpus"]),
                        r["share"],
                        r["memory_bytes_per_gpu"],
                        r["revision"],
                    ),
                )
                for r in raw["replicas"]
            ),
        )
    except (KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise ValueError(
            f"pod {pod.get('metadata', {}).get('name')}: bad group annotation"
        ) from exc


def _engine_container(
    k: int,
    replica: TargetReplica,
    group: GroupSpec,
    rollout: RolloutSettings,
    cluster: Cluster,
    mps: bool,
    gpu: bool,
) -> dict[str, Any]:
    kube = rollout.kubernetes
    spec = replica.spec
    serving = rollout.model(spec.model)
    port = kube.engine_port + k
    first = cluster.node(group.node).gpu(spec.gpus[0])
    env: list[tuple[str, str]] = []
    if gpu:
        local = [group.gpus.index(g) for g in spec.gpus]
        env += [
            ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
            ("NVIDIA_VISIBLE_DEVICES", ",".join(map(str, group.gpus))),
            ("CUDA_VISIBLE_DEVICES", ",".join(map(str, local))),
        ]
    if mps:
        limit = ",".join(f"{i}={spec.memory_bytes_per_gpu // MIB}M" for i in range(spec.tp))
        env += [
            ("CUDA_MPS_PIPE_DIRECTORY", f"{MPS_DIR}/pipe"),
            ("CUDA_MPS_LOG_DIRECTORY", f"{MPS_DIR}/log"),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(max(1, round(spec.share * 100)))),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limit),
        ]
    container: dict[str, Any] = {
        "name": f"engine-{k}",
        "image": _image(serving, kube),
        "command": engine_command(serving, spec, port, first.type, first.memory_bytes),
        "ports": [{"name": f"http-{k}", "containerPort": port, "protocol": "TCP"}],
        "env": _env(env),
        # Cold starts take minutes (calibration.md): the startup probe allows the whole
        # ready_timeout_s before the kubelet restarts the engine.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 10,
            "failureThreshold": max(1, int(kube.ready_timeout_s // 10)),
        },
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5},
    }
    real = serving.engine != "emulator"
    if gpu and real and kube.hf_token_secret:
        container["env"].append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": kube.hf_token_secret, "key": "HF_TOKEN"}},
            }
        )
    cache = kube.model_cache
    if real and cache.enabled:
        container["env"].append({"name": "HF_HOME", "value": cache.mount_path})
        if cache.read_only:
            container["env"].append({"name": "HF_HUB_OFFLINE", "value": "1"})
    mounts: list[dict[str, Any]] = []
    if mps:
        mounts.append({"name": "mps", "mountPath": MPS_DIR})
    if gpu and spec.tp > 1:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})  # NCCL between TP ranks
    if real and cache.enabled:
        mounts.append(
            {"name": CACHE_VOLUME, "mountPath": cache.mount_path, "readOnly": cache.read_only}
        )
    if mounts:
        container["volumeMounts"] = mounts
    resources = kube.resources.manifest(kube.gpu_resource)
    if gpu and not mps:
        resources["limits"] = {**resources.get("limits", {}), kube.gpu_resource: str(spec.tp)}
    if resources:
        container["resources"] = resources
    security = _security_context(kube, ours=not real)
    if security:
        container["securityContext"] = security
    return container


def _mps_daemon(group: GroupSpec, kube: KubernetesSettings) -> dict[str, Any]:
    return {
        "name": "mps-control",
        "image": kube.mps_image,
        "restartPolicy": "Always",
        "command": ["nvidia-cuda-mps-control", "-f"],
        "env": _env(
            [
                ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
                ("NVIDIA_VISIBLE_DEVICES", ",".join(map(str, group.gpus))),
                ("CUDA_MPS_PIPE_DIRECTORY", f"{MPS_DIR}/pipe"),
                ("CUDA_MPS_LOG_DIRECTORY", f"{MPS_DIR}/log"),
            ]
        ),
        "resources": {"limits": {kube.gpu_resource: str(len(group.gpus))}},
        "volumeMounts": [{"name": "mps", "mountPath": MPS_DIR}],
        "startupProbe": {
            "exec": {"command": ["sh", "-c", "echo get_server_list | nvidia-cuda-mps-control"]},
            "periodSeconds": 2,
            "failureThreshold": 30,
        },
        **({"securityContext": ctx} if (ctx := _security_context(kube, ours=False)) else {}),
    }


def _pod_knobs(kube: KubernetesSettings, group: GroupSpec) -> dict[str, Any]:
    """Scheduling and runtime fields of an engine pod from the user's cluster knobs."""
    spec: dict[str, Any] = {
        "nodeSelector": {
            **dict(sorted(kube.node_selector.items())),
            "kubernetes.io/hostname": group.node,
        },
    }
    if kube.tolerations:
        spec["tolerations"] = [t.manifest() for t in kube.tolerations]
    if kube.runtime_class_name is not None:
        spec["runtimeClassName"] = kube.runtime_class_name
    if kube.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in kube.image_pull_secrets]
    if kube.harden:
        spec["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
    return spec


def render_group(
    group: GroupSpec, rollout: RolloutSettings, cluster: Cluster
) -> list[dict[str, Any]]:
    """The Pod of one GPU group, then one Service per replica."""
    kube = rollout.kubernetes
    gpu = any(rollout.model(r.spec.model).engine != "emulator" for r in group.replicas)
    mps = gpu and group.shared
    labels: dict[str, str] = {
        **owner_labels(kube),
        LABEL_NAME: "scepsy-engine",
        LABEL_COMPONENT: "engine",
        LABEL_GROUP: group.id,
    }
    spec: dict[str, Any] = {
        **_pod_knobs(kube, group),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "containers": [
            _engine_container(k, r, group, rollout, cluster, mps, gpu)
            for k, r in enumerate(group.replicas)
        ],
    }
    volumes: list[dict[str, Any]] = []
    if mps:
        spec["initContainers"] = [_mps_daemon(group, kube)]
        volumes.append({"name": "mps", "emptyDir": {}})
    if gpu and any(r.spec.tp > 1 for r in group.replicas):
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    cache = kube.model_cache
    if gpu and cache.enabled:
        source: dict[str, Any] = (
            {"persistentVolumeClaim": {"claimName": cache.claim, "readOnly": cache.read_only}}
            if cache.claim is not None
            else {"hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
        )
        volumes.append({"name": CACHE_VOLUME, **source})
    if volumes:
        spec["volumes"] = volumes
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(group.id),
            "namespace": kube.namespace,
            "labels": labels,
            "annotations": {ANNOTATION_GROUP: _group_json(group)},
        },
        "spec": spec,
    }
    selector = {**owner_labels(kube), LABEL_GROUP: group.id}
    services: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": service_name(r.id),
                "namespace": kube.namespace,
                "labels": {**labels, LABEL_REPLICA: r.id},
                "annotations": {ANNOTATION_MODEL: r.spec.model},
            },
            "spec": {
                "selector": selector,
                "ports": [
                    {
                        "name": "http",
                        "port": kube.service_port,
                        "protocol": "TCP",
                        "targetPort": kube.engine_port + k,
                    }
                ],
            },
        }
        for k, r in enumerate(group.replicas)
    ]
    return [pod, *services]


def render_routes(routes: Sequence[tuple[str, str]], kube: KubernetesSettings) -> dict[str, Any]:
    """The routes ConfigMap: ``routes.json`` = ``{"upstreams": [{"model", "url"}, ...]}``."""
    upstreams = [{"model": m, "url": u} for m, u in sorted(set(routes))]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": kube.routes_configmap,
            "namespace": kube.namespace,
            "labels": {
                **owner_labels(kube),
                LABEL_NAME: "scepsy-routes",
                LABEL_COMPONENT: "routes",
            },
        },
        "data": {ROUTES_KEY: orjson.dumps({"upstreams": upstreams}).decode()},
    }


def render_target(
    target: Sequence[GroupSpec], rollout: RolloutSettings, cluster: Cluster
) -> list[dict[str, Any]]:
    """Every object of a fully rolled-out target: pods, services, routes to every replica."""
    kube = rollout.kubernetes
    objects = [obj for g in target for obj in render_group(g, rollout, cluster)]
    routes = [(r.spec.model, replica_url(r.id, kube)) for g in target for r in g.replicas]
    return [*objects, render_routes(routes, kube)]
