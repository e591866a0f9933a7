"""Output parsers of `/v1/chat/completions` (pure Python, no JAX): the reasoning parsers
split a model's `<think>...</think>` block into `reasoning_content` (`reasoning.py`), the
tool-call parsers turn a model's tool-call markup into OpenAI `tool_calls`
(`tool_calls.py`). Both are incremental: fed the text deltas of a stream, they never emit
markup that might still turn out to be a tag; `ChatOutputParser` (`chat.py`) chains them
for one request. The names are SGLang's (`--reasoning-parser glm45 | deepseek-v3`,
`--tool-call-parser glm45 | glm47 | deepseekv32`).
"""

from serving.parsers.chat import ChatOutputParser, ChatParserConfig
from serving.parsers.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_parser
from serving.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallParser,
    tool_call_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChatOutputParser",
    "ChatParserConfig",
    "ReasoningParser",
    "ToolCall",
    "ToolCallParser",
    "reasoning_parser",
    "tool_call_parser",
]
