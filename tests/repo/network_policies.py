"""NetworkPolicies as Kubernetes reads them: who a policy selects, for the tests of k8s/'s policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

APP_NAMESPACE = "glm4-serve"  # the overlays' namespace; the plain base has none


@dataclass(frozen=True)
class Peer:
    """A pod that opens a connection: its namespace and its labels."""

    namespace: str
    labels: dict[str, str] = field(default_factory=dict)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' label selector: every matchLabels pair and every matchExpressions term holds."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for term in selector.get("matchExpressions", []):
        key, operator, values = term["key"], term["operator"], term.get("values", [])
        holds = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not holds:
            return False
    return True


# An address that is no pod of the cluster: the Kubernetes API server, the internet.
OUTSIDE = Peer("")


def rule_admits(rule: dict[str, Any], peers_key: str, peer: Peer, port: int, protocol: str, namespace: str) -> bool:
    """Whether one ingress (``from``) or egress (``to``) rule of a policy in ``namespace`` admits ``peer``
    on ``port``: no port list admits every port, no peer list every peer, and a peer entry with both
    selectors needs both (address blocks are not read here)."""
    ports = rule.get("ports")
    if ports and not any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports):
        return False
    peers = rule.get(peers_key)
    if not peers:
        return True
    for allowed in peers:
        assert "ipBlock" not in allowed, "address blocks are not read here"
        if "namespaceSelector" in allowed:
            in_namespace = selects(allowed["namespaceSelector"], {"kubernetes.io/metadata.name": peer.namespace})
        else:
            in_namespace = peer.namespace == namespace
        if in_namespace and selects(allowed.get("podSelector", {}), peer.labels):
            return True
    return False
