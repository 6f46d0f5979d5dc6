"""The vLLM internals the app touches exist in the installed vLLM, and that vLLM is the one they were read in.

An upgrade of vLLM fails the first test on purpose: review each function of
``serve_app/vllm_internals.py`` against the new version's source, then move
``WRITTEN_AGAINST``. The other tests say which touch broke when a name moved.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import vllm

from serve_app import vllm_internals
from serve_app.glm4 import vllm_plugin


def assigns(cls: type, attribute: str) -> bool:
    """``cls.__init__`` sets ``self.<attribute>`` (instance attributes are not on the class)."""
    return f"self.{attribute}" in inspect.getsource(cls.__init__)  # type: ignore[misc]


def test_the_installed_vllm_is_the_one_the_internals_were_written_against() -> None:
    assert vllm.__version__ == vllm_internals.WRITTEN_AGAINST, (
        f"vLLM {vllm.__version__} is installed; serve_app/vllm_internals.py was written against "
        f"{vllm_internals.WRITTEN_AGAINST}: check each of its touches, then update WRITTEN_AGAINST"
    )


def test_the_serving_classes_have_the_render_steps_and_prompt_count() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    for serving, step in (
        (OpenAIServingChat, vllm_internals.CHAT_RENDER_STEP),
        (OpenAIServingCompletion, vllm_internals.COMPLETION_RENDER_STEP),
        (OpenAIServingResponses, vllm_internals.RESPONSES_RENDER_STEP),
    ):
        assert inspect.iscoroutinefunction(getattr(serving, step)), (serving, step)
        assert callable(serving._extract_prompt_len), serving
    assert assigns(OpenAIServingChat, "parser_cls")
    assert assigns(OpenAIServingResponses, "parser")
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    assert issubclass(OpenAIServingResponses, GenerateBaseServing) and assigns(GenerateBaseServing, "engine_client")


def test_the_renderers_have_the_chat_rendering_and_parser() -> None:
    from vllm.entrypoints.launchers.api_server import app_state
    from vllm.renderers.base import BaseRenderer
    from vllm.renderers.online_renderer import OnlineRenderer

    sync_name, async_name = vllm_internals.CHAT_RENDER_METHODS
    assert callable(getattr(BaseRenderer, sync_name))
    assert inspect.iscoroutinefunction(getattr(BaseRenderer, async_name))
    assert assigns(OnlineRenderer, "parser")
    assert assigns(BaseRenderer, "_executor")  # vllm_internals.tokenizer_executor
    assert "state.online_renderer" in inspect.getsource(app_state.init_app_state)


def test_the_engine_has_its_generation_config_and_error_propagation() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor

    assert assigns(AsyncLLM, "input_processor") and assigns(AsyncLLM, "output_processor")
    assert assigns(InputProcessor, "generation_config_fields")
    assert list(inspect.signature(OutputProcessor.propagate_error).parameters) == ["self", "e"]


def test_once_settled_vllm_reads_a_variable_no_more_and_the_startup_heap_is_frozen(monkeypatch) -> None:
    """As vLLM's server once its engine is up: a full collection no longer walks what was made before."""
    import gc

    from vllm import envs

    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "0")

    class MadeBefore:
        pass

    made_before = MadeBefore()  # a GC-tracked object
    try:
        vllm_internals.settle_after_start()
        monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
        assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False
        assert gc.get_freeze_count() > 0 and not any(o is made_before for o in gc.get_objects())
    finally:
        envs.disable_envs_cache()  # (the test process's other tests read the environment)
        gc.unfreeze()
    assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is True


def test_the_ray_stat_logger_gauge_class_is_the_switch_that_is_replaced() -> None:
    from vllm.v1.metrics.ray_wrappers import RayGaugeWrapper, RayPrometheusStatLogger

    assert RayPrometheusStatLogger._gauge_cls is RayGaugeWrapper
    assert assigns(RayGaugeWrapper, "metric") and "self._tags" in inspect.getsource(RayGaugeWrapper)
    logger_cls = vllm_internals.ray_stat_logger(lambda metric, value, tags: None, lambda metric, tags: None)
    assert issubclass(logger_cls, RayPrometheusStatLogger)
    gauge_cls = logger_cls._gauge_cls  # type: ignore[attr-defined]
    assert issubclass(gauge_cls, RayGaugeWrapper) and gauge_cls is not RayGaugeWrapper


