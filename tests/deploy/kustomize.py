"""The slice of ``kustomize build`` that deploy/ uses, for machines without kubectl.

Role: build a kustomization folder into the objects ``kubectl kustomize`` would print, so the
tests can validate them. Supported: ``resources`` (files), ``namespace``,
``configMapGenerator`` / ``secretGenerator`` (``files``, optional ``KEY=path``), their name
suffix hash (kustomize's api/hasher: sha256 over Go-style JSON of kind, an empty name, data,
the first ten hex digits with 0,1,3,a,e mapped to g,h,k,m,t), Secret data in base64 lines, references to generated objects from pod
specs (volumes, projected volumes, envFrom, env valueFrom, imagePullSecrets), ``images``
(``newName``, ``newTag``, ``digest``) and ``generatorOptions.disableNameSuffixHash``.

Invariant: anything else in a kustomization (a field, a generator source, a resource folder)
raises :class:`Unsupported` instead of being approximated, so deploy/ stays within what this
builds exactly, or the test says so.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

SUPPORTED = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "configMapGenerator",
    "secretGenerator",
    "generatorOptions",
    "images",
}
GENERATOR_KEYS = {"name", "files", "options", "type"}
# Cluster-scoped kinds deploy/ might hold; the namespace transformer leaves them alone.
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PersistentVolume",
    "StorageClass",
    "RuntimeClass",
    "CustomResourceDefinition",
    "PriorityClass",
}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
_HASH_MAP = str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"})


class Unsupported(ValueError):
    """The kustomization uses something this builder does not do exactly."""


def documents(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _go_json(value: Any) -> str:
    """``json.Marshal`` of Go: sorted keys, no spaces, <, > and & escaped, UTF-8 kept."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    return text


def name_hash(obj: Obj) -> str:
    """The suffix kustomize appends to a generated ConfigMap's or Secret's name.

    The encoded name is empty: kustomize 5 hashes the generated object without it (checked
    against kubectl kustomize v5.5: literal ``one=`` of ConfigMap ``cm`` -> ``cm-9g67k2htb6``,
    the hash its own tests expect of a nameless ConfigMap)."""
    if obj["kind"] == "ConfigMap":
        enc: Obj = {"kind": "ConfigMap", "name": "", "data": obj.get("data", {})}
        if obj.get("binaryData"):
            enc["binaryData"] = obj["binaryData"]
    else:
        enc = {
            "kind": "Secret",
            "type": obj.get("type", "Opaque"),
            "name": "",
            "data": obj.get("data", {}),
        }
    digest = hashlib.sha256(_go_json(enc).encode()).hexdigest()
    return digest[:10].translate(_HASH_MAP)


def secret_value(text: str) -> str:
    """Base64 as kustomize writes Secret data: when the encoding reaches 70 characters, in
    lines of 70, each ended by a newline (kyaml's encodeBase64)."""
    encoded = base64.b64encode(text.encode()).decode()
    if len(encoded) // 70 == 0:
        return encoded
    return "".join(encoded[i : i + 70] + "\n" for i in range(0, len(encoded), 70))


def _generate(root: Path, kind: str, gen: Obj, hashed: bool) -> Obj:
    unknown = set(gen) - GENERATOR_KEYS
    if unknown or set(gen.get("options", {})) - {"disableNameSuffixHash"}:
        raise Unsupported(f"{kind} generator {gen.get('name')}: {sorted(unknown)}")
    data: dict[str, str] = {}
    for spec in gen.get("files", []):
        key, _, rel = spec.rpartition("=")
        path = root / rel
        text = path.read_text()
        data[key or path.name] = text if kind == "ConfigMap" else secret_value(text)
    obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}, "data": data}
    if kind == "Secret":
        obj["type"] = gen.get("type", "Opaque")
    if hashed and not gen.get("options", {}).get("disableNameSuffixHash", False):
        obj["metadata"]["name"] = f"{gen['name']}-{name_hash(obj)}"
    return obj


