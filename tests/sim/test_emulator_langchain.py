"""LangChain's ChatOpenAI (what many agent apps use) against an in-process emulator."""

from __future__ import annotations

from langchain_openai import ChatOpenAI

from sim.emulator_server import serving
from sim.serving import EmulatorConfig


async def test_chat_openai_invoke_and_stream() -> None:
    async with serving(EmulatorConfig(model="llama-3-8b", speedup=1000.0)) as srv:
        llm = ChatOpenAI(
            base_url=srv.base_url,
            api_key="x",  # type: ignore[arg-type, call-arg]
            model="llama-3-8b",
            max_tokens=12,
            seed=5,
            max_retries=0,
            default_headers={"X-Scepsy-Workflow": "lc"},
        )
        whole = await llm.ainvoke("Name three prime numbers.")
        assert isinstance(whole.content, str) and whole.content
        assert whole.response_metadata.get("system_fingerprint") == "scepsy-emulated"
        parts = [chunk.content async for chunk in llm.astream("Name three prime numbers.")]
        assert "".join(str(p) for p in parts) == whole.content
