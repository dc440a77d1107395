"""The ``rollout:`` settings section (how models are served and rolled out).

Role: the schema of what the rollout needs beyond the cluster: per model, the engine that serves
it, where its weights come from and the least memory it needs; an explicit allocation (replicas,
tensor-parallel degree, GPU share per model) for when no search has run yet, optionally several
named ones (``scenarios``, e.g. before and after a traffic shift); and the Kubernetes backend's
namespace, images, ports and timeouts, and the engine pods' scheduling knobs a real cluster needs (tolerations,
``nodeSelector``, ``runtimeClassName``, image pull secrets, resources, a model-weights cache
volume); the local backend's state folder, proxies, ports and timeouts (``local``).

Invariants: decoded once by :func:`shared.settings_schema.decode`, frozen afterwards; a bad
value raises :class:`SettingsError` naming its key path relative to ``rollout``; every model an
allocation names is listed in ``models``; names that end up in Kubernetes object names are
DNS-1123 labels.
"""

from __future__ import annotations

import hashlib
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from shared.cluster import GB
from shared.settings_schema import SettingsError, setting

__all__ = [
    "AllocationEntry",
    "Engine",
    "EngineResources",
    "KubernetesSettings",
    "LocalSettings",
    "ModelCacheSettings",
    "ModelServing",
    "NamedAllocation",
    "Quantity",
    "RolloutSettings",
    "Toleration",
]

Engine = Literal["vllm", "sglang", "emulator"]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
# A Kubernetes resource quantity ("4", "500m", "16Gi", "1.5"); YAML numbers are accepted too.
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i?|[mkMGTPE])?$")
# Set by the placement (whole GPUs per pod), never by the user's resources.
_HOSTNAME_LABEL = "kubernetes.io/hostname"

Quantity = str | int | float


def _empty() -> Mapping[str, Quantity]:
    return types.MappingProxyType({})


def _no_labels() -> Mapping[str, str]:
    return types.MappingProxyType({})


@dataclass(frozen=True)
class ModelServing:
    """How one model is served: its engine, its weights and its memory floor."""

    name: str = setting(doc="model name clients send in the `model` field (served model name)")
    engine: Engine = setting("emulator", doc="vllm, sglang, or emulator (scepsy-engine)")
    source: str | None = setting(
        None,
        doc="weights: a Hugging Face id or path for vllm/sglang; the emulator's --model spec "
        "name for the emulator (default: name)",
    )
    min_memory_gb: float = setting(
        0.0, doc="least memory a replica needs over all its GPUs (weights plus a minimal KV cache)"
    )
    extra_args: tuple[str, ...] = setting(
        factory=tuple, doc="further engine arguments, appended as given"
    )

    def __post_init__(self) -> None:
        if not self.name:
            raise SettingsError("name", "must not be empty")
        if self.min_memory_gb < 0:
            raise SettingsError("min_memory_gb", "must not be negative")

    @property
    def weights(self) -> str:
        return self.source or self.name

    @property
    def revision(self) -> str:
        """Digest of how the model is served; a change replaces its replicas."""
        text = "\0".join([self.engine, self.weights, *self.extra_args])
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    @property
    def min_memory_bytes(self) -> int:
        return round(self.min_memory_gb * GB)


@dataclass(frozen=True)
class AllocationEntry:
    """Replicas of one model: how many, at which tensor-parallel degree and GPU share."""

    model: str = setting(doc="a model listed in rollout.models")
    replicas: int = setting(1, doc="number of replicas")
    tp: int = setting(1, doc="tensor-parallel degree (GPUs per replica, in one NVLink domain)")
    share: float = setting(1.0, doc="fraction of each of its GPUs a replica gets (0 < share <= 1)")
    workflow: str = setting("*", doc="the workflow the replicas were allocated for (informative)")

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise SettingsError("replicas", "must not be negative")
        if self.tp < 1 or self.tp & (self.tp - 1):
            raise SettingsError("tp", f"must be a power of two, got {self.tp}")
        if not 0.0 < self.share <= 1.0:
            raise SettingsError("share", f"must be in (0, 1], got {self.share}")


@dataclass(frozen=True)
class NamedAllocation:
    """A named allocation, e.g. the one after a traffic shift: an entry of the settings'
    ``rollout.scenarios`` list (``scepsy render --scenario NAME``). Not a search scenario
    file (:mod:`optimizer.search.scenario`)."""

    name: str = setting(doc="scenario name (scepsy render --scenario NAME)")
    allocation: tuple[AllocationEntry, ...] = setting(doc="the allocation of this scenario")

    def __post_init__(self) -> None:
        if not self.name:
            raise SettingsError("name", "must not be empty")


