"""Scepsy's settings: one YAML file parsed once into frozen, documented dataclasses.

Role: the schema of every section both the proxy and the optimizer read, and the loader.
Invariants: values are validated here, once; a bad value raises ``SettingsError`` naming its
key path (``proxy.upstreams[1].url: must start with http:// or https://``); settings objects
are immutable after loading, so they can be shared across tasks and threads freely.
"""

from __future__ import annotations

import math
import os
import socket
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from shared.cluster import ClusterSettings
from shared.optimizer_settings import OptimizerSettings
from shared.rollout_settings import RolloutSettings
from shared.settings_schema import SettingsError, decode, describe, setting
from shared.yaml_file import read_yaml

__all__ = [
    "ProxySettings",
    "RoutingSettings",
    "Settings",
    "SettingsError",
    "StoreSettings",
    "UpstreamSettings",
    "UpstreamTlsSettings",
    "describe",
    "load_settings",
    "parse_host_port",
    "route_problem",
    "split_upstream_url",
]


def parse_host_port(value: str, key: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:80`` allowed), or raise naming ``key``."""
    host, sep, port = value.rpartition(":")
    # isascii: "²" is a digit to str.isdigit and not to int()
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise SettingsError(key, f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def split_upstream_url(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of an engine base URL, ``http[s]://host[:port]`` (the default
    port filled in): the only shape the proxy can call, since it appends the client's own path.
    Anything else raises ``ValueError`` saying what is wrong, in one line."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port out of 0-65535 or not a number
    except ValueError as exc:
        raise ValueError(f"must be http[s]://host[:port], got {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"must start with http:// or https://, got {url!r}")
    if "@" in parts.netloc:
        raise ValueError(f"must not hold credentials (user:pass@; use api_key), got {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"names no host, got {url!r}")
    if not host.isascii() or any(c.isspace() or not c.isprintable() for c in host):
        raise ValueError(f"host must be ASCII without spaces (IDN: its xn-- form), got {url!r}")
    if port == 0:
        raise ValueError(f"port must be between 1 and 65535, got {url!r}")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(f"must not have a query or fragment, got {url!r}")
    if parts.path not in ("", "/"):
        raise ValueError(f"must not have a path (no /v1: clients' paths are appended), got {url!r}")
    return parts.scheme, host, port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class UpstreamSettings:
    """One engine replica serving one model."""

    model: str = setting(doc="model name clients send in the `model` field")
    url: str = setting(doc="base URL of the engine, e.g. http://10.0.0.5:8000 (no /v1)")
    api_key: str | None = setting(
        None,
        doc="key sent upstream instead of the client's Authorization (null: pass through); "
        "os.environ/NAME or ${NAME} reads it from the environment",
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise SettingsError("model", "must not be empty")
        try:
            split_upstream_url(self.url)
        except ValueError as exc:
            raise SettingsError("url", str(exc)) from None
        if self.api_key is not None and not self.api_key.isprintable():
            # It goes out in a header: a line break would smuggle another one.
            raise SettingsError("api_key", "must be printable (no line breaks or controls)")
        object.__setattr__(self, "url", self.url.rstrip("/"))


def cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The CPUs this process's cgroup (v2) may use per period (``"200000 100000"``: 2.0), or
    None when it sets no quota (``max``) or the file is missing or unreadable."""
    try:
        with open(path) as f:
            quota, _, period = f.read().strip().partition(" ")
        return int(quota) / int(period or "100000") if quota != "max" else None
    except (OSError, ValueError, ZeroDivisionError):
        return None


RoutingPolicy = Literal["least_outstanding", "round_robin", "prefix_affinity", "consistent_hash"]
ROUTING_POLICIES: tuple[str, ...] = get_args(RoutingPolicy)


