"""GLM-4 tool calling inside vLLM's OpenAI chat serving.

vLLM's serving layer asks one ``Parser`` per request to turn generated text into
``content`` and ``tool_calls``, unary (``parse``) and streamed (``parse_delta``,
told when the answer is finished). :class:`Glm4Parser` is that parser for GLM-4:

* ``tool_choice="auto"`` with tools: GLM-4's own call format, read by
  :mod:`serve_app.glm4.tool_calls`.
* ``"required"`` or a named function: vLLM's own handling, which constrains
  decoding to a JSON schema of the tools (structured outputs), so even a weak
  model returns a valid call.
* no tools, or ``"none"``: text, without the empty metadata line GLM-4 starts
  its answers with.

:class:`Glm4ToolParser` is registered in vLLM's tool-parser registry as
``glm4`` so that ``--enable-auto-tool-choice --tool-call-parser glm4`` switches
vLLM's tool paths on; :func:`serve_app.glm4.serving.configure` then puts
:class:`Glm4Parser` in place of the parser vLLM composed around it.

Runs in each model replica, inside vLLM's chat serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.abstract_parser import DelegatingParser
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

from serve_app.glm4 import tool_calls
from serve_app.glm4.format import SPECIAL_TOKENS
from serve_app.glm4.tool_calls import ToolCallStream, parse_output

PARSER_NAME = "glm4"


def tool_names(request: Any) -> list[str]:
    """Names of the functions a request offers (in ``function`` for chat; the Responses API's at the top)."""
    names = []
    for tool in request.tools or []:
        function = getattr(tool, "function", None)
        if function is not None:
            names.append(function.name)
        elif getattr(tool, "type", None) == "function":
            names.append(tool.name)
    return names


def without_special_tokens(text: str) -> str:
    """Text as it reads with special tokens skipped, as vLLM shows it without tools.

    Reading calls needs special tokens kept in the text (the turn separator);
    once the turns are split, the rest of them must not reach the user.
    """
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text


def partial_required_calls(model_output: str) -> list[FunctionCall]:
    """The calls of a ``tool_choice="required"`` answer whose JSON was cut short (by ``max_tokens``).

    vLLM's unary path reads only a complete JSON array, so a cut answer would
    come back with no call and no content: an empty message. Its streamed path
    sends each call's name and the arguments written so far; this reads the
    whole answer with that same function, so both forms return the same calls.
    """
    delta, _ = extract_required_tool_call_streaming(
        previous_text="", current_text=model_output, tool_call_idx=None, tool_call_id_type="random"
    )
    return [
        FunctionCall(id=call.id, name=call.function.name, arguments=call.function.arguments or "")
        for call in (delta.tool_calls if delta else [])
        if call.function is not None and call.function.name
    ]


def reads_glm4_calls(request: Any) -> bool:
    """Whether the model may answer in GLM-4's call format (``tool_choice="auto"``)."""
    return bool(request.tools) and request.tool_choice in ("auto", None)


def uses_vllm_json_calls(request: Any) -> bool:
    """Whether vLLM's schema-constrained JSON calls apply (required / named)."""
    return bool(request.tools) and (
        request.tool_choice == "required" or not isinstance(request.tool_choice, str | None)
    )


@ToolParserManager.register_module(PARSER_NAME)
class Glm4ToolParser(ToolParser):
    """GLM-4's entry in vLLM's tool-parser registry.

    It prepares requests and reads whole answers; streamed answers are read by
    :class:`Glm4Parser`, which vLLM tells when an answer ends (the legacy
    ``ToolParser`` streaming interface is never told, so it could not release
    a held-back function name or a malformed call at the end).
    """

    def adjust_request(self, request: Any) -> Any:
        request = super().adjust_request(request)  # JSON schema for required / named
        if reads_glm4_calls(request):  # (chat's requests and the Responses API's)
            # Several calls in one answer are separated by <|assistant|>, a special token.
            request.skip_special_tokens = False
        return request

    def extract_tool_calls(self, model_output: str, request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        parsed = parse_output(model_output, tool_names(request))
        return ExtractedToolCallInformation(
            tools_called=bool(parsed.calls),
            tool_calls=[ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls],
            content=without_special_tokens(parsed.content) or None,
        )

    def extract_tool_calls_streaming(self, *args: Any, **kwargs: Any) -> DeltaMessage | None:
        raise NotImplementedError("GLM-4 streams are read by serve_app.glm4.parser.Glm4Parser")


class Glm4Parser(DelegatingParser):
    """One request's reader of GLM-4's answers (see the module docstring)."""

    tool_parser_cls = Glm4ToolParser

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stream: ToolCallStream | None = None
        self._calls_sent = 0

    def parse(
        self,
        model_output: str,
        request: Any,
        enable_auto_tools: bool = False,
        model_output_token_ids: Sequence[int] = (),
    ) -> tuple[str | None, str | None, list[FunctionCall] | None]:
        if uses_vllm_json_calls(request):
            reasoning, content, calls = super().parse(model_output, request, enable_auto_tools, model_output_token_ids)
            if not calls and request.tool_choice == "required":
                calls = partial_required_calls(model_output)
            return reasoning, content, calls
        if reads_glm4_calls(request) and enable_auto_tools:
            parsed = parse_output(model_output, tool_names(request))
            content = without_special_tokens(parsed.content)
            calls = [FunctionCall(name=c.name, arguments=c.arguments) for c in parsed.calls]
            return None, (content or None) if calls else content, calls
        return None, parse_output(model_output, (), separator=None).content, []

    def parse_delta(
        self,
        delta_text: str,
        delta_token_ids: list[int],
        request: Any,
        prompt_token_ids: list[int] | None = None,
        *,
        finished: bool,
    ) -> DeltaMessage | None:
        if uses_vllm_json_calls(request):
            return super().parse_delta(delta_text, delta_token_ids, request, prompt_token_ids, finished=finished)
        if self._stream is None:
            if reads_glm4_calls(request):
                self._stream = ToolCallStream(tool_names(request))
            else:
                self._stream = ToolCallStream((), separator=None)
        events = self._stream.feed(delta_text)
        if finished:
            events += self._stream.finish()
        return self._delta(events)

    def _delta(self, events: list[tool_calls.Event]) -> DeltaMessage | None:
        text = without_special_tokens("".join(e for e in events if isinstance(e, str)))
        calls = [e for e in events if isinstance(e, tool_calls.ToolCall)]
        if not text and not calls:
            return None
        deltas = [
            DeltaToolCall(
                index=self._calls_sent + i,
                id=make_tool_call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for i, call in enumerate(calls)
        ]
        self._calls_sent += len(calls)
        return DeltaMessage(content=text or None, tool_calls=deltas)
