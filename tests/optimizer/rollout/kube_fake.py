"""An in-memory Kubernetes API with server-side-apply semantics, for the kube backend's tests.

What it keeps of the real API: an apply of an identical object is a no-op (returns False, no
new resourceVersion); a changed Pod spec is refused (pod specs are immutable); get/list return
copies; list filters on labels; deletes remove at once, or (``graceful=True``) mark the pod
terminating until the next :meth:`FakeKube.kubelet` call. Pods start Pending with every
container unready; :meth:`kubelet` plays the node agent: marks pods Running and ready.
Every mutation is logged in ``log`` (verb, kind, name, changed), every routes ConfigMap
version in ``routes_history``. ``crash_after`` raises :class:`Crash` on that many mutations, to
play a daemon killed mid-rollout.
"""

from __future__ import annotations

import builtins
import copy
from collections.abc import Mapping
from typing import Any

import orjson

from optimizer.rollout.backend import RolloutError
from optimizer.rollout.kube.render import ROUTES_KEY

Key = tuple[str, str, str]


STARTED_AT = "2026-12-05T12:00:00Z"  # when the fake kubelet starts every container


class Crash(Exception):
    """The daemon 'dies' here."""


class FakeKube:
    def __init__(self, *, graceful: bool = False, crash_after: int | None = None) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.applied: dict[Key, dict[str, Any]] = {}
        self.log: list[tuple[str, str, str, bool]] = []
        self.routes_history: list[list[tuple[str, str]]] = []
        self.graceful = graceful
        self.crash_after = crash_after
        self._version = 0

    def _mutation(self) -> None:
        if self.crash_after is not None:
            if self.crash_after <= 0:
                raise Crash
            self.crash_after -= 1

    def apply(self, manifest: Mapping[str, Any]) -> bool:
        self._mutation()
        m = copy.deepcopy(dict(manifest))
        key = (m["kind"], m["metadata"]["namespace"], m["metadata"]["name"])
        if self.applied.get(key) == m:
            self.log.append(("apply", key[0], key[2], False))
            return False
        old = self.objects.get(key)
        if old is not None and m["kind"] == "Pod" and old["spec"] != m["spec"]:
            raise RolloutError(
                f"Pod {key[2]} is invalid: spec: Forbidden: pod updates may not "
                "change fields other than image, activeDeadlineSeconds, ..."
            )
        self._version += 1
        obj = copy.deepcopy(m)
        obj["metadata"]["resourceVersion"] = str(self._version)
        if m["kind"] == "Pod":
            obj["status"] = (old or {}).get("status") or {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "ready": False,
                        "restartCount": 0,
                        "state": {"waiting": {"reason": "ContainerCreating"}},
                    }
                    for c in m["spec"]["containers"]
                ],
            }
        self.objects[key] = obj
        self.applied[key] = m
        self.log.append(("apply", key[0], key[2], True))
        if m["kind"] == "ConfigMap" and ROUTES_KEY in m.get("data", {}):
            table = orjson.loads(m["data"][ROUTES_KEY])["upstreams"]
            self.routes_history.append([(u["model"], u["url"]) for u in table])
        return True

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj)

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self.objects.items())
            if k == kind
            and ns == namespace
            and all((o["metadata"].get("labels") or {}).get(a) == b for a, b in labels.items())
        ]

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        self._mutation()
        key = (kind, namespace, name)
        if key not in self.objects:
            return False
        self.log.append(("delete", kind, name, True))
        if self.graceful and kind == "Pod":
            self.objects[key]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        else:
            del self.objects[key]
            self.applied.pop(key, None)
        return True

    def kubelet(self) -> None:
        """Finish terminating pods; run and ready the rest."""
        for key, obj in list(self.objects.items()):
            if key[0] != "Pod":
                continue
            if obj["metadata"].get("deletionTimestamp"):
                del self.objects[key]
                self.applied.pop(key, None)
                continue
            obj["status"] = {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "ready": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": STARTED_AT}},
                    }
                    for c in obj["spec"]["containers"]
                ],
            }

    def pods(self) -> builtins.list[dict[str, Any]]:
        return [o for (k, _, _), o in sorted(self.objects.items()) if k == "Pod"]