def pod_specs(obj: Obj) -> Iterator[Obj]:
    """The pod spec of a Pod, or of a workload's pod template."""
    if obj.get("kind") == "Pod":
        yield obj["spec"]
    elif obj.get("kind") in WORKLOADS:
        yield obj["spec"]["template"]["spec"]


def containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _rename_references(spec: Obj, renamed: dict[tuple[str, str], str]) -> None:
    def new(kind: str, name: str) -> str:
        return renamed.get((kind, name), name)

    for vol in spec.get("volumes", []):
        if "configMap" in vol:
            vol["configMap"]["name"] = new("ConfigMap", vol["configMap"]["name"])
        if "secret" in vol:
            vol["secret"]["secretName"] = new("Secret", vol["secret"]["secretName"])
        for src in vol.get("projected", {}).get("sources", []):
            if "configMap" in src:
                src["configMap"]["name"] = new("ConfigMap", src["configMap"]["name"])
            if "secret" in src:
                src["secret"]["name"] = new("Secret", src["secret"]["name"])
    for ref in spec.get("imagePullSecrets", []):
        ref["name"] = new("Secret", ref["name"])
    for c in containers(spec):
        for src in c.get("envFrom", []):
            if "configMapRef" in src:
                src["configMapRef"]["name"] = new("ConfigMap", src["configMapRef"]["name"])
            if "secretRef" in src:
                src["secretRef"]["name"] = new("Secret", src["secretRef"]["name"])
        for env in c.get("env", []):
            source = env.get("valueFrom", {})
            if "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                ref["name"] = new("ConfigMap", ref["name"])
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                ref["name"] = new("Secret", ref["name"])


def _set_images(spec: Obj, images: list[Obj]) -> None:
    for c in containers(spec):
        image: str = c["image"]
        name = image.split("@", 1)[0]
        if ":" in name.rsplit("/", 1)[-1]:
            name = name.rsplit(":", 1)[0]
        for rule in images:
            if set(rule) - {"name", "newName", "newTag", "digest"}:
                raise Unsupported(f"images: {rule}")
            if rule["name"] != name:
                continue
            repo = rule.get("newName", name)
            if "digest" in rule:
                c["image"] = f"{repo}@{rule['digest']}"
            else:
                tag = rule.get("newTag") or (image.rsplit(":", 1)[1] if image != name else None)
                c["image"] = f"{repo}:{tag}" if tag else repo


def build(root: Path) -> list[Obj]:
    """The objects ``kubectl kustomize root`` prints (in resource, then generator order)."""
    (k,) = documents(root / "kustomization.yaml")
    if k.get("kind", "Kustomization") != "Kustomization" or set(k) - SUPPORTED:
        raise Unsupported(f"{root}: {sorted(set(k) - SUPPORTED) or k.get('kind')}")
    objects: list[Obj] = []
    for rel in k.get("resources", []):
        path = root / rel
        if not path.is_file():
            raise Unsupported(f"{root}: resource {rel} is not a file")
        objects += documents(path)
    options = k.get("generatorOptions", {})
    if set(options) - {"disableNameSuffixHash"}:
        raise Unsupported(f"{root}: generatorOptions {sorted(options)}")
    hashed = not options.get("disableNameSuffixHash", False)
    renamed: dict[tuple[str, str], str] = {}
    for key, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for gen in k.get(key, []):
            obj = _generate(root, kind, gen, hashed)
            renamed[(kind, gen["name"])] = obj["metadata"]["name"]
            objects.append(obj)
    namespace = k.get("namespace")
    for obj in objects:
        meta = obj.setdefault("metadata", {})
        if namespace and obj["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = namespace
        if namespace and obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace
        for spec in pod_specs(obj):
            _rename_references(spec, renamed)
            _set_images(spec, k.get("images", []))
    return objects
