"""The kubernetes rollout backend: engine pods, services and routes through the Kubernetes API.

Role: implements :class:`optimizer.rollout.backend.Backend` over :class:`KubeApi`, a four-verb view of
the API (server-side apply, get, list by labels, delete) with two implementations:
:class:`KubernetesApi` on the official ``kubernetes`` client, and the in-memory fake the tests
use. Manifests come from :mod:`optimizer.rollout.kube.render`.

Invariants:
- the only module that talks to the Kubernetes API (DESIGN §2); blocking client calls run in a
  thread, never on the event loop;
- applies are server-side applies with field manager ``scepsy`` (an identical apply is a no-op);
- deletes touch only objects carrying the owner labels (``app.kubernetes.io/managed-by=scepsy``,
  ``scepsy.io/owner=<owner>``); anything else is refused with :class:`RolloutError`;
- observing is read-only: replicas come from the pods' group annotations, readiness from their
  container statuses (a pod being deleted still holds its GPUs, and is observed, never ready),
  routes from the routes ConfigMap;
- the proxies learn routes from the ConfigMap (their route sync), so a drain waits
  ``rollout.drain_s``, which must cover the ConfigMap's propagation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import orjson

from optimizer.plan.observed import Observed, Route, RunningReplica
from optimizer.plan.target import GroupSpec
from optimizer.rollout.backend import RolloutError
from optimizer.rollout.kube.render import (
    LABEL_COMPONENT,
    LABEL_GROUP,
    ROUTES_KEY,
    group_from_pod,
    owner_labels,
    pod_name,
    render_group,
    render_routes,
    replica_url,
)
from shared.cluster import Cluster
from shared.rollout_settings import RolloutSettings

__all__ = ["FIELD_MANAGER", "KubeApi", "KubeBackend", "KubernetesApi"]

FIELD_MANAGER = "scepsy"

Manifest = dict[str, Any]


class KubeApi(Protocol):
    """The slice of the Kubernetes API the backend uses; kinds are Pod, Service, ConfigMap."""

    def apply(self, manifest: Mapping[str, Any]) -> bool:
        """Server-side apply (field manager ``scepsy``); True if the object was created or
        changed, False for a no-op."""
        ...

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None: ...

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Manifest]: ...

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete (gracefully); True if the object existed."""
        ...


