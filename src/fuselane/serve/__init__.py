"""`fuselane serve`: an OpenAI-compatible HTTP server over the engine (`fuselane.engine`).

- `protocol`: OpenAI's request bodies, read and checked (a bad field is a 400 naming it);
- `replies`: the JSON OpenAI's clients read back (completions, stream chunks, errors, usage);
- `app`: the ASGI application (Starlette): the routes, the API key, streaming, cancelling on disconnect,
  one log line a request;
- `server`: the listening socket and uvicorn, as the command line starts them.
"""
