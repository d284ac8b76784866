"""What both agents do around their work: signals, systemd notification, the control socket,
the metrics endpoint, reload on SIGHUP, and the command-line entry."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Callable

from rqp import RQPError
from rqp.control import serve_control, serve_metrics
from rqp.service import notify, watchdog_interval


class Daemon:
    """Base of the sending and receiving MCAs. Subclasses provide ``status()``, ``metrics()``
    and ``reload()`` (which raises :class:`RQPError` to refuse a bad config)."""

    #: What a first SIGTERM starts, for the log.
    stop_note = "stopping"

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._stopping = asyncio.Event()  # (bound to the running loop on first use)
        self._reloading = False
        self._servers: list = []
        self._pinger: asyncio.Task | None = None
        self._control_path: Path | None = None

    async def start_service(self, control_path: Path, metrics_listen) -> None:
        """Signal handlers, the control socket and (if configured) the metrics endpoint."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        self._control_path = control_path
        self._servers.append(await serve_control(control_path, self._control))
        if metrics_listen:
            self._servers.append(await serve_metrics(metrics_listen.host, metrics_listen.port,
                                                     self.metrics))
            self.log.info("metrics on http://%s/metrics", metrics_listen)

    def ready(self, status: str) -> None:
        notify(f"READY=1\nSTATUS={status}")
        interval = watchdog_interval()
        if interval:
            self._pinger = asyncio.create_task(self._watchdog(interval))

    async def wait_for_stop(self) -> None:
        await self._stopping.wait()
        notify("STOPPING=1")

    def stop_service(self) -> None:
        if self._pinger:
            self._pinger.cancel()
        for server in self._servers:
            server.close()
        if self._control_path is not None:
            self._control_path.unlink(missing_ok=True)

    def _on_signal(self, sig: int) -> None:
        if self._stopping.is_set():
            self.log.warning("second %s: exiting at once", signal.Signals(sig).name)
            os._exit(0)
        self.log.info("%s: %s", signal.Signals(sig).name, self.stop_note)
        self._stopping.set()

    def _on_hup(self) -> None:
        if self._reloading:
            return  # a SIGHUP during a reload is coalesced into it
        self._reloading = True
        asyncio.get_running_loop().call_soon(self._reload)

    def _reload(self) -> None:
        self._reloading = False
        notify("RELOADING=1")
        try:
            self.reload()
        except RQPError as exc:
            self.log.error("reload refused, keeping the running configuration: %s", exc)
        notify("READY=1")

    async def _watchdog(self, interval: float) -> None:
        while True:  # from the main loop: a stuck loop stops the pings
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _control(self, request: dict) -> dict:
        command = request.get("command")
        if command == "status":
            return self.status()
        if command == "metrics":
            return {"text": self.metrics()}
        return {"error": f"unknown command {command!r} (status, metrics)"}

    def status(self) -> dict:  # pragma: no cover - overridden
        raise NotImplementedError

    def metrics(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def reload(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def run_daemon(log: logging.Logger, build: Callable[[], Daemon]) -> int:
    """Build the agent and run it; exit status 1 with the reason logged if it cannot."""
    try:
        agent = build()
        asyncio.run(agent.run())
    except RQPError as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0
