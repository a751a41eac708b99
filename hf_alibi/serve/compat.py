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


def cb_worker_fatal_error(generation_state) -> str:
    """Why transformers' continuous-batching worker died, as its status records it
    (``GenerationState._cb_manager._cb.background_thread_status.fatal_error``, all private; checked on 5.24.0), or
    ``""`` where any of it is missing."""
    manager = getattr(generation_state, "_cb_manager", None)
    status = getattr(getattr(manager, "_cb", None), "background_thread_status", None)
    return str(getattr(status, "fatal_error", "") or "")


def serving_available() -> bool:
    """Whether ``transformers serve``'s own dependencies are installed (``transformers.utils.import_utils.
    is_serve_available``, what its server checks first; checked on transformers 5.19.0 and 5.24.0)."""
    from transformers.utils.import_utils import is_serve_available

    return is_serve_available()
