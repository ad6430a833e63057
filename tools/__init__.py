"""Built-in tools for gpt-oss and the client side of MCP tool servers.

`tools.protocol` is the contract the agent loop uses (`ToolServer`, `ToolSession`,
`ToolResult`, `start_tool_servers`); `tools.browser` is the browser (Exa or a local folder),
`tools.python.server` the sandboxed Python notebook, `tools.mcp_client` external MCP servers.
Nothing here knows about HTTP or the inference engine.
"""

from tools.protocol import (ToolResult, ToolServer, ToolServerError, ToolSession, ToolSessionGroup,
                          start_tool_servers)

__all__ = ["ToolResult", "ToolServer", "ToolServerError", "ToolSession", "ToolSessionGroup",
           "start_tool_servers"]