@dataclass(frozen=True)
class RoutingSettings:
    """How a call picks one of its model's replicas."""

    policy: RoutingPolicy = setting(
        "least_outstanding",
        doc="least_outstanding: power of two choices on in-flight calls; round_robin: each "
        "replica in turn, load ignored; prefix_affinity: "
        "calls sharing a prompt prefix go to the replica this process saw it on; "
        "consistent_hash: a workflow request's calls (else calls whose prompts begin alike) go "
        "to one replica by consistent hashing with bounded load, the same replica in every "
        "proxy process and worker",
    )
    hash_load_factor: float = setting(
        1.25,
        doc="consistent_hash: a replica takes no more than this times the mean in-flight "
        "calls (or affinity_slack above the mean, whichever is more); a key whose replica is "
        "over it spills to the next replica on the ring",
    )
    hash_key_chars: int = setting(
        256,
        doc="consistent_hash: prompt characters a call without a workflow request id is hashed on",
    )
    hash_vnodes: int = setting(
        128, doc="consistent_hash: points per replica on the ring (more: keys spread evenly)"
    )
    max_prefix_chars: int = setting(
        8192, doc="prompt characters considered for prefix affinity (the rest is ignored)"
    )
    prefix_block_chars: int = setting(
        128, doc="prefix affinity hashes the prompt in blocks of this many characters"
    )
    affinity_min_match: float = setting(
        0.5,
        doc="prefix affinity follows a remembered replica only when at least this fraction of "
        "the prompt's blocks matched; shorter matches (a system prompt every call shares) go "
        "to the least-loaded replica",
    )
    affinity_slack: int = setting(
        8,
        doc="prefix affinity falls back to the least-loaded replica when the preferred one has "
        "this many more in-flight calls than the other replicas' mean (than an idle one); "
        "consistent_hash lets a replica take this many calls above the mean before a key spills",
    )
    affinity_load_ratio: float = setting(
        1.0,
        doc="prefix affinity also tolerates the preferred replica being this fraction busier "
        "than the other replicas' mean (in-flight calls), when that is more than affinity_slack: "
        "under heavy load a fixed slack is crossed all the time, calls scatter, and each "
        "replica recomputes prefixes its peer holds (2 beam-search verifier replicas lost a "
        "tenth of their throughput that way, simulated); 0 for the fixed slack alone",
    )
    affinity_entries: int = setting(65536, doc="prefixes remembered (LRU) for prefix affinity")
    eject_after_failures: int = setting(
        3, doc="consecutive connection failures after which a replica is ejected"
    )
    eject_seconds: float = setting(10.0, doc="how long an ejected replica stays out at least")
    probe_interval_s: float = setting(
        1.0, doc="how often an ejected replica's /health is probed once its ejection has passed"
    )

    engine_scrape_s: float = setting(
        1.0,
        doc="how often each replica's /metrics is read for its running and waiting calls and "
        "KV-cache use (vLLM and SGLang names), which every policy adds to this proxy's own "
        "in-flight counts, so several proxies and workers see one another's load; 0: off",
    )
    engine_stale_s: float = setting(
        3.0, doc="an engine's scraped load older than this is ignored (local counts only)"
    )
    engine_kv_full: float = setting(
        0.95,
        doc="an engine whose KV cache is at least this full counts its running calls twice: a "
        "new call waits for one of them to end",
    )

    def keeps_affinity(self, preferred_in_flight: float, others_in_flight: Sequence[float]) -> bool:
        """Whether a call follows its prefix to the preferred replica rather than falling
        back to the least-loaded one, given the other replicas' in-flight calls: the proxy's
        rule, which the simulator's router shares. An idle replica (under one call in flight)
        takes the call once the preferred one is ``affinity_slack`` ahead of it: it is spare
        capacity, and a prefix every request shares reaches it that way. Otherwise the bound
        is the others' mean, not their least: the least of many busy replicas falls as
        replicas are added, and a bound on it scatters a pool's prefixes the more the larger
        the pool (beam search on 8 + 8 replicas, the search's pick on 16 GPUs: mean latency
        27.5 s bounded by the least, 22.5 s by the mean, simulated)."""
        if not others_in_flight:
            return True
        least = min(others_in_flight)
        if least < 1.0:
            return preferred_in_flight <= least + self.affinity_slack
        mean = sum(others_in_flight) / len(others_in_flight)
        return preferred_in_flight <= mean + max(
            self.affinity_slack, self.affinity_load_ratio * mean
        )

    def __post_init__(self) -> None:
        for key in (
            "max_prefix_chars",
            "prefix_block_chars",
            "affinity_entries",
            "eject_after_failures",
            "hash_key_chars",
            "hash_vnodes",
        ):
            if getattr(self, key) < 1:
                raise SettingsError(key, "must be at least 1")
        if not 0.0 <= self.affinity_min_match <= 1.0:
            raise SettingsError("affinity_min_match", "must be between 0 and 1")
        if not 0.0 <= self.engine_scrape_s <= 3600.0:
            raise SettingsError("engine_scrape_s", "must be between 0 and 3600 seconds")
        if not self.engine_stale_s > 0.0:
            raise SettingsError("engine_stale_s", "must be positive")
        if not 0.0 < self.engine_kv_full <= 1.0:
            raise SettingsError("engine_kv_full", "must be in (0, 1]")
        if not self.hash_load_factor > 1.0:
            raise SettingsError("hash_load_factor", "must be greater than 1")
        if self.affinity_slack < 0:
            raise SettingsError("affinity_slack", "must not be negative")
        if self.affinity_load_ratio < 0:
            raise SettingsError("affinity_load_ratio", "must not be negative")
        for key in ("eject_seconds", "probe_interval_s"):
            if getattr(self, key) <= 0:
                raise SettingsError(key, "must be positive")


