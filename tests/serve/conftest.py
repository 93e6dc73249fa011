"""The server's tests need its HTTP stack (starlette, uvicorn; httpx as the client): a machine that has only the
lanes' dependencies (a GPU host running `pytest -m cuda tests`) skips them instead of failing to collect."""

import importlib.util

collect_ignore_glob = (
    [] if all(importlib.util.find_spec(m) for m in ("starlette", "uvicorn", "httpx")) else ["test_*.py"]
)