@dataclass(frozen=True)
class Toleration:
    """One toleration of the engine pods (the pod spec's ``tolerations[]``), e.g. of the
    ``nvidia.com/gpu:NoSchedule`` taint GPU node pools carry."""

    key: str | None = setting(None, doc="taint key (null with operator Exists: every taint)")
    operator: Literal["Equal", "Exists"] = setting("Equal", doc="Equal (key and value) or Exists")
    value: str | None = setting(None, doc="taint value (operator Equal)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = setting(
        None, doc="taint effect tolerated (null: every effect)"
    )
    toleration_seconds: int | None = setting(
        None, doc="NoExecute only: how long the pod stays bound after the taint appears"
    )

    def __post_init__(self) -> None:
        if self.operator == "Exists" and self.value is not None:
            raise SettingsError("value", "must be null when operator is Exists")
        if self.key is None and self.operator != "Exists":
            raise SettingsError("key", "is required unless operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise SettingsError("toleration_seconds", "applies to effect NoExecute only")

    def manifest(self) -> dict[str, object]:
        """The toleration in the API's shape (null fields left out)."""
        out: dict[str, object] = {"operator": self.operator}
        for name, value in (
            ("key", self.key),
            ("value", self.value),
            ("effect", self.effect),
            ("tolerationSeconds", self.toleration_seconds),
        ):
            if value is not None:
                out[name] = value
        return out


@dataclass(frozen=True)
class EngineResources:
    """CPU, memory and other resources of every engine container, besides its GPUs (which
    the placement sets). Values are Kubernetes quantities: ``cpu: 8``, ``memory: 64Gi``."""

    requests: Mapping[str, Quantity] = setting(
        factory=_empty, doc="resources each engine container requests (e.g. cpu, memory)"
    )
    limits: Mapping[str, Quantity] = setting(
        factory=_empty, doc="resource limits of each engine container (e.g. memory)"
    )

    def __post_init__(self) -> None:
        for part in ("requests", "limits"):
            for name, value in getattr(self, part).items():
                if isinstance(value, bool) or not _QUANTITY.match(str(value)):
                    raise SettingsError(f"{part}.{name}", f"not a Kubernetes quantity: {value!r}")

    def manifest(self, gpu_resource: str) -> dict[str, dict[str, str]]:
        """``resources`` of a container in the API's shape (empty parts left out)."""
        out = {
            part: {k: str(v) for k, v in sorted(getattr(self, part).items())}
            for part in ("requests", "limits")
        }
        for part, values in out.items():
            if gpu_resource in values:
                raise SettingsError(
                    f"resources.{part}.{gpu_resource}",
                    "is set by the placement (whole GPUs per pod), not here",
                )
        return {part: values for part, values in out.items() if values}


@dataclass(frozen=True)
class ModelCacheSettings:
    """A volume holding downloaded model weights, mounted into vllm/sglang engines at the
    Hugging Face cache path (``HF_HOME``), so a restarted or moved replica does not download
    its weights again. Set one of ``claim`` and ``host_path``; neither: no cache volume."""

    claim: str | None = setting(
        None, doc="PersistentVolumeClaim of the cache (ReadWriteMany when pods span nodes)"
    )
    host_path: str | None = setting(None, doc="a folder on each node used as the cache")
    mount_path: str = setting(
        "/root/.cache/huggingface", doc="where the cache is mounted; engines get HF_HOME set to it"
    )
    read_only: bool = setting(False, doc="mount read-only (weights pre-loaded; HF_HUB_OFFLINE=1)")

    def __post_init__(self) -> None:
        if self.claim is not None and self.host_path is not None:
            raise SettingsError("host_path", "give claim or host_path, not both")
        if self.claim is not None and not _DNS_SUBDOMAIN.match(self.claim):
            raise SettingsError("claim", f"must be a DNS name (a-z, 0-9, -, .), got {self.claim!r}")
        for key in ("host_path", "mount_path"):
            value = getattr(self, key)
            if value is not None and not value.startswith("/"):
                raise SettingsError(key, f"must be an absolute path, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.claim is not None or self.host_path is not None


@dataclass(frozen=True)
class KubernetesSettings:
    """The Kubernetes backend: where engine pods go and what they run."""

    namespace: str = setting("scepsy", doc="namespace of engine pods, services and routes")
    owner: str = setting(
        "scepsy",
        doc="value of the scepsy.io/owner label; the backend deletes only objects carrying it, "
        "so two Scepsy installations in one namespace need different owners",
    )
    routes_configmap: str = setting(
        "scepsy-routes", doc="ConfigMap holding routes.json, which the proxies' route sync reads"
    )
    engine_port: int = setting(8000, doc="first container port of a pod's engines (+1 each)")
    service_port: int = setting(8000, doc="port of each replica's Service")
    vllm_image: str = setting("vllm/vllm-openai:v0.8.5", doc="image of vLLM engines")
    sglang_image: str = setting("lmsysorg/sglang:v0.4.6.post1-cu124", doc="image of SGLang engines")
    emulator_image: str = setting(
        "scepsy-optimizer:0.1.0",
        doc="image with scepsy-engine (deploy/image/build.sh builds it; set your registry's name)",
    )
    mps_image: str = setting(
        "nvidia/cuda:12.4.1-base-ubuntu22.04", doc="image providing nvidia-cuda-mps-control"
    )
    gpu_resource: str = setting("nvidia.com/gpu", doc="extended resource name of a whole GPU")
    hf_token_secret: str | None = setting(
        None, doc="Secret with key HF_TOKEN given to vllm/sglang engines (null: none)"
    )
    ready_timeout_s: float = setting(
        900.0, doc="longest a pod may take to get every engine ready (cold starts take minutes)"
    )
    delete_timeout_s: float = setting(300.0, doc="longest a stopped pod may take to disappear")
    poll_interval_s: float = setting(2.0, doc="how often pod states are polled while waiting")
    node_selector: Mapping[str, str] = setting(
        factory=_no_labels,
        doc="node labels engine pods require besides the placement's node "
        "(kubernetes.io/hostname is set by the placement)",
    )
    tolerations: tuple[Toleration, ...] = setting(
        factory=tuple, doc="tolerations of engine pods (e.g. of GPU node pools' taints)"
    )
    runtime_class_name: str | None = setting(
        None, doc="RuntimeClass of engine pods, e.g. nvidia where it is not the default runtime"
    )
    image_pull_secrets: tuple[str, ...] = setting(
        factory=tuple, doc="names of Secrets engine pods pull their images with"
    )
    resources: EngineResources = setting(
        factory=EngineResources, doc="CPU and memory of every engine container"
    )
    model_cache: ModelCacheSettings = setting(
        factory=ModelCacheSettings, doc="a volume caching model weights across engine restarts"
    )
    harden: bool = setting(
        True,
        doc="engine containers run without privilege escalation, with every capability dropped "
        "and the RuntimeDefault seccomp profile (the emulator also as non-root on a read-only "
        "root file system); false: the images' defaults, for GPU setups that need more",
    )

    def __post_init__(self) -> None:
        if _HOSTNAME_LABEL in self.node_selector:
            raise SettingsError(f"node_selector.{_HOSTNAME_LABEL}", "is set by the placement")
        names = [(f"image_pull_secrets[{i}]", n) for i, n in enumerate(self.image_pull_secrets)]
        if self.runtime_class_name is not None:
            names.append(("runtime_class_name", self.runtime_class_name))
        for key, value in names:
            if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
                raise SettingsError(key, f"must be a DNS name (a-z, 0-9, -, .), got {value!r}")
        self.resources.manifest(self.gpu_resource)  # a GPU count here is refused
        for key in ("namespace", "owner", "routes_configmap"):
            value = getattr(self, key)
            if len(value) > 63 or not _DNS_LABEL.match(value):
                raise SettingsError(key, f"must be a DNS label (a-z, 0-9, -), got {value!r}")
        for key in ("engine_port", "service_port"):
            if not 1 <= getattr(self, key) <= 65535:
                raise SettingsError(key, "must be a port number (1-65535)")
        for key in ("ready_timeout_s", "delete_timeout_s", "poll_interval_s"):
            if getattr(self, key) <= 0:
                raise SettingsError(key, "must be positive")


@dataclass(frozen=True)
class LocalSettings:
    """The local backend: engine processes on this machine, routes pushed to the proxies."""

    state_dir: str = setting(
        ".scepsy/local",
        doc="folder holding one JSON file per running GPU group (pids, ports, URLs), so a "
        "restarted daemon adopts the engines it left running; relative to the working directory",
    )
    log_dir: str | None = setting(
        None, doc="folder of the engines' log files (null: state_dir/logs)"
    )
    node: str | None = setting(
        None,
        doc="this machine's node name in cluster.nodes; groups placed on other nodes are refused "
        "(null: every node is served here, which only emulated engines can share)",
    )
    host: str = setting("127.0.0.1", doc="address engines listen on and the proxies reach them at")
    first_port: int = setting(0, doc="lowest engine port (0: any free port the OS picks)")
    last_port: int = setting(0, doc="highest engine port (with first_port)")
    proxies: tuple[str, ...] = setting(
        factory=tuple,
        doc="base URLs of the proxies whose admin API gets the route table, e.g. "
        "http://127.0.0.1:8080 (every one is told; one that is down is reported, not fatal)",
    )
    admin_token: str | None = setting(
        None, doc="bearer token of the proxies' admin API (null: proxy.admin_token)"
    )
    mps_control: tuple[str, ...] = setting(
        ("nvidia-cuda-mps-control", "-f"),
        doc="command of the MPS control daemon started, in the foreground, for a GPU group "
        "whose GPUs are shared by vllm/sglang engines",
    )
    ready_timeout_s: float = setting(
        900.0, doc="longest a group may take until every engine answers /health"
    )
    stop_grace_s: float = setting(
        30.0, doc="after SIGTERM, how long an engine gets to exit before SIGKILL"
    )
    request_timeout_s: float = setting(5.0, doc="timeout of one health check or admin API call")
    push_attempts: int = setting(3, doc="attempts per proxy to push a route table")
    poll_interval_s: float = setting(0.5, doc="how often health and drain state are polled")

    def __post_init__(self) -> None:
        if not self.state_dir:
            raise SettingsError("state_dir", "must not be empty")
        if self.first_port or self.last_port:
            for key in ("first_port", "last_port"):
                if not 1 <= getattr(self, key) <= 65535:
                    raise SettingsError(key, "must be a port number (1-65535), or both 0")
            if self.last_port < self.first_port:
                raise SettingsError("last_port", f"must be at least first_port ({self.first_port})")
        for i, url in enumerate(self.proxies):
            if not url.startswith(("http://", "https://")):
                raise SettingsError(
                    f"proxies[{i}]", f"must start with http:// or https://, got {url!r}"
                )
        if not self.mps_control:
            raise SettingsError("mps_control", "must not be empty")
        for key in ("ready_timeout_s", "stop_grace_s", "request_timeout_s", "poll_interval_s"):
            if getattr(self, key) <= 0:
                raise SettingsError(key, "must be positive")
        if self.push_attempts < 1:
            raise SettingsError("push_attempts", "must be at least 1")


@dataclass(frozen=True)
class RolloutSettings:
    """Serving and rollout: models, an explicit allocation, backend details."""

    backend: Literal["local", "kubernetes"] = setting(
        "local", doc="local: engine processes on this machine; kubernetes: pods on the cluster"
    )
    models: tuple[ModelServing, ...] = setting(factory=tuple, doc="how each model is served")
    allocation: tuple[AllocationEntry, ...] = setting(
        factory=tuple, doc="an explicit allocation, used where no search result is available"
    )
    scenarios: tuple[NamedAllocation, ...] = setting(
        factory=tuple, doc="further named allocations (scepsy render --scenario NAME)"
    )
    drain_s: float = setting(
        30.0,
        doc="after a replica's route is removed, how long in-flight calls get before it is "
        "stopped (on Kubernetes include the ConfigMap propagation delay)",
    )
    kubernetes: KubernetesSettings = setting(
        factory=KubernetesSettings, doc="the kubernetes backend"
    )
    local: LocalSettings = setting(factory=LocalSettings, doc="the local backend")

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise SettingsError(f"models[{i}].name", f"model {name!r} is listed twice")
        if self.drain_s < 0:
            raise SettingsError("drain_s", "must not be negative")
        seen: set[str] = set()
        for s, scenario in enumerate(self.scenarios):
            if scenario.name in seen:
                raise SettingsError(f"scenarios[{s}].name", f"{scenario.name!r} is listed twice")
            seen.add(scenario.name)
        for prefix, allocation in [
            ("allocation", self.allocation),
            *((f"scenarios[{s}].allocation", sc.allocation) for s, sc in enumerate(self.scenarios)),
        ]:
            for i, entry in enumerate(allocation):
                if entry.model not in names:
                    raise SettingsError(
                        f"{prefix}[{i}].model",
                        f"{entry.model!r} is not in rollout.models ({', '.join(names) or 'none'})",
                    )

    def revisions(self) -> dict[str, str]:
        """Per model, the revision of how it is served (see :attr:`ModelServing.revision`)."""
        return {m.name: m.revision for m in self.models}

    def model(self, name: str) -> ModelServing:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def scenario(self, name: str | None) -> tuple[AllocationEntry, ...]:
        """The allocation called ``name`` (``None``: the default ``allocation``)."""
        if name is None:
            return self.allocation
        for sc in self.scenarios:
            if sc.name == name:
                return sc.allocation
        known = ", ".join(sc.name for sc in self.scenarios) or "none"
        raise SettingsError("rollout.scenarios", f"no scenario {name!r} (known: {known})")
