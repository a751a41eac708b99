"""Every private transformers API the server wing uses (``transformers serve`` and its command line), each with the
versions it was checked on: what only ``hf-alibi serve`` runs stays out of ``core/compat.py``, which a checkpoint's
remote code copies. Imports nothing at module level (the command line's front loads this package without torch)."""

from __future__ import annotations


def transformers_cli_app():
    """The ``transformers`` command's typer app (``transformers.cli.transformers.app``; ``app(args=["serve", ...])``
    runs ``transformers serve`` in this process without its update check; checked on 5.19.0 and 5.24.0)."""
    from transformers.cli.transformers import app

    return app


def wrap_server_builder(wrap) -> None:
    """Replace transformers' ``build_server`` (``transformers.cli.serving.server.build_server``, which ``Serve``
    imports from that module when it runs) with ``wrap(build_server)``; checked on transformers 5.24.0 (hf-alibi
    serve refuses older releases)."""
    from transformers.cli.serving import server  # through sys.modules: the transformers module that holds the name

    server.build_server = wrap(server.build_server)


def cb_manager(generation_state):
    """transformers serve's continuous-batching manager (``GenerationState._cb_manager._cb``, private; checked on
    5.24.0), or ``None`` where no batching worker runs (or another release names it otherwise)."""
    return getattr(getattr(generation_state, "_cb_manager", None), "_cb", None)


def cb_worker_fatal_error(generation_state) -> str:
    """Why transformers' continuous-batching worker died, as its status records it
    (``ContinuousBatchingManager.background_thread_status.fatal_error``; checked on 5.24.0), or ``""`` where any of
    it is missing."""
    status = getattr(cb_manager(generation_state), "background_thread_status", None)
    return str(getattr(status, "fatal_error", "") or "")


def cancel_cb_request(generation_state, request_id: str) -> None:
    """Drop ``request_id`` from transformers' batching worker (``ContinuousBatchingManager.cancel_request``, reached
    through :func:`cb_manager`; checked on transformers 5.24.0)."""
    manager = cb_manager(generation_state)
    if manager is not None:
        manager.cancel_request(request_id)


def cb_requests(generation_state) -> dict | None:
    """transformers' continuous-batching scheduler's requests (``active``: in the batch, holding cache blocks;
    ``waiting``; ``cancelling``: asked to stop, not yet removed) and the cache blocks in their block tables
    (``cache_blocks_held``; complete blocks kept for prefix reuse, free to evict, are not counted), or None where no
    batching worker runs. It reads :func:`cb_manager`'s ``batch_processor.scheduler`` (private;
    checked on transformers 5.24.0), each step with a default, so another release answers None."""
    manager = cb_manager(generation_state)
    scheduler = getattr(getattr(manager, "batch_processor", None), "scheduler", None)
    cache = getattr(scheduler, "cache", None)
    if cache is None:
        return None
    held = sum(len(table) for a in cache.cache_allocators.values() for table in list(a.block_table.values()))
    return {"active": len(scheduler.active_requests), "waiting": len(scheduler.waiting_requests),
            "cancelling": len(getattr(scheduler, "_requests_to_cancel", ())), "cache_blocks_held": held}  # fmt: skip


def serving_available() -> bool:
    """Whether ``transformers serve``'s own dependencies are installed (``transformers.utils.import_utils.
    is_serve_available``, what its server checks first; checked on transformers 5.19.0 and 5.24.0)."""
    from transformers.utils.import_utils import is_serve_available

    return is_serve_available()
