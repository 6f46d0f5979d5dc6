"""Fixed conversations and the exact GLM-4 prompts they must render to.

Shared by the unit tests (template rendered alone) and the end-to-end tests
(prompt as the running server rendered it), so both check one documented format:
``[gMASK]<sop>``, a tools system turn when tools are offered, then
``<|role|>{metadata}\\n{content}`` per message, ending with ``<|assistant|>``.
"""

from __future__ import annotations

import json
from typing import Any

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Beijing", "Paris"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
        },
    },
}

TOOLS_SYSTEM_TURN = (
    "<|system|>\n你是一个名为 ChatGLM 的人工智能助手。你是基于智谱AI训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具"
    "\n\n## get_weather\n\n"
    + json.dumps(WEATHER_TOOL["function"], indent=4, ensure_ascii=False)
    + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
    "\n\n## get_time\n\n"
    + json.dumps(TIME_TOOL["function"], indent=4, ensure_ascii=False)
    + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
)

CONVERSATIONS: dict[str, tuple[dict, str]] = {
    "plain": (
        {"messages": [{"role": "user", "content": "Hello"}]},
        "[gMASK]<sop><|user|>\nHello<|assistant|>",
    ),
    "system and history": (
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "北京天气怎么样？"},
            ]
        },
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello! How can I help?"
        "<|user|>\n北京天气怎么样？<|assistant|>",
    ),
    "tools offered": (
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
            ],
            "tools": [WEATHER_TOOL, TIME_TOOL],
        },
        "[gMASK]<sop>" + TOOLS_SYSTEM_TURN + "<|system|>\nBe brief.<|user|>\nWeather in Paris?<|assistant|>",
    ),
    "tool call and result": (
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
            ],
            "tools": [WEATHER_TOOL, TIME_TOOL],
        },
        "[gMASK]<sop>" + TOOLS_SYSTEM_TURN + "<|user|>\nWeather in Paris?"
        '<|assistant|>get_weather\n{"city": "Paris"}<|observation|>\n{"celsius": 21}<|assistant|>',
    ),
}