@dataclass(frozen=True)
class UpstreamTlsSettings:
    """How the proxy checks the certificates of https:// upstreams."""

    verify: bool = setting(
        True,
        doc="verify https:// upstreams' certificates and host names (false: any certificate is "
        "accepted, for testing only)",
    )
    ca_file: str | None = setting(
        None,
        doc="PEM file of the CA certificates trusted for https:// upstreams (null: the "
        "system's trust store)",
    )

    def __post_init__(self) -> None:
        if self.ca_file is not None:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=self.ca_file)
            except OSError as exc:
                why = exc.strerror or str(exc)  # ssl.SSLError is an OSError without strerror
                raise SettingsError("ca_file", f"cannot load {self.ca_file!r}: {why}") from None


def route_problem(route: str) -> str | None:
    """Why ``route`` cannot be an engine route the proxy forwards, or None: a plain absolute
    path (no query, escapes, empty, ``.`` or ``..`` segments) outside the proxy's own paths."""
    if not route.startswith("/") or len(route) > 256:
        return f"{route[:80]!r} must start with / (at most 256 characters)"
    if not route.isascii() or any(c in route for c in "?#%\\ ") or not route.isprintable():
        return f"{route!r} must be a plain path (no query, %-escapes, blanks or controls)"
    segments = route[1:].split("/")
    if any(s in ("", ".", "..") for s in segments):
        return f"{route!r} has an empty, . or .. segment"
    if segments[0] in ("w", "r", "admin", "health", "metrics"):
        return f"{route!r} is the proxy's own path (/w, /r, /admin, /health, /metrics)"
    return None


@dataclass(frozen=True)
class ProxySettings:
    """The sidecar proxy (data plane)."""

    listen: str = setting("127.0.0.1:8080", doc="HOST:PORT the proxy listens on (port 0: any)")
    proxy_id: str | None = setting(None, doc="this proxy's id in the store (default: hostname-pid)")
    default_workflow: str | None = setting(
        None, doc="workflow name for calls that name none (sidecar mode: one proxy per app)"
    )
    upstreams: tuple[UpstreamSettings, ...] = setting(
        factory=tuple, doc="engine replicas; several entries for one model are its replicas"
    )
    routing: RoutingSettings = setting(factory=RoutingSettings, doc="replica choice")
    workers: int | None = setting(
        None,
        doc="processes serving the listen address (SO_REUSEPORT; each records its own "
        "segments as <proxy_id>-w<i>; admin route changes reach all, /metrics sums all; about "
        "100 MB of memory each); null: one per core this process may run on (its CPU "
        "affinity, bounded by a container's CPU limit)",
    )
    admin_token: str | None = setting(
        None,
        doc="bearer token for /admin/routes (null: the admin API is disabled); "
        "os.environ/NAME or ${NAME} reads it from the environment",
    )
    client_keys: tuple[str, ...] = setting(
        factory=tuple,
        doc="if not empty, clients must send one of these as their bearer key; each may be "
        "os.environ/NAME or ${NAME}",
    )
    max_body_bytes: int = setting(16 * 1024 * 1024, doc="largest request body accepted (413 above)")
    connect_timeout_s: float = setting(5.0, doc="upstream connect timeout")
    upstream_timeout_s: float = setting(
        600.0, doc="longest an upstream call may take end to end (streams included)"
    )
    read_timeout_s: float = setting(
        300.0, doc="longest silence between two chunks of an upstream response"
    )
    upstream_tls: UpstreamTlsSettings = setting(
        factory=UpstreamTlsSettings, doc="certificate checks for https:// upstreams"
    )
    shutdown_grace_s: float = setting(
        30.0, doc="on SIGTERM, how long in-flight calls may take to finish before they are cut"
    )
    record_bodies: bool = setting(
        True, doc="keep request bodies in the store (profiling replays them)"
    )
    access_log: bool = setting(
        False,
        doc="log one line per proxied call (method, path, status, model, workflow, upstream, "
        "duration_ms) on the scepsy.proxy.access logger; off costs nothing per call",
    )
    extra_routes: tuple[str, ...] = setting(
        factory=tuple,
        doc="POST routes engines serve beyond the OpenAI-compatible ones the proxy forwards "
        "(e.g. /tokenize, /detokenize, /v1/load_lora_adapter); any other path is a 404",
    )
    client_header_timeout_s: float = setting(
        60.0,
        doc="longest a client connection may take to send a request head, or stay idle "
        "between requests, before the proxy closes it",
    )
    client_body_timeout_s: float = setting(
        60.0, doc="longest a client may take to send a request body (408 past it)"
    )
    identity_max_chars: int = setting(
        256,
        doc="workflow names, request ids and call ids from a client are cut to this many "
        "characters before they are stored, counted or routed on",
    )
    metrics_max_workflows: int = setting(
        50,
        doc="distinct workflow label values in /metrics: the first this many seen (plus "
        "proxy.default_workflow and the workflows rollout.allocation names); later ones are "
        "counted as `other`, so client-chosen names cannot grow /metrics without bound",
    )

    def __post_init__(self) -> None:
        parse_host_port(self.listen, "listen")
        if self.max_body_bytes < 1024:
            raise SettingsError("max_body_bytes", "must be at least 1024")
        for key in ("connect_timeout_s", "upstream_timeout_s", "read_timeout_s"):
            if getattr(self, key) <= 0:
                raise SettingsError(key, "must be positive")
        if self.shutdown_grace_s < 0:
            raise SettingsError("shutdown_grace_s", "must not be negative")
        if self.metrics_max_workflows < 0:
            raise SettingsError("metrics_max_workflows", "must not be negative")
        for key in ("client_header_timeout_s", "client_body_timeout_s"):
            if not 0 < getattr(self, key) < 86400:
                raise SettingsError(key, "must be positive and under a day")
        if self.workers is not None and not 1 <= self.workers <= 256:
            raise SettingsError("workers", "must be between 1 and 256")
        if self.identity_max_chars < 16:
            raise SettingsError("identity_max_chars", "must be at least 16")
        for i, route in enumerate(self.extra_routes):
            why = route_problem(route)
            if why:
                raise SettingsError(f"extra_routes[{i}]", why)
        seen: set[tuple[str, str]] = set()
        for i, up in enumerate(self.upstreams):
            if (up.model, up.url) in seen:
                raise SettingsError(f"upstreams[{i}]", f"duplicate replica {up.model}={up.url}")
            seen.add((up.model, up.url))

    @property
    def resolved_proxy_id(self) -> str:
        return self.proxy_id or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def resolved_workers(self) -> int:
        """``workers``, or the cores this process may run on: its CPU affinity, bounded by
        its cgroup's CPU quota (a container's CPU limit), rounded up."""
        if self.workers is not None:
            return self.workers
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not on Linux
            cores = os.cpu_count() or 1
        quota = cgroup_cpu_quota()
        if quota is not None:
            cores = min(cores, math.ceil(quota))
        return max(1, cores)


