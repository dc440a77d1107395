"""The kubernetes backend against the in-memory API: render, schemas, apply, rollout order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import kubernetes_validate
import orjson
import pytest
import yaml

from optimizer.cli import main as cli
from optimizer.cli.render import target_for
from optimizer.plan.observed import Observed
from optimizer.plan.planner import make_plan
from optimizer.plan.target import GroupSpec
from optimizer.rollout.backend import RolloutError, converge, execute
from optimizer.rollout.kube.backend import KubeBackend
from optimizer.rollout.kube.render import render_target
from shared.cluster import GB, Cluster, cluster_from_settings
from shared.rollout_settings import RolloutSettings
from shared.settings import load_settings
from shared.settings_schema import SettingsError, decode
from tests.optimizer.rollout.kube_fake import STARTED_AT, Crash, FakeKube

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cluster.yaml"


@pytest.fixture(scope="module")
def example() -> tuple[Cluster, RolloutSettings]:
    settings = load_settings(EXAMPLE)
    rollout = settings.rollout
    return cluster_from_settings(settings.cluster), rollout


def fast(rollout: RolloutSettings) -> RolloutSettings:
    kube = dataclasses.replace(
        rollout.kubernetes, poll_interval_s=1.0, ready_timeout_s=30.0, delete_timeout_s=30.0
    )
    return dataclasses.replace(rollout, drain_s=5.0, kubernetes=kube)


class Clock:
    """Fake time: sleeping advances it and lets the fake kubelet act."""

    def __init__(self, api: FakeKube, kubelet: bool = True) -> None:
        self.now = 0.0
        self.api = api
        self.kubelet = kubelet
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept.append(seconds)
        if self.kubelet:
            self.api.kubelet()

    def time(self) -> float:
        return self.now


def backend(api: FakeKube, rollout: RolloutSettings, cluster: Cluster, clock: Clock) -> KubeBackend:
    return KubeBackend(api, fast(rollout), cluster, sleep=clock.sleep, clock=clock.time)


def test_render_of_the_example_validates_against_kubernetes_1_32(
    example: tuple[Cluster, RolloutSettings], tmp_path: Path
) -> None:
    for scenario in (None, "rag_x3"):
        out = tmp_path / (scenario or "default")
        assert (
            cli.main(
                ["render", "--config", str(EXAMPLE), "--out", str(out)]
                + (["--scenario", scenario] if scenario else [])
            )
            == 0
        )
        files = sorted(out.glob("*.yaml"))
        kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
        assert sorted(kustomization["resources"]) == sorted(
            f.name for f in files if f.name != "kustomization.yaml"
        )
        kinds = []
        for f in files:
            if f.name == "kustomization.yaml":
                continue
            obj = yaml.safe_load(f.read_text())
            kubernetes_validate.validate(obj, "1.32", strict=True)
            kinds.append(obj["kind"])
        assert kinds.count("ConfigMap") == 1 and kinds.count("Pod") >= 4


def test_rendered_pods_carry_placement_mps_limits_and_node(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    _, target = target_for(cluster, rollout, None)
    objects = render_target(target, rollout, cluster)
    shared = next(g for g in target if len(g.replicas) == 2)
    pod = next(
        o
        for o in objects
        if o["kind"] == "Pod" and o["metadata"]["labels"]["scepsy.io/group"] == shared.id
    )
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": shared.node}
    (daemon,) = pod["spec"]["initContainers"]
    assert daemon["restartPolicy"] == "Always"
    assert daemon["resources"]["limits"]["nvidia.com/gpu"] == str(len(shared.gpus))
    for k, (container, replica) in enumerate(
        zip(pod["spec"]["containers"], shared.replicas, strict=True)
    ):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(round(replica.spec.share * 100))
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == (
            f"0={replica.spec.memory_bytes_per_gpu >> 20}M"
        )
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/pipe"
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(map(str, shared.gpus))
        assert "resources" not in container  # the daemon holds the GPUs
        assert container["ports"][0]["containerPort"] == 8000 + k
        assert "--gpu-memory-utilization" in container["command"]
    tp2 = next(g for g in target if len(g.gpus) == 2)
    pod2 = next(
        o
        for o in objects
        if o["kind"] == "Pod" and o["metadata"]["labels"]["scepsy.io/group"] == tp2.id
    )
    assert "initContainers" not in pod2["spec"]
    (engine,) = pod2["spec"]["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert engine["command"][engine["command"].index("--tensor-parallel-size") + 1] == "2"
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "scepsy"
        assert labels["scepsy.io/owner"] == rollout.kubernetes.owner


def test_apply_twice_changes_nothing_the_second_time(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    _, target = target_for(cluster, rollout, None)
    api = FakeKube()
    first = [api.apply(o) for o in render_target(target, rollout, cluster)]
    second = [api.apply(o) for o in render_target(target, rollout, cluster)]
    assert all(first) and not any(second)
    assert len(api.objects) == len(first)


def emulated(rollout: RolloutSettings) -> RolloutSettings:
    models = tuple(
        dataclasses.replace(m, engine="emulator", source=None, extra_args=())
        for m in rollout.models
    )
    return dataclasses.replace(rollout, models=models)


def served(history: Sequence[Sequence[tuple[str, str]]]) -> list[set[str]]:
    return [{m for m, _ in table} for table in history]


async def test_converge_rolls_out_then_shifts_without_losing_a_model(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    api = FakeKube(graceful=True)
    clock = Clock(api)
    kb = backend(api, rollout, cluster, clock)
    _, before = target_for(cluster, rollout, None)
    _, after = target_for(cluster, rollout, "rag_x3")

    plan, results = await converge(kb, before)
    # (later wait_ready steps may find their pods ready already: the fake kubelet readies all)
    assert plan.safe and all(not r.skipped for r in results if r.step.kind != "wait_ready")
    assert_running(api, before)
    models = {m for g in before for m in g.models}
    assert served(api.routes_history)[-1] == models
    # each ready engine is observed with when its container started running
    observed = await kb.observe()
    assert observed.replicas and all(r.ready for r in observed.replicas)
    assert {r.started_at for r in observed.replicas} == {
        datetime.fromisoformat(STARTED_AT.replace("Z", "+00:00")).timestamp()
    }

    api.log.clear()
    api.routes_history.clear()
    plan, _ = await converge(kb, after, cluster=cluster)
    # e5 and the reranker stay on their GPU (as a new group): temporary copies on a spare GPU
    # carry them meanwhile, so the plan is safe.
    assert plan.safe and plan.kept and plan.temporary  # unchanged groups stay up
    assert_running(api, after)
    # Every route table pushed during the shift serves every model.
    assert all(s == models for s in served(api.routes_history))
    # Make-before-break: the first change is a new pod, not a deletion.
    assert api.log[0][0] == "apply"
    # A drain waits the drain time before the pod is deleted.
    assert 5.0 in clock.slept
    # Nothing else to do, and applying again is a no-op plan.
    assert (await converge(kb, after, cluster=cluster))[0].empty


def assert_running(api: FakeKube, target: Sequence[GroupSpec]) -> None:
    pods = api.pods()
    assert sorted(p["metadata"]["labels"]["scepsy.io/group"] for p in pods) == sorted(
        g.id for g in target
    )
    held = [
        (p["spec"]["nodeSelector"]["kubernetes.io/hostname"], g)
        for p in pods
        for g in _annotation_gpus(p)
    ]
    assert len(held) == len(set(held)), "two pods hold one GPU"
    services = [k for k in api.objects if k[0] == "Service"]
    assert len(services) == sum(len(g.replicas) for g in target)
    urls = {u for _, u in api.routes_history[-1]}
    assert len(urls) == len(services)


def _annotation_gpus(pod: dict[str, Any]) -> list[int]:
    return [
        int(g)
        for g in yaml.safe_load(pod["metadata"]["annotations"]["scepsy.io/group-spec"])["gpus"]
    ]


@pytest.mark.parametrize("crash_after", [1, 4, 9, 15])
async def test_a_rollout_killed_half_way_converges_when_run_again(
    example: tuple[Cluster, RolloutSettings], crash_after: int
) -> None:
    cluster, rollout = example
    rollout = emulated(rollout)
    api = FakeKube(graceful=True)
    clock = Clock(api)
    _, before = target_for(cluster, rollout, None)
    _, after = target_for(cluster, rollout, "rag_x3")
    await converge(backend(api, rollout, cluster, clock), before)
    api.crash_after = crash_after
    with pytest.raises(Crash):
        await converge(backend(api, rollout, cluster, clock), after, cluster=cluster)
    api.crash_after = None
    # A new daemon: same plan executed again skips what was done; re-planning finishes.
    restarted = backend(api, rollout, cluster, clock)
    plan, _ = await converge(restarted, after, cluster=cluster)
    assert plan.safe
    assert_running(api, after)
    models = {m for g in after for m in g.models}
    assert all(s == models for s in served(api.routes_history))
    assert (await converge(restarted, after, cluster=cluster))[0].empty


async def test_executing_a_finished_plan_again_skips_every_step(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    api = FakeKube()
    clock = Clock(api)
    kb = backend(api, rollout, cluster, clock)
    _, target = target_for(cluster, rollout, None)
    plan = make_plan(Observed(), target)
    await execute(plan, kb)
    mutations = len(api.log)
    results = await execute(plan, kb)
    assert all(r.skipped for r in results) and len(api.log) == mutations


async def test_wait_ready_times_out_naming_the_waiting_containers(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    api = FakeKube()
    clock = Clock(api, kubelet=False)
    kb = backend(api, rollout, cluster, clock)
    _, target = target_for(cluster, rollout, None)
    await kb.start(target[0])
    with pytest.raises(RolloutError, match="not ready after 30 s: engine-0: ContainerCreating"):
        await kb.wait_ready(target[0])


async def test_stop_refuses_objects_without_the_owner_labels(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    api = FakeKube()
    clock = Clock(api)
    kb = backend(api, rollout, cluster, clock)
    _, target = target_for(cluster, rollout, None)
    (pod, *_) = render_target(target[:1], rollout, cluster)
    pod["metadata"]["labels"] = {"app": "someone-else"}
    api.apply(pod)
    with pytest.raises(RolloutError, match="lacks scepsy's owner labels"):
        await kb.stop(target[0].id)
    assert api.get("Pod", "scepsy", pod["metadata"]["name"]) is not None


async def test_unsafe_plans_are_refused() -> None:
    narrow = decode(
        RolloutSettings,
        {
            "models": [{"name": "a"}, {"name": "b"}],
            "allocation": [{"model": "a"}],
            "scenarios": [
                {
                    "name": "both",
                    "allocation": [{"model": "a", "share": 0.5}, {"model": "b", "share": 0.5}],
                }
            ],
        },
    )
    small = Cluster.uniform(1, 1, 1, "a6000", 48 * GB)  # one GPU: no room to surge
    api = FakeKube()
    kb = backend(api, narrow, small, Clock(api))
    await converge(kb, target_for(small, narrow, None)[1])
    with pytest.raises(RolloutError, match="without a replica"):
        await converge(kb, target_for(small, narrow, "both")[1])
    plan, _ = await converge(kb, target_for(small, narrow, "both")[1], allow_outage=True)
    assert plan.outages == ("a",)


KNOBS = {
    "node_selector": {"cloud.example.com/pool": "gpu"},
    "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "spot", "value": "true", "effect": "NoExecute", "toleration_seconds": 60},
    ],
    "runtime_class_name": "nvidia",
    "image_pull_secrets": ["regcred"],
    "resources": {"requests": {"cpu": 8, "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
    "model_cache": {"claim": "hf-cache"},
}


def test_cluster_knobs_reach_every_engine_pod_and_validate(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    kube = decode(type(rollout.kubernetes), {"hf_token_secret": "hf-token", **KNOBS})
    tuned = dataclasses.replace(rollout, kubernetes=kube)
    _, target = target_for(cluster, tuned, None)
    pods = [o for o in render_target(target, tuned, cluster) if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        kubernetes_validate.validate(pod, "1.32", strict=True)
        spec = pod["spec"]
        node = spec["nodeSelector"].pop("kubernetes.io/hostname")
        assert node in {n.name for n in cluster.nodes}
        assert spec["nodeSelector"] == {"cloud.example.com/pool": "gpu"}
        assert spec["tolerations"] == [
            {"operator": "Exists", "key": "nvidia.com/gpu", "effect": "NoSchedule"},
            {
                "operator": "Equal",
                "key": "spot",
                "value": "true",
                "effect": "NoExecute",
                "tolerationSeconds": 60,
            },
        ]
        assert spec["runtimeClassName"] == "nvidia"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        assert {
            "name": "model-cache",
            "persistentVolumeClaim": {"claimName": "hf-cache", "readOnly": False},
        } in spec["volumes"]
        for c in spec["containers"]:
            assert c["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
            assert c["resources"]["limits"]["memory"] == "96Gi"
            assert {
                "name": "model-cache",
                "mountPath": "/root/.cache/huggingface",
                "readOnly": False,
            } in c["volumeMounts"]
            assert {"name": "HF_HOME", "value": "/root/.cache/huggingface"} in c["env"]
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = c["securityContext"]
            assert ctx["capabilities"] == {"drop": ["ALL"]}
            assert ctx["allowPrivilegeEscalation"] is False
    # GPU limits stay the placement's: an unshared TP-2 engine holds exactly its two GPUs.
    tp2 = next(
        p
        for p in pods
        if "initContainers" not in p["spec"]
        and len(orjson.loads(p["metadata"]["annotations"]["scepsy.io/group-spec"])["gpus"]) == 2
    )
    assert tp2["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_emulated_engines_run_as_non_root_on_a_read_only_root(
    example: tuple[Cluster, RolloutSettings],
) -> None:
    cluster, rollout = example
    kube = decode(type(rollout.kubernetes), {"model_cache": {"host_path": "/srv/hf"}})
    fake = dataclasses.replace(emulated(rollout), kubernetes=kube)
    _, target = target_for(cluster, fake, None)
    pods = [o for o in render_target(target, fake, cluster) if o["kind"] == "Pod"]
    for pod in pods:
        kubernetes_validate.validate(pod, "1.32", strict=True)
        assert "volumes" not in pod["spec"]  # no GPU, no MPS, no weights to cache
        for c in pod["spec"]["containers"]:
            assert c["image"] == "scepsy-optimizer:0.1.0"
            assert c["securityContext"]["runAsNonRoot"] is True
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert "volumeMounts" not in c


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (
            {"resources": {"limits": {"nvidia.com/gpu": 1}}},
            "resources.limits.nvidia.com/gpu: is set by the placement",
        ),
        (
            {"node_selector": {"kubernetes.io/hostname": "n0"}},
            "node_selector.kubernetes.io/hostname: is set by the placement",
        ),
        (
            {"resources": {"requests": {"memory": "lots"}}},
            "resources.requests.memory: not a Kubernetes quantity",
        ),
        (
            {"model_cache": {"claim": "c", "host_path": "/x"}},
            "model_cache.host_path: give claim or host_path, not both",
        ),
        ({"tolerations": [{"value": "x"}]}, r"tolerations\[0\].key: is required"),
        ({"image_pull_secrets": ["Reg_Cred"]}, r"image_pull_secrets\[0\]: must be a DNS name"),
    ],
)
def test_bad_cluster_knobs_name_their_key(knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=f"^rollout.kubernetes.{message}"):
        decode(RolloutSettings, {"kubernetes": knobs}, "rollout")
