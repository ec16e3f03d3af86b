"""Ending the HTTP transports a test made against pytest-django's live server."""

import threading

from tests.waiting import wait_for
from workers.http import HttpTransport

WAIT = 10.0


def hang_up(transport: HttpTransport) -> None:
    """Close the transport's keep-alive connections now: urllib3 2.8's
    PoolManager.clear() (what Session.close() calls) leaves closing the
    pools' sockets to garbage collection."""
    for session in transport.sessions:
        for adapter in session.adapters.values():
            pools = adapter.poolmanager.pools
            for key in pools.keys():  # noqa: SIM118 -- RecentlyUsedContainer cannot be iterated itself
                pools[key].close()
        session.close()


def hang_up_all(transports) -> None:
    """Hang up every HTTP transport, then wait for the live server to notice.
    It serves each keep-alive connection on a thread of its own, which closes
    its database connection once the client hangs up; none may still be
    connected when the test database is flushed or dropped."""
    for transport in transports:
        if isinstance(transport, HttpTransport):
            hang_up(transport)
    wait_for(
        lambda: not any("process_request_thread" in t.name for t in threading.enumerate()),
        timeout=WAIT,
        what="the live server's request threads to end",
    )