def test_the_ray_stat_logger_starts_the_prefix_cache_counters_of_each_engine() -> None:
    """vLLM's Ray counters skip increments of 0: a prefix-cache hit rate needs both started."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    model = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4"
    vllm_config = AsyncEngineArgs(model=str(model), max_model_len=1024, served_model_name=["m"]).create_engine_config()
    started: list[tuple[str, dict[str, str]]] = []
    logger_cls = vllm_internals.ray_stat_logger(
        lambda metric, value, tags: None, lambda metric, tags: started.append((metric._name, tags))
    )
    logger_cls(vllm_config, [0])
    assert started == [
        ("vllm_prefix_cache_queries", {"model_name": "m", "engine": "0", "ReplicaId": ""}),
        ("vllm_prefix_cache_hits", {"model_name": "m", "engine": "0", "ReplicaId": ""}),
    ]


def test_async_llm_builds_its_engine_core_client_with_the_factory_the_simulation_replaces() -> None:
    from vllm.v1.engine import async_llm
    from vllm.v1.engine.core_client import EngineCoreClient

    assert isinstance(EngineCoreClient.__dict__["make_async_mp_client"], staticmethod)
    assert "EngineCoreClient.make_async_mp_client(" in inspect.getsource(async_llm.AsyncLLM.__init__)
    # What the simulated core must answer: every engine_core call on AsyncLLM's generate path.
    source = inspect.getsource(async_llm.AsyncLLM)
    for call in ("add_request_async(", "get_output_async(", "abort_requests_async(", "resources.engine_dead"):
        assert f"engine_core.{call}" in source, call


def test_the_guidance_plugin_is_registered_with_vllm_and_replaces_both_of_its_tokenizers() -> None:
    """vLLM runs ``vllm.general_plugins`` entry points in each of its processes (engine core included)."""
    from importlib.metadata import entry_points

    import vllm.sampling_params
    import vllm.v1.engine.core as engine_core_module
    from vllm.v1.structured_output.backend_guidance import GuidanceBackend

    [plugin] = [p for p in entry_points(group="vllm.general_plugins") if p.value.startswith("serve_app.")]
    assert plugin.load() is vllm_plugin.register
    assert "load_general_plugins()" in inspect.getsource(engine_core_module)
    assert isinstance(GuidanceBackend.__dict__["_build_ll_tokenizer"], staticmethod)
    assert callable(vllm.sampling_params._get_llg_tokenizer)
    vllm_plugin.register()
    build = GuidanceBackend._build_ll_tokenizer
    vllm_plugin.register()  # twice, as vLLM may: one wrapping, not two
    assert GuidanceBackend._build_ll_tokenizer is build and getattr(build, "reads_text_as_text", False)
    assert vllm.sampling_params._get_llg_tokenizer.__module__ == "serve_app.vllm_internals"


def test_a_memory_handler_keeps_writing_after_vllm_configures_its_logging(tmp_path: Path) -> None:
    """vLLM configures its logging when it builds an engine (AsyncLLM and the engine config call
    ``configure_logging_if_needed``), and that closes every handler in the process: a
    MemoryHandler, what Serve writes a replica's log through, loses its target. Inside
    ``process_logging_preserved`` it gets it back, and the next line reaches the file."""
    import logging.handlers

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    def memory_logger(name: str) -> tuple[logging.Logger, logging.handlers.MemoryHandler, Path]:
        path = tmp_path / f"{name}.log"
        handler = logging.handlers.MemoryHandler(1, target=logging.FileHandler(path))
        log = logging.getLogger(f"test.replica.{name}")
        log.setLevel(logging.INFO)
        log.propagate = False
        log.addHandler(handler)
        return log, handler, path

    unkept, unkept_handler, unkept_path = memory_logger("unkept")
    configure_logging(LoggingConfig())
    assert unkept_handler.target is None  # vLLM still closes every handler: the repair is needed
    unkept.info("lost")
    assert "lost" not in unkept_path.read_text()

    kept, kept_handler, kept_path = memory_logger("kept")
    with vllm_internals.process_logging_preserved():
        configure_logging(LoggingConfig())
    kept.info("the request log line")
    assert kept_handler.target is not None and "the request log line" in kept_path.read_text()
    for log in (unkept, kept):
        for handler in list(log.handlers):
            log.removeHandler(handler)
            handler.close()


def test_the_front_end_builds_grammars_as_the_ingress_builds_them_first() -> None:
    """vllm_internals.build_request_grammar repeats these steps in the ingress's checker process."""
    from vllm.sampling_params import SamplingParams
    from vllm.tool_parsers.abstract_tool_parser import ToolParser
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar

    assert "get_json_schema_from_tools(" in inspect.getsource(ToolParser.adjust_request)
    assert "validate_guidance_grammar(" in inspect.getsource(SamplingParams)
    assert list(inspect.signature(validate_guidance_grammar).parameters) == ["sampling_params", "tokenizer"]


def test_the_names_read_from_vllms_source_are_the_ones_it_imports() -> None:
    """A serve config is checked against these when the application is built, without importing vLLM."""
    import dataclasses
    from typing import get_args

    from vllm.config.cache import CacheDType
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    engine, frontend = vllm_internals.engine_argument_names()
    assert engine == {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    assert frontend == {field.name for field in dataclasses.fields(FrontendArgs)}
    assert list(vllm_internals.quantization_methods()) == QUANTIZATION_METHODS
    assert vllm_internals.kv_cache_dtypes() == get_args(CacheDType)
