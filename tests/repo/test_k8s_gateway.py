"""k8s/gateway: TLS at a Gateway in front of the Serve Service, with the limits HAProxy lacks.

Nothing here needs a cluster. Each object, as `kubectl kustomize k8s/gateway` renders it, is
validated against its CRD's schema (Gateway API v1.6.1 and Envoy Gateway v1.9.0, verbatim in
tests/data/gateway-api); its time limits are read against deploy/config.yaml, whose Serve
Service (k8s/base/rayservice.yaml) the routes send to.
"""

from __future__ import annotations

import functools
import re
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from serve_app.config import parse_app_config
from serve_app.serve_internals import client_control_headers
from tests.repo.k8s_manifests import K8S, ROOT, SERVE_CONFIG, kubectl

CRD_DIR = ROOT / "tests" / "data" / "gateway-api"
CRD_FILES = {
    "Gateway": "gateway.networking.k8s.io_gateways.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
    "GRPCRoute": "gateway.networking.k8s.io_grpcroutes.yaml",
    "ClientTrafficPolicy": "gateway.envoyproxy.io_clienttrafficpolicies.yaml",
    "BackendTrafficPolicy": "gateway.envoyproxy.io_backendtrafficpolicies.yaml",
}
# How long a front may wait past Serve's own limit, so that Serve's answer (a 504, a final error
# event) always comes first; the same margin the serve configs give their proxies over the front door.
MARGIN_S = 30


@functools.cache
def gateway_documents() -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "gateway")], check=True, capture_output=True, text=True
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def one(kind: str) -> dict[str, Any]:
    (found,) = [d for d in gateway_documents() if d["kind"] == kind]
    return found


def seconds(duration: str) -> float:
    """A Gateway API duration ("990s", "1m30s", "500ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def serve_config() -> dict[str, Any]:
    return yaml.safe_load(SERVE_CONFIG.read_text())


def serve_service_ports() -> dict[str, int]:
    (rayservice,) = [d for d in yaml.safe_load_all((K8S / "base" / "rayservice.yaml").read_text()) if d]
    service = rayservice["spec"]["serveService"]
    return {service["metadata"]["name"] + f":{p['name']}": p["port"] for p in service["spec"]["ports"]}


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others: the API server
    drops a field its schema does not name (a misspelt limit would vanish without a word), so the
    test refuses it instead."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_each_object_is_valid_for_its_crd_and_names_no_field_it_lacks(kind):
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=yaml.CSafeLoader)
    document = one(kind)
    group, version = document["apiVersion"].split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    schema = closed(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # Kubernetes' ObjectMeta, not in the CRD
    jsonschema.validate(document, schema)


def test_clients_reach_the_serve_service_over_tls_only():
    """Every listener terminates TLS with a certificate; both routes attach to it and send to the
    Serve Service's HTTP and gRPC ports."""
    gateway = one("Gateway")
    for listener in gateway["spec"]["listeners"]:
        assert listener["protocol"] == "HTTPS" and listener["tls"]["mode"] == "Terminate", listener
        assert listener["tls"]["certificateRefs"], listener
    ports = serve_service_ports()
    for kind, port_name in (("HTTPRoute", "serve"), ("GRPCRoute", "grpc")):
        route = one(kind)
        assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
        backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
        assert [f"{ref['name']}:{ref['port']}" for ref in backends] == [
            f"glm4-serve:{ports['glm4-serve:' + port_name]}"
        ]


def test_no_request_the_serve_config_lets_live_is_cut_at_the_gateway():
    """The routes wait as long as Serve's proxies do, and a margin; a stream may stay silent as long
    as a unary answer takes to come (the front door's whole request limit)."""
    config = serve_config()
    (http_rule,) = one("HTTPRoute")["spec"]["rules"]
    http_s = config["http_options"]["request_timeout_s"]
    assert seconds(http_rule["timeouts"]["request"]) >= http_s + MARGIN_S
    assert seconds(http_rule["timeouts"]["backendRequest"]) >= http_s + MARGIN_S
    (grpc_policy,) = [
        d
        for d in gateway_documents()
        if d["kind"] == "BackendTrafficPolicy" and d["spec"]["targetRefs"][0]["kind"] == "GRPCRoute"
    ]
    grpc_s = config["grpc_options"]["request_timeout_s"]
    assert seconds(grpc_policy["spec"]["timeout"]["http"]["requestTimeout"]) >= grpc_s + MARGIN_S
    client = one("ClientTrafficPolicy")["spec"]["timeout"]["http"]
    (app,) = config["applications"]
    ingress = parse_app_config(app["args"]).ingress
    assert seconds(client["streamIdleTimeout"]) >= ingress.request_timeout_s
    assert seconds(client["idleTimeout"]) == config["http_options"]["keep_alive_timeout_s"]


def test_what_comes_before_a_key_is_bounded_at_the_gateway():
    """Headers within seconds, a body within the front door's body limit, a bounded number of
    connections with bounded buffers, TLS 1.2 at least."""
    spec = one("ClientTrafficPolicy")["spec"]
    http = spec["timeout"]["http"]
    (app,) = serve_config()["applications"]
    assert seconds(http["requestHeadersReceivedTimeout"]) <= 10
    assert seconds(http["requestReceivedTimeout"]) == parse_app_config(app["args"]).ingress.body_timeout_s
    assert seconds(spec["timeout"]["tcp"]["tlsHandshakeTimeout"]) <= 10
    assert spec["connection"]["connectionLimit"]["value"] > 0 and spec["connection"]["bufferLimit"]
    assert spec["tls"]["minVersion"] in ("1.2", "1.3")


def test_serves_control_headers_are_removed_at_the_edge():
    headers = one("ClientTrafficPolicy")["spec"]["headers"]
    assert set(headers["earlyRequestHeaders"]["remove"]) == set(client_control_headers())
    assert headers["withUnderscoresAction"] == "DropHeader"