@dataclass(frozen=True)
class StoreSettings:
    """The trace store: Parquet segments under one local (or mounted) folder."""

    path: str = setting("scepsy-store", doc="folder holding calls/ and optimizer.duckdb")
    queue_size: int = setting(
        200_000, doc="records buffered before the proxy drops (and counts) new ones"
    )
    segment_rows: int = setting(50_000, doc="a segment is written once this many records wait")
    flush_interval_s: float = setting(5.0, doc="a segment is written at least this often")

    def __post_init__(self) -> None:
        if not self.path:
            raise SettingsError("path", "must not be empty")
        # Refused, not attempted: the writer renames segments into a local folder (an object
        # store has no atomic rename), and DuckDB's httpfs extension is downloaded at run time,
        # which offline clusters cannot; "s3://x" would silently become a local folder "s3:".
        if "://" in self.path:
            scheme = self.path.split("://", 1)[0]
            raise SettingsError(
                "path",
                f"object storage ({scheme}://...) is not supported yet; mount a volume",
            )
        for key in ("queue_size", "segment_rows"):
            if getattr(self, key) < 1:
                raise SettingsError(key, "must be at least 1")
        if self.flush_interval_s <= 0:
            raise SettingsError("flush_interval_s", "must be positive")


@dataclass(frozen=True)
class Settings:
    """The whole settings file."""

    proxy: ProxySettings = setting(factory=ProxySettings, doc="the sidecar proxy")
    store: StoreSettings = setting(factory=StoreSettings, doc="the trace store")
    cluster: ClusterSettings = setting(
        factory=ClusterSettings, doc="the GPU cluster: nodes, NVLink domains, GPUs"
    )
    rollout: RolloutSettings = setting(
        factory=RolloutSettings, doc="how models are served and rolled out"
    )
    optimizer: OptimizerSettings = setting(
        factory=OptimizerSettings, doc="the optimizer daemon: change detection and re-planning"
    )


def settings_from_mapping(data: Any, env: Mapping[str, str] | None = os.environ) -> Settings:
    """Decode an already-parsed YAML document; string values naming an environment variable
    (``os.environ/NAME``, ``${NAME}``) take its value from ``env`` (None: kept as written)."""
    return decode(Settings, data, env=env)


def load_settings(path: str | Path) -> Settings:
    """Read and validate one YAML settings file (environment references resolved); whatever
    the file holds, a problem is a one-line ``SettingsError`` (see ``shared.yaml_file``)."""
    return settings_from_mapping(read_yaml(path, "settings file"))
