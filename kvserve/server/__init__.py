"""The OpenAI-compatible HTTP server: ``kvserve serve``.

``create_app(AsyncLLMEngine(engine), ServerConfig())`` builds the FastAPI app; nothing outside this
package imports it (``server → engine``, never the other way).
"""
