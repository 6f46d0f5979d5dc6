"""The applications the suite serves, both from the serve configs under ``deploy/``.

- ``glm`` at ``/``: ``deploy/config.cpu.yaml`` as shipped, the real vLLM CPU engine on the
  tiny GLM-4 model. The tests of generation run on it: protocol, GLM-4's format and tools,
  exact lengths, the same seed over HTTP and gRPC, the README's examples, and the one
  canary whose engine process really dies.
- ``glm-sim`` at ``/sim``, *the bed*: ``deploy/config.sim.yaml``'s application, the
  production shape on the simulated engine, which stands in for the GPU: it costs the host
  almost no CPU, as a GPU engine does, and it is driven through
  :mod:`serve_app.simulated_engine.controls` (pause, pace, fail, hang). The tests of the
  serving layer under load and faults run on it. What differs from the shipped config, and
  why, is :func:`bed_application`'s list.

The cluster-wide options (HTTP and gRPC ports, the proxies' time limits) are the CPU
config's, as ``make serve`` runs it; only the ports differ.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = REPO / "deploy" / "config.cpu.yaml"
SIM_CONFIG = REPO / "deploy" / "config.sim.yaml"
BED_NAME = "glm-sim"
BED_ROUTE = "/sim"
# Short enough that the hang test's watchdog acts within seconds; a paused engine keeps
# reporting (heartbeats), so only a hang trips it.
BED_STALL_TIMEOUT_S = 5
# Requests on the bed: the CPU config's limits, since its proxies' (90 s) bound every app.
BED_REQUEST_TIMEOUT_S = 60


@dataclass(frozen=True)
class RunningApp:
    """One application of the suite's running Serve config, as its clients see it."""

    name: str  # Serve's application name (the gRPC proxy routes by it: `application` metadata)
    origin: str  # the HTTP server every application's routes hang below (http://host:port)
    route_prefix: str
    grpc_target: str  # host:port of Serve's gRPC proxy
    model: str
    model_path: Path  # the engine's checkpoint (or the simulated engine's tokenizer)
    log_path: Path  # `serve run`'s output
    config_path: Path  # the suite's whole config, as `serve run` was given it

    @property
    def url(self) -> str:
        """This application's HTTP base URL (its route prefix included)."""
        return self.origin + self.route_prefix.rstrip("/")

    @property
    def model_deployment(self) -> str:
        return "model-" + self.model

    @property
    def direct_streaming(self) -> bool:
        """Whether its model replicas answer clients themselves (``ingress.direct_streaming``)."""
        config = application(yaml.safe_load(self.config_path.read_text()), self.name)
        return bool(config["args"]["ingress"].get("direct_streaming"))

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def cpu_application() -> dict[str, Any]:
    """deploy/config.cpu.yaml's application, as shipped."""
    return yaml.safe_load(CPU_CONFIG.read_text())["applications"][0]


def bed_application() -> dict[str, Any]:
    """deploy/config.sim.yaml's application as the suite's bed. What differs from it:

    - its name and route (``glm-sim`` at ``/sim``), beside the CPU app;
    - no model load time (``load_s`` 0): a replacement replica serves within seconds;
    - one model replica and one ingress replica, not autoscaling: a burst sized for one
      replica's queue meets exactly that (the autoscale test sets autoscaling back);
    - the CPU config's time limits (request 60 s, first token 30 s, drain 60 s), since the
      cluster's proxies are the CPU config's (they end any request after 90 s);
    - ``engine_stall_timeout_s`` 5, so that a hung engine is caught within seconds.
    """
    application = yaml.safe_load(SIM_CONFIG.read_text())["applications"][0]
    application["name"], application["route_prefix"] = BED_NAME, BED_ROUTE
    (model,) = application["args"]["models"]
    model["simulated_engine"]["load_s"] = 0
    model["engine_stall_timeout_s"] = BED_STALL_TIMEOUT_S
    deployment = model["deployment"]
    deployment.pop("autoscaling_config")
    deployment["num_replicas"] = 1
    deployment["graceful_shutdown_timeout_s"] = BED_REQUEST_TIMEOUT_S
    ingress = application["args"]["ingress"]
    ingress["request_timeout_s"], ingress["first_token_timeout_s"] = BED_REQUEST_TIMEOUT_S, 30
    ingress["deployment"].pop("autoscaling_config")
    ingress["deployment"]["num_replicas"] = 1
    return application


def bed_autoscaling() -> dict[str, Any]:
    """The model deployment's autoscaling_config as deploy/config.sim.yaml ships it."""
    (model,) = yaml.safe_load(SIM_CONFIG.read_text())["applications"][0]["args"]["models"]
    return copy.deepcopy(model["deployment"]["autoscaling_config"])


def suite_config(http_port: int, grpc_port: int, env_vars: dict[str, str]) -> dict[str, Any]:
    """The serve config the suite runs: the CPU app and the bed, ``env_vars`` added to both."""
    config = yaml.safe_load(CPU_CONFIG.read_text())
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = grpc_port
    config["applications"] = [cpu_application(), bed_application()]
    for application in config["applications"]:
        application.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(env_vars)
    return config


def application(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The application called ``name`` in a serve config (to change it in place)."""
    (found,) = [a for a in config["applications"] if a["name"] == name]
    return found
