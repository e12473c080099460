"""The HTTP server: OpenAI- and Anthropic-compatible APIs on Starlette + uvicorn around one engine."""