class KubernetesApi:
    """:class:`KubeApi` on the official client (in-cluster config, else ``~/.kube/config``)."""

    _APPLY = "application/apply-patch+yaml"

    def __init__(self, core: Any = None) -> None:
        if core is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            core = client.CoreV1Api()
        self._core = core

    def _suffix(self, kind: str) -> str:
        names = {"Pod": "pod", "Service": "service", "ConfigMap": "config_map"}
        if kind not in names:
            raise RolloutError(f"scepsy does not manage objects of kind {kind}")
        return names[kind]

    def _plain(self, obj: Any) -> Manifest:
        out: Manifest = self._core.api_client.sanitize_for_serialization(obj)
        return out

    def _call(self, verb: str, kind: str, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return getattr(self._core, f"{verb}_namespaced_{self._suffix(kind)}")(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 404 and verb in ("read", "delete"):
                return None
            raise RolloutError(f"{verb} {kind} {args[:2]}: {exc.status} {exc.reason}") from exc

    def apply(self, manifest: Mapping[str, Any]) -> bool:
        meta = manifest["metadata"]
        before = self.get(manifest["kind"], meta["namespace"], meta["name"])
        after = self._plain(
            self._call(
                "patch",
                manifest["kind"],
                meta["name"],
                meta["namespace"],
                dict(manifest),
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=self._APPLY,
            )
        )
        # A no-op apply leaves resourceVersion alone.
        version = (before or {}).get("metadata", {}).get("resourceVersion")
        return before is None or after["metadata"].get("resourceVersion") != version

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        obj = self._call("read", kind, name, namespace)
        return None if obj is None else self._plain(obj)

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[Manifest]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        found = self._plain(self._call("list", kind, namespace, label_selector=selector))
        items: list[Manifest] = found.get("items") or []
        return items

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        return self._call("delete", kind, name, namespace) is not None


class KubeBackend:
    """:class:`optimizer.rollout.backend.Backend` on Kubernetes."""

    def __init__(
        self,
        api: KubeApi,
        rollout: RolloutSettings,
        cluster: Cluster,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.rollout = rollout
        self.kube = rollout.kubernetes
        self.cluster = cluster
        self._sleep = sleep
        self._clock = clock

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def _pods(self) -> list[Manifest]:
        labels = {**owner_labels(self.kube), LABEL_COMPONENT: "engine"}
        return self.api.list("Pod", self.kube.namespace, labels)

    def _observe(self) -> Observed:
        replicas: list[RunningReplica] = []
        for pod in self._pods():
            try:
                group = group_from_pod(pod)
            except ValueError:
                continue  # not ours to interpret; never touched either
            status = pod.get("status") or {}
            containers = status.get("containerStatuses") or []
            ready = {c.get("name"): bool(c.get("ready")) for c in containers}
            started = {c.get("name"): _running_since(c) for c in containers}
            alive = not pod["metadata"].get("deletionTimestamp")
            names = [f"engine-{k}" for k in range(len(group.replicas))]
            replicas += group.running(
                lambda rid: replica_url(rid, self.kube),
                [alive and ready.get(n, False) for n in names],
                [started.get(n) for n in names],
            )
        return Observed(tuple(replicas), self._routes())

    def _routes(self) -> tuple[Route, ...]:
        cm = self.api.get("ConfigMap", self.kube.namespace, self.kube.routes_configmap)
        if cm is None:
            return ()
        try:
            table = orjson.loads((cm.get("data") or {}).get(ROUTES_KEY) or "{}")
            return tuple(
                Route(u["model"], u["url"], u.get("api_key")) for u in table.get("upstreams", [])
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise RolloutError(f"ConfigMap {self.kube.routes_configmap}: bad {ROUTES_KEY}") from exc

    async def observe(self) -> Observed:
        observed: Observed = await self._run(self._observe)
        return observed

    def _start(self, group: GroupSpec) -> None:
        pod, *services = render_group(group, self.rollout, self.cluster)
        for obj in services:  # the URLs resolve by the time the engines are ready
            self.api.apply(obj)
        existing = self.api.get("Pod", self.kube.namespace, pod_name(group.id))
        if existing is None or not existing["metadata"].get("deletionTimestamp"):
            self.api.apply(pod)

    async def start(self, group: GroupSpec) -> None:
        await self._run(self._start, group)

    async def wait_ready(self, group: GroupSpec) -> None:
        deadline = self._clock() + self.kube.ready_timeout_s
        ids = {r.id for r in group.replicas}
        while True:
            state = await self.observe()
            mine = [r for r in state.replicas if r.id in ids]
            if len(mine) == len(ids) and all(r.ready for r in mine):
                return
            if self._clock() >= deadline:
                pod = await self._run(self.api.get, "Pod", self.kube.namespace, pod_name(group.id))
                raise RolloutError(
                    f"pod {pod_name(group.id)} not ready after "
                    f"{self.kube.ready_timeout_s:g} s: {_why_waiting(pod)}"
                )
            await self._sleep(self.kube.poll_interval_s)

    async def push_routes(self, routes: Sequence[Route]) -> None:
        manifest = render_routes([(r.model, r.url) for r in routes], self.kube)
        await self._run(self.api.apply, manifest)

    async def wait_drained(self, replicas: Sequence[RunningReplica]) -> None:
        if replicas:
            await self._sleep(self.rollout.drain_s)

    def _owned(self, obj: Manifest) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(labels.get(k) == v for k, v in owner_labels(self.kube).items())

    def _delete(self, kind: str, obj: Manifest) -> None:
        name = obj["metadata"]["name"]
        if not self._owned(obj):
            raise RolloutError(f"refusing to delete {kind} {name}: it lacks scepsy's owner labels")
        self.api.delete(kind, self.kube.namespace, name)

    def _stop(self, group_id: str) -> None:
        ns = self.kube.namespace
        for svc in self.api.list("Service", ns, {**owner_labels(self.kube), LABEL_GROUP: group_id}):
            self._delete("Service", svc)
        pod = self.api.get("Pod", ns, pod_name(group_id))
        if pod is not None and not pod["metadata"].get("deletionTimestamp"):
            self._delete("Pod", pod)

    async def stop(self, group_id: str) -> None:
        await self._run(self._stop, group_id)
        deadline = self._clock() + self.kube.delete_timeout_s
        # The GPUs are free only once the pod is gone; a new group may be waiting for them.
        while await self._run(self.api.get, "Pod", self.kube.namespace, pod_name(group_id)):
            if self._clock() >= deadline:
                raise RolloutError(
                    f"pod {pod_name(group_id)} still terminating after "
                    f"{self.kube.delete_timeout_s:g} s"
                )
            await self._sleep(self.kube.poll_interval_s)


def _why_waiting(pod: Manifest | None) -> str:
    if pod is None:
        return "the pod does not exist"
    status = pod.get("status") or {}
    reasons = []
    for c in status.get("containerStatuses") or []:
        state = c.get("state") or {}
        waiting = state.get("waiting") or state.get("terminated")
        if waiting and not c.get("ready"):
            reasons.append(
                f"{c.get('name')}: {waiting.get('reason', '?')} "
                f"(restarts {c.get('restartCount', 0)})"
            )
    return "; ".join(reasons) or f"phase {status.get('phase', 'unknown')}"


def _running_since(container: Manifest) -> float | None:
    """When a container's current run started (epoch s; ``state.running.startedAt``), or None
    when it is not running or the time does not parse."""
    since = ((container.get("state") or {}).get("running") or {}).get("startedAt")
    if not isinstance(since, str):
        return None
    try:
        return datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
