"""The data plane: an OpenAI-compatible aiohttp proxy that routes, relays and records calls."""
