"""Tools the server runs on a model's behalf: MCP servers reached through the official `mcp` SDK
(`mcp_servers`), and a turn's tool calls run together, each bounded and isolated (`tool_runs`)."""
