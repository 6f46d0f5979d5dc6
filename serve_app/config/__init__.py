"""The validated shape of a serve config's ``args``, one module per section.

Read in the application's build (:func:`serve_app.app.build_app` validates it before anything
starts) and handed, parsed, to every deployment's replicas. :mod:`.app` is the whole, with the
rules across sections; :mod:`.models` and :mod:`.ingress` the two sections; :mod:`.checks` the
checks against vLLM, the GPU table (:mod:`.accelerators`) and Ray. Nothing here builds a
deployment: the builders in :mod:`serve_app.deployments` and :mod:`serve_app.app` decide.

Runs in the application's build, which validates the config; the replicas hold what it validated.
"""

from serve_app.config.app import AppConfig, ConfigError, parse_app_config
from serve_app.config.checks import split_engine_args
from serve_app.config.ingress import (
    APIKeysConfig,
    CORSConfig,
    GRPCStreamConfig,
    IngressConfig,
    OpenCallsConfig,
    PromptLogprobsConfig,
    RateLimitsConfig,
)
from serve_app.config.models import ModelConfig, SimulatedEngineConfig, sized_for
from serve_app.config.responses_store import RedisStoreConfig, ResponsesStoreConfig

__all__ = [
    "APIKeysConfig",
    "AppConfig",
    "CORSConfig",
    "ConfigError",
    "GRPCStreamConfig",
    "OpenCallsConfig",
    "IngressConfig",
    "RedisStoreConfig",
    "ResponsesStoreConfig",
    "ModelConfig",
    "PromptLogprobsConfig",
    "RateLimitsConfig",
    "SimulatedEngineConfig",
    "parse_app_config",
    "sized_for",
    "split_engine_args",
]
