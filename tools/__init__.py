"""Built-in tools for gpt-oss and the client side of MCP tool servers.

`tools/protocol.py` is the contract the agent loop uses (`ToolServer`, `ToolSession`,
`ToolResult`); `tools/servers.py` starts what `--tool-server` names: `tools/browser/` (Exa or a
local folder), `tools/python/` (the sandboxed notebook), `tools/mcp_client.py` (external MCP
servers). Nothing here knows about HTTP.
"""
